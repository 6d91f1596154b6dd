"""Longest-processing-time-first assignment of weighted work units to CTAs (FlashInfer's
Algorithm 1, step 3), vectorised in numpy, with integer cost ticks that make the assignment
exact and reproducible. Used by `scheduler.plan` (which re-exports these names); planner.c is
the compiled twin of the same rules; the tests hold the plain min-heap they are checked against.

Example (integer costs: `cost_ticks` quantises float ones):
    >>> indptr, units = lpt_schedule([5, 3, 3, 1], num_ctas=2)
    >>> indptr.tolist(), units.tolist()      # CTA 0 runs units 0 and 3, CTA 1 units 1 and 2
    ([0, 2, 4], [0, 3, 1, 2])
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .format import as_int_array, check_plan_int

__all__ = ["cost_ticks", "cta_queues", "lpt_schedule", "lpt_sorted", "small_int"]

_TICK_BUDGET = 2.0**61

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


def small_int(a: np.ndarray, bound: int) -> np.ndarray:
    """`a` (values in [0, bound)) as int16 when it fits: numpy's stable sort is then a radix sort."""
    return a.astype(np.int16 if bound <= 2**15 else np.int64, copy=False)


def cta_queues(order: np.ndarray, assign: np.ndarray, num_ctas: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """CSR (cta_indptr, cta_units) from units in assignment order and their CTAs."""
    by_cta = np.argsort(small_int(assign, num_ctas), kind="stable")
    cta_units = order[by_cta].astype(np.int32)
    indptr = np.zeros(num_ctas + 1, dtype=np.int32)
    np.cumsum(np.bincount(assign, minlength=num_ctas), out=indptr[1:])
    return indptr, cta_units


def lpt_sorted(c: np.ndarray, run_ends: np.ndarray, p: int) -> np.ndarray:
    """The CTA of each unit of ``c`` (int64 costs, already in greedy order: descending, or
    descending within each section).

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
        if st == 0:  # a run that costs nothing: the least loaded CTA stays least loaded
            nz = np.flatnonzero(step[t:])  # (with sections, costs rise again after a run of 0s)
            e = t + int(nz[0]) if nz.size else n
            assign[t:e] = int(np.argmin(key))
            t = e
            continue
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


def _unit_ints(x: Any, n: int, name: str) -> np.ndarray:
    a = as_int_array(x, name)
    if a.size != n:
        raise ValueError(f"{name} has {a.size} entries, costs has {n}")
    return a


def _greedy_order(c: np.ndarray, tiebreak: Any, section: Any = None) -> np.ndarray:
    """Unit indices by ``section`` ascending (if given), then cost descending, then
    ``tiebreak`` ascending, then index."""
    if tiebreak is None and section is None:
        return np.argsort(-c, kind="stable")
    keys = [] if tiebreak is None else [_unit_ints(tiebreak, c.size, "tiebreak")]
    keys.append(-c)
    if section is not None:
        keys.append(_unit_ints(section, c.size, "section"))
    return np.lexsort(keys)


def lpt_schedule(costs: Any, num_ctas: int, tiebreak: Any = None,
                 section: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time-first assignment of integer ``costs`` to ``num_ctas`` CTAs.

    Units are taken by cost descending, ties by ``tiebreak`` (ints, default none) then index;
    each goes to the least loaded CTA, ties to the lowest CTA index. With ``section`` (ints, one
    per unit) the units of a lower section are all taken first -- LPT section by section, on
    the loads the earlier sections left -- so CTAs that run their queues at about the same rate
    work in one section at a time (serving.batch uses it to keep a prefill's concurrently
    read K/V within the L2). Returns
    ``(cta_indptr int32 [num_ctas+1], cta_units int32 [n])``: CTA ``c`` runs units
    ``cta_units[cta_indptr[c]:cta_indptr[c+1]]`` in the order it received them. Identical to a
    plain Python min-heap of ``(load, cta)`` (the tests' reference), but assigns whole runs of equal cost and
    whole blocks of up to ``num_ctas`` units per numpy step (docs/serving.md,
    "Assignment (longest processing time first)").

    Example:
        >>> indptr, units = lpt_schedule([5, 3, 3, 2, 2, 1], num_ctas=2)
        >>> [units[indptr[c]:indptr[c + 1]].tolist() for c in range(2)]
        [[0, 3, 5], [1, 2, 4]]
        >>> indptr, units = lpt_schedule([5, 3, 3, 2, 2, 1], 2, section=[1, 1, 1, 0, 0, 0])
        >>> [units[indptr[c]:indptr[c + 1]].tolist() for c in range(2)]
        [[3, 5, 1, 2], [4, 0]]
    """
    c = _as_costs(costs)
    p = check_plan_int(num_ctas, "num_ctas", 1)
    if c.size and float(c.sum(dtype=np.float64)) * p >= 2.0**62:
        raise OverflowError("costs too large: sum(costs) * num_ctas must stay below 2**62")
    # (lpt_sorted replays the heap for units in any order: its steps check, not assume, that
    # unit j of a block goes to the j-th least loaded CTA)
    order = _greedy_order(c, tiebreak, section)
    cs = c[order]
    return cta_queues(order, lpt_sorted(cs, _run_ends(cs), p), p)


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
