"""Reading ptxas's `-v` report: spill bytes and wgmma serialization notes (what the kernel
cache's fallback forms in jit/kernels.py act on).

Example:
    >>> spill_bytes("ptxas info : 8 bytes spill stores, 8 bytes spill loads")
    16
"""
from __future__ import annotations

import re

__all__ = ["spill_bytes", "stack_frame", "wgmma_notes"]


def spill_bytes(log: str) -> int:
    """Spill stores + loads in ptxas's `-v` report (0 when the log has no report)."""
    return sum(int(a) + int(b) for a, b in
               re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))


def stack_frame(log: str) -> int:
    """The largest stack frame (bytes) ptxas's `-v` report gives any function: the local
    memory the loaded kernel may use (0 when the log has no report).

    >>> stack_frame("ptxas . 8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads")
    8
    """
    return max((int(a) for a in re.findall(r"(\d+) bytes stack frame", log)), default=0)


def wgmma_notes(log: str) -> list[str]:
    """ptxas's C7510-C7519 notes in a `-v` log: it serialized the wgmmas (C7515, C7518) or
    injected a wait after one (C7517) -- the kernel's pipeline is gone, spills or not.

    >>> wgmma_notes("ptxas info    : (C7517) warpgroup.wait is injected\\nptxas info : Used 168")
    ['ptxas info    : (C7517) warpgroup.wait is injected']
    """
    return [ln for ln in log.splitlines() if "(C751" in ln]
