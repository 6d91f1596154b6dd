"""Exact per-tile classification of a mask_mod (EMPTY / FULL / PARTIAL) without a dense mask.

Most masks people write are boolean combinations of comparisons whose two sides move
monotonically with `kv_idx` for a fixed row (b, h, q_idx): causal `q >= kv`, sliding windows
`q - kv < W`, prefix-LM `kv < P | q >= kv`, chunks `q // C == kv // C`, document ranges
`kv >= start[b, q]`, sorted document ids `doc[b, q] == doc[b, kv]`. For such a mask ("affine-like"
here) every comparison flips at most once (twice for `==` / `!=`) along a row, so per row the kv
axis splits into at most 2*atoms+1 segments on which the mask is constant. We find each flip by
binary search over kv, evaluating the comparison with the IR evaluator for all rows at once
(log2(KV) steps), evaluate the mask once per segment, and turn the resulting kept intervals into
exact per-tile kept counts. Cost: O(rows * atoms * log KV) evaluations plus a sort per row group;
never O(Q * KV). Anything else is evaluated densely, a bounded chunk of query rows at a time.

Example:
    >>> from attncc.ir.nodes import var
    >>> causal = var("q_idx") >= var("kv_idx")
    >>> is_affine_mask(causal)
    True
    >>> kept, total = block_classes(causal, 1, 1, 256, 256, 128, 128)
    >>> kept[0, 0].tolist(), total[0, 0].tolist()
    ([[8256, 0], [16384, 8256]], [[16384, 16384], [16384, 16384]])
    >>> classify_tile(causal, 128, 256, 0, 128)
    <TileClass.FULL: 'full'>
"""
from __future__ import annotations

import enum
import math
from typing import Literal, Mapping

import torch

from .evaluator import evaluate
from .nodes import BOOL, Node, binary, free_vars, walk

Direction = Literal["const", "inc", "dec"]

# Element budgets that bound memory: a dense chunk holds at most this many mask elements, an
# analytic chunk at most this many (row, segment) entries.
DENSE_CHUNK_ELEMS = 1 << 24
ANALYTIC_CHUNK_ELEMS = 1 << 22

_COMPARES = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})


class TileClass(enum.Enum):
    """How a mask covers one tile: nothing kept, everything kept, or a mix."""

    EMPTY = "empty"
    FULL = "full"
    PARTIAL = "partial"


# ----------------------------------------------------------------------------- monotonicity


def _flip(d: Direction | None) -> Direction | None:
    return "dec" if d == "inc" else "inc" if d == "dec" else d


def _join(a: Direction | None, b: Direction | None) -> Direction | None:
    """Direction of a sum (or min/max) of two monotone terms; a constant goes with anything."""
    if a is None or b is None:
        return None
    if a == "const":
        return b
    if b == "const" or a == b:
        return a
    return None


def _reads_kv(root: Node) -> dict[int, bool]:
    """For every node under `root`: does it depend on kv_idx?"""
    reads: dict[int, bool] = {}
    for n in walk(root):
        reads[id(n)] = (n.op == "var" and n.attr == "kv_idx") or any(reads[id(a)] for a in n.args)
    return reads


def _static_value(n: Node, params: Mapping[str, int | float] | None) -> float | None:
    """The value of a closed expression (constants and known params), else None."""
    for m in walk(n):
        if m.op in ("var", "load", "vec"):
            return None
        if m.op == "param" and (params is None or m.attr not in params):
            return None
    try:
        v = float(evaluate(n, {}, params=params or {}, float_dtype=torch.float64))
    except Exception:  # division by zero and the like: not a usable sign
        return None
    return v if math.isfinite(v) else None


def _tensor_direction(t: torch.Tensor, dim: int) -> Direction | None:
    """Is the captured tensor sorted along `dim` (for every other index)? Data-dependent."""
    if t.shape[dim] <= 1:
        return "const"
    x = t if t.dtype.is_floating_point else t.to(torch.int64)
    d = torch.diff(x, dim=dim)
    if bool((d >= 0).all()):  # NaN fails both tests, so NaN data is never called monotone
        return "inc"
    if bool((d <= 0).all()):
        return "dec"
    return None


def _directions(root: Node, params: Mapping[str, int | float] | None,
                tensors: Mapping[str, torch.Tensor] | None) -> dict[int, Direction | None]:
    """Monotonicity in kv_idx of every node under `root` (bool comparisons included: a bool
    is ordered False < True, so a sorted bool tensor read at kv is a monotone predicate)."""
    reads = _reads_kv(root)
    memo: dict[int, Direction | None] = {}
    for n in walk(root):
        memo[id(n)] = _direction_step(n, memo, reads, params, tensors)
    return memo


def _direction_step(n: Node, memo: dict[int, Direction | None], reads: dict[int, bool],
                    params: Mapping[str, int | float] | None,
                    tensors: Mapping[str, torch.Tensor] | None) -> Direction | None:
    if not reads[id(n)]:
        return "const"
    a = [memo[id(x)] for x in n.args]
    op = n.op
    if op == "var":  # only kv_idx reads kv
        return "inc"
    if op in ("add", "min", "max"):
        return _join(a[0], a[1])
    if op == "sub":
        return _join(a[0], _flip(a[1]))
    if op == "neg":
        return _flip(a[0])
    if op in ("to_f32", "to_i32", "floor", "ceil", "trunc", "round", "sign"):
        # rounding / truncation never reverses order
        return a[0]
    if op == "mul":
        for i in (0, 1):
            if not reads[id(n.args[1 - i])]:
                s = _static_value(n.args[1 - i], params)
                if s is None:
                    return None
                return "const" if s == 0 else a[i] if s > 0 else _flip(a[i])
        return None
    if op == "floordiv":
        if reads[id(n.args[1])]:
            return None
        s = _static_value(n.args[1], params)
        if s is None or s == 0:
            return None
        return a[0] if s > 0 else _flip(a[0])
    if op == "where":  # a row-constant condition picks one monotone branch per row
        if reads[id(n.args[0])]:
            return None
        return _join(a[1], a[2])
    if op == "load" and tensors is not None and n.attr in tensors:
        kv_dims = [i for i, x in enumerate(n.args) if reads[id(x)]]
        if len(kv_dims) != 1 or a[kv_dims[0]] is None:
            return None
        t = tensors[n.attr]
        if not isinstance(t, torch.Tensor) or t.dim() != len(n.args):
            return None
        td = _tensor_direction(t, kv_dims[0])
        if td is None:
            return None
        inner = a[kv_dims[0]]
        if td == "const" or inner == "const":
            return "const"
        return inner if td == "inc" else _flip(inner)
    return None


def kv_monotonic(expr: Node, params: Mapping[str, int | float] | None = None,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> Direction | None:
    """How `expr` moves as kv_idx grows with everything else fixed: "const", "inc" (never
    decreases), "dec" (never increases), or None when that cannot be shown.

    Multipliers and divisors must be constants (or params whose values are given). With
    `tensors`, a load whose only kv-dependent index is monotone counts as monotone when the
    captured tensor is sorted along that dim (checked on the data).

    Example:
        >>> from attncc.ir.nodes import var, const, param, binary, I32
        >>> q, kv = var("q_idx"), var("kv_idx")
        >>> kv_monotonic(q - kv), kv_monotonic(kv * 2 + q), kv_monotonic(q * 3)
        ('dec', 'inc', 'const')
        >>> kv_monotonic(kv * param("s", I32)), kv_monotonic(kv * param("s", I32), {"s": -1})
        (None, 'dec')
        >>> print(kv_monotonic(kv - binary("floordiv", kv, const(2))))
        None
    """
    return _directions(expr, params, tensors)[id(expr)]


# ----------------------------------------------------------------------------- decomposition


def monotone_predicates(mask: Node, params: Mapping[str, int | float] | None = None,
                        tensors: Mapping[str, torch.Tensor] | None = None) -> list[Node] | None:
    """The boolean predicates, each flipping at most once along kv, that `mask` is built of.

    None when the mask is not a boolean combination (& | ~ where) of comparisons between
    kv-monotone sides and kv-free booleans. `a == b` / `a != b` contribute `a <= b` and `a >= b`.

    Example:
        >>> from attncc.ir.nodes import var
        >>> q, kv = var("q_idx"), var("kv_idx")
        >>> [str(p) for p in monotone_predicates((q >= kv) & (q - kv < 8))]
        ['<q_idx >= kv_idx : bool>', '<q_idx - kv_idx < 8 : bool>']
        >>> from attncc.ir.nodes import binary, const
        >>> print(monotone_predicates(binary("mod", q, const(7)) >= binary("mod", kv, const(7))))
        None
    """
    if mask.dtype is not BOOL:
        return None
    reads = _reads_kv(mask)
    dirs: dict[int, Direction | None] | None = None
    preds: list[Node] = []
    seen: set[int] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if id(n) in seen or not reads[id(n)]:
            continue  # kv-free parts are constant along a row
        seen.add(id(n))
        if n.op in ("and", "or", "not") or (n.op == "where" and n.dtype is BOOL):
            stack.extend(reversed(n.args))
            continue
        if dirs is None:
            dirs = _directions(mask, params, tensors)
        if n.op in _COMPARES and n.args[0].dtype is not BOOL:
            lhs, rhs = n.args
            if _join(dirs[id(lhs)], _flip(dirs[id(rhs)])) is None:
                return None
            if n.op in ("eq", "ne"):
                preds += [binary("le", lhs, rhs), binary("ge", lhs, rhs)]
            else:
                preds.append(n)
            continue
        if n.op == "load" and dirs[id(n)] is not None:  # a sorted bool tensor read at kv
            preds.append(n)
            continue
        return None
    return list(dict.fromkeys(preds))  # a repeated predicate would only add empty segments


def is_affine_mask(mask: Node, params: Mapping[str, int | float] | None = None,
                   tensors: Mapping[str, torch.Tensor] | None = None) -> bool:
    """Can `mask` be classified analytically (row-interval decomposable)?

    Example:
        >>> from attncc.ir.nodes import var, load, const, binary, I32
        >>> q, kv, b = var("q_idx"), var("kv_idx"), var("b")
        >>> chunk = lambda i: binary("floordiv", i, const(128))
        >>> is_affine_mask((kv < 64) | (q >= kv)), is_affine_mask(binary("eq", chunk(q), chunk(kv)))
        (True, True)
        >>> doc = lambda i: load("doc", (b, i), I32)
        >>> is_affine_mask(binary("eq", doc(q), doc(kv)))
        False
        >>> import torch
        >>> sorted_ids = torch.tensor([[0, 0, 1, 2]])  # data-dependent: sorted along kv
        >>> is_affine_mask(binary("eq", doc(q), doc(kv)), tensors={"doc": sorted_ids})
        True
    """
    return monotone_predicates(mask, params, tensors) is not None


# ----------------------------------------------------------------------------- row intervals


def _eval_rows(expr: Node, rows: Mapping[str, torch.Tensor], kv: torch.Tensor,
               params: Mapping[str, int | float], tensors: Mapping[str, torch.Tensor]
               ) -> torch.Tensor:
    """`expr` at per-row kv positions: rows are [R] (or [R, 1]), kv is [R] or [R, S]."""
    env = {k: (v if kv.dim() == 1 else v[:, None]) for k, v in rows.items()}
    env["kv_idx"] = kv
    return evaluate(expr, env, tensors, params).expand(kv.shape)


def _first_flip(pred: Node, rows: Mapping[str, torch.Tensor], k0: int, k1: int,
                params: Mapping[str, int | float], tensors: Mapping[str, torch.Tensor]
                ) -> torch.Tensor:
    """Per row, the first kv in (k0, k1) where `pred` differs from its value at k0, else k1.

    `pred` flips at most once on a row, so the kv where it differs from pred(k0) form a suffix
    and bisection finds its start. A fixed step count avoids a device sync per step.
    """
    R = next(iter(rows.values())).shape[0]
    device = next(iter(rows.values())).device
    lo = torch.full((R,), k0, dtype=torch.int64, device=device)
    hi = torch.full((R,), k1, dtype=torch.int64, device=device)
    p0 = _eval_rows(pred, rows, lo, params, tensors)
    for _ in range(max(0, (k1 - k0 - 1).bit_length())):
        mid = (lo + hi) >> 1  # == lo once hi - lo == 1, and pred(lo) == p0: no change
        same = _eval_rows(pred, rows, mid, params, tensors) == p0
        lo = torch.where(same, mid, lo)
        hi = torch.where(same, hi, mid)
    return hi


def _sort_rows(x: torch.Tensor) -> torch.Tensor:
    """Sort each row of a narrow [R, w] tensor. A min/max transposition network beats
    torch.sort (a per-row sort call) by ~100x when rows are many and w is a handful."""
    w = x.shape[1]
    if w > 16:
        return x.sort(dim=1).values
    cols = list(x.unbind(1))
    for p in range(w):
        for i in range(p % 2, w - 1, 2):
            a, b = cols[i], cols[i + 1]
            cols[i], cols[i + 1] = torch.minimum(a, b), torch.maximum(a, b)
    return torch.stack(cols, dim=1)


def kept_intervals(mask: Node, preds: list[Node], rows: Mapping[str, torch.Tensor], k0: int,
                   k1: int, params: Mapping[str, int | float] | None = None,
                   tensors: Mapping[str, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the kv segments of [k0, k1) on which `mask` is constant, and its value there.

    `rows` maps "b", "h", "q_idx" to int64 tensors [R]; `preds` = monotone_predicates(mask).
    Returns (starts, ends, keep), each [R, len(preds) + 1]; segments may be empty (start == end,
    keep False). The mask is evaluated once per segment, so the result is exact.

    Example:
        >>> from attncc.ir.nodes import var
        >>> m = var("q_idx") >= var("kv_idx")
        >>> rows = {"q_idx": torch.tensor([2, 9])}
        >>> s, e, k = kept_intervals(m, monotone_predicates(m), rows, 0, 8)
        >>> s.tolist(), e.tolist(), k.tolist()
        ([[0, 3], [0, 8]], [[3, 8], [8, 8]], [[True, False], [True, False]])
    """
    params, tensors = params or {}, tensors or {}
    R = next(iter(rows.values())).shape[0]
    device = next(iter(rows.values())).device
    edge = [torch.full((R, 1), k0, dtype=torch.int64, device=device)]
    flips = [_first_flip(p, rows, k0, k1, params, tensors)[:, None] for p in preds]
    bounds = _sort_rows(torch.cat(edge + flips + [torch.full_like(edge[0], k1)], dim=1))
    starts, ends = bounds[:, :-1], bounds[:, 1:]
    # every predicate is constant on [start, end), hence so is the mask: one evaluation each
    probe = starts.clamp(max=k1 - 1)
    keep = _eval_rows(mask, rows, probe, params, tensors) & (ends > starts)
    return starts, ends, keep


# ----------------------------------------------------------------------------- tile counts


def _pick_device(device: torch.device | str | None,
                 tensors: Mapping[str, torch.Tensor] | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in (tensors or {}).values():
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _row_chunks(n_rows: int, group: int, per_row: int, budget: int) -> list[tuple[int, int]]:
    """Split [0, n_rows) into ranges of whole `group`s with about `budget // per_row` rows."""
    step = max(group, (budget // max(per_row, 1)) // group * group)
    return [(r, min(r + step, n_rows)) for r in range(0, n_rows, step)]


def _rows_of(r0: int, r1: int, H: int, Qp: int, Q_LEN: int, device: torch.device
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Index tensors for flattened rows r = (b * H + h) * Qp + q; padding rows are clamped."""
    r = torch.arange(r0, r1, dtype=torch.int64, device=device)
    q = r % Qp
    bh = r // Qp
    rows = {"b": bh // H, "h": bh % H, "q_idx": q.clamp(max=Q_LEN - 1)}
    return rows, q < Q_LEN


def _relu_sums(x: torch.Tensor, groups: int, BLOCK_KV: int, nKvb: int) -> torch.Tensor:
    """Per row group g and kv-block boundary k: sum over x in group g of max(k*BLOCK_KV - x, 0).

    x < k*BLOCK_KV exactly when x // BLOCK_KV < k, so a per-group histogram of count and sum of
    x by block, prefix-summed over blocks, gives every boundary at once (no sort, exact ints).
    """
    group_of_row = torch.arange(x.shape[0], device=x.device) // (x.shape[0] // groups)
    blk = (x // BLOCK_KV).clamp(max=nKvb)  # x <= KV_LEN, so at most nKvb
    flat = (group_of_row[:, None] * (nKvb + 1) + blk).reshape(-1)
    cnt = torch.zeros(groups * (nKvb + 1), dtype=torch.int64, device=x.device)
    tot = torch.zeros_like(cnt)
    cnt.index_add_(0, flat, torch.ones_like(flat))
    tot.index_add_(0, flat, x.reshape(-1))
    zero = torch.zeros(groups, 1, dtype=torch.int64, device=x.device)
    cnt_lt = torch.cat([zero, cnt.view(groups, -1).cumsum(1)[:, :nKvb]], dim=1)  # [g, nKvb+1]
    tot_lt = torch.cat([zero, tot.view(groups, -1).cumsum(1)[:, :nKvb]], dim=1)
    at = torch.arange(nKvb + 1, dtype=torch.int64, device=x.device) * BLOCK_KV
    return cnt_lt * at - tot_lt


def _analytic_kept(mask: Node, preds: list[Node], rows: Mapping[str, torch.Tensor],
                   valid: torch.Tensor, KV_LEN: int, BLOCK_Q: int, BLOCK_KV: int, nKvb: int,
                   params: Mapping[str, int | float], tensors: Mapping[str, torch.Tensor]
                   ) -> torch.Tensor:
    """Kept counts [groups, nKvb] for rows in whole q-blocks (groups of BLOCK_Q rows).

    Kept count of a tile = G(x1) - G(x0) with G(x) = sum over the tile's rows and kept segments
    [s, e) of |[s, e) ∩ [0, x)| = relu(x - s) - relu(x - e). Dropped segments become [0, 0).
    Past KV_LEN, G is flat (as many s as e), so the last boundary needs no clamping.
    """
    starts, ends, keep = kept_intervals(mask, preds, rows, 0, KV_LEN, params, tensors)
    keep = keep & valid[:, None]
    starts = torch.where(keep, starts, 0)
    ends = torch.where(keep, ends, 0)
    G = starts.shape[0] // BLOCK_Q
    g = _relu_sums(starts, G, BLOCK_KV, nKvb) - _relu_sums(ends, G, BLOCK_KV, nKvb)
    return g[:, 1:] - g[:, :-1]


def _dense_kept(mask: Node, rows: Mapping[str, torch.Tensor], valid: torch.Tensor, KV_LEN: int,
                BLOCK_Q: int, BLOCK_KV: int, nKvb: int, params: Mapping[str, int | float],
                tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Kept counts [groups, nKvb] by evaluating every element of this chunk of rows."""
    R = valid.shape[0]
    kv = torch.arange(KV_LEN, dtype=torch.int64, device=valid.device)
    env = {k: v[:, None] for k, v in rows.items()}
    env["kv_idx"] = kv[None, :]
    m = evaluate(mask, env, tensors, params).expand(R, KV_LEN) & valid[:, None]
    m = torch.nn.functional.pad(m, (0, nKvb * BLOCK_KV - KV_LEN))
    return m.reshape(R // BLOCK_Q, BLOCK_Q, nKvb, BLOCK_KV).sum(dim=(1, 3), dtype=torch.int64)


def block_classes(mask: Node, B: int, H: int, Q_LEN: int, KV_LEN: int, BLOCK_Q: int,
                  BLOCK_KV: int, params: Mapping[str, int | float] | None = None,
                  tensors: Mapping[str, torch.Tensor] | None = None,
                  device: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept and in-bounds element counts of every (BLOCK_Q x BLOCK_KV) tile of the mask.

    Returns int64 tensors (kept, total) of shape [B', H', ceil(Q/BLOCK_Q), ceil(KV/BLOCK_KV)]
    where B' = 1 when the mask does not read b (likewise H'), meant to broadcast. A tile is full
    when kept == total > 0 and empty when kept == 0. Analytic when `is_affine_mask`, else dense
    over bounded chunks of query rows.

    Example:
        >>> from attncc.ir.nodes import var
        >>> q, kv = var("q_idx"), var("kv_idx")
        >>> kept, total = block_classes(q - kv < 4, 2, 8, 10, 10, 4, 4)
        >>> kept.shape, kept[0, 0].tolist()
        (torch.Size([1, 1, 3, 3]), [[16, 16, 8], [6, 16, 8], [0, 5, 4]])
        >>> total[0, 0, 2].tolist()
        [8, 8, 4]
    """
    if min(Q_LEN, KV_LEN, BLOCK_Q, BLOCK_KV) <= 0:
        raise ValueError(f"lengths and block sizes must be positive, got Q_LEN={Q_LEN}, "
                         f"KV_LEN={KV_LEN}, BLOCK_SIZE=({BLOCK_Q}, {BLOCK_KV})")
    dev = _pick_device(device, tensors)
    params = dict(params or {})
    tensors = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
               for k, v in (tensors or {}).items()}
    used = free_vars(mask)
    Bp = B if "b" in used else 1
    Hp = H if "h" in used else 1
    nQb, nKvb = -(-Q_LEN // BLOCK_Q), -(-KV_LEN // BLOCK_KV)
    Qp = nQb * BLOCK_Q
    n_rows = Bp * Hp * Qp
    preds = monotone_predicates(mask, params, tensors)
    if preds is not None:
        chunks = _row_chunks(n_rows, BLOCK_Q, len(preds) + 1, ANALYTIC_CHUNK_ELEMS)
    else:
        chunks = _row_chunks(n_rows, BLOCK_Q, KV_LEN, DENSE_CHUNK_ELEMS)
    parts = []
    for r0, r1 in chunks:
        rows, valid = _rows_of(r0, r1, Hp, Qp, Q_LEN, dev)
        if preds is not None:
            parts.append(_analytic_kept(mask, preds, rows, valid, KV_LEN, BLOCK_Q, BLOCK_KV,
                                        nKvb, params, tensors))
        else:
            parts.append(_dense_kept(mask, rows, valid, KV_LEN, BLOCK_Q, BLOCK_KV, nKvb, params,
                                     tensors))
    kept = torch.cat(parts).reshape(Bp, Hp, nQb, nKvb)
    qb = torch.arange(nQb, dtype=torch.int64, device=dev)
    kb = torch.arange(nKvb, dtype=torch.int64, device=dev)
    rows_in = (Q_LEN - qb * BLOCK_Q).clamp(max=BLOCK_Q)
    cols_in = (KV_LEN - kb * BLOCK_KV).clamp(max=BLOCK_KV)
    total = (rows_in[:, None] * cols_in[None, :]).expand(Bp, Hp, nQb, nKvb)
    return kept, total


def classify_tile(mask: Node, q0: int, q1: int, k0: int, k1: int, *, b: int = 0, h: int = 0,
                  params: Mapping[str, int | float] | None = None,
                  tensors: Mapping[str, torch.Tensor] | None = None,
                  kv_len: int | None = None) -> TileClass:
    """Classify the tile rows [q0, q1) x cols [k0, k1) (cols clipped to kv_len) of batch b, head h.

    Exact: FULL when every in-bounds element is kept, EMPTY when none is (or none is in bounds).

    Example:
        >>> from attncc.ir.nodes import var
        >>> q, kv = var("q_idx"), var("kv_idx")
        >>> classify_tile((q >= kv) & (q < kv), 0, 64, 0, 64)
        <TileClass.EMPTY: 'empty'>
        >>> classify_tile(q >= kv, 0, 64, 0, 64), classify_tile(q >= kv, 64, 128, 0, 64)
        (<TileClass.PARTIAL: 'partial'>, <TileClass.FULL: 'full'>)
    """
    if kv_len is not None:
        k1 = min(k1, kv_len)
    if q1 <= q0 or k1 <= k0:
        return TileClass.EMPTY
    dev = _pick_device(None, tensors)
    params = dict(params or {})
    tensors = dict(tensors or {})
    q = torch.arange(q0, q1, dtype=torch.int64, device=dev)
    rows = {"b": torch.full_like(q, b), "h": torch.full_like(q, h), "q_idx": q}
    preds = monotone_predicates(mask, params, tensors)
    if preds is not None:
        s, e, keep = kept_intervals(mask, preds, rows, k0, k1, params, tensors)
        kept = int(torch.where(keep, e - s, 0).sum())
    else:
        kv = torch.arange(k0, k1, dtype=torch.int64, device=dev)
        env = {k: v[:, None] for k, v in rows.items()}
        env["kv_idx"] = kv[None, :]
        kept = int(evaluate(mask, env, tensors, params).expand(q1 - q0, k1 - k0).sum())
    total = (q1 - q0) * (k1 - k0)
    return TileClass.EMPTY if kept == 0 else TileClass.FULL if kept == total else \
        TileClass.PARTIAL
