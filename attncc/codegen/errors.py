"""The error codegen raises when IR cannot become CUDA (a pass or caller produced bad IR).

Example:
    >>> from attncc.codegen.errors import CodegenError
    >>> issubclass(CodegenError, ValueError)
    True
"""
from __future__ import annotations

from ..errors import AttnccError


class CodegenError(AttnccError, ValueError):
    """IR or options codegen cannot turn into CUDA; the message says what to change."""
