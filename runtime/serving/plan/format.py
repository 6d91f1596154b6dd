"""The packed plan format shared by the host scheduler (scheduler.py, planner.c) and the GPU
kernels (kernels/common/batch_params.cuh, kernels/fa2/fa2_batch.cuh): the work-unit and
merge-target records, the int32 header, `PlanLayout` (the plan's room from the user's maxima,
so a CUDA graph can be captured once), `packed_offsets` (where a plan's sections sit in that
room) and `workspace_bytes`, plus the argument checks both the planner and the layout use.
`attncc.runtime.serving.plan.scheduler` re-exports the public names.

A packed plan is one contiguous run of used words, ``[0, end)``: the header and ``cta_indptr``
at fixed offsets, then the sections whose sizes vary from plan to plan (`DYNAMIC_SECTIONS`)
back to back, their word offsets in the header, where the kernels read them. So plan() uploads
a plan with one copy, whatever its counts (sections at fixed offsets sized for the maxima would
each need a copy of ~3 us host time; docs/serving.md#plan-format).

Example:
    >>> layout = PlanLayout(max_batch=4, max_qo_tokens=64, max_ctas=2, num_qo_heads=2,
    ...                     num_kv_heads=2, tile_q=16)
    >>> layout.size % _ALIGN, HEADER_FIELDS[:2], len(HEADER_FIELDS)
    (0, ('magic', 'version'), 24)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attncc.codegen.layout import PLAN_DYNAMIC_SECTIONS as DYNAMIC_SECTIONS
from attncc.codegen.layout import PLAN_HEADER_FIELDS as HEADER_FIELDS

__all__ = ["TILE_Q_CHOICES", "WRITE_THROUGH", "WORK_UNIT_DTYPE", "MERGE_TARGET_DTYPE",
           "HEADER_FIELDS", "DYNAMIC_SECTIONS", "PLAN_MAGIC", "PLAN_VERSION", "PlanLayout",
           "packed_offsets", "workspace_bytes", "INT32_MAX", "as_int_array", "as_indptr",
           "ceil_div", "check_coef", "check_heads", "check_plan_int", "check_tile_q", "pad_words"]

TILE_Q_CHOICES = (16, 32, 64, 128)
"""Allowed query-tile heights (fused rows per CTA tile)."""

WRITE_THROUGH = -1
"""`WorkUnit.slot` of a unit that writes its result straight to the output."""

WORK_UNIT_DTYPE = np.dtype([
    ("request", np.int32),    # request index in the batch
    ("kv_head", np.int32),    # first KV head; query heads kv_head*g .. kv_head*g + g-1
    ("kv_heads", np.int32),   # KV heads kv_head .. kv_head + kv_heads - 1, run one after another
    ("q_start", np.int32),    # first fused row of the tile within the request (multiple of tile_q)
    ("q_rows", np.int32),     # fused rows in the tile, 1..tile_q
    ("kv_start", np.int32),   # first KV token of the chunk (within the request)
    ("kv_end", np.int32),     # one past the last KV token of the chunk
    ("slot", np.int32),       # workspace slot of the partial (O, LSE), or WRITE_THROUGH (-1)
])
"""One work unit: 8 int32 (32 bytes, two 16-byte vector loads on the GPU). A unit covers
``kv_heads >= 1`` consecutive KV heads with the same rows and KV range (each head's rows as
described for ``kv_head``); only write-through units of one-tile requests cover more than one
(see attncc.runtime.serving.plan.scheduler, "Head spans"). The request's first query token is
``qo_indptr[request]``, which the kernels read from the batch's tables."""

MERGE_TARGET_DTYPE = np.dtype([
    ("request", np.int32),    # request index
    ("kv_head", np.int32),    # KV head
    ("qo_offset", np.int32),  # qo_indptr[request]
    ("q_start", np.int32),    # first fused row of the tile within the request
    ("q_rows", np.int32),     # fused rows of the tile
])
"""Where the merged result of one split work item goes (fused rows, as in `WORK_UNIT_DTYPE`; a
split item is one KV head)."""

PLAN_MAGIC = 0x4E4C5041  # b"APLN" little endian
PLAN_VERSION = 6
# 6: no slot_merge section (each slot's split item; no kernel read it after the in-place merge
# went); 5: one used range (section offsets in the header); 4: small sections first; 3: units
# carry kv_heads (was qo_offset); 2: slot_merge after merge_indptr
_ALIGN = 4  # every packed section starts at a multiple of 4 int32 (16 bytes)
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- validation helpers

def as_int_array(x: Any, name: str) -> np.ndarray:
    """`x` as a 1-D int64 numpy array, or a ValueError/TypeError naming `name`."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def as_indptr(x: Any, name: str) -> np.ndarray:
    """A validated CSR indptr: 1-D ints, starts at 0, non-decreasing."""
    a = as_int_array(x, name)
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


def check_plan_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return int(value)


def check_heads(num_qo_heads: Any, num_kv_heads: Any) -> int:
    """Validate the head counts; return the GQA group size."""
    hq = check_plan_int(num_qo_heads, "num_qo_heads", 1)
    hk = check_plan_int(num_kv_heads, "num_kv_heads", 1)
    if hq % hk:
        raise ValueError(f"num_qo_heads ({hq}) must be a multiple of num_kv_heads ({hk})")
    return hq // hk


def check_tile_q(tile_q: Any) -> int:
    if isinstance(tile_q, bool) or tile_q not in TILE_Q_CHOICES:
        raise ValueError(f"tile_q must be one of {TILE_Q_CHOICES}, got {tile_q!r}")
    return int(tile_q)


def check_coef(value: Any, name: str) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return v


def ceil_div(a: Any, b: Any) -> Any:
    return -(-a // b)


# --------------------------------------------------------------------------- packed layout

def pad_words(words: int) -> int:
    """`words` rounded up to a whole number of 16-byte groups."""
    return ceil_div(words, _ALIGN) * _ALIGN


def _section_words(num_units: int, num_merges: int) -> tuple[int, ...]:
    """Words of each of `DYNAMIC_SECTIONS` for these counts, in that order."""
    n, m = num_units, num_merges
    return (n * len(WORK_UNIT_DTYPE.names), n, m + 1, m * len(MERGE_TARGET_DTYPE.names))


def packed_offsets(start: int, num_units: int, num_merges: int) -> dict[str, int]:
    """Word offsets of the `DYNAMIC_SECTIONS` of a plan with these counts, packed back to back
    from ``start`` (`PlanLayout.dynamic_at`), each at a multiple of 4 words (16 bytes: the
    kernels load units as int4), and ``"end"``: one past the plan's last used word. They depend
    on the counts alone; planner.c's ``packed_offsets`` computes the same words.

    Example:
        >>> at = packed_offsets(32, num_units=3, num_merges=1)
        >>> [at[s] for s in DYNAMIC_SECTIONS], at["end"]     # units: 24 words, cta_units: 3 + 1
        ([32, 56, 60, 64], 69)
    """
    out, pos = {}, start
    for name, words in zip(DYNAMIC_SECTIONS, _section_words(num_units, num_merges)):
        out[name] = pos
        pos += pad_words(words)
    out["end"] = out["merge_out"] + num_merges * len(MERGE_TARGET_DTYPE.names)
    return out


@dataclass(frozen=True)
class PlanLayout:
    """The room of a packed plan, derived from user maxima (hashable: key a graph cache by it).

    ``max_batch``: requests; ``max_qo_tokens``: total query tokens of a batch; ``max_ctas``: grid
    size; ``num_qo_heads`` / ``num_kv_heads`` / ``tile_q`` must equal the plan's. Derived bounds
    (docs/serving.md#workspace-bound), with ``H = num_kv_heads``, ``P = max_ctas``:

    - ``max_items = H * floor((g * N + min(max_batch, N) * (tile_q - 1)) / tile_q)``,
      ``N = max_qo_tokens``
    - ``max_units = max_items + H*P - 1``
    - ``max_merges = min(max_items, H*P - 1)``
    - ``max_partial_slots = min(2*H*P - 2, max_items + H*P - 1)``

    Memory (int32 words): the fixed part, ``offsets`` -- ``header`` (`HEADER_FIELDS`) at 0,
    ``cta_indptr`` (``max_ctas + 1``) after it -- then, from ``dynamic_at``, a plan's
    `DYNAMIC_SECTIONS` back to back at the offsets its header holds (`packed_offsets` of its
    counts). ``size`` is the room of the largest plan (every section at its maximum), so what
    follows the plan in the workspace (BatchAttention's page tables) sits at fixed offsets.

    Example:
        >>> layout = PlanLayout(max_batch=256, max_qo_tokens=8192, max_ctas=264,
        ...                     num_qo_heads=32, num_kv_heads=8, tile_q=64)
        >>> layout.max_units, layout.max_partial_slots, layout.size
        (8223, 4222, 86968)
        >>> layout.offsets, layout.dynamic_at
        ({'header': 0, 'cta_indptr': 24}, 292)
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
    dynamic_at: int = field(init=False)
    size: int = field(init=False)

    def __post_init__(self) -> None:
        b = check_plan_int(self.max_batch, "max_batch", 0)
        nq = check_plan_int(self.max_qo_tokens, "max_qo_tokens", 0)
        p = check_plan_int(self.max_ctas, "max_ctas", 1)
        g = check_heads(self.num_qo_heads, self.num_kv_heads)
        t = check_tile_q(self.tile_q)
        h = int(self.num_kv_heads)
        items = h * ((g * nq + min(b, nq) * (t - 1)) // t)
        hp = h * p
        derived = {
            "max_items": items,
            "max_units": items + hp - 1,
            "max_merges": max(0, min(items, hp - 1)),
            "max_partial_slots": max(0, min(2 * hp - 2, items + hp - 1)),
        }
        offsets = {"header": 0, "cta_indptr": len(HEADER_FIELDS)}
        dynamic_at = offsets["cta_indptr"] + pad_words(p + 1)
        room = packed_offsets(dynamic_at, derived["max_units"], derived["max_merges"])
        size = pad_words(room["end"])
        if size > INT32_MAX:
            raise ValueError(f"the packed plan would need {size} int32: lower the maxima")
        for k, v in {**derived, "offsets": offsets, "dynamic_at": dynamic_at,
                     "size": size}.items():
            object.__setattr__(self, k, v)

    def check(self, p: Any) -> None:
        """Raise ValueError naming the maximum (or constant) that plan ``p`` does not fit.

        Example:
            >>> layout = PlanLayout(2, 16, 4, 1, 1, 16)
            >>> from attncc.runtime.serving.plan.scheduler import plan
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

    def dynamic_offsets(self, header: dict[str, int]) -> dict[str, int]:
        """`packed_offsets` of a plan in this layout with these header counts (``num_units``,
        ``num_merges``).

        Example:
            >>> h = dict(num_units=3, num_merges=1)
            >>> PlanLayout(4, 64, 2, 1, 1, 16).dynamic_offsets(h)["cta_units"]
            52
        """
        return packed_offsets(self.dynamic_at, header["num_units"], header["num_merges"])

    def used_words(self, header: dict[str, int]) -> int:
        """One past the last word of a packed plan with these header counts: the plan is the
        words ``[0, used_words)``, one range (the room after it, up to ``size``, holds
        nothing).

        Example:
            >>> h = dict(num_units=3, num_merges=1)
            >>> PlanLayout(4, 64, 2, 1, 1, 16).used_words(h)
            65
        """
        return self.dynamic_offsets(header)["end"]

    def unpack(self, buf: np.ndarray) -> dict[str, Any]:
        """Read a packed plan back: header fields as ints, sections as views trimmed to use
        (each dynamic one at the offset its header gives, checked against its counts).

        Example:
            >>> layout = PlanLayout(4, 64, 8, 2, 2, 16)
            >>> from attncc.runtime.serving.plan.scheduler import plan
            >>> d = layout.unpack(plan([0, 2], [300], 2, 2, 16, 8).pack(layout))
            >>> d["kv_chunk"], d["cta_indptr"].tolist(), d["units"]["kv_end"].tolist()
            (128, [0, 1, 2, 3, 4, 5, 6, 6, 6], [128, 256, 300, 128, 256, 300])
            >>> d["units_at"], d["merge_out_at"]
            (36, 96)
        """
        buf = np.asarray(buf)
        if buf.dtype != np.int32 or buf.ndim != 1 or buf.size < self.size:
            raise ValueError(f"buf must be a 1-D int32 array of at least {self.size} entries")
        out: dict[str, Any] = {k: int(v) for k, v in zip(HEADER_FIELDS, buf[:len(HEADER_FIELDS)])}
        if out["magic"] != PLAN_MAGIC or out["version"] != PLAN_VERSION:
            raise ValueError("buf does not hold a packed plan (bad magic or version)")
        at = self.dynamic_offsets(out)
        if at["end"] > self.size or any(out[f"{s}_at"] != at[s] for s in DYNAMIC_SECTIONS):
            raise ValueError("buf's section offsets do not match its counts and this layout")
        o = self.offsets["cta_indptr"]
        out["cta_indptr"] = buf[o: o + out["num_ctas"] + 1]
        words = _section_words(out["num_units"], out["num_merges"])
        for name, n in zip(DYNAMIC_SECTIONS, words):  # views of `buf`
            out[name] = buf[out[f"{name}_at"]: out[f"{name}_at"] + n]
        out["units"] = out["units"].view(WORK_UNIT_DTYPE)
        out["merge_out"] = out["merge_out"].view(MERGE_TARGET_DTYPE)
        return out


def workspace_bytes(layout: PlanLayout, head_dim: int, num_qo_heads: int, dtype_bytes: int) -> int:
    """Bytes of the partial-(O, LSE) workspace for any plan that fits ``layout``.

    Slot ``s`` holds ``tile_q`` fused rows of partial O (``head_dim`` values of ``dtype_bytes``
    each) and ``tile_q`` float32 LSE values; the O part of all slots comes first, then the LSE
    part, each 256-byte aligned. The slot count is ``layout.max_partial_slots``
    (``<= 2 * num_kv_heads * max_ctas - 2``, see attncc.runtime.serving.plan.scheduler's docstring).
    ``num_qo_heads`` must equal the layout's (the fused rows of a slot span the
    ``num_qo_heads / num_kv_heads`` query heads of one KV head).

    Example:
        >>> layout = PlanLayout(max_batch=256, max_qo_tokens=8192, max_ctas=264,
        ...                     num_qo_heads=32, num_kv_heads=8, tile_q=64)
        >>> workspace_bytes(layout, head_dim=128, num_qo_heads=32, dtype_bytes=4)
        139427328
    """
    head_dim = check_plan_int(head_dim, "head_dim", 1)
    dtype_bytes = check_plan_int(dtype_bytes, "dtype_bytes", 1)
    if num_qo_heads != layout.num_qo_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} != PlanLayout.num_qo_heads = "
                         f"{layout.num_qo_heads}")
    rows = layout.max_partial_slots * layout.tile_q
    o_bytes = ceil_div(rows * head_dim * dtype_bytes, 256) * 256
    lse_bytes = ceil_div(rows * 4, 256) * 256
    return int(o_bytes + lse_bytes)
