"""run()'s launch arguments, one builder per kernel kind, and the two launches
(docs/kernel-interface.md for `BatchParams`, docs/serving.md#plan--run).

Every batch kernel -- FA2 batch, its decode form (16-row tiles, KV warps), FA3 batch -- and the
merge kernel take one `BatchParams`: the operands' pointers and strides, the workspace
pointers (plan, page tables, partial states), the shape, and (FA3) the tensor maps. The
workspace pointers depend only on the workspace and the layout, so a CUDA graph that captured
run() finds every later plan at the same addresses.

Example (the workspace's word map: plan, tables, then fp32 partial O and their LSEs):
    >>> from attncc.runtime.serving.plan import scheduler
    >>> lay = scheduler.PlanLayout(4, 64, 2, 1, 1, 16)
    >>> o = {"qo_indptr": 112, "kv_page_indptr": 120, "kv_lens": 128, "kv_pos": 136,
    ...      "q_pos": 144, "pages": 208}
    >>> p = workspace_pointers(0, 220, lay, o, head_dim=64, q_positions=False, kv_positions=True)
    >>> p["plan"], p["partial_o"], p["partial_lse"], p["kv_pos_offset"], p["q_positions"]
    (0, 880, 9072, 544, 0)
"""
from __future__ import annotations

from typing import Any

import torch

from attncc.codegen import constants

from .fa3_batch import fa3_batch_maps
from .plan import scheduler
from .tiles import BatchTiles

__all__ = ["MERGE_THREADS", "decode_args", "fa2_batch_args", "fa3_batch_args", "launch_attention",
           "launch_merge", "merge_grid", "workspace_pointers"]

MERGE_THREADS = constants.MERGE_THREADS  # the batch kernels' NAME_merge block size


def round256(n: int) -> int:
    """`n` rounded up to a multiple of 256 (the partial LSEs start on a 256-byte boundary)."""
    return (n + 255) // 256 * 256


def workspace_pointers(base: int, words: int, layout: scheduler.PlanLayout,
                       offsets: dict[str, int], *, head_dim: int, q_positions: bool,
                       kv_positions: bool) -> dict[str, int]:
    """The BatchParams pointers into the workspace at `base`: the packed plan, the page tables
    at their word `offsets`, then (after the `words` int32 words of both) every partial slot's
    fp32 O and after those their LSEs (scheduler.workspace_bytes' layout). `q_positions` /
    `kv_positions`: whether the plan staged those tables (else null pointers)."""
    rows = layout.max_partial_slots * layout.tile_q
    o = offsets
    return {
        "partial_o": base + 4 * words,
        "partial_lse": base + 4 * words + round256(rows * head_dim * 4),
        "qo_indptr": base + 4 * o["qo_indptr"], "kv_page_indptr": base + 4 * o["kv_page_indptr"],
        "kv_page_indices": base + 4 * o["pages"], "kv_lens": base + 4 * o["kv_lens"],
        "q_positions": base + 4 * o["q_pos"] if q_positions else 0,
        "kv_pos_offset": base + 4 * o["kv_pos"] if kv_positions else 0,
        "plan": base + 4 * layout.offsets["header"],  # the kernels find the sections in it
    }


def fa2_batch_args(pointers: dict[str, int], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                   strides: tuple[int, int, int], *, num_kv_heads: int, page_size: int,
                   page_shift: int, sm_scale: float) -> dict[str, Any]:
    """BatchParams of the FA2 batch kernel (kernels/fa2/fa2_batch.cuh) and its merge: `pointers`
    from `workspace_pointers`, the operands, the KV cache's (page, slot, head) `strides` in
    elements, and the shape; no tensor maps."""
    return {
        "tree_mask": 0,  # (BatchAttention's tree table, where it has one: `pointers` has it)
        **pointers,
        "q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": out.data_ptr(),
        "lse": lse.data_ptr() if lse is not None else 0,
        "q_stride_tok": q.stride(0), "q_stride_h": q.stride(1),
        "o_stride_tok": out.stride(0), "o_stride_h": out.stride(1),
        "kv_stride_page": strides[0], "kv_stride_slot": strides[1], "kv_stride_h": strides[2],
        "lse_stride_tok": lse.stride(0) if lse is not None else 0,
        "num_q_heads": q.shape[1], "num_kv_heads": num_kv_heads,
        "page_size": page_size, "page_shift": page_shift,
        "sm_scale": sm_scale,
        "tma": 0, "sinks": 0,  # BatchAttention.run sets the sinks' pointer when it has some
        "k_scale": 0, "v_scale": 0,  # an fp8 cache's: run() sets them (serving/scales.py)
    }


def decode_args(pointers: dict[str, int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor | None, strides: tuple[int, int, int],
                **shape: Any) -> dict[str, Any]:
    """BatchParams of the decode form: the FA2 batch kernel with 16-row tiles whose KV warps
    split each KV tile (docs/serving.md#decode) reads the same members; its launch differs
    only in the threads per CTA, which the kernel's config gives."""
    return fa2_batch_args(pointers, q, k, v, out, lse, strides, **shape)


def fa3_batch_args(pointers: dict[str, int], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                   strides: tuple[int, int, int], *, tiles: BatchTiles,
                   **shape: Any) -> dict[str, Any]:
    """BatchParams of the FA3 batch kernel (kernels/fa3/fa3_batch.cuh): the FA2 members plus its
    q / k / v tensor maps (fa3_batch_maps, cached per operand), whose K/V boxes are a page or a
    KV tile, whichever is shorter."""
    args = fa2_batch_args(pointers, q, k, v, out, lse, strides, **shape)
    group = q.shape[1] // shape["num_kv_heads"]
    args["tma"] = fa3_batch_maps(q, k, v, group=group, row_stride=strides[1],
                                 box_rows=min(shape["page_size"], tiles.tkv)).data_ptr()
    return args


def merge_grid(layout: scheduler.PlanLayout, num_sms: int) -> int:
    """The merge kernel's CTAs: one per merge target the layout has room for, at most one per
    SM (each CTA loops over targets)."""
    return min(layout.max_merges, num_sms)


def launch_attention(kern: Any, params: dict[str, Any], vp: dict, layout: scheduler.PlanLayout,
                     stream: int) -> None:
    """The persistent attention kernel over the plan: layout.max_ctas CTAs (the plan's grid, so
    fixed by the workspace) of the kernel config's threads and shared memory."""
    cfg = kern.config
    kern.launcher.launch((layout.max_ctas, 1, 1), (cfg.threads, 1, 1), cfg.smem_bytes,
                         kern.launcher.ap.flatten(params), kern.launcher.vp.flatten(vp),
                         stream=stream)


def launch_merge(kern: Any, params: dict[str, Any], vp: dict, grid: int, stream: int,
                 pdl: bool) -> None:
    """The split items' merge (`grid` from `merge_grid`), with programmatic dependent launch
    when `pdl` (sm_90: its launch and plan reads overlap the attention kernel's tail,
    docs/serving.md#merge-kernel-and-programmatic-dependent-launch)."""
    kern.merge.launch((grid, 1, 1), (MERGE_THREADS, 1, 1), 0, kern.merge.ap.flatten(params),
                      kern.merge.vp.flatten(vp), stream=stream, pdl=pdl)
