"""The variant's captured-tensor reads made safe for a serving plan: every read the plan's
positions do not prove inside its tensor is clamped (docs/semantics.md). Serving never raises
here -- a position the bounding box holds may not be in this step's batch -- so what would be an
error in flex_attention is clamped instead.
"""
from __future__ import annotations

from typing import Any

import torch

from attncc.ir.analysis import Shapes
from attncc.ir.program import Bindings, VariantIR

from ..jit.launch_args import clamped

__all__ = ["SafeReads", "serving_clamps"]


def serving_clamps(ir: VariantIR, tensors: dict, scalars: dict, positions_unknown: bool,
                   shapes: Shapes) -> tuple[VariantIR, dict[str, int]]:
    """The clamped variant and the clamps' sizes: the reads `shapes` does not prove in bounds,
    or every read when `positions_unknown` (explicit q_positions / kv_position_offset) or when
    the proof itself fails."""
    from attncc.ir.analysis import CapturedReadError, clamp_reads, load_guards
    from attncc.ir.simplified import simplify_variant

    if not positions_unknown:
        try:
            got, sizes = clamped(ir, shapes, tensors, scalars)
            return got, sizes
        except CapturedReadError:
            pass  # clamp every read instead
    simple = simplify_variant(ir)
    every = {n: tuple(range(len(n.args))) for h in simple.hooks.values()
             for n, _ in load_guards(h.expr).values() if n.args}
    return clamp_reads(simple, every, tensors)


class SafeReads:
    """`serving_clamps` cached per plan shape, tensor shapes and scalar values (at most 65
    entries; a CUDA graph replays the kernel and sizes of the run it captured)."""

    def __init__(self) -> None:
        self.cache: dict[tuple, tuple] = {}

    def __call__(self, ir: VariantIR, bindings: Bindings, kv_lens: Any, *,
                 positions_unknown: bool, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, head_dim_vo: int | None = None) -> tuple[VariantIR, Bindings]:
        """The variant and bindings for a plan of `kv_lens` (positions: b < requests, q_idx and
        kv_idx < the longest KV length), with the clamps' sizes among the scalars."""
        if not ir.tensors:
            return ir, bindings
        _, safe, sizes = self._entry(ir, bindings, kv_lens, positions_unknown, num_qo_heads,
                                     num_kv_heads, head_dim, head_dim_vo)
        if not sizes:
            return safe, bindings
        return safe, Bindings({**bindings.scalars, **sizes}, bindings.tensors)

    def signature(self, ir: VariantIR, bindings: Bindings, kv_lens: Any, *,
                  positions_unknown: bool, num_qo_heads: int, num_kv_heads: int,
                  head_dim: int, head_dim_vo: int | None = None) -> tuple[bool, tuple]:
        """(whether any read is clamped, the clamps' sizes) for a plan of `kv_lens`: what a
        kernel captured in a CUDA graph fixed of the reads (capture.LaunchShape.reads)."""
        if not ir.tensors:
            return False, ()
        _, safe, sizes = self._entry(ir, bindings, kv_lens, positions_unknown, num_qo_heads,
                                     num_kv_heads, head_dim, head_dim_vo)
        return safe is not ir, tuple(sorted(sizes.items()))

    def _entry(self, ir: VariantIR, bindings: Bindings, kv_lens: Any, positions_unknown: bool,
               num_qo_heads: int, num_kv_heads: int, head_dim: int,
               head_dim_vo: int | None) -> tuple:
        """The cache entry (ir, clamped variant, clamp sizes), computed on a miss."""
        tensors = {t.name: bindings.tensors.get(t.name) for t in ir.tensors}
        kv = int(kv_lens.max()) if len(kv_lens) else 0
        try:
            key = (id(ir), len(kv_lens), kv, positions_unknown, num_qo_heads, num_kv_heads,
                   head_dim, head_dim_vo,
                   tuple((n, tuple(t.shape)) for n, t in tensors.items()
                         if isinstance(t, torch.Tensor)),
                   tuple(sorted(bindings.scalars.items())))
            hit = self.cache.get(key)
        except TypeError:  # an unhashable scalar: clamp every read, uncached
            key, hit = None, None
        if hit is None or hit[0] is not ir:
            shapes = Shapes(len(kv_lens), num_qo_heads, num_kv_heads, kv, kv, head_dim,
                            head_dim if head_dim_vo is None else head_dim_vo)
            hit = (ir, *serving_clamps(ir, tensors, bindings.scalars,
                                       key[3] if key else True, shapes))
            if key is not None:
                if len(self.cache) > 64:
                    self.cache.clear()
                self.cache[key] = hit
        return hit
