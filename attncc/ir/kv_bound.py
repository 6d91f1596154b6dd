"""A provable upper bound on the keys a mask can keep, relative to the query: kv_idx <= q_idx + c.

A causal mask keeps no key after its query, so a query tile never needs the keys past its last
row's position; a serving plan can end each unit's KV range there instead of at the request's
end (half the work of a causal prefill). `causal_bound(mask)` finds the smallest such c the
mask's structure proves, or None:

- a comparison of `q_idx` and `kv_idx` that are linear with unit coefficients and integer
  constants (`q_idx >= kv_idx`, `kv_idx < q_idx + 4`, `q_idx - kv_idx >= 0`, `kv_idx == q_idx`);
- `a & b`: the tighter of the bounds the two sides have (one side is enough);
- `a | b`: the looser, only when both sides have one;
- anything else: None (no bound is claimed).

`kv_window(mask)` answers a stronger question: whether the mask is *exactly* a band
lo <= kv_idx - q_idx <= hi (a conjunction of such comparisons: causal, a causal sliding window
with a literal width), so that a kernel may skip evaluating it on a tile whose every
(query, key) pair lies inside the band.

Example:
    >>> from attncc.ir.nodes import var, param, I32
    >>> q, kv = var("q_idx"), var("kv_idx")
    >>> causal_bound(q >= kv), causal_bound(kv < q), causal_bound((q >= kv) & (q - kv <= 256))
    (0, -1, 0)
    >>> causal_bound((kv < param("prefix", I32)) | (q >= kv)) is None   # prefix-LM: no bound
    True
    >>> kv_window(q >= kv), kv_window((q >= kv) & (q - kv <= 256)), kv_window(q >= kv * 2)
    ((None, 0), (-256, 0), None)
"""
from __future__ import annotations

from .nodes import I32, Node, const_value

__all__ = ["causal_bound", "kv_window", "kv_window_params"]


def _compare_window(op: str, lhs: Node, rhs: Node) -> tuple[int | None, int | None] | None:
    """`lhs op rhs` as exactly lo <= kv_idx - q_idx <= hi with constant bounds (None: an
    unbounded side), or None."""
    return _constant(_compare_bounds(op, lhs, rhs, scalars=False))


def _compare_bound(op: str, lhs: Node, rhs: Node) -> int | None:
    """The c of `lhs op rhs  =>  kv_idx <= q_idx + c`: the upper side of the comparison's exact
    band (_compare_window), or None (le / lt / ne bound kv from below or not at all)."""
    w = _compare_window(op, lhs, rhs)
    return None if w is None else w[1]


def causal_bound(mask: Node) -> int | None:
    """The smallest c with mask(b, h, q_idx, kv_idx) => kv_idx <= q_idx + c that the mask's
    structure proves (see the module docstring), or None."""
    if mask.op in ("ge", "gt", "le", "lt", "eq", "ne"):
        return _compare_bound(mask.op, mask.args[0], mask.args[1])
    if mask.op == "and":
        got = [c for c in (causal_bound(a) for a in mask.args) if c is not None]
        return min(got) if got else None
    if mask.op == "or":
        got = [causal_bound(a) for a in mask.args]
        return None if any(c is None for c in got) else max(got)  # type: ignore[type-var]
    return None


def kv_window(mask: Node) -> tuple[int | None, int | None] | None:
    """(lo, hi) when mask(b, h, q_idx, kv_idx) is exactly lo <= kv_idx - q_idx <= hi (None for
    an unbounded side): a comparison of unit-coefficient q_idx / kv_idx with integer constants,
    or a conjunction of such. None for anything else -- including masks that merely imply a
    band (`causal_bound` answers that weaker question).

    Example:
        >>> from attncc.ir.nodes import var
        >>> q, kv = var("q_idx"), var("kv_idx")
        >>> kv_window(kv < q), kv_window((q >= kv) & (kv > q - 9)), kv_window((q >= kv) | (kv < 4))
        ((None, -1), (-8, 0), None)
    """
    return _constant(_band(mask, scalars=False))


# ---- bands whose bounds read captured integer scalars (a sliding window's width) -------------
# A bound is (k, terms): k + sum(coef * scalar for scalar, coef in terms), terms sorted.
Bound = tuple[int, tuple[tuple[str, int], ...]]


def _constant(w: tuple[Bound | None, Bound | None] | None
              ) -> tuple[int | None, int | None] | None:
    """A band of constant bounds (`scalars=False` below) as (lo, hi) integers."""
    if w is None:
        return None
    lo, hi = w
    return (None if lo is None else lo[0]), (None if hi is None else hi[0])


def _affine(n: Node) -> tuple[int, int, int, dict[str, int]] | None:
    """`n` as a*q_idx + b*kv_idx + c + sum(coef * scalar) over captured I32 scalars, or None."""
    if n.op == "param":
        return (0, 0, 0, {n.attr: 1}) if n.dtype is I32 else None
    if n.op == "var":
        v = {"q_idx": (1, 0), "kv_idx": (0, 1)}.get(n.attr)
        return None if v is None else (*v, 0, {})
    if n.op == "const":
        c = const_value(n)
        return (0, 0, int(c), {}) if isinstance(c, int) and not isinstance(c, bool) else None
    if n.op == "neg":
        x = _affine(n.args[0])
        return None if x is None else (-x[0], -x[1], -x[2], {k: -v for k, v in x[3].items()})
    if n.op in ("add", "sub"):
        a, b = _affine(n.args[0]), _affine(n.args[1])
        if a is None or b is None:
            return None
        sg = 1 if n.op == "add" else -1
        terms = dict(a[3])
        for name, c in b[3].items():
            terms[name] = terms.get(name, 0) + sg * c
        return (a[0] + sg * b[0], a[1] + sg * b[1], a[2] + sg * b[2],
                {k: v for k, v in terms.items() if v})
    return None


def _compare_bounds(op: str, lhs: Node, rhs: Node, scalars: bool = True
                    ) -> tuple[Bound | None, Bound | None] | None:
    """`lhs op rhs` as exactly lo <= kv_idx - q_idx <= hi with affine bounds, or None; with
    `scalars` False, None as soon as a side reads a captured scalar (kv_window's bands)."""
    a, b = _affine(lhs), _affine(rhs)
    if a is None or b is None or (not scalars and (a[3] or b[3])):
        return None
    cq, ckv, k = a[0] - b[0], a[1] - b[1], a[2] - b[2]
    terms = dict(a[3])
    for name, c in b[3].items():
        terms[name] = terms.get(name, 0) - c
    if cq != -ckv or cq not in (1, -1):
        return None
    if cq == -1:  # -(q - kv) + K op 0  <=>  (q - kv) - K  flipped op  0
        op = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}[op]
        k, terms = -k, {n: -c for n, c in terms.items()}
    t = tuple(sorted((n, c) for n, c in terms.items() if c))
    # (q - kv) + K op 0  <=>  (kv - q)  op'  K
    return {"ge": (None, (k, t)), "gt": (None, (k - 1, t)), "le": ((k, t), None),
            "lt": ((k + 1, t), None), "eq": ((k, t), (k, t))}.get(op)


def kv_window_params(mask: Node) -> tuple[Bound | None, Bound | None] | None:
    """kv_window for bands whose bounds may read captured I32 scalars: (lo, hi), each None
    (unbounded) or (k, ((scalar, coef), ...)) meaning k + sum(coef * scalar), when `mask` is
    exactly lo <= kv_idx - q_idx <= hi; None otherwise. A side bounded twice keeps the tighter
    only when both bounds are constants (a scalar's bound cannot be ordered against another).

    Example:
        >>> from attncc.ir.nodes import var, param, I32
        >>> q, kv, w = var("q_idx"), var("kv_idx"), param("window", I32)
        >>> kv_window_params((q >= kv) & (q - kv <= w))
        ((0, (('window', -1),)), (0, ()))
        >>> kv_window_params((q >= kv) & (kv > q - 9))
        ((-8, ()), (0, ()))
        >>> kv_window_params((q - kv <= w) & (q - kv <= 4)) is None
        True
    """
    return _band(mask, scalars=True)


def _band(mask: Node, scalars: bool) -> tuple[Bound | None, Bound | None] | None:
    """kv_window_params, or with `scalars` False kv_window's band (constant bounds only)."""
    if mask.op in ("ge", "gt", "le", "lt", "eq", "ne"):
        return _compare_bounds(mask.op, mask.args[0], mask.args[1], scalars)
    if mask.op == "and":
        lo: Bound | None = None
        hi: Bound | None = None
        for a in mask.args:
            w = _band(a, scalars)
            if w is None:
                return None
            for side, new in ((0, w[0]), (1, w[1])):
                if new is None:
                    continue
                old = lo if side == 0 else hi
                if old is not None:
                    if old[1] or new[1]:
                        return None
                    new = (max(old[0], new[0]) if side == 0 else min(old[0], new[0]), ())
                if side == 0:
                    lo = new
                else:
                    hi = new
        return lo, hi
    return None
