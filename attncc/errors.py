"""Errors attncc raises to users. Each message says what to change.

Example:
    >>> from attncc.errors import TraceError
    >>> issubclass(TraceError, ValueError)
    True
"""
from __future__ import annotations


class AttnccError(Exception):
    """Base class of every error attncc raises on purpose."""


class TraceError(AttnccError, ValueError):
    """A mod used Python that attncc cannot compile; the message names the file and line."""


class CompileError(AttnccError, RuntimeError):
    """NVRTC rejected generated CUDA. `.log` is NVRTC's log, `.line` the offending source line."""

    def __init__(self, message: str, log: str = "", line: str | None = None,
                 source: str = "") -> None:
        super().__init__(message)
        self.log = log
        self.line = line
        self.source = source


class AttnSyntaxError(AttnccError, SyntaxError):
    """A `.attn` text variant failed to parse; the message shows line:column and a caret."""
