"""What a CUDA graph that captured `BatchAttention.run` fixed, and plan()'s check that a new plan
keeps it (docs/serving.md, "CUDA graphs and re-plans").

A replay launches the captured kernels with the captured launch arguments; only the
workspace's contents change between replays (the plan, the page tables, the tree-mask rows).
A plan whose kernel (tiles and form, head dim, fp8 cache dtype, the clamps of the variant's
captured reads) or launch arguments (plan layout and word offsets, heads, page size, explicit
positions) differ from the captured run's would be replayed with the old kernel -- a wrong
result, silently. FlashInfer fixes the kernel when a wrapper is made for CUDA graphs
(`use_cuda_graph=True`) and asks every later plan to stay compatible; here `run` records the
`LaunchShape` it captured and `plan` raises, naming what differs, before the new plan becomes
current (`capture_mismatch`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .tiles import BatchTiles

__all__ = ["LaunchShape", "capture_mismatch"]


@dataclass(frozen=True)
class LaunchShape:
    """What a captured run's kernels and launch arguments depend on in a plan."""

    # (in the order a mismatch is reported: the arguments first, then what follows from them)
    heads: tuple[int, int]       # (num_qo_heads, num_kv_heads)
    head_dim: tuple[int, int]     # the real (Dqk, Dv) (their padded width is in the tiles' kernel)
    page_size: int
    kv_data_type: torch.dtype | None
    positions: tuple[bool, bool]  # explicit q_positions, kv_position_offset
    tiles: BatchTiles            # the kernel's tiles and form (FA2, decode, FA3)
    layout: Any                  # the plan's PlanLayout: its room, the grid, the merge launch
    offsets: tuple               # the page tables' word offsets (sorted items)
    reads: tuple                 # (clamped, clamp sizes) of the variant's captured reads


_WHAT = {"tiles": "the kernel's tiles / form", "layout": "the plan layout (grid, room)",
         "offsets": "the page tables' offsets", "heads": "(num_qo_heads, num_kv_heads)",
         "head_dim": "(head_dim_qk, head_dim_vo)", "page_size": "page_size",
         "kv_data_type": "kv_data_type",
         "positions": "explicit (q_positions, kv_position_offset)",
         "reads": "the clamps of the variant's captured-tensor reads"}


def capture_mismatch(captured: LaunchShape | None, new: LaunchShape) -> str | None:
    """None when a graph that captured a run of `captured` replays a plan of `new` correctly
    (or no graph captured: `captured` None); else what differs, said for an error message.

    Example:
        >>> from attncc.runtime.serving.tiles import choose_batch_tiles
        >>> s = LaunchShape((8, 2), (128, 128), 16, None, (False, False),
        ...                 choose_batch_tiles(128, 8, 132), None, (), (False, ()))
        >>> capture_mismatch(s, s) is None
        True
        >>> big = dataclasses.replace(s, tiles=choose_batch_tiles(128, 64, 132))
        >>> capture_mismatch(s, big).split(":")[0]
        "the kernel's tiles / form"
    """
    if captured is None:
        return None
    for f in dataclasses.fields(LaunchShape):
        old, now = getattr(captured, f.name), getattr(new, f.name)
        if old != now:
            if f.name == "layout":  # (a long repr: its grid and tile say enough)
                old, now = _brief_layout(old), _brief_layout(now)
            return f"{_WHAT[f.name]}: captured {old}, this plan {now}"
    return None


def _brief_layout(layout: Any) -> Any:
    fields = ("max_ctas", "tile_q", "num_qo_heads", "num_kv_heads")
    if not all(hasattr(layout, n) for n in fields):
        return layout
    return ", ".join(f"{n}={getattr(layout, n)}" for n in fields)
