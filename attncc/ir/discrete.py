"""Where float arithmetic becomes a discrete value: the *discrete cone* of an expression.

A mod's float arithmetic normally only shapes the score, where a rounding difference of one ulp
is invisible. But when a float reaches a *discrete sink* -- an int cast (`to_i32`), `floor`, a
float `//` or `%`, a comparison (and so a `where` condition or a mask) -- one ulp can move the
value across an integer or a threshold, and the result differs by a whole bucket. So every
F32 node whose value can reach a sink must be computed exactly as the user's Python computes it
on float32 tensors (torch's FlexAttention semantics; docs/semantics.md):

- the simplifier leaves it in the user's order (no reassociation, float32 constant folding),
- the CPU evaluator computes it in float32 even for the float64 reference,
- the generated CUDA spells it with round-to-nearest intrinsics (no FMA contraction) and the
  accurate libm functions, even when the score itself uses fast approximations.

A *Python scalar* is a value computed from captured scalars (params) and constants only: in the
user's code that is Python arithmetic on doubles, rounded to float32 where it meets a tensor.

Example:
    >>> from attncc.ir.nodes import var, const, cast, binary, F32, I32
    >>> d = binary("div", cast(var("q_idx"), F32), const(3.0))
    >>> e = var("score") + cast(cast(d, I32), F32)
    >>> d in discrete_cone(e), var("score") in discrete_cone(e)
    (True, False)
"""
from __future__ import annotations

import weakref

from .nodes import F32, Node, walk

__all__ = ["discrete_cone", "is_closed", "is_python_scalar", "is_sink"]

# F32 results that are integers by construction, or whose value jumps with the inputs' exact
# bits (fmod, sign, copysign, nextafter): their inputs decide a discrete value.
_ROUNDING_OPS = frozenset({"floor", "ceil", "trunc", "round", "sign", "floordiv", "mod", "fmod",
                           "copysign", "nextafter"})

_CONE: "weakref.WeakKeyDictionary[Node, frozenset[Node]]" = weakref.WeakKeyDictionary()
_CLOSED: "weakref.WeakKeyDictionary[Node, bool]" = weakref.WeakKeyDictionary()


def is_sink(n: Node) -> bool:
    """Whether `n` turns float operands into a discrete value (cast, compare, rounding).

    Example:
        >>> from attncc.ir.nodes import var, const
        >>> is_sink(var("score") > const(0.0)), is_sink(var("score") * 2.0)
        (True, False)
    """
    if n.op in _ROUNDING_OPS and n.dtype is F32:
        return True
    return n.dtype is not F32 and any(a.dtype is F32 for a in n.args)


def discrete_cone(root: Node) -> frozenset[Node]:
    """The F32 nodes under `root` whose value reaches a discrete sink (through F32 nodes).

    Cached per root (nodes are interned and immutable, so the answer never changes).
    """
    hit = _CONE.get(root)
    if hit is not None:
        return hit
    order = list(walk(root))
    cone: set[Node] = set()
    for n in reversed(order):  # parents before children
        if is_sink(n) or n in cone:
            cone.update(a for a in n.args if a.dtype is F32)
    out = frozenset(cone)
    _CONE[root] = out
    return out


def is_closed(n: Node) -> bool:
    """Whether `n` reads no index variable, score, captured tensor or head vector.

    Example:
        >>> from attncc.ir.nodes import param, const, var, F32
        >>> is_closed(param("cap", F32) * 2.0), is_closed(var("score") * 2.0)
        (True, False)
    """
    hit = _CLOSED.get(n)
    if hit is not None:
        return hit
    for m in walk(n):
        if m not in _CLOSED:
            _CLOSED[m] = m.op not in ("var", "load", "vec") and all(_CLOSED[a] for a in m.args)
    return _CLOSED[n]


def is_python_scalar(n: Node) -> bool:
    """Whether `n` is Python arithmetic on captured scalars: closed, and reads a param.

    (Closed expressions of constants only do not come from Python code -- Python folds them
    before tracing -- and the simplifier folds them in float32.)

    Example:
        >>> from attncc.ir.nodes import param, const, F32
        >>> is_python_scalar(param("cap", F32) * 2.0), is_python_scalar(const(2.0) * 2.0)
        (True, False)
    """
    return is_closed(n) and any(m.op == "param" for m in walk(n))
