"""The packed plan format shared by the host scheduler (runtime/scheduler.py, runtime/planner.c)
and the GPU kernels (kernels/batch_params.cuh, kernels/fa2_batch.cuh): the work-unit and
merge-target records, the int32 header, `PlanLayout` (fixed section offsets from the user's
maxima, so a CUDA graph can be captured once) and `workspace_bytes`, plus the argument checks
both the planner and the layout use. `attncc.runtime.scheduler` re-exports the public names.

Example:
    >>> layout = PlanLayout(max_batch=4, max_qo_tokens=64, max_ctas=2, num_qo_heads=2,
    ...                     num_kv_heads=2, tile_q=16)
    >>> layout.size % _ALIGN, HEADER_FIELDS[:2]
    (0, ('magic', 'version'))
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .scheduler import Plan

__all__ = ["TILE_Q_CHOICES", "WRITE_THROUGH", "WORK_UNIT_DTYPE", "MERGE_TARGET_DTYPE",
           "HEADER_FIELDS", "PLAN_MAGIC", "PLAN_VERSION", "PlanLayout", "workspace_bytes"]

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
(see attncc.runtime.scheduler, "Head spans"). The request's first query token is
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

HEADER_FIELDS = (
    "magic", "version", "batch_size", "num_units", "num_ctas", "num_merges",
    "num_partial_slots", "kv_chunk", "tile_q", "group_size", "num_qo_heads", "num_kv_heads",
    "total_qo_tokens", "layout_size", "reserved0", "reserved1",
)
"""The int32 header at offset 0 of a packed plan, in this order."""

PLAN_MAGIC = 0x4E4C5041  # b"APLN" little endian
PLAN_VERSION = 4  # 4: small sections first; 3: units carry kv_heads (was qo_offset); 2: slot_merge after merge_indptr
_ALIGN = 4  # every packed section starts at a multiple of 4 int32 (16 bytes)
_INT32_MAX = 2**31 - 1


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


# --------------------------------------------------------------------------- packed layout

@dataclass(frozen=True)
class PlanLayout:
    """Fixed offsets of a packed plan, derived from user maxima (hashable: key a graph cache by it).

    ``max_batch``: requests; ``max_qo_tokens``: total query tokens of a batch; ``max_ctas``: grid
    size; ``num_qo_heads`` / ``num_kv_heads`` / ``tile_q`` must equal the plan's. Derived bounds
    (see attncc.runtime.scheduler's module docstring), with ``H = num_kv_heads``, ``P = max_ctas``:

    - ``max_items = H * floor((g * N + min(max_batch, N) * (tile_q - 1)) / tile_q)``,
      ``N = max_qo_tokens``
    - ``max_units = max_items + H*P - 1``
    - ``max_merges = min(max_items, H*P - 1)``
    - ``max_partial_slots = min(2*H*P - 2, max_items + H*P - 1)``

    Sections (int32, each at a multiple of 4), in memory order: ``header`` (`HEADER_FIELDS`),
    ``cta_indptr`` (``max_ctas + 1``), ``merge_indptr`` (``max_merges + 1``), ``units``
    (``max_units * 8``, `WORK_UNIT_DTYPE` rows), ``cta_units`` (``max_units``), ``slot_merge``
    (``max_partial_slots``), ``merge_out`` (``max_merges * 5``, `MERGE_TARGET_DTYPE` rows).

    Example:
        >>> layout = PlanLayout(max_batch=256, max_qo_tokens=8192, max_ctas=264,
        ...                     num_qo_heads=32, num_kv_heads=8, tile_q=64)
        >>> layout.max_units, layout.max_partial_slots, layout.size
        (8223, 4222, 91184)
        >>> layout.offsets["cta_indptr"], layout.offsets["units"]
        (16, 2396)
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
        # In memory order: the small sections first, then the large ones, whose used prefixes
        # are what plan() uploads -- one copy per range of used words (batch.used_ranges joins
        # ranges less than 64 KB apart), so header .. units is one copy whatever the counts
        # (at batch 256 x Hkv 32 a decode plan went from 4 copies to 3 on this order).
        sizes = {
            "header": len(HEADER_FIELDS),
            "cta_indptr": p + 1,
            "merge_indptr": derived["max_merges"] + 1,
            "units": derived["max_units"] * len(WORK_UNIT_DTYPE.names),
            "cta_units": derived["max_units"],
            "slot_merge": derived["max_partial_slots"],
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
            >>> from attncc.runtime.scheduler import plan
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

    def used_words(self, header: dict[str, int]) -> dict[str, int]:
        """Words each section of a packed plan with these header counts uses (the rest of its
        room, sized for the maxima, holds nothing).

        Example:
            >>> h = dict(num_units=3, num_ctas=2, num_merges=1, num_partial_slots=2)
            >>> PlanLayout(4, 64, 2, 1, 1, 16).used_words(h)["units"]
            24
        """
        n, m = header["num_units"], header["num_merges"]
        return {"header": len(HEADER_FIELDS), "units": n * len(WORK_UNIT_DTYPE.names),
                "cta_indptr": header["num_ctas"] + 1, "cta_units": n, "merge_indptr": m + 1,
                "slot_merge": header["num_partial_slots"],
                "merge_out": m * len(MERGE_TARGET_DTYPE.names)}

    def unpack(self, buf: np.ndarray) -> dict[str, Any]:
        """Read a packed plan back: header fields as ints, sections as views trimmed to use.

        Example:
            >>> layout = PlanLayout(4, 64, 4, 2, 2, 16)
            >>> from attncc.runtime.scheduler import plan
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
        used = self.used_words(out)
        for name in list(used)[1:]:  # the sections after the header, as views of `buf`
            out[name] = buf[self.offsets[name]: self.offsets[name] + used[name]]
        out["units"] = out["units"].view(WORK_UNIT_DTYPE)
        out["merge_out"] = out["merge_out"].view(MERGE_TARGET_DTYPE)
        return out


def workspace_bytes(layout: PlanLayout, head_dim: int, num_qo_heads: int, dtype_bytes: int) -> int:
    """Bytes of the partial-(O, LSE) workspace for any plan that fits ``layout``.

    Slot ``s`` holds ``tile_q`` fused rows of partial O (``head_dim`` values of ``dtype_bytes``
    each) and ``tile_q`` float32 LSE values; the O part of all slots comes first, then the LSE
    part, each 256-byte aligned. The slot count is ``layout.max_partial_slots``
    (``<= 2 * num_kv_heads * max_ctas - 2``, see attncc.runtime.scheduler's docstring).
    ``num_qo_heads`` must equal the layout's (the fused rows of a slot span the
    ``num_qo_heads / num_kv_heads`` query heads of one KV head).

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
