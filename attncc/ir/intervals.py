"""Integer interval analysis of IR expressions over a call's shapes.

The index variables range over the call's domain: b in [0, B), h in [0, H), q_idx in [0, Sq),
kv_idx in [0, Skv), d in [0, D). `ranges(expr, domain)` gives every i32 node of `expr` an
interval `(lo, hi)` (inclusive, Python ints, so a value past 32 bits shows as such) or None
when the analysis cannot bound it (float arithmetic, a captured tensor's values, division by a
range holding zero). Intervals are sound: every value the node takes on the domain lies inside.

A domain may also carry a band `lo <= kv_idx - q_idx <= hi` (what a causal or sliding-window
mask keeps, see `implied_band`). Expressions linear in the index variables with integer
coefficients (`q_idx - kv_idx + 7`, `2 * h + 1`) are bounded exactly over the box cut by the
band -- the optimum of a linear form sits at a vertex of that polygon -- so `q_idx - kv_idx`
under a causal mask is [0, Sq - 1], not [-(Skv - 1), Sq - 1].

Example:
    >>> from attncc.ir.nodes import var, const, binary
    >>> q, kv = var("q_idx"), var("kv_idx")
    >>> dom = Domain({"q_idx": 8, "kv_idx": 8})
    >>> interval(q - kv, dom), interval(q - kv, dom.with_band((None, 0)))
    ((-7, 7), (0, 7))
    >>> interval(binary("mod", q * 3, const(5)), dom), interval(q * 100000 * 100000, dom)
    ((0, 4), (0, 70000000000))
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from .kv_bound import _compare_window
from .nodes import BOOL, I32, Node, const_value, walk

__all__ = ["Domain", "Interval", "Band", "ranges", "interval", "implied_band", "band_points",
           "INT32_MIN", "INT32_MAX"]

Interval = tuple[int, int]
Band = tuple[int | None, int | None]  # lo <= kv_idx - q_idx <= hi; None: unbounded side
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_LINEAR_VARS = ("b", "h", "q_idx", "kv_idx", "d")


@dataclass(frozen=True)
class Domain:
    """Sizes of the index variables (a variable absent here is unbounded), an optional band on
    kv_idx - q_idx, the captured scalars' values and known value ranges of captured tensors."""

    sizes: Mapping[str, int]
    band: Band | None = None
    params: Mapping[str, int | float] = field(default_factory=dict)
    tensor_ranges: Mapping[str, Interval] = field(default_factory=dict)

    def with_band(self, band: Band | None) -> "Domain":
        """This domain cut by one more band (intersected with its own)."""
        return replace(self, band=intersect_bands(self.band, band))

    def var_range(self, name: str) -> Interval | None:
        n = self.sizes.get(name)
        return None if n is None else (0, n - 1)


def intersect_bands(a: Band | None, b: Band | None) -> Band | None:
    """The band both `a` and `b` imply (None: no constraint).

    Example:
        >>> intersect_bands((None, 0), (-8, None)), intersect_bands(None, (1, 2))
        ((-8, 0), (1, 2))
    """
    if a is None or b is None:
        return a if b is None else b
    lo = b[0] if a[0] is None else a[0] if b[0] is None else max(a[0], b[0])
    hi = b[1] if a[1] is None else a[1] if b[1] is None else min(a[1], b[1])
    return lo, hi


def implied_band(cond: Node) -> Band | None:
    """A band lo <= kv_idx - q_idx <= hi that holds wherever `cond` is true, or None.

    Comparisons of unit-coefficient q_idx / kv_idx with integer constants give their band;
    `a & b` the intersection of what either side implies; `a | b` the hull of both sides'
    bands (only when both have one); anything else no band.

    Example:
        >>> from attncc.ir.nodes import var, load, binary
        >>> q, kv = var("q_idx"), var("kv_idx")
        >>> implied_band((q >= kv) & binary("eq", load("doc", (q,), I32), load("doc", (kv,), I32)))
        (None, 0)
        >>> implied_band((q - kv <= 4) | (q >= kv)), implied_band(binary("eq", q, kv + 1) | (q >= kv))
        (None, (None, 0))
    """
    if cond.op in ("ge", "gt", "le", "lt", "eq"):
        return _compare_window(cond.op, cond.args[0], cond.args[1])
    if cond.op == "and":
        return intersect_bands(implied_band(cond.args[0]), implied_band(cond.args[1]))
    if cond.op == "or":
        a, b = implied_band(cond.args[0]), implied_band(cond.args[1])
        if a is None or b is None:
            return None
        lo = None if a[0] is None or b[0] is None else min(a[0], b[0])
        hi = None if a[1] is None or b[1] is None else max(a[1], b[1])
        return None if lo is None and hi is None else (lo, hi)
    return None


def band_points(domain: Domain) -> list[tuple[int, int]]:
    """The vertices (q_idx, kv_idx) of the box [0, Sq) x [0, Skv) cut by the domain's band:
    where a linear form of the two takes its extremes. Empty when no position is in the band.

    Example:
        >>> sorted(band_points(Domain({"q_idx": 4, "kv_idx": 6}, band=(None, 0))))
        [(0, 0), (3, 0), (3, 3)]
    """
    sq, skv = domain.sizes.get("q_idx"), domain.sizes.get("kv_idx")
    if sq is None or skv is None or sq <= 0 or skv <= 0:
        return []
    lo, hi = domain.band if domain.band is not None else (None, None)
    cands = {(0, 0), (0, skv - 1), (sq - 1, 0), (sq - 1, skv - 1)}
    for c in (lo, hi):
        if c is not None:
            cands |= {(0, c), (sq - 1, sq - 1 + c), (-c, 0), (skv - 1 - c, skv - 1)}

    def inside(q: int, kv: int) -> bool:
        return (0 <= q < sq and 0 <= kv < skv and (lo is None or kv - q >= lo)
                and (hi is None or kv - q <= hi))

    return sorted(p for p in cands if inside(*p))


def _linear(n: Node, params: Mapping[str, int | float]) -> dict[str, int] | None:
    """`n` as sum(coef * var) + coef[""] with integer coefficients, or None."""
    if n.dtype is not I32:
        return None
    if n.op == "var":
        return {n.attr: 1, "": 0} if n.attr in _LINEAR_VARS else None
    if n.op == "const":
        return {"": int(const_value(n))}
    if n.op == "param":
        v = params.get(n.attr)
        return {"": int(v)} if isinstance(v, int) else None
    if n.op == "neg":
        x = _linear(n.args[0], params)
        return None if x is None else {k: -c for k, c in x.items()}
    if n.op in ("add", "sub"):
        a, b = _linear(n.args[0], params), _linear(n.args[1], params)
        if a is None or b is None:
            return None
        s = 1 if n.op == "add" else -1
        return {k: a.get(k, 0) + s * b.get(k, 0) for k in a.keys() | b.keys()}
    if n.op == "mul":
        a, b = _linear(n.args[0], params), _linear(n.args[1], params)
        if a is None or b is None:
            return None
        for x, y in ((a, b), (b, a)):
            if set(x) == {""}:
                return {k: x[""] * c for k, c in y.items()}
    return None


def _linear_range(form: dict[str, int], domain: Domain) -> Interval | None:
    """Exact range of a linear form over the domain (box cut by the band); None if unbounded
    or empty."""
    lo = hi = form.get("", 0)
    for v in ("b", "h", "d"):
        c = form.get(v, 0)
        if c:
            r = domain.var_range(v)
            if r is None:
                return None
            lo, hi = lo + min(c * r[0], c * r[1]), hi + max(c * r[0], c * r[1])
    cq, ckv = form.get("q_idx", 0), form.get("kv_idx", 0)
    if not cq and not ckv:
        return lo, hi
    joint = domain.band is not None and None not in (domain.sizes.get("q_idx"),
                                                     domain.sizes.get("kv_idx"))
    if not joint:  # q and kv independent: each over its own range
        for v, c in (("q_idx", cq), ("kv_idx", ckv)):
            if c:
                r = domain.var_range(v)
                if r is None:
                    return None
                lo, hi = lo + min(c * r[0], c * r[1]), hi + max(c * r[0], c * r[1])
        return lo, hi
    pts = band_points(domain)
    if not pts:
        return None
    vals = [cq * q + ckv * kv for q, kv in pts]
    return lo + min(vals), hi + max(vals)


def _floordiv(a: Interval, b: Interval) -> Interval | None:
    if b[0] <= 0 <= b[1]:
        return None
    qs = [x // y for x in a for y in b]
    return min(qs), max(qs)


def _mod(a: Interval, b: Interval) -> Interval | None:
    if b[0] <= 0 <= b[1]:
        return None
    if b[0] > 0:  # Python's %: the divisor's sign
        if b[0] == b[1] and 0 <= a[0] and a[1] < b[0]:
            return a
        return 0, b[1] - 1
    return b[0] + 1, 0


def _fmod(a: Interval, b: Interval) -> Interval | None:
    """C's remainder: the dividend's sign, smaller in magnitude than both operands."""
    if b[0] <= 0 <= b[1]:
        return None
    m = max(abs(b[0]), abs(b[1])) - 1
    return max(min(a[0], 0), -m), min(max(a[1], 0), m)


def _bits(n: Node, a: Interval, b: Interval) -> Interval | None:
    """Bitwise ops and shifts: bounded where the signs (and shift counts) say so."""
    op = n.op
    if op == "bitand" and (a[0] >= 0 or b[0] >= 0):
        return 0, min(x[1] for x in (a, b) if x[0] >= 0)
    if op in ("bitor", "bitxor") and a[0] >= 0 and b[0] >= 0:
        return 0, (1 << max(a[1], b[1]).bit_length()) - 1
    if op in ("lshift", "rshift") and 0 <= b[0] and b[1] < 32:
        # monotone in the value for a fixed count, and in the count for a fixed sign: corners
        f = (lambda x, k: x * 2**k) if op == "lshift" else (lambda x, k: x >> k)
        vals = [f(x, k) for x in a for k in b]
        return min(vals), max(vals)
    return None


def _step(n: Node, a: list[Interval | None], domain: Domain) -> Interval | None:
    """Interval arithmetic for one node from its children's intervals."""
    op = n.op
    if op == "var":
        return domain.var_range(n.attr)
    if op == "const":
        return (int(n.attr), int(n.attr))
    if op == "param":
        v = domain.params.get(n.attr)
        return (v, v) if isinstance(v, int) and not isinstance(v, bool) else None
    if op == "load":
        return domain.tensor_ranges.get(n.attr)
    if op == "to_i32":
        return (0, 1) if n.args[0].dtype is BOOL else None
    if op == "where":
        x, y = a[1], a[2]
        return None if x is None or y is None else (min(x[0], y[0]), max(x[1], y[1]))
    if any(x is None for x in a):
        return None
    if op == "neg":
        return -a[0][1], -a[0][0]
    if op == "abs":
        lo, hi = a[0]
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if op in ("add", "sub", "mul", "min", "max"):
        (al, ah), (bl, bh) = a
        if op == "add":
            return al + bl, ah + bh
        if op == "sub":
            return al - bh, ah - bl
        if op == "min":
            return min(al, bl), min(ah, bh)
        if op == "max":
            return max(al, bl), max(ah, bh)
        ps = [al * bl, al * bh, ah * bl, ah * bh]
        return min(ps), max(ps)
    if op == "floordiv":
        return _floordiv(a[0], a[1])
    if op == "mod":
        return _mod(a[0], a[1])
    if op == "fmod":
        return _fmod(a[0], a[1])
    if op == "sign":
        return (-1 if a[0][0] < 0 else 0 if a[0][0] == 0 else 1,
                1 if a[0][1] > 0 else 0 if a[0][1] == 0 else -1)
    if op == "bitnot":
        return -a[0][1] - 1, -a[0][0] - 1
    if op in ("fmin", "fmax"):  # no NaN among integers: min and max
        (al, ah), (bl, bh) = a
        return (min(al, bl), min(ah, bh)) if op == "fmin" else (max(al, bl), max(ah, bh))
    if len(a) == 2:
        return _bits(n, a[0], a[1])
    return None


def ranges(expr: Node, domain: Domain) -> dict[int, Interval | None]:
    """id(node) -> interval of every i32 node of `expr` over `domain` (None: unbounded).

    Example:
        >>> from attncc.ir.nodes import var
        >>> e = var("h") * 2 + 1
        >>> ranges(e, Domain({"h": 4}))[id(e)]
        (1, 7)
    """
    out: dict[int, Interval | None] = {}
    for n in walk(expr):
        if n.dtype is not I32:
            continue
        r = _step(n, [out.get(id(x)) for x in n.args], domain)
        form = _linear(n, domain.params) if n.op in ("add", "sub", "mul", "neg") else None
        if form is not None:
            exact = _linear_range(form, domain)
            if exact is not None:
                r = exact if r is None else (max(r[0], exact[0]), min(r[1], exact[1]))
        out[id(n)] = r
    return out


def interval(expr: Node, domain: Domain) -> Interval | None:
    """The interval of one i32 expression over `domain` (None: unbounded).

    Example:
        >>> from attncc.ir.nodes import var
        >>> interval(var("kv_idx") - var("q_idx"), Domain({"q_idx": 10, "kv_idx": 10}, band=(-3, 0)))
        (-3, 0)
    """
    if expr.dtype is not I32:
        raise TypeError(f"interval() takes an i32 expression, got {expr.dtype.value}")
    return ranges(expr, domain)[id(expr)]
