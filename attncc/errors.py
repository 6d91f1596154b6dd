"""Errors attncc raises to users. Each message says what to change.

Example:
    >>> from attncc.errors import TraceError
    >>> issubclass(TraceError, ValueError)
    True
    >>> check_int("H", 0, minimum=1, fix="pass the number of heads")
    Traceback (most recent call last):
    ...
    attncc.errors.InvalidArgument: H must be an int >= 1, got 0; pass the number of heads
"""
from __future__ import annotations

import numbers
from typing import Any


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


class CapturedReadError(TraceError, IndexError):
    """A hook reads a captured tensor outside its bounds at a position that counts (one the
    mask keeps, or any position for mask_mod and the transforms): what torch reports as an
    IndexError. The message names the hook's line, the read, the position and the fix."""


class DifferentiationError(TraceError):
    """A variant cannot be differentiated as asked: a mask_mod reads a captured tensor that
    requires grad, or grads are asked of a tensor the variant does not capture (or of an
    integer one). The message names the hook's Python line and the fix (docs/backward.md)."""


class IndexOverflowWarning(UserWarning):
    """An i32 expression of a hook can leave 32 bits at a call's shapes: the kernels compute it
    in 32-bit integers, where it wraps around."""


class CodegenError(AttnccError, ValueError):
    """IR or options codegen cannot turn into CUDA (a pass or caller produced bad IR, or a
    kernel form a template lacks); the message says what to change."""


class InvalidArgument(AttnccError, ValueError):
    """An argument has a value attncc cannot run (a zero size, a wrong shape, a bad id)."""


class InvalidArgumentType(AttnccError, TypeError):
    """An argument has the wrong type (a float where an int belongs, a string for a bool)."""


class ResourceError(AttnccError, RuntimeError):
    """A loaded kernel's resources the kernel cache must make impossible: the driver's local
    bytes above ptxas's stack frame, or a spill past its form's budget never recompiled (an
    error under ATTNCC_STRICT_RESOURCES=1, a warning otherwise; runtime/jit/kernels.py); the
    message names the kernel, the bytes and what to do."""


class DeviceError(AttnccError, RuntimeError):
    """The call needs a device this machine lacks (a CUDA GPU, or a GPU of another arch)."""


def check_int(name: str, value: Any, minimum: int = 0, fix: str = "") -> int:
    """`value` as an int >= `minimum`; InvalidArgumentType for a non-integer (bools and floats
    too: a silently truncated size is a wrong answer), InvalidArgument for a small one. `fix`
    is appended to the message."""
    tail = f"; {fix}" if fix else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentType(f"{name} must be an int >= {minimum}, got "
                                  f"{type(value).__name__} {value!r}{tail}")
    if value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}, got {value}{tail}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """`value` if it is a bool; InvalidArgumentType otherwise (a string like "no" is truthy)."""
    if not isinstance(value, bool):
        raise InvalidArgumentType(f"{name} must be True or False, got {type(value).__name__} "
                                  f"{value!r}")
    return value
