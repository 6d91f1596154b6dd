"""Load-balanced work plan for a persistent attention kernel (CPU half).

This is the host-side scheduler of FlashInfer's serving runtime (arXiv 2501.01005, section 3.3,
"Algorithm 1"), rewritten for attncc. It turns one batch of ragged requests into a *plan*: a
fixed-size grid of CTAs, each with a queue of work units (one unit: a KV chunk of one
(request, KV head, query tile) work item, or a span of KV heads of a decode row), plus a
reduction map that merges the partial results of requests whose KV range was split.
`Plan.pack` flattens it into one int32 buffer with fixed offsets so that a CUDA graph captured
once can replay with new plans. Three modules: this one (work decomposition, chunking, the typed
`Plan`), `lpt` (the assignment of units to CTAs) and `format` (record dtypes, header,
`PlanLayout`, workspace size); the public names of all three are importable from here. The
compiled twin (`planner.c`, used when a C compiler is found) computes the same plan.

The design -- work decomposition, KV chunk length, head spans, the LPT assignment, outputs and
reduction, the workspace bound and host time, with the measurements behind each choice -- is
in docs/serving.md, "The scheduler (LPT)".

Example:
    >>> p = plan([0, 1, 2, 3], [100, 1000, 5000], num_qo_heads=8, num_kv_heads=2, tile_q=16,
    ...          num_ctas=8)
    >>> p.kv_chunk, p.num_units, p.num_merges, p.num_partial_slots
    (1536, 11, 2, 8)
    >>> [round(x) for x in simulate(p)]      # request 0: one unit of both heads (cost 2 x 104)
    [1540, 1540, 1540, 1540, 1540, 1540, 1608, 1400]
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import planner
from .lpt import cost_ticks, cta_queues, lpt_schedule, lpt_sorted, small_int
from .format import (INT32_MAX, DYNAMIC_SECTIONS, HEADER_FIELDS, MERGE_TARGET_DTYPE,
                     PLAN_MAGIC, PLAN_VERSION, TILE_Q_CHOICES, WORK_UNIT_DTYPE, WRITE_THROUGH,
                     PlanLayout, as_indptr, as_int_array, ceil_div, check_coef,
                     check_heads, check_plan_int, check_tile_q, packed_offsets,
                     workspace_bytes)

__all__ = [
    "TILE_Q_CHOICES", "WRITE_THROUGH", "WORK_UNIT_DTYPE", "MERGE_TARGET_DTYPE", "HEADER_FIELDS",
    "paged_kv_lens", "kv_chunk_size", "cost_ticks", "lpt_schedule",
    "plan", "plan_into", "Plan",
    "PlanLayout", "workspace_bytes", "simulate",
]

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
    page_size = check_plan_int(page_size, "page_size", 1)
    indptr = as_indptr(kv_indptr, "kv_indptr")
    last = as_int_array(kv_last_page_len, "kv_last_page_len")
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
                  kv_chunk_align: int = 16, max_kv: int = 0) -> int:
    """The maximum KV chunk length ``L_kv`` (docs/serving.md#kv-chunk-length).

    ``tile_kv_work`` is ``num_kv_heads * sum_i ceil(l_q[i] * g / tile_q) * l_kv[i]`` (the work
    of every KV head); ``max_kv`` the longest KV range of a request with query rows (0: not
    known), which becomes the chunk when it is at most twice the formula's.

    Example:
        >>> kv_chunk_size(10_000, 8), kv_chunk_size(100, 8), kv_chunk_size(100, 8, 50, 32)
        (1264, 128, 64)
        >>> kv_chunk_size(10_000, 8, max_kv=2000), kv_chunk_size(10_000, 8, max_kv=3000)
        (2000, 1264)
    """
    raw = ceil_div(int(tile_kv_work), num_ctas)
    chunk = int(ceil_div(max(raw, min_kv_chunk), kv_chunk_align) * kv_chunk_align)
    if 0 < max_kv <= 2 * chunk:  # at most two pieces: not worth a merge
        chunk = max(chunk, int(ceil_div(int(max_kv), kv_chunk_align) * kv_chunk_align))
    return chunk


# --------------------------------------------------------------------------- the plan

def _checked_lengths(qo_indptr: Any, kv_lens: Any) -> tuple[np.ndarray, np.ndarray]:
    """`plan`'s checks of the batch: a query CSR from 0 and one KV length >= 0 per request."""
    qo = as_indptr(qo_indptr, "qo_indptr")
    kv = as_int_array(kv_lens, "kv_lens")
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
    g = check_heads(num_qo_heads, num_kv_heads)
    tile_q = check_tile_q(tile_q)
    num_ctas = check_plan_int(num_ctas, "num_ctas", 1)
    alpha, beta = check_coef(alpha, "alpha"), check_coef(beta, "beta")
    if alpha == 0.0 and beta == 0.0:
        raise ValueError("alpha and beta cannot both be 0")
    align = check_plan_int(kv_chunk_align, "kv_chunk_align", 1, 2**20)
    floor = check_plan_int(min_kv_chunk, "min_kv_chunk", 1, 2**30)
    return g, tile_q, num_ctas, alpha, beta, align, floor


_checked_params_memo = functools.lru_cache(maxsize=256, typed=True)(_check_params)


def _check_int32_range(qo: np.ndarray, kv: np.ndarray) -> None:
    if qo[-1] > INT32_MAX or (kv.size and kv.max() > INT32_MAX):
        raise ValueError("qo_indptr / kv_lens exceed the int32 range of the packed plan")


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class Plan:
    """A scheduled batch (docs/serving.md#the-scheduler-lpt); arrays are read-only numpy arrays.

    Attributes:
        batch_size, num_qo_heads, num_kv_heads, group_size, tile_q, num_ctas: the problem.
        kv_chunk: ``L_kv``, the maximum KV tokens of one unit (a multiple of ``kv_chunk_align``).
        alpha, beta: the cost coefficients (per fused query row, per KV token).
        qo_indptr: int32 ``[batch+1]``, the query CSR the plan was made for.
        kv_lens: int32 ``[batch]``, the KV length of each request.
        units: `WORK_UNIT_DTYPE` ``[num_units]``, ordered by (request, kv_head, tile, kv chunk);
            a unit covers ``kv_heads`` heads from ``kv_head`` (see "Head spans").
        cta_indptr: int32 ``[num_ctas+1]``, CSR of the per-CTA queues in ``cta_units``.
        cta_units: int32 ``[num_units]``, unit indices, each CTA's queue in execution order.
        merge_indptr: int32 ``[num_merges+1]``: split item m's partials are the workspace slots
            ``merge_indptr[m] .. merge_indptr[m+1]``, ascending in kv start.
        merge_out: `MERGE_TARGET_DTYPE` ``[num_merges]``, where each merged result goes.
        num_partial_slots: workspace slots used (each ``tile_q`` rows of O plus ``tile_q`` LSE).

    Example:
        >>> p = plan([0, 2], [300], num_qo_heads=4, num_kv_heads=2, tile_q=16, num_ctas=8)
        >>> p.kv_chunk, p.units[["kv_head", "kv_start", "kv_end", "slot"]].tolist()[:4]
        (128, [(0, 0, 128, 0), (0, 128, 256, 1), (0, 256, 300, 2), (1, 0, 128, 3)])
        >>> d = plan([0, 1, 2], [100, 100], 4, 4, 16, num_ctas=2)   # decode rows: head spans
        >>> d.units[["request", "kv_head", "kv_heads"]].tolist(), d.unit_costs().tolist()
        ([(0, 0, 2), (0, 2, 2), (1, 0, 2), (1, 2, 2)], [202.0, 202.0, 202.0, 202.0])
        >>> p.merge_indptr.tolist(), p.merge_out["kv_head"].tolist()
        ([0, 3, 6], [0, 1])
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
        """float64 ``[num_units]``: ``(alpha * q_rows + beta * (kv_end - kv_start)) * kv_heads``.

        Example:
            >>> p = plan([0, 1], [40], 2, 1, 16, 1, alpha=2.0, beta=0.5)
            >>> p.unit_costs().tolist()
            [24.0]
        """
        u = self.units
        kv_len = (u["kv_end"] - u["kv_start"]).astype(np.float64)
        return (self.alpha * u["q_rows"] + self.beta * kv_len) * u["kv_heads"]

    def pack(self, layout: "PlanLayout", out: np.ndarray | None = None) -> np.ndarray:
        """Flatten the plan into one int32 buffer laid out by ``layout``: the header and
        ``cta_indptr`` at the layout's fixed offsets, then the sections back to back from
        ``layout.dynamic_at`` (`packed_offsets` of the plan's counts, written into the header).

        Returns a new zero-filled ``int32 [layout.size]`` array, or writes into ``out`` (e.g. a
        numpy view of a pinned host tensor) and returns it; then only the header and the
        sections are written (not the padding between them, nor the room after the plan).
        ``cta_indptr`` is padded to ``layout.max_ctas + 1`` with its last value, so a grid of
        ``layout.max_ctas`` CTAs sees empty queues past ``num_ctas``; ``merge_indptr`` is not
        padded (the kernels read it only below the header's ``num_merges``). Raises ValueError
        naming the `PlanLayout` maximum the plan exceeds.

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
        n = self.num_units
        at = packed_offsets(layout.dynamic_at, n, self.num_merges)
        values = dict(magic=PLAN_MAGIC, version=PLAN_VERSION, batch_size=self.batch_size,
                      num_units=n, num_ctas=self.num_ctas,
                      num_merges=self.num_merges, num_partial_slots=self.num_partial_slots,
                      kv_chunk=self.kv_chunk, tile_q=self.tile_q, group_size=self.group_size,
                      num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                      total_qo_tokens=int(self.qo_indptr[-1]), layout_size=layout.size,
                      **{f"{s}_at": at[s] for s in DYNAMIC_SECTIONS})
        buf[:len(HEADER_FIELDS)] = [values.get(name, 0) for name in HEADER_FIELDS]
        o = layout.offsets["cta_indptr"]
        buf[o: o + self.num_ctas + 1] = self.cta_indptr
        buf[o + self.num_ctas + 1: o + layout.max_ctas + 1] = n
        for name in DYNAMIC_SECTIONS:
            words = getattr(self, name)
            if words.dtype.names:  # units, merge_out: their int32 fields in order
                words = words.view(np.int32)
            words = words.reshape(-1)
            buf[at[name]: at[name] + words.size] = words
        return buf


def plan(qo_indptr: Any, kv_lens: Any, num_qo_heads: int, num_kv_heads: int, tile_q: int,
         num_ctas: int, *, alpha: float = 1.0, beta: float = 1.0, kv_chunk_align: int = 16,
         min_kv_chunk: int = 128, head_span: bool = True, impl: str = "auto") -> Plan:
    """Schedule one batch (Algorithm 1, docs/serving.md#the-scheduler-lpt).

    Args:
        qo_indptr: ``[batch+1]`` CSR of query tokens per request (ragged, starts at 0).
        kv_lens: ``[batch]`` KV tokens per request (see `paged_kv_lens`).
        num_qo_heads, num_kv_heads: head counts (GQA group ``g = num_qo_heads // num_kv_heads``).
        tile_q: fused query rows per CTA tile, one of `TILE_Q_CHOICES`.
        num_ctas: CTAs of the persistent grid (e.g. ``k * #SM``).
        alpha, beta: unit cost = ``alpha * q_rows + beta * kv_tokens``.
        kv_chunk_align: chunk lengths are multiples of this (use the page size).
        min_kv_chunk: floor of the chunk length (rounded up to ``kv_chunk_align``).
        head_span: let a unit of a one-tile, unsplit request cover several KV heads (module
            docstring, "Head spans"); False: one KV head per unit.
        impl: "numpy", "c" (the compiled twin in planner.c: the same plan, tens of
            microseconds instead of a millisecond at batch 256; `plan_into` skips the typed
            arrays too) or "auto" (C when a C compiler is available).

    Example:
        >>> p = plan([0, 1, 1, 2], [4096, 50, 0], num_qo_heads=32, num_kv_heads=4, tile_q=16,
        ...          num_ctas=16)
        >>> p.kv_chunk, p.num_units, p.num_merges
        (1024, 17, 4)
        >>> p.cta_indptr.tolist()
        [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
        >>> p.units[-1].tolist()     # request 2 has no KV: one empty write-through unit, 4 heads
        (2, 0, 4, 0, 8, 0, 0, -1)
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
                                      alpha=alpha, beta=beta, align=align, floor=floor,
                                      head_span=bool(head_span))
            return Plan(
                batch_size=batch, num_qo_heads=int(num_qo_heads), num_kv_heads=hk,
                group_size=g, tile_q=tile_q, num_ctas=num_ctas, kv_chunk=r["chunk"],
                alpha=alpha, beta=beta, qo_indptr=_frozen(qo.astype(np.int32)),
                kv_lens=_frozen(kv.astype(np.int32)),
                units=_frozen(r["units"].view(WORK_UNIT_DTYPE).reshape(-1)),
                cta_indptr=_frozen(r["cta_indptr"]), cta_units=_frozen(r["cta_units"]),
                merge_indptr=_frozen(r["merge_indptr"]),
                merge_out=_frozen(r["merge_out"].view(MERGE_TARGET_DTYPE).reshape(-1)),
                num_partial_slots=r["num_slots"])
        if impl == "c":
            raise RuntimeError("plan(impl='c'): the compiled planner could not be built (no C "
                               "compiler found; set CC) -- use impl='numpy'")

    # per request (int64 [batch]): fused rows, query tiles, KV chunks
    rows = np.diff(qo) * g
    ntiles = ceil_div(rows, tile_q)
    chunk = kv_chunk_size(int(ntiles @ kv) * hk, num_ctas, floor, align,
                          max_kv=int(kv[ntiles > 0].max(initial=0)))
    chunk = min(chunk, INT32_MAX // align * align)  # only absurd sizes: stays a packed int32
    nchunks = np.where(ntiles > 0, np.maximum(ceil_div(kv, chunk), 1), 0)
    total = hk * (alpha * float(rows @ nchunks) + beta * float(ntiles @ kv))
    span = _head_spans(rows, kv, ntiles, nchunks, hk, alpha, beta, total, num_ctas, head_span)

    table, unit_group, split_first, split_nc = _expand_units(kv, rows, ntiles, nchunks, span,
                                                             hk, tile_q, chunk)
    units = table.view(WORK_UNIT_DTYPE).reshape(-1)
    # reduction map: one entry per split work item, its slots consecutive in unit order; the
    # first fields of a work unit, the third the request's first query token
    n_fields = len(MERGE_TARGET_DTYPE.names)
    merge_out = np.ascontiguousarray(table[split_first, :n_fields])
    merge_out[:, 2] = qo[merge_out[:, 0]]
    merge_out = merge_out.view(MERGE_TARGET_DTYPE).reshape(-1)
    merge_indptr = np.zeros(split_first.size + 1, dtype=np.int32)
    np.cumsum(split_nc, out=merge_indptr[1:])
    num_slots = int(merge_indptr[-1])

    g_count, g_ticks = _group_ticks(rows, ntiles, nchunks, kv, span, hk, tile_q, chunk, alpha,
                                    beta, num_ctas, total)
    order, c_sorted, run_ends = _greedy_order_groups(unit_group, g_count, g_ticks)
    cta_indptr, cta_units = cta_queues(order, lpt_sorted(c_sorted, run_ends, num_ctas), num_ctas)
    return Plan(
        batch_size=batch, num_qo_heads=int(num_qo_heads), num_kv_heads=hk, group_size=g,
        tile_q=tile_q, num_ctas=num_ctas, kv_chunk=chunk, alpha=alpha, beta=beta,
        qo_indptr=_frozen(qo.astype(np.int32)), kv_lens=_frozen(kv.astype(np.int32)),
        units=_frozen(units), cta_indptr=_frozen(cta_indptr), cta_units=_frozen(cta_units),
        merge_indptr=_frozen(merge_indptr),
        merge_out=_frozen(merge_out), num_partial_slots=num_slots,
    )


def plan_into(out: np.ndarray, layout: PlanLayout, qo_indptr: Any, kv_lens: Any,
              num_qo_heads: int, num_kv_heads: int, tile_q: int, num_ctas: int, *,
              alpha: float = 1.0, beta: float = 1.0, kv_chunk_align: int = 16,
              min_kv_chunk: int = 128, head_span: bool = True, checked: bool = False) -> None:
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
            floor=floor, head_span=bool(head_span)) is not None:
        return
    # no compiler, or the plan does not fit: Plan.pack writes it or names what does not fit
    plan(qo, kv, num_qo_heads, num_kv_heads, tile_q, num_ctas, alpha=alpha, beta=beta,
         kv_chunk_align=align, min_kv_chunk=floor, head_span=head_span).pack(layout, out=out)


_BUILD_DTYPE = np.dtype(WORK_UNIT_DTYPE.descr + [("first", np.int32)])
"""`WORK_UNIT_DTYPE` plus scratch: a work item's first unit (used while expanding units)."""


def _divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending.

    Example:
        >>> _divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def _head_spans(rows: np.ndarray, kv: np.ndarray, ntiles: np.ndarray, nchunks: np.ndarray,
                hk: int, alpha: float, beta: float, total: float, num_ctas: int,
                enabled: bool = True) -> np.ndarray:
    """Each request's head span, int64 ``[batch]`` (docs/serving.md#head-spans): the largest
    divisor ``s`` of ``hk`` with ``s * c_i <= total / (2 * num_ctas)`` for a one-tile request
    whose KV range is one chunk, else 1. (planner.c computes ``c_i`` with the same float
    operations and decides ``s * c_i <= limit`` exactly, as one compare of ``c_i`` with the
    largest cost for which the rounded product passes.)

    Example:
        >>> _head_spans(np.array([1, 1, 40]), np.array([100, 900, 100]), np.array([1, 1, 3]),
        ...             np.array([1, 1, 1]), 8, 1.0, 1.0, 8000.0, 4).tolist()
        [8, 1, 1]
    """
    span = np.ones(rows.size, dtype=np.int64)
    if not enabled or hk == 1:
        return span
    one = (ntiles == 1) & (nchunks == 1)
    cost = alpha * rows + beta * kv  # (alpha * rows) + (beta * kv): as _group_ticks' last group
    limit = total / (2.0 * num_ctas)
    for d in _divisors(hk)[1:]:
        span[one & (d * cost <= limit)] = d
    return span


def _expand_units(kv: np.ndarray, rows: np.ndarray, ntiles: np.ndarray, nchunks: np.ndarray,
                  span: np.ndarray, hk: int, tile_q: int, chunk: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All work units in (request, kv_head, tile, chunk) order.

    Returns ``(table, unit_group, split_first, split_nc)``: the units as a contiguous int32
    ``[n, 8]`` table (the `WORK_UNIT_DTYPE` fields in order), each unit's cost group
    (``4 * request + 2 * last_tile + last_chunk``, see `_group_ticks`), and for each split
    work item its first unit and its number of chunks. A request with span ``s > 1`` (one tile,
    one chunk) has ``hk / s`` units of ``s`` heads.

    Work items are built once, then (when some request is split) repeated per chunk in one
    call; until the per-chunk fields are filled in, ``kv_start`` holds the item's group base,
    ``kv_end`` the KV length and ``slot`` the request's slot offset (first slot minus first
    unit: a split request's units take consecutive slots).
    """
    per_req = ntiles * (hk // span)                  # work items (units of s heads) per request
    req = np.repeat(np.arange(ntiles.size, dtype=np.int64), per_req)
    j = np.arange(req.size, dtype=np.int64) - (np.cumsum(per_req) - per_req)[req]
    req_rows = rows[req]
    req_span = span[req]
    if ntiles.max(initial=0) <= 1:                   # one tile per request and head: decode
        head, q_start = j * req_span, np.zeros_like(j)
    else:                                            # (a request of several tiles has span 1)
        nt = ntiles[req]
        head = j // nt
        q_start = (j - head * nt) * tile_q
        head *= req_span
    group_base = 4 * req + 2 * (q_start + tile_q >= req_rows)
    any_split = bool(nchunks.max(initial=0) > 1)
    items = np.empty(req.size, dtype=_BUILD_DTYPE if any_split else WORK_UNIT_DTYPE)
    items["request"] = req
    items["kv_head"] = head
    items["kv_heads"] = req_span
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
                 span: np.ndarray, hk: int, tile_q: int, chunk: int, alpha: float, beta: float,
                 num_ctas: int, total: float) -> tuple[np.ndarray, np.ndarray]:
    """Unit count and tick cost of each cost group, int64 ``[4 * batch]``.

    Request ``i``'s units fall in four groups ``4*i + 2*a + b``: ``a`` = last query tile
    (``tile_q`` rows otherwise), ``b`` = last KV chunk (``chunk`` tokens otherwise). ``total``
    is the plan's cost, ``num_kv_heads * sum_i (alpha * rows_i * nchunks_i + beta * ntiles_i *
    kv_i)``. A request of span ``s > 1`` has only the last group: ``hk / s`` units of ``s``
    heads' cost.
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
    if span.max(initial=1) > 1:
        count[:, 3] //= span
        cost[:, 3] *= span
    count = count.reshape(-1)
    cost = cost.reshape(-1)
    cost[count == 0] = 0.0
    return count, cost_ticks(cost, num_ctas, total)


def _greedy_order_groups(unit_group: np.ndarray, g_count: np.ndarray, g_ticks: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Units in greedy order (ticks descending, then group id, then unit index), their ticks
    in that order, and the ends of the runs of equal ticks (see `lpt_sorted`)."""
    gid = np.flatnonzero(g_count)
    g_order = gid[np.argsort(-g_ticks[gid], kind="stable")]
    rank = np.empty(g_count.size, dtype=np.int64)
    rank[g_order] = np.arange(g_order.size)
    order = np.argsort(small_int(rank[unit_group], g_order.size), kind="stable")
    ticks, count = g_ticks[g_order], g_count[g_order]
    ends = np.cumsum(count)
    run_ends = ends[np.append(ticks[1:] != ticks[:-1], True)] if ticks.size else ends
    return order, np.repeat(ticks, count), run_ends


def simulate(plan: Plan, costs: Sequence[float] | None = None) -> list[float]:
    """Each CTA's total cost, by walking the queues in pure Python (a reference, not fast).

    ``costs[u]`` is unit ``u``'s cost; by default ``(alpha * q_rows + beta * kv_len) * kv_heads``.

    Example:
        >>> p = plan([0, 1, 2], [10, 20], 1, 1, 16, num_ctas=2)
        >>> simulate(p), simulate(p, costs=[1.0, 5.0])
        ([21.0, 11.0], [5.0, 1.0])
    """
    if costs is None:
        costs = [(plan.alpha * int(u["q_rows"]) + plan.beta * (int(u["kv_end"])
                                                               - int(u["kv_start"])))
                 * int(u["kv_heads"]) for u in plan.units]
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

