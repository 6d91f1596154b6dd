"""Host side of the FA3 batch kernel (kernels/fa3/fa3_batch.cuh): when `BatchAttention` may use it,
its generated source, and its TMA maps.

The FA3 batch kernel runs the same plans as the FA2 one (units of 128 fused query rows x a KV
range, merged by the same merge kernel) with the warp-specialized TMA + wgmma pipeline. It needs
an sm_90 GPU, bf16 or fp16, head dim 64 or 128 (every variant hook runs on it), a GQA group
that divides 64 (a 64-row box is 64 / g tokens x g heads), and KV pages TMA can address one box
per page: power-of-two page sizes of at least 16 tokens, or a ragged cache.

Example:
    >>> fa3_unsupported("cpu", head_dim=128, group=4, kv_layout="NHD",
    ...                 page_size=16, q_dtype=None)
    'a CUDA device'
"""
from __future__ import annotations

from typing import Any

import torch

from attncc.codegen.tiles import KernelTiles, fa3_tiles
from attncc.ir.hoist import transforms_in
from attncc.ir.program import VariantIR

from ..jit.tiles import fa3_stages
from ..jit.tma import MapCache, MapSlot, encode_map

__all__ = ["fa3_unsupported", "fa3_batch_source", "fa3_batch_maps", "fa3_batch_tiles",
           "pair_form_runs", "FA3_BATCH_HEAD_DIMS"]

FA3_BATCH_HEAD_DIMS = (64, 128)


def fa3_unsupported(device: Any, *, head_dim: int, group: int, kv_layout: str,
                    page_size: int, q_dtype: torch.dtype | None,
                    kv_dtype: torch.dtype | None = None) -> str | None:
    """What the FA3 batch kernel would need and this batch lacks (None: it can run it).
    `q_dtype` None means not known yet (checked again at run). An fp8 cache (`kv_dtype`) runs
    on the FA2 batch kernel, which widens its tiles in the load path (docs/serving.md, "fp8
    KV cache")."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "a CUDA device"
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return "an sm_90 (Hopper) GPU"
    if q_dtype is not None and q_dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 queries (plan(q_data_type={q_dtype}))"
    if kv_dtype is not None and kv_dtype != q_dtype:
        return f"a KV cache in q's dtype (plan(kv_data_type={kv_dtype}) runs on the FA2 kernel)"
    if head_dim not in FA3_BATCH_HEAD_DIMS:
        return f"head dim 64 or 128 (got {head_dim})"
    if 64 % group:
        return f"a GQA group that divides 64 (got {group})"
    if kv_layout != "ragged" and (page_size < 16 or page_size & (page_size - 1)):
        return f"a power-of-two page size >= 16 (got {page_size})"
    return None


def pair_form_runs(ir: VariantIR) -> bool:
    """Whether the FA3 batch kernel's pair form can run variant `ir`: not with query, key or
    value transforms, since its consumers share Q and each sees half the K/V tiles (the
    kernel's static_assert; docs/serving.md, "The FA3 pair form").

    Example:
        >>> pair_form_runs(VariantIR())
        True
    """
    return not transforms_in(ir)


def fa3_batch_tiles(head_dim: int, tq: int = 128) -> KernelTiles:
    """The FA3 batch kernel's tiles: 128 fused query rows x 128 keys, the deepest K/V ring its
    shared memory allows (kernels/fa3/fa3_prefill.cuh Smem); `tq` 64: the pair form, units of
    64 rows whose K/V tiles the two consumers split (docs/serving.md, "The FA3 pair form").

    Example:
        >>> fa3_batch_tiles(128)
        KernelTiles(tq=128, tkv=128, stages=3, m_frags=1, kv_warps=1, half_rows=False)
        >>> fa3_batch_tiles(64, tq=64), fa3_batch_tiles(128, tq=64).suffix
        (KernelTiles(tq=64, tkv=128, stages=4, m_frags=1, kv_warps=1, half_rows=False), '_q64_k64_s4')
    """
    if tq == 128:
        return fa3_tiles(fa3_stages(head_dim, 128), 128)
    # the pair form needs an even ring (fa3_tiles): four stages, each consumer's tiles two deep,
    # of 64-key tiles at D = 128, where 128-key stages would leave only two
    tkv = 128 if head_dim <= 64 else 64
    return fa3_tiles(4, tkv, tq)


def fa3_batch_source(ir: VariantIR, head_dim: int, dtype: str) -> Any:
    """Codegen's `fa3batch` translation unit (attention + merge kernels) for a simplified IR.

    Example:
        >>> gk = fa3_batch_source(VariantIR(name="plain"), 128, "bfloat16")
        >>> gk.kernel_name, gk.threads
        ('attncc_plain_fa3batch_d128_bf16_q128_k128_s3', 384)
    """
    from attncc.codegen.generate import generate_source

    return generate_source(ir, head_dim=head_dim, dtype=dtype, kernel="fa3batch",
                           tiles=fa3_batch_tiles(head_dim))


_MAPS = MapCache(64)  # q / k / v maps of recent runs (runtime/jit/tma.py)


def _rows_view(t: torch.Tensor, row_stride: int) -> torch.Tensor:
    """`t`'s memory from its first element to its last as a 2-D [rows, row_stride] view: the
    kernel addresses cache element (page, slot, head, col) as row page * rows_per_page +
    head_row + slot of this view (kernels/fa3/fa3_batch.cuh)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    rows = -(-span // row_stride)
    return t.as_strided((rows, row_stride), (row_stride, 1))


def fa3_batch_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: int,
                   row_stride: int, box_rows: int) -> MapSlot:
    """The q / k / v tensor maps (384 bytes on the device) the FA3 batch kernel reads through:
    q [tokens, heads, D] in boxes of 64 / group tokens x group heads x 64 columns; k and v as
    [rows, row_stride] views (row_stride = the cache's token stride) in boxes of box_rows x 64."""
    key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in (q, k, v))
    if q.stride(2) != 1 or (q.stride(1) * 2) % 16 or (q.stride(0) * 2) % 16:
        raise ValueError(f"the FA3 batch kernel reads q with TMA: it needs a contiguous head dim "
                         f"and 16-byte aligned strides, got {q.stride()}; pass q.contiguous() or "
                         f"BatchAttention(kernel='fa2')")
    return _MAPS.get(key + (group, row_stride, box_rows), q.device, lambda: b"".join([
        encode_map(q, (64 // group, group, 64)),
        encode_map(_rows_view(k, row_stride), (box_rows, 64)),
        encode_map(_rows_view(v, row_stride), (box_rows, 64))]))
