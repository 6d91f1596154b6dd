"""Simplify IR: constant folding, boolean/select rules, and sympy on arithmetic islands.

Passes are pure: `simplify(node)` returns a node that computes the same value (exactly for
integers and booleans, up to float rounding for f32) and is never more expensive. Because nodes are
interned, the result is a DAG in which equal subexpressions are shared; codegen binds shared nodes
to temporaries, so this is also common-subexpression elimination.

An *arithmetic island* is a maximal subtree of `add sub mul neg` (plus `div` for f32) nodes of one
dtype. Everything else (`load`, `vec`, `tanh`, `where`, `//`, `%`, `min`, comparisons, casts, ...)
is opaque: its children are simplified on their own and the island sees it as one symbol. The
island goes through sympy's automatic canonicalisation (like terms collected, `x*30/30` cancelled),
optionally `expand`/`factor_terms` when the island is small, and comes back as IR of its own dtype.
Python's floor-division and modulo never enter sympy, so integer semantics are kept exactly.
Long islands are cut into chunks of about 16 ops so that loops building huge sums stay linear.

A float computation whose value reaches a discrete sink (an int cast, floor, a comparison, a
float `//` / `%`: `attncc.ir.discrete`) is the exception: there one ulp can change a bucket or a
mask, so those nodes keep the user's order -- no sympy, no reassociation, only rules that hold
bit for bit in IEEE float32 (`x * 1`, `x / -1`, `--x`, ...) and constant folding in float32.

Elsewhere float rules are those of `-ffast-math` algebra (`x - x -> 0`, `x * 0 -> 0`, reassociation), except
that an island holding a NaN/inf *constant* is never rewritten by sympy, and `x - x` / `x * 0`
keep an `x` that contains one: `(score + -inf) - -inf` stays NaN-producing, as written. Float
comparisons keep NaN semantics (`~(a < b)` is not `a >= b`; `x == x` is not folded).

Example:
    >>> from attncc.ir.nodes import var, const
    >>> from attncc.ir.printer import format_expr
    >>> s = var("score")
    >>> format_expr(simplify(s * 1 + 0))
    'score'
    >>> format_expr(simplify(var("q_idx") - var("kv_idx") + var("kv_idx")))
    'q_idx'
    >>> format_expr(simplify((var("q_idx") >= var("kv_idx")) & const(True)))
    'q_idx >= kv_idx'
"""
from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import replace
from typing import Callable

import sympy

from .discrete import discrete_cone
from .evaluator import eval_const
from .nodes import BOOL, F32, I32, DType, Node, binary, const, rebuild, unary, walk, where
from .program import VariantIR, identity_expr

__all__ = ["clear_cache", "simplify", "simplify_variant"]

_ISLAND_OPS = frozenset({"add", "sub", "mul", "neg", "div"})
# Islands are cut into chunks: an island child whose own island (counted as a tree) has
# _CHUNK ops or more is treated as opaque and simplified on its own, so long chains
# (sum of 1000 terms, x = tanh(x) + x / 2 repeated) cost linear time, not quadratic.
_CHUNK = 16
# sympy is skipped for islands larger than this (time), and expand/factor_terms run only on
# islands up to _REWRITE_LIMIT ops whose expansion stays under _EXPAND_TERMS terms.
_SYMPY_LIMIT = 48
_REWRITE_LIMIT = 32
_EXPAND_TERMS = 64
_F32_MAX = 3.4028234663852886e38
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1

# node -> weakref(simplified node). Keys are weak so the cache never keeps IR alive; values are
# weak because a value that refers back to its key would otherwise pin the entry forever.
_CACHE: "weakref.WeakKeyDictionary[Node, weakref.ref[Node]]" = weakref.WeakKeyDictionary()
# The same for nodes simplified as discrete-cone nodes (strict rules: see `_local_strict`).
_STRICT: "weakref.WeakKeyDictionary[Node, weakref.ref[Node]]" = weakref.WeakKeyDictionary()
_DIGEST: "weakref.WeakKeyDictionary[Node, str]" = weakref.WeakKeyDictionary()
_CHUNK_SIZE: "weakref.WeakKeyDictionary[Node, int]" = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- public API


def simplify(expr: Node) -> Node:
    """Fold constants, apply boolean/select rules, and canonicalise arithmetic with sympy.

    The result has the same dtype as `expr`. Integer arithmetic is preserved exactly (floor-div
    and modulo are opaque); float arithmetic up to rounding. NaN/inf constants are never
    cancelled away. Results are memoised per node.

    Example:
        >>> from attncc.ir.nodes import var, const, binary, unary
        >>> from attncc.ir.printer import format_expr
        >>> format_expr(simplify(binary("div", var("score"), const(30.0)) * 30))
        'score'
        >>> format_expr(simplify(unary("tanh", const(0.0)) + var("score")))
        'score'
        >>> format_expr(simplify(binary("mod", var("q_idx") + 0, const(8))))
        'q_idx % 8'
    """
    if not isinstance(expr, Node):
        raise TypeError(f"simplify takes an IR Node, got {type(expr).__name__}")
    memo: dict[Node, Node] = {}
    cone = discrete_cone(expr)
    for n in _schedule(expr, memo, cone):
        strict = n in cone
        out = _simplify_one(n, memo, strict)
        memo[n] = out
        cache = _STRICT if strict else _CACHE
        cache[n] = weakref.ref(out)
        if out not in cache:  # a result is its own simplification: re-simplifying is free
            cache[out] = weakref.ref(out)
    return memo[expr]


def simplify_variant(ir: VariantIR) -> VariantIR:
    """Simplify every hook; drop hooks that became their identity and captures nobody reads.

    An identity score_mod (`score`), an all-true mask_mod and a transform that returns `q[d]`
    produce no code, so they are removed from `ir.hooks`.

    Example:
        >>> from attncc.ir.nodes import var, const
        >>> from attncc.ir.program import Hook, VariantIR
        >>> ir = VariantIR(hooks={"score_mod": Hook("score_mod", var("score") * 1 + 0),
        ...                       "mask_mod": Hook("mask_mod", var("q_idx") >= var("kv_idx"))})
        >>> sorted(simplify_variant(ir).hooks)
        ['mask_mod']
    """
    hooks = {}
    for name, hook in ir.hooks.items():
        e = simplify(hook.expr)
        if e is identity_expr(name):
            continue
        hooks[name] = hook if e is hook.expr else replace(hook, expr=e)
    used: set[tuple[str, str]] = set()
    for h in hooks.values():
        for n in walk(h.expr):
            if n.op in ("param", "load"):
                used.add((n.op, n.attr))
    scalars = tuple(p for p in ir.scalars if ("param", p.name) in used)
    tensors = tuple(t for t in ir.tensors if ("load", t.name) in used)
    return replace(ir, hooks=hooks, scalars=scalars, tensors=tensors)


def clear_cache() -> None:
    """Forget memoised results (for benchmarks and tests of the uncached path).

    Example:
        >>> clear_cache()
    """
    _CACHE.clear()
    _STRICT.clear()


# ----------------------------------------------------------------------------- driver


def _cached(n: Node, strict: bool) -> Node | None:
    ref = (_STRICT if strict else _CACHE).get(n)
    return ref() if ref is not None else None


def _island_op(n: Node, dtype: DType) -> bool:
    return n.op in _ISLAND_OPS and n.dtype is dtype


def _chunk_size(root: Node) -> int:
    """Ops in the island tree below `root`, not counting children cut off as chunks (cached)."""
    hit = _CHUNK_SIZE.get(root)
    if hit is not None:
        return hit
    dt = root.dtype
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        n, done = stack.pop()
        if n in _CHUNK_SIZE:
            continue
        if not done:
            stack.append((n, True))
            stack.extend((a, False) for a in n.args if _island_op(a, dt) and a not in _CHUNK_SIZE)
            continue
        size = 1
        for a in n.args:
            if _island_op(a, dt):
                k = _CHUNK_SIZE[a]
                size += k if k < _CHUNK else 0
        _CHUNK_SIZE[n] = size
    return _CHUNK_SIZE[root]


def _island(root: Node) -> tuple[list[Node], list[Node]]:
    """(island nodes in post-order, opaque leaves) of the island rooted at `root`."""
    dt = root.dtype
    inner: list[Node] = []
    leaves: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        n, done = stack.pop()
        if done:
            inner.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        if _island_op(n, dt) and (n is root or _chunk_size(n) < _CHUNK):
            stack.append((n, True))
            stack.extend((a, False) for a in reversed(n.args))
        else:
            leaves.append(n)
    return inner, leaves


def _deps(n: Node, strict: bool) -> list[Node]:
    """What must be simplified before `n`: an island's opaque leaves, else the arguments."""
    if _island_op(n, n.dtype) and not strict:
        return _island(n)[1]
    return list(n.args)


def _schedule(root: Node, memo: dict[Node, Node], cone: frozenset[Node]) -> list[Node]:
    """Nodes to simplify, dependencies first (iterative: user expressions can be deep).

    Nodes already in the cache go straight into `memo` (a strong reference for this call).
    """
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        hit = _cached(n, n in cone)
        if hit is not None:
            memo[n] = hit
            continue
        stack.append((n, True))
        stack.extend((d, False) for d in reversed(_deps(n, n in cone)) if d not in seen)
    return order


def _cast_i32(v: float) -> int:
    """float -> int32 as the device's cvt.rzi does (and the evaluator's to_i32)."""
    if math.isnan(v):
        return 0
    if math.isinf(v):
        return _I32_MAX if v > 0 else _I32_MIN
    return max(_I32_MIN, min(_I32_MAX, math.trunc(v)))


def _rebuild(n: Node, args: tuple[Node, ...]) -> Node:
    """`rebuild`, except that a float constant cast to int folds as the device casts it
    (the builders' cast rejects constants outside int32)."""
    if n.op == "to_i32" and args[0].op == "const" and args[0].dtype is F32:
        return const(_cast_i32(args[0].attr), I32)
    return rebuild(n, args)


def _simplify_one(n: Node, memo: dict[Node, Node], strict: bool) -> Node:
    if not n.args:
        return n
    if strict:  # a discrete-cone node: the user's order, exact rules only
        return _local_strict(_rebuild(n, tuple(memo[a] for a in n.args)))
    if not _island_op(n, n.dtype):
        done = tuple(memo[a] for a in n.args)
        pre = _local(_rebuild(n, done))
    else:
        # An island: rebuild it over simplified leaves with the local rules.
        inner, leaves = _island(n)
        done = tuple(memo[leaf] for leaf in leaves)
        new: dict[Node, Node] = dict(zip(leaves, done))
        for m in inner:
            new[m] = _local(rebuild(m, tuple(new[a] for a in m.args)))
        pre = new[n]
    # Then sympy, also when a rule made an island of a non-island node (x // -1 -> -x), unless
    # the rule just returned a simplified input (where(True, a + b, c) -> a + b).
    if _island_op(pre, n.dtype) and pre not in done and len(_island(pre)[0]) >= 2:
        return _sympy_island(pre)
    return pre


# ----------------------------------------------------------------------------- local rules


def _is_num(n: Node, value: float) -> bool:
    return n.op == "const" and n.dtype is not BOOL and n.attr == value


def _is_bool(n: Node, value: bool) -> bool:
    return n.op == "const" and n.dtype is BOOL and n.attr is value


def _has_special(n: Node) -> bool:
    """Whether a NaN/inf constant occurs in `n` (then x - x and x * 0 are not 0)."""
    return any(m.op == "const" and m.dtype is F32 and not math.isfinite(m.attr) for m in walk(n))


def _zero(dtype: DType) -> Node:
    return const(0.0 if dtype is F32 else 0, dtype)


def _fold(n: Node) -> Node | None:
    """Evaluate a node whose arguments are all constants, or None if that must not happen."""
    try:
        v = eval_const(n)
    except Exception:  # e.g. integer division by zero: leave it for the user to see
        return None
    if n.dtype is I32 and _overflows(n):
        return None  # keep the computation (it wraps, here as on the device): visibly
    return const(v, n.dtype)


_EXACT_INT = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
              "neg": lambda a: -a, "abs": abs, "floordiv": lambda a, b: a // b}


def _overflows(n: Node) -> bool:
    """Whether an integer op on constants leaves the int32 range (in exact arithmetic)."""
    f = _EXACT_INT.get(n.op)
    if f is None or any(a.dtype is not I32 for a in n.args):
        return False
    try:
        v = f(*(a.attr for a in n.args))
    except ZeroDivisionError:
        return False
    return not _I32_MIN <= v <= _I32_MAX


_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}


def _r_add(n: Node) -> Node:
    a, b = n.args
    if _is_num(b, 0):
        return a
    if _is_num(a, 0):
        return b
    if a.op == "const":  # canonical order, as sympy prints: x + 1
        return _local(binary("add", b, a))
    if b.op == "neg":
        return _local(binary("sub", a, b.args[0]))
    if a.op == "neg":
        return _local(binary("sub", b, a.args[0]))
    return n


def _r_sub(n: Node) -> Node:
    a, b = n.args
    if _is_num(b, 0):
        return a
    if a is b and not _has_special(a):
        return _zero(n.dtype)
    if _is_num(a, 0):
        return _local(unary("neg", b))
    if b.op == "neg":
        return _local(binary("add", a, b.args[0]))
    return n


def _r_mul(n: Node) -> Node:
    a, b = n.args
    for x, y in ((a, b), (b, a)):
        if _is_num(x, 1):
            return y
        if _is_num(x, 0) and not _has_special(y):
            return _zero(n.dtype)
        if _is_num(x, -1):
            return _local(unary("neg", y))
    if b.op == "const" and a.op != "const":  # canonical order, as sympy prints: 2 * x
        return binary("mul", b, a)
    return n


def _r_div(n: Node) -> Node:
    a, b = n.args
    if _is_num(b, 1):
        return a
    if _is_num(b, -1):
        return _local(unary("neg", a))
    return n


def _r_neg(n: Node) -> Node:
    return n.args[0].args[0] if n.args[0].op == "neg" else n


def _r_abs(n: Node) -> Node:
    x = n.args[0]
    if x.op == "abs":
        return x
    if x.op == "neg":
        return _local(unary("abs", x.args[0]))
    return n


def _r_floor(n: Node) -> Node:
    """Rounding an integer-valued float changes nothing (bit for bit: -0.0, inf, NaN too)."""
    return n.args[0] if n.args[0].op in ("floor", "ceil", "trunc", "round") else n


def _r_bitnot(n: Node) -> Node:
    return n.args[0].args[0] if n.args[0].op == "bitnot" else n


_BIT_IDENTITY = {"bitand": -1, "bitor": 0, "bitxor": 0}


def _r_bitwise(n: Node) -> Node:
    """x & -1, x | 0, x ^ 0, x << 0, x >> 0 are x; x & x and x | x too (exact for int32)."""
    a, b = n.args
    unit = _BIT_IDENTITY.get(n.op, 0)
    if _is_num(b, unit):
        return a
    if n.op in _BIT_IDENTITY and _is_num(a, unit):
        return b
    if n.op in ("bitand", "bitor") and a is b:
        return a
    return n


def _r_pow(n: Node) -> Node:
    return n.args[0] if _is_num(n.args[1], 1) else n


def _r_floordiv(n: Node) -> Node:
    a, b = n.args
    if n.dtype is I32:  # exact for integers only (floats: floor(x / 1) is not x for non-integers)
        if _is_num(b, 1):
            return a
        if _is_num(b, -1):
            return _local(unary("neg", a))
    return n


def _r_mod(n: Node) -> Node:
    if n.dtype is I32 and (_is_num(n.args[1], 1) or _is_num(n.args[1], -1)):
        return _zero(I32)
    return n


def _r_minmax(n: Node) -> Node:
    return n.args[0] if n.args[0] is n.args[1] else n


def _r_compare(n: Node) -> Node:
    a, b = n.args
    if a is not b:
        return n
    exact = a.dtype is not F32  # float x == x is False for NaN
    if n.op in ("lt", "gt"):
        return const(False)  # false for NaN too
    if n.op in ("le", "ge", "eq"):
        return const(True) if exact else n
    return const(False) if exact else n  # ne


def _r_not(n: Node) -> Node:
    x = n.args[0]
    if x.op == "not":
        return x.args[0]
    if x.op in _NEGATED and (x.op in ("eq", "ne") or x.args[0].dtype is not F32):
        # ~(a < b) is a >= b only without NaN, so float orderings keep their `~`
        return _local(binary(_NEGATED[x.op], x.args[0], x.args[1]))
    return n


def _complement(a: Node, b: Node) -> bool:
    """Whether b is exactly ~a (also as a flipped comparison, e.g. q < k against q >= k)."""
    if (a.op == "not" and a.args[0] is b) or (b.op == "not" and b.args[0] is a):
        return True
    return (_NEGATED.get(a.op) == b.op and a.args == b.args
            and (a.op in ("eq", "ne") or a.args[0].dtype is not F32))


def _r_and(n: Node) -> Node:
    a, b = n.args
    for x, y in ((a, b), (b, a)):
        if _is_bool(x, True):
            return y
        if _is_bool(x, False):
            return x
    if a is b:
        return a
    if _complement(a, b):
        return const(False)
    return n


def _r_or(n: Node) -> Node:
    a, b = n.args
    for x, y in ((a, b), (b, a)):
        if _is_bool(x, False):
            return y
        if _is_bool(x, True):
            return x
    if a is b:
        return a
    if _complement(a, b):
        return const(True)
    return n


def _r_where(n: Node) -> Node:
    c, a, b = n.args
    if c.op == "const":
        return a if c.attr else b
    if a is b:
        return a
    if c.op == "not":
        return _local(where(c.args[0], b, a))
    if a.op == "where" and a.args[0] is c:  # where(c, where(c, x, y), z) = where(c, x, z)
        return _local(where(c, a.args[1], b))
    if b.op == "where" and b.args[0] is c:
        return _local(where(c, a, b.args[2]))
    if n.dtype is BOOL:
        nc = lambda: _local(unary("not", c))  # noqa: E731
        if a.op == "const" and b.op == "const":
            return c if a.attr else nc()  # branches differ, so this is c or ~c
        if _is_bool(a, True):
            return _local(binary("or", c, b))
        if _is_bool(b, False):
            return _local(binary("and", c, a))
        if _is_bool(a, False):
            return _local(binary("and", nc(), b))
        if _is_bool(b, True):
            return _local(binary("or", nc(), a))
    return n


_RULES: dict[str, Callable[[Node], Node]] = {
    "add": _r_add, "sub": _r_sub, "mul": _r_mul, "div": _r_div, "neg": _r_neg, "abs": _r_abs,
    "floor": _r_floor, "pow": _r_pow, "floordiv": _r_floordiv, "mod": _r_mod,
    "min": _r_minmax, "max": _r_minmax, "not": _r_not, "and": _r_and, "or": _r_or,
    "where": _r_where, **{op: _r_compare for op in _NEGATED},
    **{op: _r_floor for op in ("ceil", "trunc", "round")}, "bitnot": _r_bitnot,
    **{op: _r_bitwise for op in ("bitand", "bitor", "bitxor", "lshift", "rshift")},
}


def _local(n: Node) -> Node:
    """Peephole rules on one node whose arguments are already simplified."""
    if not n.args:
        return n
    if n.op not in ("load", "vec") and all(a.op == "const" for a in n.args):
        folded = _fold(n)
        return n if folded is None else folded
    rule = _RULES.get(n.op)
    return rule(n) if rule is not None else n


def _is_zero(n: Node, negative: bool) -> bool:
    return (n.op == "const" and n.dtype is F32 and n.attr == 0
            and (math.copysign(1.0, n.attr) < 0) == negative)


def _s_add(n: Node) -> Node:
    a, b = n.args
    if _is_zero(b, True):  # x + -0.0 is x (x + 0.0 is not: -0.0 + 0.0 = 0.0)
        return a
    if _is_zero(a, True):
        return b
    if a.op == "const":  # IEEE addition commutes
        return _local_strict(binary("add", b, a))
    if b.op == "neg":  # a + -b is a - b by definition
        return _local_strict(binary("sub", a, b.args[0]))
    if a.op == "neg":
        return _local_strict(binary("sub", b, a.args[0]))
    return n


def _s_sub(n: Node) -> Node:
    a, b = n.args
    if _is_zero(b, False):
        return a
    if b.op == "neg":
        return _local_strict(binary("add", a, b.args[0]))
    return n


def _s_mul(n: Node) -> Node:
    a, b = n.args
    for x, y in ((a, b), (b, a)):
        if _is_num(x, 1):
            return y
        if _is_num(x, -1):
            return _local_strict(unary("neg", y))
    if b.op == "const" and a.op != "const":  # IEEE multiplication commutes
        return binary("mul", b, a)
    return n


# Rules that hold bit for bit in IEEE float32, including NaN, infinities and signed zeros. The
# div and abs rules are the general ones: x / 1, x / -1 = -x, |-x| and ||x|| are exact, and
# what they build (neg, abs) goes through rules both tables share.
_STRICT_RULES: dict[str, Callable[[Node], Node]] = {
    "add": _s_add, "sub": _s_sub, "mul": _s_mul, "div": _r_div, "neg": _r_neg, "abs": _r_abs,
    "floor": _r_floor, "pow": _r_pow, "min": _r_minmax, "max": _r_minmax,
    **{op: _r_floor for op in ("ceil", "trunc", "round")},
}


def _local_strict(n: Node) -> Node:
    """`_local` for a discrete-cone F32 node: float32 constant folding and exact rules only."""
    if n.dtype is not F32:
        return _local(n)
    if n.args and n.op not in ("load", "vec") and all(a.op == "const" for a in n.args):
        folded = _fold(n)  # evaluated in float32, as torch would
        return n if folded is None else folded
    rule = _STRICT_RULES.get(n.op)
    return rule(n) if rule is not None else n


# ----------------------------------------------------------------------------- sympy islands


class _NoConvert(Exception):
    """A sympy result that cannot (or must not) become IR again: keep the original island."""


def _digest(root: Node) -> str:
    """A structural name for an opaque node: stable across runs, so sympy's term order is too."""
    hit = _DIGEST.get(root)
    if hit is not None:
        return hit
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # post-order over the nodes not digested yet (each is digested once, ever)
        n, done = stack.pop()
        if n in _DIGEST:
            continue
        if not done:
            stack.append((n, True))
            stack.extend((a, False) for a in n.args if a not in _DIGEST)
            continue
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{n.op}|{n.dtype.value}|{n.attr!r}|".encode())
        for a in n.args:
            h.update(_DIGEST[a].encode())
        _DIGEST[n] = h.hexdigest()
    return _DIGEST[root]


def _symbol(n: Node) -> tuple[sympy.Symbol, bool]:
    """The sympy symbol standing for an opaque node, and whether it is a NaN/inf constant."""
    assume = {"integer": True} if n.dtype is I32 else {"real": True}
    if n.op == "var":
        return sympy.Symbol(n.attr, **assume), False
    if n.op == "param":
        return sympy.Symbol("p:" + n.attr, **assume), False
    if n.op == "const":  # only non-finite floats get here
        return sympy.Symbol("c:" + repr(n.attr), **assume), True
    return sympy.Symbol("z:" + _digest(n), **assume), False


def _to_sympy(root: Node, inner: list[Node], leaves: list[Node]
              ) -> tuple[sympy.Expr, dict[sympy.Symbol, Node], set[sympy.Symbol]]:
    syms: dict[sympy.Symbol, Node] = {}
    special: set[sympy.Symbol] = set()
    val: dict[Node, sympy.Expr] = {}
    for leaf in leaves:
        if leaf.op == "const" and (leaf.dtype is I32 or math.isfinite(leaf.attr)):
            v = leaf.attr
            val[leaf] = sympy.Integer(int(v)) if leaf.dtype is I32 or float(v).is_integer() \
                else sympy.Float(v)
            continue
        s, is_special = _symbol(leaf)
        syms[s] = leaf
        if is_special:
            special.add(s)
        val[leaf] = s
    for m in inner:
        a = [val[x] for x in m.args]
        if m.op == "add":
            val[m] = a[0] + a[1]
        elif m.op == "sub":
            val[m] = a[0] - a[1]
        elif m.op == "mul":
            val[m] = a[0] * a[1]
        elif m.op == "neg":
            val[m] = -a[0]
        else:  # div (f32 islands only)
            val[m] = a[0] / a[1]
    return val[root], syms, special


def _expanded_terms(e: sympy.Expr) -> int:
    """An upper bound on the number of terms `sympy.expand(e)` produces."""
    if e.is_Add:
        return sum(_expanded_terms(a) for a in e.args)
    if e.is_Mul:
        out = 1
        for a in e.args:
            out *= _expanded_terms(a)
        return out
    if e.is_Pow and e.exp.is_Integer and e.exp > 0:
        return _expanded_terms(e.base) ** int(e.exp)
    return 1


def _has_common_factor(e: sympy.Expr) -> bool:
    """Whether the terms of a sum share a symbol or a rational content, i.e. whether
    `factor_terms` (slow: a third of all simplify time when called blindly) can save a multiply."""
    if not e.is_Add:
        return False
    common: set[sympy.Expr] | None = None
    nums: list[sympy.Rational] = []
    for t in e.args:
        k, rest = t.as_coeff_Mul()
        bases = {f.base if f.is_Pow else f for f in sympy.Mul.make_args(rest)} - {sympy.S.One}
        common = bases if common is None else common & bases
        nums.append(k)
    if common:
        return True
    if not all(k.is_Rational for k in nums):
        return False
    p = math.gcd(*(int(k.p) for k in nums))
    q = math.gcd(*(int(k.q) for k in nums))
    return p > 1 or q > 1


class _Back:
    """Converts a sympy expression over the island's symbols back into IR of one dtype."""

    def __init__(self, dtype: DType, syms: dict[sympy.Symbol, Node]) -> None:
        self.dt = dtype
        self.syms = syms

    def num(self, v: sympy.Expr) -> Node:
        if self.dt is I32:
            if not v.is_Integer or not _I32_MIN <= int(v) <= _I32_MAX:
                raise _NoConvert(v)
            return const(int(v), I32)
        try:
            f = float(v)
        except (TypeError, OverflowError) as e:
            raise _NoConvert(v) from e
        if not math.isfinite(f) or abs(f) > _F32_MAX:
            raise _NoConvert(v)
        return const(f, F32)

    def __call__(self, e: sympy.Expr) -> Node:
        if e.is_Symbol:
            if e not in self.syms:
                raise _NoConvert(e)
            return self.syms[e]
        if e.is_Number:
            return self.num(e)
        if e.is_Add:
            return self.add(e)
        if e.is_Mul:
            return self.mul(e)
        if e.is_Pow:
            node, den = self.pow(e)
            return binary("div", const(1.0), node) if den else node
        raise _NoConvert(e)

    def add(self, e: sympy.Expr) -> Node:
        c, rest = e.as_coeff_Add()
        pos: list[Node] = []
        neg: list[Node] = []
        for t in sympy.Add.make_args(rest):
            k, _ = t.as_coeff_Mul()
            if k.is_negative:
                neg.append(self(-t))
            else:
                pos.append(self(t))
        if c.is_positive:
            pos.append(self.num(c))
        elif c.is_negative:
            neg.append(self.num(-c))
        if pos:
            out = pos[0]
            for p in pos[1:]:
                out = binary("add", out, p)
        else:
            out = unary("neg", neg.pop(0))
        for m in neg:
            out = binary("sub", out, m)
        return out

    def pow(self, e: sympy.Expr) -> tuple[Node, bool]:
        """`base ** |n|` by repeated squaring (shared nodes), and whether n was negative."""
        if not e.exp.is_Integer or e.exp == 0:
            raise _NoConvert(e)
        n = int(e.exp)
        if n < 0 and self.dt is I32:
            raise _NoConvert(e)
        base, k, out = self(e.base), abs(n), None
        while True:
            if k & 1:
                out = base if out is None else binary("mul", out, base)
            k >>= 1
            if not k:
                break
            base = binary("mul", base, base)
        return out, n < 0  # type: ignore[return-value]

    def mul(self, e: sympy.Expr) -> Node:
        coef, rest = e.as_coeff_Mul()
        num: list[Node] = []
        den: list[Node] = []
        for f in sympy.Mul.make_args(rest):
            if f.is_Pow:
                node, inverse = self.pow(f)
                (den if inverse else num).append(node)
            else:
                num.append(self(f))
        out: Node | None = None
        for x in num:
            out = x if out is None else binary("mul", out, x)
        if den:
            d = den[0]
            for x in den[1:]:
                d = binary("mul", d, x)
            out = binary("div", out if out is not None else const(1.0), d)
        if out is None:
            return self.num(coef)
        if coef == 1:
            return out
        if coef == -1:
            return unary("neg", out)
        if self.dt is F32 and coef.is_Rational and not coef.is_Integer and abs(coef.p) == 1:
            # x/30 stays a division by 30: more accurate than a multiply by a rounded 1/30
            out = binary("div", out, const(float(coef.q)))
            return out if coef.p == 1 else unary("neg", out)
        return binary("mul", self.num(coef), out)


def _island_cost(n: Node) -> int:
    return len(_island(n)[0]) if _island_op(n, n.dtype) else 0


_BAD = (sympy.nan, sympy.zoo, sympy.oo, -sympy.oo)


def _sympy_island(pre: Node) -> Node:
    """Canonicalise one arithmetic island with sympy; keep `pre` unless a form is as cheap.

    Candidates are sympy's automatic form, its expansion and the expansion with common factors
    pulled out. The fewest ops wins; ties go to the expanded/factored forms, which depend only
    on the polynomial (so equal islands written differently meet), then to the input as written.
    """
    inner, leaves = _island(pre)
    if len(inner) > _SYMPY_LIMIT:
        return pre
    try:
        expr, syms, special = _to_sympy(pre, inner, leaves)
        if special:
            # algebra with inf/NaN is unsound ((x - inf) * 2 + inf is NaN, not -inf): leave it
            return pre
        forms = [(expr, 3)]  # (form, tie rank): lower wins among equal costs; `pre` is 2
        if len(inner) <= _REWRITE_LIMIT and _expanded_terms(expr) <= _EXPAND_TERMS:
            expanded = sympy.expand(expr, power_base=False, power_exp=False, log=False)
            forms.append((expanded, 0))
            if _has_common_factor(expanded):
                forms.append((sympy.factor_terms(expanded), 1))
        back = _Back(pre.dtype, syms)
        best, best_key = pre, (len(inner), 2)
        for form, rank in forms:
            if form.has(*_BAD):
                continue  # sympy invented an infinity (x / 0 is zoo * x)
            try:
                node = _simplify_new(back(form))
            except _NoConvert:
                continue
            key = (_island_cost(node), rank)
            if key < best_key:
                best, best_key = node, key
        return best
    except (RecursionError, TypeError, ValueError, ZeroDivisionError, AttributeError):
        return pre


def _simplify_new(n: Node) -> Node:
    """Local rules over a freshly converted island (its leaves are already simplified)."""
    inner, leaves = _island(n)
    new: dict[Node, Node] = {leaf: leaf for leaf in leaves}
    for m in inner:
        new[m] = _local(rebuild(m, tuple(new[a] for a in m.args)))
    return new[n]
