"""Generated translation units both the FlexAttention path and serving compile.

Example:
    >>> fa2_source(VariantIR(name="plain"), head_dim=64, dtype="bfloat16", tq=64, tkv=64)[1]
    'attncc_plain_fa2_d64_bf16_q64_k64_s2'
"""
from __future__ import annotations

from typing import Any

from attncc.codegen.tiles import KernelTiles
from attncc.ir.program import VariantIR

from .tiles import fa2_config

__all__ = ["fa2_source"]


def fa2_source(ir: VariantIR, *, head_dim: int, dtype: str, tq: int, tkv: int,
               stages: int = 2, m_frags: int = 1, fast_math: bool = True, batch: bool = False,
               kv_warps: int = 1, kv_dtype: str | None = None,
               head_dims: tuple[int, int] | None = None, half_rows: bool = False
               ) -> tuple[str, str, Any, Any]:
    """(source, kernel_name, params_layout, first_argument_layout) of an FA2 kernel for `ir`:
    codegen's `kernel="fa2"` translation unit (first argument AttentionParams) or, with
    `batch=True`, `kernel="fa2batch"`: the persistent serving kernel plus its merge kernel
    `<kernel_name>_merge` (first argument BatchParams); `kv_dtype` an fp8 cache's dtype there
    (None: q's); `head_dims`: a padded form's real head dims (generate_source); `half_rows`
    the decode form for 8-row tiles (KernelTiles.half_rows).

    Example:
        >>> src, name, _, _ = fa2_source(VariantIR(name="plain"), head_dim=64, dtype="bfloat16",
        ...                              tq=64, tkv=64)
        >>> name, src.count("ATTNCC_FA2_ENTRY(attncc_plain")
        ('attncc_plain_fa2_d64_bf16_q64_k64_s2', 1)
        >>> fa2_source(VariantIR(name="plain"), head_dim=64, dtype="bfloat16", tq=16, tkv=64,
        ...            batch=True)[1]
        'attncc_plain_fa2batch_d64_bf16_q16_k64_s2'
    """
    from attncc.codegen.generate import generate_source

    fa2_config(head_dim, tq, tkv, stages, m_frags, kv_warps)  # ValueError naming a bad tile
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r}: the FA2 kernel runs bfloat16 or float16")
    gk = generate_source(ir, head_dim=head_dim, dtype=dtype, kernel="fa2batch" if batch else "fa2",
                         fast_math=fast_math,
                         tiles=KernelTiles(tq, tkv, stages, m_frags, kv_warps, half_rows),
                         kv_dtype=kv_dtype, head_dims=head_dims)
    return gk.source, gk.kernel_name, gk.params_layout, gk.attention_params_layout
