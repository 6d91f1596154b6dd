"""The compile policy flex and serving share: reading ptxas's `-v` report (spill bytes, wgmma
serialization notes) and the FA3 fallback to the low-pressure form when the first compile spills.

Example:
    >>> spill_bytes("ptxas info : 8 bytes spill stores, 8 bytes spill loads")
    16
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["compile_fa3", "spill_bytes", "wgmma_notes"]


def spill_bytes(log: str) -> int:
    """Spill stores + loads in ptxas's `-v` report (0 when the log has no report)."""
    return sum(int(a) + int(b) for a, b in
               re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))


def wgmma_notes(log: str) -> list[str]:
    """ptxas's C7510-C7519 notes in a `-v` log: it serialized the wgmmas (C7515, C7518) or
    injected a wait after one (C7517) -- the kernel's pipeline is gone, spills or not.

    >>> wgmma_notes("ptxas info    : (C7517) warpgroup.wait is injected\\nptxas info : Used 168")
    ['ptxas info    : (C7517) warpgroup.wait is injected']
    """
    return [ln for ln in log.splitlines() if "(C751" in ln]


def compile_fa3(source: str, *, arch: str, name: str) -> tuple[Any, bool]:
    """Compile an FA3 translation unit (dense or batch; through the kernel cache) as it is and,
    if ptxas spills, again in the low-pressure form (codegen's `with_form(source,
    low_pressure=True)`: the kernels' other way to evaluate a tile's logits, fewer registers for
    more instructions; docs/fa3.md, "Low-pressure form and the spill policy"); returns (the
    NvrtcResult used, whether it is the low-pressure one). The second compile is kept only if
    it spills less. Needs NVRTC.
    """
    from attncc.codegen.generate import with_form

    from .cache import cached_compile

    res, _ = cached_compile(source, arch=arch, name=name, verbose=True)
    if spill_bytes(res.log) == 0:
        return res, False
    low, _ = cached_compile(with_form(source, low_pressure=True), arch=arch, name=name,
                            verbose=True)
    if spill_bytes(low.log) < spill_bytes(res.log):
        return low, True
    return res, False
