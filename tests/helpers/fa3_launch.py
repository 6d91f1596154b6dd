"""A helper for the FA3 GPU tests that compare two launch forms (CTA pairs, the split tail): one
launch with given kernel_options into poisoned (or given) outputs, with the LSE."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from attncc.runtime.flex import gpu_flex


def run_fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: Any, bind: Any, g: int,
            options: Mapping[str, Any], out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gpu_flex_attention` with kernel_options {"KERNEL": "fa3", "PREPASS": "none", **options}
    (GQA when `g` > 1) into `out` / `lse`, NaN-filled new tensors when not given: every element
    the kernel should write but does not stays NaN.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     out, lse = run_fa3(q, k, v, ir, bind, 1, {"PAIRED": False})
    """
    out = torch.full_like(q, float("nan")) if out is None else out
    lse = torch.full(q.shape[:3], float("nan"), device=q.device) if lse is None else lse
    opts = {"KERNEL": "fa3", "PREPASS": "none", **options}
    gpu_flex.gpu_flex_attention(q, k, v, ir, bind, enable_gqa=g > 1, return_lse=True,
                                kernel_options=opts, out=out, lse_out=lse)
    return out, lse
