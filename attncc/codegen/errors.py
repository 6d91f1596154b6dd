"""The error codegen raises when IR cannot become CUDA: `attncc.errors.CodegenError`, one class
of the package's single error hierarchy, importable from here too.

Example:
    >>> from attncc.codegen.errors import CodegenError
    >>> issubclass(CodegenError, ValueError) and CodegenError is __import__("attncc").CodegenError
    True
"""
from __future__ import annotations

from ..errors import CodegenError

__all__ = ["CodegenError"]
