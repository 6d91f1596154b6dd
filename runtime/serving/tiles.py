"""Tiles for the batch kernels and the plan config that follows from them: the layout the plan
is packed in and the scheduler's arguments (docs/serving.md#decode, #the-fa3-batch-kernel).

Pure functions of the batch's shape and the instance's knobs; BatchAttention memoises them per
step (a serving loop plans the same shape step after step).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..jit.tiles import HEAD_DIMS, fa2_config
from .fa3_batch import fa3_batch_tiles
from .plan import planner, scheduler

__all__ = ["BatchTiles", "PlanConfig", "LONG_KV_KEYS", "batch_tiles", "choose_batch_tiles",
           "fa3_mode", "keep_captured_depth", "keep_captured_tiles", "long_kv_batch",
           "multi_token_kv_tiles", "plan_config", "plan_layout"]

# A decode batch whose requests hold this many keys on average gets three-stage decode tiles
# (long_kv_batch): measured on the H200 at D = 128, three stages read the long-context cell
# (B128, Hq 64 / Hkv 8, kv 32768) at 1.007 of copy bandwidth against 0.84 with two, while at
# ~1K keys per request they cost 5-16 % on uniform and skewed lengths (fewer CTAs per SM for
# the scheduler's many short units) (docs/serving.md, "Decode tiles by KV length").
LONG_KV_KEYS = 8192
# The fewest fused rows (query tokens x GQA group) a batch's longest request has for the FA3
# pair form to run it (choose_batch_tiles' `pair`); fewer run FA2's decode tiles. Measured on
# the H200 (Hq 64 / Hkv 8, kv 8192, batch 32, fraction of copy bandwidth): 16 rows, FA2's
# decode tiles 0.87; 32 rows, the pair form 0.94 against FA2's 32-row tiles 0.52
# (docs/serving.md, "The FA3 pair form").
PAIR_MIN_ROWS = 17


@dataclass(frozen=True)
class BatchTiles:
    """The FA2 configuration of a plan: fused query rows per tile, KV rows per tile, pipeline
    depth, 16-row MMA fragments per warp, the persistent grid, and (decode) the warps that split
    each KV tile."""

    tq: int
    tkv: int
    stages: int
    m_frags: int
    ctas_per_sm: int
    num_ctas: int
    kv_warps: int = 1
    kernel: str = "fa2"  # "fa3": kernels/fa3/fa3_batch.cuh (sm_90; runtime/serving/fa3_batch.py)
    # decode: the form for 8 fused rows a request (KernelTiles.half_rows); it runs any batch
    half_rows: bool = False


def choose_batch_tiles(head_dim: int, max_fused_rows: int, num_sms: int,
                       force: tuple[int, ...] | None = None, fa3: str = "off",
                       long_kv: bool = False, pair: bool = False,
                       tree: bool = False) -> BatchTiles:
    """Tiles for a batch whose longest request has `max_fused_rows` (query tokens x GQA group);
    `force=(T_q, T_kv, stages[, kv_warps])` takes those instead (the grid still follows
    residency). `fa3` ("off", "auto", "on"; the caller checked the FA3 batch kernel can run the
    batch, fa3_batch.py): "on" takes the FA3 batch kernel's tiles (128 fused rows x 128
    keys, one CTA per SM), "auto" does so for prefill batches (at least 128 fused rows).
    `pair` (the variant has no query/key/value transform): where FA3 runs, a batch of 17 to 64
    fused rows -- multi-token decode -- takes its pair form, 64-row units whose K/V tiles the
    two consumer warpgroups split (docs/serving.md, "The FA3 pair form").
    `tree` (the plan has a tree mask): only FA2 and FA3's pair form read one, so FA3 runs the
    batch only in its pair form ("on" raises where it cannot).

    Decode (up to 16 fused rows) gets 16-row tiles with 2 warps splitting each 32-row KV tile:
    the memory-bound case wants many loads in flight per SM, and a 16-row tile alone is one
    warp (docs/serving.md#decode); a third stage at D <= 128 when `long_kv` (long_kv_batch).
    Larger tiles are FA2's, with the prefill kernel's 128-row tiles at D <= 128.

    Example:
        >>> choose_batch_tiles(128, 8, 132)
        BatchTiles(tq=16, tkv=32, stages=2, m_frags=1, ctas_per_sm=6, num_ctas=792, kv_warps=2, kernel='fa2', half_rows=True)
        >>> choose_batch_tiles(128, 4096, 132).tq
        128
        >>> choose_batch_tiles(128, 8, 132, long_kv=True)
        BatchTiles(tq=16, tkv=32, stages=3, m_frags=1, ctas_per_sm=4, num_ctas=528, kv_warps=2, kernel='fa2', half_rows=True)
        >>> choose_batch_tiles(128, 4096, 132, fa3="auto")
        BatchTiles(tq=128, tkv=128, stages=3, m_frags=1, ctas_per_sm=1, num_ctas=132, kv_warps=1, kernel='fa3', half_rows=False)
        >>> choose_batch_tiles(128, 64, 132, fa3="auto", pair=True).tq
        64
    """
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: the batch kernel supports {HEAD_DIMS}")
    paired = pair and force is None and PAIR_MIN_ROWS <= max_fused_rows <= 64
    if tree and not paired and fa3 != "off":
        if fa3 == "on":
            raise ValueError(f"BatchAttention(kernel='fa3') with a tree mask: the FA3 batch "
                             f"kernel reads tree masks only in its pair form, {PAIR_MIN_ROWS} to "
                             f"64 fused rows a request (query tokens x GQA group; this batch: "
                             f"{max_fused_rows}) and no query/key/value mods; use kernel=None "
                             f"or 'fa2'")
        fa3 = "off"
    if fa3 == "on" or (fa3 == "auto" and force is None and (max_fused_rows >= 128 or paired)):
        t = fa3_batch_tiles(head_dim, 64 if paired else 128)
        return BatchTiles(t.tq, t.tkv, t.stages, 1, 1, num_sms, 1, "fa3")
    tq = next((t for t in (16, 32, 64) if t >= max_fused_rows), 128 if head_dim <= 128 else 64)
    # small tiles are bandwidth-bound: 32-row KV tiles halve the shared memory per CTA so twice
    # as many CTAs (and their loads) are in flight per SM
    tkv = 32 if head_dim == 256 or tq <= 32 else 64
    stages, kv_warps = 2, 1
    if tq == 16:
        kv_warps = 2
        if long_kv and head_dim <= 128:
            stages = 3
    elif tq <= 64 and head_dim <= 128:
        tkv, stages = multi_token_kv_tiles(tq)
    if force is not None:
        tq, tkv, stages = force[:3]
        kv_warps = force[3] if len(force) > 3 else 1
    m_frags = 2 if tq == 128 and head_dim <= 128 else 1
    cfg = fa2_config(head_dim, tq, tkv, stages, m_frags, kv_warps)
    # residency: 64K registers and 227 KB of shared memory per SM, with registers per thread as
    # the kernel's __launch_bounds__ caps them (fa2_config.cuh's kMinBlocks: decode CTAs fit 128
    # registers per thread, the others may take 255)
    by_regs = 65536 // (cfg.threads * (128 if kv_warps > 1 else 256))
    by_smem = (227 * 1024) // cfg.smem_bytes
    per_sm = max(1, min(by_regs, by_smem, 16))
    # a decode batch whose longest request fuses exactly 8 rows (one token of a GQA group of 8,
    # or q_len x group = 8): its tiles of 8 rows skip their padding row (docs/serving.md,
    # "GQA-8 tiles"); a run-time test in the one form cost MHA decode 3-5 %
    half = kv_warps > 1 and max_fused_rows == 8 and force is None
    return BatchTiles(tq, tkv, stages, m_frags, per_sm, per_sm * num_sms, kv_warps,
                      half_rows=half)


def multi_token_kv_tiles(tq: int) -> tuple[int, int]:
    """(T_kv, stages) of 32- and 64-row query tiles at D <= 128: multi-token decode (2-8
    tokens x a GQA group) and short chunks. They are bound by memory, and two 2-stage 32-row
    K/V rings per SM (the residency 255 registers leave a 64-row tile) keep ~32 KB of loads in
    flight per SM, under what the H200's memory latency needs for its bandwidth: 8 tokens x 8
    heads read 0.76 of copy bandwidth so. Three 64-row stages (two tiles ahead, 128 KB per SM)
    for 64 rows, four 32-row stages for 32 (three CTAs per SM) (docs/serving.md, "Multi-token
    decode and tree masks").

    Example:
        >>> multi_token_kv_tiles(64), choose_batch_tiles(128, 64, 132)
        ((64, 3), BatchTiles(tq=64, tkv=64, stages=3, m_frags=1, ctas_per_sm=2, num_ctas=264, kv_warps=1, kernel='fa2', half_rows=False))
    """
    return (64, 3) if tq == 64 else (32, 4)


@functools.lru_cache(maxsize=256)
def batch_tiles(head_dim: int, max_fused_rows: int, num_sms: int,
                force: tuple[int, ...] | None, fa3: str, long_kv: bool = False,
                pair: bool = False, tree: bool = False) -> BatchTiles:
    """`choose_batch_tiles`, memoised: plan() runs every generation step."""
    return choose_batch_tiles(head_dim, max_fused_rows, num_sms, force, fa3, long_kv, pair,
                              tree)


def long_kv_batch(kv_lens: np.ndarray) -> bool:
    """Whether a batch's requests hold LONG_KV_KEYS keys or more on average (its decode tiles
    take a third stage).

    Example:
        >>> long_kv_batch(np.array([32768, 4096])), long_kv_batch(np.array([1024] * 64))
        (True, False)
    """
    return len(kv_lens) > 0 and int(kv_lens.sum()) >= LONG_KV_KEYS * len(kv_lens)


def keep_captured_depth(captured: BatchTiles | None, new: BatchTiles) -> BatchTiles:
    """`captured` (the tiles of a run a CUDA graph captured) when `new` differs from them only
    in pipeline depth (stages and, following from it, CTAs per SM) or in the 8-row decode form
    (half_rows): both run any batch, and a serving loop whose requests grow past LONG_KV_KEYS,
    or whose step has a second query token, keeps replaying its graph instead of failing
    plan()'s capture check. Else `new`.

    Example:
        >>> short, long = choose_batch_tiles(128, 8, 132), choose_batch_tiles(128, 8, 132, long_kv=True)
        >>> keep_captured_depth(short, long) is short, keep_captured_depth(None, long) is long
        (True, True)
    """
    if captured is not None and captured != new and dataclasses.replace(
            captured, stages=new.stages, ctas_per_sm=new.ctas_per_sm,
            num_ctas=new.num_ctas, half_rows=new.half_rows) == new:
        return captured
    return new


def keep_captured_tiles(current: BatchTiles | None, new: BatchTiles, fa3: str,
                        tree: bool = False) -> BatchTiles:
    """`current` (the tiles of the kernel run() last used, which a CUDA graph may have
    captured) when the new batch fits them -- larger query tiles of the same kind, or of FA2
    while FA3 may run, but not FA3's 128-row form for a plan with a tree mask (which it does
    not read) -- else `new`.

    Example:
        >>> big, small = choose_batch_tiles(128, 4096, 132), choose_batch_tiles(128, 8, 132)
        >>> keep_captured_tiles(big, small, "off") is big, keep_captured_tiles(small, big, "off") is big
        (True, True)
    """
    if current is not None and new.tq != current.tq and current.tq >= new.tq \
            and (current.kernel == "fa2" or fa3 != "off") \
            and not (tree and current.kernel == "fa3" and current.tq == 128):
        return current
    return new


def fa3_mode(kernel: str | None, forced_tiles: Any, why: str | None) -> str:
    """choose_batch_tiles' `fa3` for BatchAttention(kernel=`kernel`, tiles=`forced_tiles`) on a
    batch the FA3 batch kernel cannot run for reason `why` (None: it can): "off" when it cannot
    (or kernel="fa2", or tiles forced with kernel=None), "on" when forced (kernel="fa3"; raises
    if it cannot), else "auto".

    Example:
        >>> fa3_mode(None, None, None), fa3_mode(None, None, "sm_90"), fa3_mode("fa3", None, None)
        ('auto', 'off', 'on')
    """
    if kernel == "fa2" or (kernel is None and forced_tiles is not None):
        return "off"
    if kernel == "fa3":
        if why is not None:
            raise ValueError(f"BatchAttention(kernel='fa3') needs {why}; use kernel=None "
                             f"or 'fa2'")
        return "on"
    return "off" if why is not None else "auto"


@functools.lru_cache(maxsize=64)
def plan_layout(max_batch: int, max_qo_tokens: int, num_ctas: int, num_qo_heads: int,
                num_kv_heads: int, tile_q: int) -> scheduler.PlanLayout:
    """`scheduler.PlanLayout(...)`, memoised: plan() needs the same few every step."""
    return scheduler.PlanLayout(max_batch, max_qo_tokens, num_ctas, num_qo_heads, num_kv_heads,
                                tile_q)


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """What a plan's schedule depends on besides the batch: the tiles, the packed layout, the
    scheduler's keyword arguments, and (compiled planner) its C arguments for them."""

    tiles: BatchTiles
    layout: scheduler.PlanLayout
    kwargs: dict            # scheduler.plan's kv_chunk_align / min_kv_chunk / head_span
    problem: Any = None     # planner.plan_problem(...) when the compiled planner is in use


def plan_config(tiles: BatchTiles, qo: np.ndarray, kv_lens: np.ndarray, *, num_qo_heads: int,
                num_kv_heads: int, max_batch: int, max_qo_tokens: int, balance: bool,
                min_kv_chunk: int | None, compiled: bool) -> PlanConfig:
    """The layout and scheduler arguments of a batch (`qo` query CSR, `kv_lens`) planned with
    `tiles`; `balance=False` is one CTA per work item with its whole KV range in one unit.
    `compiled`: also the compiled planner's arguments (`PlanConfig.problem`).

    Example:
        >>> t = choose_batch_tiles(128, 8, 132)
        >>> cfg = plan_config(t, np.array([0, 1, 2]), np.array([40, 9]), num_qo_heads=8,
        ...                   num_kv_heads=2, max_batch=4, max_qo_tokens=64, balance=False,
        ...                   min_kv_chunk=None, compiled=False)
        >>> cfg.tiles.num_ctas, cfg.kwargs
        (4, {'kv_chunk_align': 32, 'min_kv_chunk': 40, 'head_span': True})
    """
    group = num_qo_heads // num_kv_heads
    # 128 tokens: it beat 256 on small GQA decode batches and 64 was no better; at batch >= 64
    # the floor does not bind (docs/serving.md, "KV chunk length")
    floor = min_kv_chunk or 128
    if not balance:  # one CTA per work item, each item's whole KV range in one unit
        items = num_kv_heads * int(np.sum(-(-(np.diff(qo) * group) // tiles.tq)))
        tiles = dataclasses.replace(tiles, num_ctas=max(items, 1))
        floor = max(int(kv_lens.max(initial=0)), 1)
    layout = plan_layout(max_batch, max_qo_tokens, tiles.num_ctas, num_qo_heads, num_kv_heads,
                         tiles.tq)
    # the FA3 batch kernel runs one KV head per unit (kernels/fa3/fa3_batch.cuh)
    span = tiles.kernel != "fa3"
    kwargs = dict(kv_chunk_align=tiles.tkv, min_kv_chunk=floor, head_span=span)
    problem = None
    if compiled:
        # scheduler.plan's checks of these (the same errors as plan_into would raise)
        _, tq, ctas, alpha, beta, align, floor = scheduler._checked_params(
            num_qo_heads, num_kv_heads, tiles.tq, tiles.num_ctas, 1.0, 1.0, tiles.tkv, floor)
        problem = planner.plan_problem(layout, num_ctas=ctas, alpha=alpha, beta=beta,
                                       align=align, floor=floor, head_span=span)
    return PlanConfig(tiles, layout, kwargs, problem)
