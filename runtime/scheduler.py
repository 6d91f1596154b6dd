"""Load-balanced work plan for a persistent attention kernel (CPU half).

This is the host-side scheduler of FlashInfer's serving runtime (arXiv 2501.01005, section 3.3,
"Algorithm 1"), rewritten for attncc. It turns one batch of ragged requests into a *plan*: a
fixed-size grid of CTAs, each with a queue of work units, plus a reduction map that merges the
partial results of requests whose KV range was split. The GPU kernel that consumes the plan is
written separately; everything it needs is in `Plan`, and `Plan.pack` flattens it into one int32
buffer with fixed offsets so that a CUDA graph captured once can replay with new plans.

Work decomposition
------------------
Request ``i`` has ``l_q[i] = qo_indptr[i+1] - qo_indptr[i]`` query tokens and ``l_kv[i]`` KV
tokens. With GQA group size ``g = num_qo_heads // num_kv_heads`` the ``g`` query heads that share
a KV head are *fused* into the rows of one query tile: fused row ``r`` of request ``i`` and KV
head ``h`` is query token ``qo_indptr[i] + r // g`` and query head ``h * g + r % g``. A request
has ``l_q[i] * g`` fused rows per KV head, cut into ``ceil(l_q[i] * g / tile_q)`` query tiles.
A *work item* is one (request, kv_head, query tile).

KV chunk length
---------------
    L_kv = round_up(max(ceil(num_kv_heads * sum_i ceil(l_q[i] * g / tile_q) * l_kv[i]
                             / num_ctas), min_kv_chunk), kv_chunk_align)

The paper's formula (the KV work of one head over the CTAs) applied to the CTAs one KV head gets
when all heads share the grid, ``num_ctas / num_kv_heads``: a chunk is the average work of a CTA,
so a batch with at least one work item per CTA is not split at all. (Dividing one head's work by
all CTAs instead split every request of a large MHA batch into ~num_kv_heads pieces: on the
H200, B=64 x 32 heads x 1K tokens became 8,192 units and 2,048 merges for 792 CTAs, and the
no-split ablation was faster.) The floor keeps chunks long enough to amortise their fixed cost,
the alignment (a page size) keeps chunk boundaries on page boundaries. The KV range of every work item is cut into chunks of at
most ``L_kv`` tokens; each chunk is a *work unit* with cost ``alpha * q_rows + beta * kv_len``.
A work item with ``l_kv = 0`` still gets one unit with an empty KV range: it must write its
output (0) and LSE (-inf). Requests with ``l_q = 0`` get no unit at all.

Assignment (longest processing time first)
------------------------------------------
Each unit in turn goes to the least loaded CTA (ties: lowest CTA index), exactly as a min-heap
of ``(load, cta)`` would do; a CTA's queue is the order in which it received units. Units are
taken by cost, descending; ties are broken by a fixed work-unit order: the unit's *cost group*
``4 * request + 2 * last_tile + last_chunk`` (a request's units have at most four distinct
costs: full or last query tile, full or last KV chunk), then unit index. To make the greedy
exact and machine independent the float costs are quantised to int64 *ticks*
(`cost_ticks`: ``rint(cost * 2**61 / (num_ctas * total_cost))``, so the heap key
``load * num_ctas + cta`` fits int64). The classic list-scheduling bound holds:
``max load <= total / num_ctas + max unit cost``.

The greedy never loops in Python per unit. Sorting is per cost group (at most ``4 * batch``),
then `_lpt_sorted` replays the heap a block at a time: a run of at least ``num_ctas`` equal
costs, when all loads are within one unit of each other, is dealt round robin; otherwise the
longest prefix of the next ``num_ctas`` units for which "unit ``j`` goes to the ``j``-th least
loaded CTA" provably holds is assigned at once. `lpt_schedule` exposes it for any integer
costs, `lpt_schedule_reference` is the plain heap; tests check they agree unit for unit.

Outputs and reduction
---------------------
A work item with one unit writes its rows straight to the output (*write-through*, ``slot = -1``).
The units of a split work item write a partial ``(O, LSE)`` to workspace *slots*, numbered in unit
order, so the slots of one item are consecutive and ascending in kv start. The reduction map
(CSR ``merge_indptr`` / ``merge_slots``, one ``merge_out`` target per split item) lists them in
that fixed order; merging in that order (`attncc.runtime.merge.merge_states`) makes results
bitwise reproducible for the same lengths.

Workspace bound
---------------
With ``H = num_kv_heads``, ``P = num_ctas``, ``S`` the per-head sum above and ``L = L_kv >= S/P``:
a split item has ``l_kv > L``, and the split items' KV sum is at most ``H * S <= H * P * L``, so
the number of split items is ``W_split <= H*P - 1``; the number of partial slots is
``sum ceil(l_kv / L) < H*S/L + W_split <= H*P + W_split``, hence
``num_partial_slots <= H*P + min(W_split, H*P - 1) - 1 <= 2*H*P - 2``: independent of the batch.
Units number at most ``W + H*P - 1`` (``W`` = work items). `PlanLayout` derives all its sizes
from these bounds; `workspace_bytes` sizes the partial-(O, LSE) workspace from them.

Host time
---------
Here everything is vectorised numpy: about 150 numpy calls plus about 10 per ``num_ctas``
units for the greedy. Measured medians at batch 256 with 32/8 heads and 264 CTAs (2 per SM):
decode (3-4k units) 0.6-1.2 ms on a noisy 2-vCPU VM (numpy 2.4), 0.8 ms on the CPU of an H200
host (numpy 2.5); prefill with 10-22k units 1.6-3.3 ms; a one-request batch 0.13 ms. The
compiled twin (runtime/planner.c, used when a C compiler is found) computes the same plan and,
through `plan_into`, packs it straight into the caller's buffer: at decode batch 256 with 792
CTAs, 35-45 us for 3-3.5k units, 48-62 us for 6-7k, 150-190 us for 25-29k on that VM
(bench/plan_time.py, which also times BatchAttention.plan end to end). The plan layout does not
depend on how the plan is computed.

Example:
    >>> p = plan([0, 1, 2, 3], [100, 1000, 5000], num_qo_heads=8, num_kv_heads=2, tile_q=16,
    ...          num_ctas=8)
    >>> p.kv_chunk, p.num_units, p.num_merges, p.num_partial_slots
    (1536, 12, 2, 8)
    >>> [round(x) for x in simulate(p)]
    [1540, 1540, 1540, 1540, 1540, 1540, 1504, 1504]
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import planner

__all__ = [
    "TILE_Q_CHOICES", "WRITE_THROUGH", "WORK_UNIT_DTYPE", "MERGE_TARGET_DTYPE", "HEADER_FIELDS",
    "paged_kv_lens", "kv_chunk_size", "cost_ticks", "lpt_schedule", "lpt_schedule_reference",
    "plan", "plan_into", "Plan",
    "PlanLayout", "workspace_bytes", "simulate",
]

TILE_Q_CHOICES = (16, 32, 64, 128)
"""Allowed query-tile heights (fused rows per CTA tile)."""

WRITE_THROUGH = -1
"""`WorkUnit.slot` of a unit that writes its result straight to the output."""

WORK_UNIT_DTYPE = np.dtype([
    ("request", np.int32),    # request index in the batch
    ("kv_head", np.int32),    # KV head; query heads kv_head*g .. kv_head*g + g-1
    ("qo_offset", np.int32),  # qo_indptr[request]: the request's first query token (absolute)
    ("q_start", np.int32),    # first fused row of the tile within the request (multiple of tile_q)
    ("q_rows", np.int32),     # fused rows in the tile, 1..tile_q
    ("kv_start", np.int32),   # first KV token of the chunk (within the request)
    ("kv_end", np.int32),     # one past the last KV token of the chunk
    ("slot", np.int32),       # workspace slot of the partial (O, LSE), or WRITE_THROUGH (-1)
])
"""One work unit: 8 int32 (32 bytes, two 16-byte vector loads on the GPU)."""

MERGE_TARGET_DTYPE = np.dtype([
    ("request", np.int32),    # request index
    ("kv_head", np.int32),    # KV head
    ("qo_offset", np.int32),  # qo_indptr[request]
    ("q_start", np.int32),    # first fused row of the tile within the request
    ("q_rows", np.int32),     # fused rows of the tile
])
"""Where the merged result of one split work item goes (fused rows, as in `WORK_UNIT_DTYPE`)."""

HEADER_FIELDS = (
    "magic", "version", "batch_size", "num_units", "num_ctas", "num_merges",
    "num_partial_slots", "kv_chunk", "tile_q", "group_size", "num_qo_heads", "num_kv_heads",
    "total_qo_tokens", "layout_size", "reserved0", "reserved1",
)
"""The int32 header at offset 0 of a packed plan, in this order."""

PLAN_MAGIC = 0x4E4C5041  # b"APLN" little endian
PLAN_VERSION = 1
_ALIGN = 4  # every packed section starts at a multiple of 4 int32 (16 bytes)
_INT32_MAX = 2**31 - 1
_TICK_BUDGET = 2.0**61


# --------------------------------------------------------------------------- validation helpers

def _as_int_array(x: Any, name: str) -> np.ndarray:
    """`x` as a 1-D int64 numpy array, or a ValueError/TypeError naming `name`."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _as_indptr(x: Any, name: str) -> np.ndarray:
    """A validated CSR indptr: 1-D ints, starts at 0, non-decreasing."""
    a = _as_int_array(x, name)
    if a.size == 0:
        raise ValueError(f"{name} must have at least one entry (batch_size + 1), got 0")
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(a[0])}")
    d = np.diff(a)
    if d.size and d.min() < 0:
        i = int(np.argmax(d < 0))
        raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}] = {int(a[i + 1])} "
                         f"< {name}[{i}] = {int(a[i])}")
    return a


def _check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return int(value)


def _check_heads(num_qo_heads: Any, num_kv_heads: Any) -> int:
    """Validate the head counts; return the GQA group size."""
    hq = _check_int(num_qo_heads, "num_qo_heads", 1)
    hk = _check_int(num_kv_heads, "num_kv_heads", 1)
    if hq % hk:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    return hq // hk


def _check_tile_q(tile_q: Any) -> int:
    if isinstance(tile_q, bool) or tile_q not in TILE_Q_CHOICES:
        raise ValueError(f"tile_q must be one of {TILE_Q_CHOICES}, got {tile_q!r}")
    return int(tile_q)


def _check_coef(value: Any, name: str) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return v


def _ceil_div(a: Any, b: Any) -> Any:
    return -(-a // b)


# --------------------------------------------------------------------------- small public helpers

def paged_kv_lens(kv_indptr: Any, kv_last_page_len: Any, page_size: int) -> np.ndarray:
    """KV length per request of a paged KV cache (int64 ``[batch]``).

    ``kv_indptr`` (``[batch+1]``) is the CSR of page indices, ``kv_last_page_len`` (``[batch]``)
    the number of used tokens in each request's last page (``1..page_size``; anything in
    ``0..page_size`` for a request without pages, whose length is 0).

    Example:
        >>> paged_kv_lens([0, 2, 2, 5], [3, 0, 16], page_size=16).tolist()
        [19, 0, 48]
    """
    page_size = _check_int(page_size, "page_size", 1)
    indptr = _as_indptr(kv_indptr, "kv_indptr")
    last = _as_int_array(kv_last_page_len, "kv_last_page_len")
    if last.size != indptr.size - 1:
        raise ValueError(f"kv_last_page_len has {last.size} entries, but kv_indptr describes "
                         f"{indptr.size - 1} requests")
    pages = np.diff(indptr)
    if last.size and (last.min() < 0 or last.max() > page_size):
        raise ValueError(f"kv_last_page_len must be in [0, page_size={page_size}]")
    if np.any((pages > 0) & (last == 0)):
        i = int(np.argmax((pages > 0) & (last == 0)))
        raise ValueError(f"kv_last_page_len[{i}] is 0 but request {i} has {int(pages[i])} pages "
                         f"(a non-empty request's last page holds 1..page_size tokens)")
    return np.where(pages > 0, (pages - 1) * page_size + last, 0)


def kv_chunk_size(tile_kv_work: int, num_ctas: int, min_kv_chunk: int = 128,
                  kv_chunk_align: int = 16) -> int:
    """The maximum KV chunk length ``L_kv`` (see the module docstring).

    ``tile_kv_work`` is ``num_kv_heads * sum_i ceil(l_q[i] * g / tile_q) * l_kv[i]`` (the work
    of every KV head).

    Example:
        >>> kv_chunk_size(10_000, 8), kv_chunk_size(100, 8), kv_chunk_size(100, 8, 50, 32)
        (1264, 128, 64)
    """
    raw = _ceil_div(int(tile_kv_work), num_ctas)
    return int(_ceil_div(max(raw, min_kv_chunk), kv_chunk_align) * kv_chunk_align)


# --------------------------------------------------------------------------- LPT assignment

def _as_costs(costs: Any, name: str = "costs") -> np.ndarray:
    c = np.asarray(costs)
    if c.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {c.shape}")
    if c.size and c.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers (quantise float costs first), got {c.dtype}")
    c = c.astype(np.int64, copy=False)
    if c.size and c.min() < 0:
        raise ValueError(f"{name} must be >= 0")
    return c


def _small_int(a: np.ndarray, bound: int) -> np.ndarray:
    """`a` (values in [0, bound)) as int16 when it fits: numpy's stable sort is then a radix sort."""
    return a.astype(np.int16 if bound <= 2**15 else np.int64, copy=False)


def _queues(order: np.ndarray, assign: np.ndarray, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR (cta_indptr, cta_units) from units in assignment order and their CTAs."""
    by_cta = np.argsort(_small_int(assign, num_ctas), kind="stable")
    cta_units = order[by_cta].astype(np.int32)
    indptr = np.zeros(num_ctas + 1, dtype=np.int32)
    np.cumsum(np.bincount(assign, minlength=num_ctas), out=indptr[1:])
    return indptr, cta_units


def _lpt_sorted(c: np.ndarray, run_ends: np.ndarray, p: int) -> np.ndarray:
    """The CTA of each unit of ``c`` (int64 costs, already in greedy order, descending).

    ``run_ends`` (ascending) holds, for each run of equal costs, one past its last unit (see
    `_run_ends`). A CTA's heap key is ``load * p + cta`` (unique, ordered like ``(load, cta)``).
    Each step handles either a whole run of at least ``p`` units of equal cost ``c`` when the
    loads differ by less than ``c`` (then the run is dealt round robin in load order), or the
    longest prefix of the next ``p`` units that provably goes unit ``j`` to the ``j``-th least
    loaded CTA: true while that CTA is below every CTA already given a unit in this step.
    """
    n = c.size
    assign = np.empty(n, dtype=np.int64)
    key = np.arange(p, dtype=np.int64)
    step = c * p
    t = 0
    while t < n:
        st = int(step[t])
        if st == 0:  # the rest cost nothing: the least loaded CTA stays least loaded
            assign[t:] = int(np.argmin(key))
            break
        srt = np.argsort(key, kind="stable")  # keys are unique: any sort would do, this is fast
        sk = key[srt]
        if int(sk[-1]) - int(sk[0]) < st:  # loads within one unit: deal a long run round robin
            e = int(run_ends[np.searchsorted(run_ends, t, side="right")])
            k = e - t
        else:
            k = 0
        if k >= p:
            assign[t:e] = srt if k == p else np.resize(srt, k)
            inc = np.full(p, (k // p) * st, dtype=np.int64)
            inc[: k % p] += st
            key[srt] = sk + inc
            t = e
            continue
        k = min(p, n - t)
        new = sk[:k] + step[t:t + k]
        ok = sk[1:k] < np.minimum.accumulate(new[:k - 1])
        bad = int(ok.argmin()) if k > 1 else 0
        m = k if k == 1 or ok[bad] else bad + 1
        assign[t:t + m] = srt[:m]
        key[srt[:m]] = new[:m]
        t += m
    return assign


def _run_ends(c: np.ndarray) -> np.ndarray:
    """For sorted ``c``: one past the last position of each run of equal values, ascending."""
    return np.append(np.flatnonzero(c[1:] != c[:-1]) + 1, c.size)


def _greedy_order(c: np.ndarray, tiebreak: Any) -> np.ndarray:
    """Unit indices by cost descending, then ``tiebreak`` ascending, then index."""
    if tiebreak is None:
        return np.argsort(-c, kind="stable")
    tb = _as_int_array(tiebreak, "tiebreak")
    if tb.size != c.size:
        raise ValueError(f"tiebreak has {tb.size} entries, costs has {c.size}")
    return np.lexsort((tb, -c))


def lpt_schedule(costs: Any, num_ctas: int, tiebreak: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time-first assignment of integer ``costs`` to ``num_ctas`` CTAs.

    Units are taken by cost descending, ties by ``tiebreak`` (ints, default none) then index;
    each goes to the least loaded CTA, ties to the lowest CTA index. Returns
    ``(cta_indptr int32 [num_ctas+1], cta_units int32 [n])``: CTA ``c`` runs units
    ``cta_units[cta_indptr[c]:cta_indptr[c+1]]`` in the order it received them. Identical to
    `lpt_schedule_reference` (a Python min-heap), but assigns whole runs of equal cost and
    whole blocks of up to ``num_ctas`` units per numpy step (see the module docstring).

    Example:
        >>> indptr, units = lpt_schedule([5, 3, 3, 2, 2, 1], num_ctas=2)
        >>> [units[indptr[c]:indptr[c + 1]].tolist() for c in range(2)]
        [[0, 3, 5], [1, 2, 4]]
    """
    c = _as_costs(costs)
    p = _check_int(num_ctas, "num_ctas", 1)
    if c.size and float(c.sum(dtype=np.float64)) * p >= 2.0**62:
        raise OverflowError("costs too large: sum(costs) * num_ctas must stay below 2**62")
    order = _greedy_order(c, tiebreak)
    cs = c[order]
    return _queues(order, _lpt_sorted(cs, _run_ends(cs), p), p)


def lpt_schedule_reference(costs: Any, num_ctas: int,
                           tiebreak: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """`lpt_schedule` with a plain Python min-heap of ``(load, cta)``: the specification.

    Example:
        >>> indptr, units = lpt_schedule_reference([5, 3, 3, 2, 2, 1], num_ctas=2)
        >>> indptr.tolist(), units.tolist()
        ([0, 3, 6], [0, 3, 5, 1, 2, 4])
    """
    c = [int(x) for x in _as_costs(costs)]
    p = _check_int(num_ctas, "num_ctas", 1)
    tb = [0] * len(c) if tiebreak is None else [int(x) for x in tiebreak]
    order = sorted(range(len(c)), key=lambda u: (-c[u], tb[u], u))
    heap = [(0, cta) for cta in range(p)]
    assign = []
    for u in order:
        load, cta = heapq.heappop(heap)
        assign.append(cta)
        heapq.heappush(heap, (load + c[u], cta))
    return _queues(np.asarray(order, dtype=np.int64), np.asarray(assign, dtype=np.int64), p)


def cost_ticks(costs: Any, num_ctas: int, total: float | None = None) -> np.ndarray:
    """Float unit costs -> int64 ticks ``rint(cost * 2**61 / (num_ctas * total))``.

    ``total`` defaults to ``sum(costs)``; `plan` passes ``alpha * sum(q_rows) + beta *
    sum(kv_len)`` (exact integer sums, so the ticks do not depend on a float summation order).
    Keeps ``sum(ticks) * num_ctas < 2**62``, so `lpt_schedule`'s heap keys fit int64.

    Example:
        >>> cost_ticks([1.0, 3.0], num_ctas=2).tolist()
        [288230376151711744, 864691128455135232]
    """
    c = np.asarray(costs, dtype=np.float64)
    total = float(c.sum()) if total is None else float(total)
    if total <= 0.0:
        return np.zeros(c.size, dtype=np.int64)
    return np.rint(c * (_TICK_BUDGET / (num_ctas * total))).astype(np.int64)


# --------------------------------------------------------------------------- the plan

def _checked_lengths(qo_indptr: Any, kv_lens: Any) -> tuple[np.ndarray, np.ndarray]:
    """`plan`'s checks of the batch: a query CSR from 0 and one KV length >= 0 per request."""
    qo = _as_indptr(qo_indptr, "qo_indptr")
    kv = _as_int_array(kv_lens, "kv_lens")
    batch = qo.size - 1
    if kv.size != batch:
        raise ValueError(f"kv_lens has {kv.size} entries, qo_indptr describes {batch} requests")
    if batch and kv.min() < 0:
        i = int(np.argmax(kv < 0))
        raise ValueError(f"kv_lens must be >= 0, kv_lens[{i}] = {int(kv[i])}")
    return qo, kv


def _checked_params(*params: Any) -> tuple[int, int, int, float, float, int, int]:
    """`plan`'s checks of its scalars (num_qo_heads, num_kv_heads, tile_q, num_ctas, alpha,
    beta, kv_chunk_align, min_kv_chunk): (group size, tile_q, num_ctas, alpha, beta, KV chunk
    alignment, KV chunk floor). Memoised (a serving loop plans with the same few every step);
    arguments that cannot be hashed, or fail a check, go through the checks themselves."""
    try:
        return _checked_params_memo(*params)
    except TypeError:
        return _check_params(*params)


def _check_params(num_qo_heads: Any, num_kv_heads: Any, tile_q: Any, num_ctas: Any,
                  alpha: Any, beta: Any, kv_chunk_align: Any, min_kv_chunk: Any
                  ) -> tuple[int, int, int, float, float, int, int]:
    g = _check_heads(num_qo_heads, num_kv_heads)
    tile_q = _check_tile_q(tile_q)
    num_ctas = _check_int(num_ctas, "num_ctas", 1)
    alpha, beta = _check_coef(alpha, "alpha"), _check_coef(beta, "beta")
    if alpha == 0.0 and beta == 0.0:
        raise ValueError("alpha and beta cannot both be 0")
    align = _check_int(kv_chunk_align, "kv_chunk_align", 1, 2**20)
    floor = _check_int(min_kv_chunk, "min_kv_chunk", 1, 2**30)
    return g, tile_q, num_ctas, alpha, beta, align, floor


_checked_params_memo = functools.lru_cache(maxsize=256, typed=True)(_check_params)


def _check_int32_range(qo: np.ndarray, kv: np.ndarray) -> None:
    if qo[-1] > _INT32_MAX or (kv.size and kv.max() > _INT32_MAX):
        raise ValueError("qo_indptr / kv_lens exceed the int32 range of the packed plan")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class Plan:
    """A scheduled batch (see the module docstring). All arrays are read-only numpy arrays.

    Attributes:
        batch_size, num_qo_heads, num_kv_heads, group_size, tile_q, num_ctas: the problem.
        kv_chunk: ``L_kv``, the maximum KV tokens of one unit (a multiple of ``kv_chunk_align``).
        alpha, beta: the cost coefficients (per fused query row, per KV token).
        qo_indptr: int32 ``[batch+1]``, the query CSR the plan was made for.
        kv_lens: int32 ``[batch]``, the KV length of each request.
        units: `WORK_UNIT_DTYPE` ``[num_units]``, ordered by (request, kv_head, tile, kv chunk).
        cta_indptr: int32 ``[num_ctas+1]``, CSR of the per-CTA queues in ``cta_units``.
        cta_units: int32 ``[num_units]``, unit indices, each CTA's queue in execution order.
        merge_indptr: int32 ``[num_merges+1]``, CSR of the reduction map over ``merge_slots``.
        merge_slots: int32 ``[num_partial_slots]``, workspace slots to merge, ascending kv start.
        merge_out: `MERGE_TARGET_DTYPE` ``[num_merges]``, where each merged result goes.
        num_partial_slots: workspace slots used (each ``tile_q`` rows of O plus ``tile_q`` LSE).

    Example:
        >>> p = plan([0, 2], [300], num_qo_heads=4, num_kv_heads=2, tile_q=16, num_ctas=4)
        >>> p.kv_chunk, p.units[["kv_head", "q_rows", "kv_start", "kv_end", "slot"]].tolist()
        (160, [(0, 4, 0, 160, 0), (0, 4, 160, 300, 1), (1, 4, 0, 160, 2), (1, 4, 160, 300, 3)])
        >>> p.merge_indptr.tolist(), p.merge_slots.tolist(), p.merge_out["kv_head"].tolist()
        ([0, 2, 4], [0, 1, 2, 3], [0, 1])
    """

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    group_size: int
    tile_q: int
    num_ctas: int
    kv_chunk: int
    alpha: float
    beta: float
    qo_indptr: np.ndarray
    kv_lens: np.ndarray
    units: np.ndarray
    cta_indptr: np.ndarray
    cta_units: np.ndarray
    merge_indptr: np.ndarray
    merge_slots: np.ndarray
    merge_out: np.ndarray
    num_partial_slots: int

    @property
    def num_units(self) -> int:
        """Number of work units."""
        return int(self.units.size)

    @property
    def num_merges(self) -> int:
        """Number of split work items (entries of the reduction map)."""
        return int(self.merge_out.size)

    def unit_costs(self) -> np.ndarray:
        """float64 ``[num_units]``: ``alpha * q_rows + beta * (kv_end - kv_start)``.

        Example:
            >>> p = plan([0, 1], [40], 2, 1, 16, 1, alpha=2.0, beta=0.5)
            >>> p.unit_costs().tolist()
            [24.0]
        """
        u = self.units
        kv_len = (u["kv_end"] - u["kv_start"]).astype(np.float64)
        return self.alpha * u["q_rows"] + self.beta * kv_len

    def pack(self, layout: "PlanLayout", out: np.ndarray | None = None) -> np.ndarray:
        """Flatten the plan into one int32 buffer laid out by ``layout`` (fixed offsets).

        Returns a new zero-filled ``int32 [layout.size]`` array, or writes into ``out`` (e.g. a
        numpy view of a pinned host tensor) and returns it; then only the header and the used
        prefix of each section are written. ``cta_indptr`` is padded to ``layout.max_ctas + 1``
        and ``merge_indptr`` to ``layout.max_merges + 1`` with their last value, so a grid of
        ``layout.max_ctas`` CTAs sees empty queues past ``num_ctas``. Raises ValueError naming
        the `PlanLayout` maximum the plan exceeds.

        Example:
            >>> layout = PlanLayout(max_batch=4, max_qo_tokens=64, max_ctas=8, num_qo_heads=4,
            ...                     num_kv_heads=1, tile_q=16)
            >>> p = plan([0, 3, 4], [500, 20], 4, 1, 16, num_ctas=4)
            >>> buf = p.pack(layout)
            >>> buf.dtype, buf.size == layout.size, layout.unpack(buf)["num_units"]
            (dtype('int32'), True, 5)
        """
        layout.check(self)
        if out is None:
            buf = np.zeros(layout.size, dtype=np.int32)
        else:
            if out.dtype != np.int32 or out.ndim != 1 or not out.flags.c_contiguous:
                raise ValueError("out must be a contiguous 1-D int32 array")
            if out.size < layout.size:
                raise ValueError(f"out has {out.size} int32, the layout needs {layout.size}")
            buf = out
        values = dict(magic=PLAN_MAGIC, version=PLAN_VERSION, batch_size=self.batch_size,
                      num_units=self.num_units, num_ctas=self.num_ctas,
                      num_merges=self.num_merges, num_partial_slots=self.num_partial_slots,
                      kv_chunk=self.kv_chunk, tile_q=self.tile_q, group_size=self.group_size,
                      num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                      total_qo_tokens=int(self.qo_indptr[-1]), layout_size=layout.size)
        buf[:len(HEADER_FIELDS)] = [values.get(name, 0) for name in HEADER_FIELDS]
        off = layout.offsets
        n = self.num_units
        buf[off["units"]: off["units"] + n * 8] = self.units.view(np.int32).reshape(-1)
        o = off["cta_indptr"]
        buf[o: o + self.num_ctas + 1] = self.cta_indptr
        buf[o + self.num_ctas + 1: o + layout.max_ctas + 1] = n
        buf[off["cta_units"]: off["cta_units"] + n] = self.cta_units
        o = off["merge_indptr"]
        buf[o: o + self.num_merges + 1] = self.merge_indptr
        buf[o + self.num_merges + 1: o + layout.max_merges + 1] = self.num_partial_slots
        buf[off["merge_slots"]: off["merge_slots"] + self.num_partial_slots] = self.merge_slots
        m = self.num_merges * len(MERGE_TARGET_DTYPE.names)
        buf[off["merge_out"]: off["merge_out"] + m] = self.merge_out.view(np.int32).reshape(-1)
        return buf


def plan(qo_indptr: Any, kv_lens: Any, num_qo_heads: int, num_kv_heads: int, tile_q: int,
         num_ctas: int, *, alpha: float = 1.0, beta: float = 1.0, kv_chunk_align: int = 16,
         min_kv_chunk: int = 128, impl: str = "auto") -> Plan:
    """Schedule one batch (Algorithm 1, see the module docstring).

    Args:
        qo_indptr: ``[batch+1]`` CSR of query tokens per request (ragged, starts at 0).
        kv_lens: ``[batch]`` KV tokens per request (see `paged_kv_lens`).
        num_qo_heads, num_kv_heads: head counts (GQA group ``g = num_qo_heads // num_kv_heads``).
        tile_q: fused query rows per CTA tile, one of `TILE_Q_CHOICES`.
        num_ctas: CTAs of the persistent grid (e.g. ``k * #SM``).
        alpha, beta: unit cost = ``alpha * q_rows + beta * kv_tokens``.
        kv_chunk_align: chunk lengths are multiples of this (use the page size).
        min_kv_chunk: floor of the chunk length (rounded up to ``kv_chunk_align``).
        impl: "numpy", "c" (the compiled twin in runtime/planner.c: the same plan, tens of
            microseconds instead of a millisecond at batch 256; `plan_into` skips the typed
            arrays too) or "auto" (C when a C compiler is available).

    Example:
        >>> p = plan([0, 1, 1, 2], [4096, 50, 0], num_qo_heads=32, num_kv_heads=4, tile_q=16,
        ...          num_ctas=16)
        >>> p.kv_chunk, p.num_units, p.num_merges
        (1024, 20, 4)
        >>> p.cta_indptr.tolist()
        [0, 2, 4, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        >>> p.units[-1].tolist()     # request 2 has no KV: an empty write-through unit
        (2, 3, 1, 0, 8, 0, 0, -1)
    """
    qo, kv = _checked_lengths(qo_indptr, kv_lens)
    batch = qo.size - 1
    g, tile_q, num_ctas, alpha, beta, align, floor = _checked_params(
        num_qo_heads, num_kv_heads, tile_q, num_ctas, alpha, beta, kv_chunk_align, min_kv_chunk)
    _check_int32_range(qo, kv)
    hk = int(num_kv_heads)
    if impl not in ("auto", "numpy", "c"):
        raise ValueError(f"impl={impl!r}: use 'auto', 'numpy' or 'c'")
    if impl != "numpy":
        if planner.available():
            r = planner.compiled_plan(qo, kv, g=g, hk=hk, tile_q=tile_q, num_ctas=num_ctas,
                                      alpha=alpha, beta=beta, align=align, floor=floor)
            return Plan(
                batch_size=batch, num_qo_heads=int(num_qo_heads), num_kv_heads=hk,
                group_size=g, tile_q=tile_q, num_ctas=num_ctas, kv_chunk=r["chunk"],
                alpha=alpha, beta=beta, qo_indptr=_frozen(qo.astype(np.int32)),
                kv_lens=_frozen(kv.astype(np.int32)),
                units=_frozen(r["units"].view(WORK_UNIT_DTYPE).reshape(-1)),
                cta_indptr=_frozen(r["cta_indptr"]), cta_units=_frozen(r["cta_units"]),
                merge_indptr=_frozen(r["merge_indptr"]),
                merge_slots=_frozen(np.arange(r["num_slots"], dtype=np.int32)),
                merge_out=_frozen(r["merge_out"].view(MERGE_TARGET_DTYPE).reshape(-1)),
                num_partial_slots=r["num_slots"])
        if impl == "c":
            raise RuntimeError("plan(impl='c'): the compiled planner could not be built (no C "
                               "compiler found; set CC) -- use impl='numpy'")

    # per request (int64 [batch]): fused rows, query tiles, KV chunks
    rows = np.diff(qo) * g
    ntiles = _ceil_div(rows, tile_q)
    chunk = kv_chunk_size(int(ntiles @ kv) * hk, num_ctas, floor, align)
    chunk = min(chunk, _INT32_MAX // align * align)  # only absurd sizes: stays a packed int32
    nchunks = np.where(ntiles > 0, np.maximum(_ceil_div(kv, chunk), 1), 0)

    table, unit_group, split_first, split_nc = _expand_units(qo, kv, rows, ntiles, nchunks, hk,
                                                             tile_q, chunk)
    units = table.view(WORK_UNIT_DTYPE).reshape(-1)
    # reduction map: one entry per split work item, its slots consecutive in unit order
    n_fields = len(MERGE_TARGET_DTYPE.names)  # the first fields of a work unit
    merge_out = np.ascontiguousarray(table[split_first, :n_fields])
    merge_out = merge_out.view(MERGE_TARGET_DTYPE).reshape(-1)
    merge_indptr = np.zeros(split_first.size + 1, dtype=np.int32)
    np.cumsum(split_nc, out=merge_indptr[1:])
    num_slots = int(merge_indptr[-1])

    g_count, g_ticks = _group_ticks(rows, ntiles, nchunks, kv, hk, tile_q, chunk, alpha, beta,
                                    num_ctas)
    order, c_sorted, run_ends = _greedy_order_groups(unit_group, g_count, g_ticks)
    cta_indptr, cta_units = _queues(order, _lpt_sorted(c_sorted, run_ends, num_ctas), num_ctas)
    return Plan(
        batch_size=batch, num_qo_heads=int(num_qo_heads), num_kv_heads=hk, group_size=g,
        tile_q=tile_q, num_ctas=num_ctas, kv_chunk=chunk, alpha=alpha, beta=beta,
        qo_indptr=_frozen(qo.astype(np.int32)), kv_lens=_frozen(kv.astype(np.int32)),
        units=_frozen(units), cta_indptr=_frozen(cta_indptr), cta_units=_frozen(cta_units),
        merge_indptr=_frozen(merge_indptr),
        merge_slots=_frozen(np.arange(num_slots, dtype=np.int32)),
        merge_out=_frozen(merge_out), num_partial_slots=num_slots,
    )


def plan_into(out: np.ndarray, layout: PlanLayout, qo_indptr: Any, kv_lens: Any,
              num_qo_heads: int, num_kv_heads: int, tile_q: int, num_ctas: int, *,
              alpha: float = 1.0, beta: float = 1.0, kv_chunk_align: int = 16,
              min_kv_chunk: int = 128, checked: bool = False) -> None:
    """``plan(...).pack(layout, out=out)`` in one step: the same int32 words, and the same
    errors. With the compiled planner the plan is computed straight into ``out`` (no `Plan`
    object, no intermediate arrays): tens of microseconds where plan + pack take a millisecond.

    ``checked=True``: the caller has already checked ``qo_indptr`` and ``kv_lens`` as `plan`
    does (int64 numpy arrays, a CSR from 0, lengths in ``0 .. 2**31 - 1``); the checks of the
    scalars are always made.

    Example:
        >>> layout = PlanLayout(max_batch=4, max_qo_tokens=64, max_ctas=8, num_qo_heads=4,
        ...                     num_kv_heads=1, tile_q=16)
        >>> out = np.zeros(layout.size, dtype=np.int32)
        >>> plan_into(out, layout, [0, 3, 4], [500, 20], 4, 1, 16, num_ctas=4)
        >>> bool(np.array_equal(out, plan([0, 3, 4], [500, 20], 4, 1, 16, 4).pack(layout)))
        True
    """
    if checked:
        qo, kv = qo_indptr, kv_lens
    else:
        qo, kv = _checked_lengths(qo_indptr, kv_lens)
    g, tile_q, num_ctas, alpha, beta, align, floor = _checked_params(
        num_qo_heads, num_kv_heads, tile_q, num_ctas, alpha, beta, kv_chunk_align, min_kv_chunk)
    if not checked:
        _check_int32_range(qo, kv)
    fits = (isinstance(out, np.ndarray) and out.dtype == np.int32 and out.ndim == 1
            and out.flags.c_contiguous and out.flags.writeable and out.size >= layout.size
            and (num_qo_heads, num_kv_heads, tile_q) == (layout.num_qo_heads,
                                                         layout.num_kv_heads, layout.tile_q))
    if fits and planner.available() and planner.pack_plan(
            out, layout, qo, kv, num_ctas=num_ctas, alpha=alpha, beta=beta, align=align,
            floor=floor) is not None:
        return
    # no compiler, or the plan does not fit: Plan.pack writes it or names what does not fit
    plan(qo, kv, num_qo_heads, num_kv_heads, tile_q, num_ctas, alpha=alpha, beta=beta,
         kv_chunk_align=align, min_kv_chunk=floor).pack(layout, out=out)


_BUILD_DTYPE = np.dtype(WORK_UNIT_DTYPE.descr + [("first", np.int32)])
"""`WORK_UNIT_DTYPE` plus scratch: a work item's first unit (used while expanding units)."""


def _expand_units(qo: np.ndarray, kv: np.ndarray, rows: np.ndarray, ntiles: np.ndarray,
                  nchunks: np.ndarray, hk: int, tile_q: int, chunk: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All work units in (request, kv_head, tile, chunk) order.

    Returns ``(table, unit_group, split_first, split_nc)``: the units as a contiguous int32
    ``[n, 8]`` table (the `WORK_UNIT_DTYPE` fields in order), each unit's cost group
    (``4 * request + 2 * last_tile + last_chunk``, see `_group_ticks`), and for each split
    work item its first unit and its number of chunks.

    Work items are built once, then (when some request is split) repeated per chunk in one
    call; until the per-chunk fields are filled in, ``kv_start`` holds the item's group base,
    ``kv_end`` the KV length and ``slot`` the request's slot offset (first slot minus first
    unit: a split request's units take consecutive slots).
    """
    per_req = ntiles * hk                            # work items per request
    req = np.repeat(np.arange(ntiles.size, dtype=np.int64), per_req)
    j = np.arange(req.size, dtype=np.int64) - (np.cumsum(per_req) - per_req)[req]
    req_rows = rows[req]
    if ntiles.max(initial=0) <= 1:                   # one tile per request and head: decode
        head, q_start = j, np.zeros_like(j)
    else:
        nt = ntiles[req]
        head = j // nt
        q_start = (j - head * nt) * tile_q
    group_base = 4 * req + 2 * (q_start + tile_q >= req_rows)
    any_split = bool(nchunks.max(initial=0) > 1)
    items = np.empty(req.size, dtype=_BUILD_DTYPE if any_split else WORK_UNIT_DTYPE)
    items["request"] = req
    items["kv_head"] = head
    items["qo_offset"] = qo[req]
    items["q_start"] = q_start
    items["q_rows"] = np.minimum(req_rows - q_start, tile_q)
    if not any_split:                                # every work item is one unit
        items["kv_start"] = 0
        items["kv_end"] = kv[req]
        items["slot"] = WRITE_THROUGH
        empty = np.zeros(0, dtype=np.int64)
        table = items.view(np.int32).reshape(req.size, len(WORK_UNIT_DTYPE.names))
        return table, group_base + 1, empty, empty

    req_units = per_req * nchunks
    unit_first = np.cumsum(req_units) - req_units
    req_slots = np.where(nchunks > 1, req_units, 0)
    slot_offset = np.cumsum(req_slots) - req_slots - unit_first
    nc = nchunks[req]
    first = unit_first[req] + j * nc
    items["kv_start"] = group_base
    items["kv_end"] = kv[req]
    items["slot"] = slot_offset[req]
    items["first"] = first
    units = np.repeat(items, nc)

    u = np.arange(units.size, dtype=np.int64)
    kv_start = (u - units["first"]) * chunk
    kv_len = units["kv_end"].astype(np.int64)
    chunk_end = kv_start + chunk
    unit_group = units["kv_start"] + (chunk_end >= kv_len)
    units["slot"] = np.where(kv_len > chunk, u + units["slot"], WRITE_THROUGH)
    units["kv_start"] = kv_start
    units["kv_end"] = np.minimum(chunk_end, kv_len)
    split = nc > 1
    width = _BUILD_DTYPE.itemsize // 4
    table = units.view(np.int32).reshape(units.size, width)[:, :len(WORK_UNIT_DTYPE.names)]
    return np.ascontiguousarray(table), unit_group, first[split], nc[split]


def _group_ticks(rows: np.ndarray, ntiles: np.ndarray, nchunks: np.ndarray, kv: np.ndarray,
                 hk: int, tile_q: int, chunk: int, alpha: float, beta: float,
                 num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Unit count and tick cost of each cost group, int64 ``[4 * batch]``.

    Request ``i``'s units fall in four groups ``4*i + 2*a + b``: ``a`` = last query tile
    (``tile_q`` rows otherwise), ``b`` = last KV chunk (``chunk`` tokens otherwise). The total
    cost is ``num_kv_heads * sum_i (alpha * rows_i * nchunks_i + beta * ntiles_i * kv_i)``.
    """
    batch = rows.size
    full_t, full_c = ntiles - 1, nchunks - 1          # full tiles / chunks (-1 if inactive)
    heads = hk * (ntiles > 0)
    count = np.empty((batch, 4), dtype=np.int64)
    count[:, 0] = full_t * full_c * heads
    count[:, 1] = full_t * heads
    count[:, 2] = full_c * heads
    count[:, 3] = heads
    last_rows = alpha * (rows - full_t * tile_q)
    last_len = beta * (kv - full_c * chunk)
    cost = np.empty((batch, 4), dtype=np.float64)
    cost[:, 0] = alpha * tile_q + beta * chunk
    cost[:, 1] = alpha * tile_q + last_len
    cost[:, 2] = last_rows + beta * chunk
    cost[:, 3] = last_rows + last_len
    count = count.reshape(-1)
    cost = cost.reshape(-1)
    cost[count == 0] = 0.0
    total = hk * (alpha * float(rows @ nchunks) + beta * float(ntiles @ kv))
    return count, cost_ticks(cost, num_ctas, total)


def _greedy_order_groups(unit_group: np.ndarray, g_count: np.ndarray, g_ticks: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Units in greedy order (ticks descending, then group id, then unit index), their ticks
    in that order, and the ends of the runs of equal ticks (see `_lpt_sorted`)."""
    gid = np.flatnonzero(g_count)
    g_order = gid[np.argsort(-g_ticks[gid], kind="stable")]
    rank = np.empty(g_count.size, dtype=np.int64)
    rank[g_order] = np.arange(g_order.size)
    order = np.argsort(_small_int(rank[unit_group], g_order.size), kind="stable")
    ticks, count = g_ticks[g_order], g_count[g_order]
    ends = np.cumsum(count)
    run_ends = ends[np.append(ticks[1:] != ticks[:-1], True)] if ticks.size else ends
    return order, np.repeat(ticks, count), run_ends


def simulate(plan: Plan, costs: Sequence[float] | None = None) -> list[float]:
    """Each CTA's total cost, by walking the queues in pure Python (a reference, not fast).

    ``costs[u]`` is unit ``u``'s cost; by default ``alpha * q_rows + beta * kv_len``.

    Example:
        >>> p = plan([0, 1, 2], [10, 20], 1, 1, 16, num_ctas=2)
        >>> simulate(p), simulate(p, costs=[1.0, 5.0])
        ([21.0, 11.0], [5.0, 1.0])
    """
    if costs is None:
        costs = [plan.alpha * int(u["q_rows"]) + plan.beta * (int(u["kv_end"]) - int(u["kv_start"]))
                 for u in plan.units]
    if len(costs) != plan.num_units:
        raise ValueError(f"costs has {len(costs)} entries, the plan has {plan.num_units} units")
    indptr = plan.cta_indptr.tolist()
    queue = plan.cta_units.tolist()
    loads = []
    for cta in range(plan.num_ctas):
        total = 0.0
        for i in range(indptr[cta], indptr[cta + 1]):
            total += float(costs[queue[i]])
        loads.append(total)
    return loads


# --------------------------------------------------------------------------- packed layout

@dataclass(frozen=True)
class PlanLayout:
    """Fixed offsets of a packed plan, derived from user maxima (hashable: key a graph cache by it).

    ``max_batch``: requests; ``max_qo_tokens``: total query tokens of a batch; ``max_ctas``: grid
    size; ``num_qo_heads`` / ``num_kv_heads`` / ``tile_q`` must equal the plan's. Derived bounds
    (see the module docstring), with ``H = num_kv_heads``, ``P = max_ctas``:

    - ``max_items = H * floor((g * N + min(max_batch, N) * (tile_q - 1)) / tile_q)``,
      ``N = max_qo_tokens``
    - ``max_units = max_items + H*P - 1``
    - ``max_merges = min(max_items, H*P - 1)``
    - ``max_partial_slots = min(2*H*P - 2, max_items + H*P - 1)``

    Sections (int32, each at a multiple of 4): ``header`` (`HEADER_FIELDS`), ``units``
    (``max_units * 8``, `WORK_UNIT_DTYPE` rows), ``cta_indptr`` (``max_ctas + 1``),
    ``cta_units`` (``max_units``), ``merge_indptr`` (``max_merges + 1``), ``merge_slots``
    (``max_partial_slots``), ``merge_out`` (``max_merges * 5``, `MERGE_TARGET_DTYPE` rows).

    Example:
        >>> layout = PlanLayout(max_batch=256, max_qo_tokens=8192, max_ctas=264,
        ...                     num_qo_heads=32, num_kv_heads=8, tile_q=64)
        >>> layout.max_units, layout.max_partial_slots, layout.size
        (8223, 4222, 91184)
        >>> layout.offsets["units"], layout.offsets["cta_indptr"]
        (16, 65800)
    """

    max_batch: int
    max_qo_tokens: int
    max_ctas: int
    num_qo_heads: int
    num_kv_heads: int
    tile_q: int
    max_items: int = field(init=False)
    max_units: int = field(init=False)
    max_merges: int = field(init=False)
    max_partial_slots: int = field(init=False)
    offsets: dict = field(init=False, compare=False, hash=False)
    size: int = field(init=False)

    def __post_init__(self) -> None:
        b = _check_int(self.max_batch, "max_batch", 0)
        nq = _check_int(self.max_qo_tokens, "max_qo_tokens", 0)
        p = _check_int(self.max_ctas, "max_ctas", 1)
        g = _check_heads(self.num_qo_heads, self.num_kv_heads)
        t = _check_tile_q(self.tile_q)
        h = int(self.num_kv_heads)
        items = h * ((g * nq + min(b, nq) * (t - 1)) // t)
        hp = h * p
        derived = {
            "max_items": items,
            "max_units": items + hp - 1,
            "max_merges": max(0, min(items, hp - 1)),
            "max_partial_slots": max(0, min(2 * hp - 2, items + hp - 1)),
        }
        sizes = {
            "header": len(HEADER_FIELDS),
            "units": derived["max_units"] * len(WORK_UNIT_DTYPE.names),
            "cta_indptr": p + 1,
            "cta_units": derived["max_units"],
            "merge_indptr": derived["max_merges"] + 1,
            "merge_slots": derived["max_partial_slots"],
            "merge_out": derived["max_merges"] * len(MERGE_TARGET_DTYPE.names),
        }
        offsets, pos = {}, 0
        for name, n in sizes.items():
            offsets[name] = pos
            pos += _ceil_div(n, _ALIGN) * _ALIGN
        if pos > _INT32_MAX:
            raise ValueError(f"the packed plan would need {pos} int32: lower the maxima")
        for k, v in {**derived, "offsets": offsets, "size": pos}.items():
            object.__setattr__(self, k, v)

    def check(self, p: Plan) -> None:
        """Raise ValueError naming the maximum (or constant) that plan ``p`` does not fit.

        Example:
            >>> layout = PlanLayout(2, 16, 4, 1, 1, 16)
            >>> layout.check(plan([0, 1, 2, 3], [1, 1, 1], 1, 1, 16, 4))
            Traceback (most recent call last):
            ...
            ValueError: plan has batch_size 3 > PlanLayout.max_batch = 2
        """
        for name in ("num_qo_heads", "num_kv_heads", "tile_q"):
            if getattr(p, name) != getattr(self, name):
                raise ValueError(f"plan has {name} {getattr(p, name)} but PlanLayout.{name} = "
                                 f"{getattr(self, name)}")
        checks = (("batch_size", p.batch_size, "max_batch"),
                  ("total query tokens", int(p.qo_indptr[-1]), "max_qo_tokens"),
                  ("num_ctas", p.num_ctas, "max_ctas"),
                  ("num_units", p.num_units, "max_units"),
                  ("num_merges", p.num_merges, "max_merges"),
                  ("num_partial_slots", p.num_partial_slots, "max_partial_slots"))
        for what, value, limit in checks:
            if value > getattr(self, limit):
                raise ValueError(f"plan has {what} {value} > PlanLayout.{limit} = "
                                 f"{getattr(self, limit)}")

    def unpack(self, buf: np.ndarray) -> dict[str, Any]:
        """Read a packed plan back: header fields as ints, sections as views trimmed to use.

        Example:
            >>> layout = PlanLayout(4, 64, 4, 2, 2, 16)
            >>> d = layout.unpack(plan([0, 2], [300], 2, 2, 16, 4).pack(layout))
            >>> d["kv_chunk"], d["cta_indptr"].tolist(), d["units"]["kv_end"].tolist()
            (160, [0, 1, 2, 3, 4], [160, 300, 160, 300])
        """
        buf = np.asarray(buf)
        if buf.dtype != np.int32 or buf.ndim != 1 or buf.size < self.size:
            raise ValueError(f"buf must be a 1-D int32 array of at least {self.size} entries")
        out: dict[str, Any] = {k: int(v) for k, v in zip(HEADER_FIELDS, buf[:len(HEADER_FIELDS)])}
        if out["magic"] != PLAN_MAGIC or out["version"] != PLAN_VERSION:
            raise ValueError("buf does not hold a packed plan (bad magic or version)")
        off, n, m = self.offsets, out["num_units"], out["num_merges"]
        nw, nm = len(WORK_UNIT_DTYPE.names), len(MERGE_TARGET_DTYPE.names)
        out["units"] = buf[off["units"]: off["units"] + n * nw].view(WORK_UNIT_DTYPE)
        out["cta_indptr"] = buf[off["cta_indptr"]: off["cta_indptr"] + out["num_ctas"] + 1]
        out["cta_units"] = buf[off["cta_units"]: off["cta_units"] + n]
        out["merge_indptr"] = buf[off["merge_indptr"]: off["merge_indptr"] + m + 1]
        out["merge_slots"] = buf[off["merge_slots"]: off["merge_slots"] + out["num_partial_slots"]]
        out["merge_out"] = buf[off["merge_out"]: off["merge_out"] + m * nm].view(MERGE_TARGET_DTYPE)
        return out


def workspace_bytes(layout: PlanLayout, head_dim: int, num_qo_heads: int, dtype_bytes: int) -> int:
    """Bytes of the partial-(O, LSE) workspace for any plan that fits ``layout``.

    Slot ``s`` holds ``tile_q`` fused rows of partial O (``head_dim`` values of ``dtype_bytes``
    each) and ``tile_q`` float32 LSE values; the O part of all slots comes first, then the LSE
    part, each 256-byte aligned. The slot count is ``layout.max_partial_slots``
    (``<= 2 * num_kv_heads * max_ctas - 2``, see the module docstring). ``num_qo_heads`` must
    equal the layout's (the fused rows of a slot span the ``num_qo_heads / num_kv_heads`` query
    heads of one KV head).

    Example:
        >>> layout = PlanLayout(max_batch=256, max_qo_tokens=8192, max_ctas=264,
        ...                     num_qo_heads=32, num_kv_heads=8, tile_q=64)
        >>> workspace_bytes(layout, head_dim=128, num_qo_heads=32, dtype_bytes=4)
        139427328
    """
    head_dim = _check_int(head_dim, "head_dim", 1)
    dtype_bytes = _check_int(dtype_bytes, "dtype_bytes", 1)
    if num_qo_heads != layout.num_qo_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} != PlanLayout.num_qo_heads = "
                         f"{layout.num_qo_heads}")
    rows = layout.max_partial_slots * layout.tile_q
    o_bytes = _ceil_div(rows * head_dim * dtype_bytes, 256) * 256
    lse_bytes = _ceil_div(rows * 4, 256) * 256
    return int(o_bytes + lse_bytes)
