"""Symbolic derivatives of a score_mod: w.r.t. the score and w.r.t. each captured-tensor read.

The backward kernels need, at every kept (query, key) pair, `d score_mod / d score` (the
`LogitsGrad` hook) and, for every read `t[idx...]` of a captured float tensor that requires
grad, `d score_mod / d t[idx...]` (the `CapturedGrad` hook scatters `dlogit` times it into
`t.grad[idx...]`). Both come from forward-mode differentiation of the IR: one rule per op in
`_RULES`, then `attncc.ir.simplify`. docs/backward.md, section 1, has the derivation.

Conventions are torch's autograd (the mod means what its Python means):

- discrete values (ints, bools, comparisons, `floor`, float `//`, casts) are piecewise constant:
  derivative 0; `where(c, a, b)` differentiates branch-wise;
- `abs` at 0 has derivative 0; `x % y` has `d/dx = 1`, `d/dy = -(x // y)`; `x ** y` follows
  torch's `pow` backward (0 where the exponent is 0, and for `d/dy` where `x == 0 and y >= 0`);
- `max(a, b)` / `min(a, b)` at a tie: when the bound `b` depends on nothing differentiated (a
  constant, a scalar, an index expression, a tensor not requiring grad: `torch.clamp(a, ...)`
  lowers to exactly this) `a` takes the whole gradient, as `torch.clamp` does; otherwise each
  side takes half, as `torch.maximum` / `torch.minimum` do. The CPU evaluator's autograd makes
  the same choice (`attncc.ir.evaluator`).

Reads are IR nodes, and IR nodes are interned: two reads of one tensor at the same index
expression are one read; reads at different index expressions each contribute.

Example:
    >>> from attncc.ir.nodes import var, const, unary, binary
    >>> from attncc.ir.printer import format_expr
    >>> s = var("score")
    >>> format_expr(derivative(unary("tanh", s), s))
    '1.0 - tanh(score) * tanh(score)'
    >>> format_expr(derivative(binary("max", s, const(0.0)), s))  # torch.clamp(score, min=0)
    'where(score < 0.0, 0.0, 1.0)'
    >>> format_expr(derivative(unary("floor", s), s))
    '0.0'
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ..errors import DifferentiationError
from .nodes import F32, Node, binary, const, unary, var, walk, where
from .program import VariantIR
from .simplify import simplify

__all__ = ["DifferentiationError", "CapturedRead", "ScoreModGrad", "derivative",
           "score_mod_grad", "check_grad_tensors"]

D = Optional[Node]  # a derivative; None means structurally zero
_LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- helpers


def _f(x: float) -> Node:
    return const(float(x))


def _mul(a: D, b: Node) -> D:
    return None if a is None else binary("mul", a, b)


def _add(a: D, b: D) -> D:
    if a is None:
        return b
    return a if b is None else binary("add", a, b)


def _or0(a: D) -> Node:
    return _f(0.0) if a is None else a


# ----------------------------------------------------------------------------- rules
# Each rule: (node, its args, the args' derivatives) -> the node's derivative (None = 0).
Rule = Callable[[Node, tuple[Node, ...], tuple[D, ...]], D]


def _zero(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    return None


def _chain(fn: Callable[[Node, Node], Node]) -> Rule:
    """A unary rule `d f(x) = f'(x) dx`; `fn(x, f(x))` builds f'(x)."""
    def rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
        return None if d[0] is None else binary("mul", d[0], fn(a[0], n))
    return rule


def _neg(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    return None if d[0] is None else unary("neg", d[0])


def _abs(x: Node, r: Node) -> Node:  # torch: grad * sgn(x), sgn(0) = 0
    return where(binary("gt", x, _f(0.0)), _f(1.0),
                 where(binary("lt", x, _f(0.0)), _f(-1.0), _f(0.0)))


def _add_rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    return _add(d[0], d[1])


def _sub_rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    return _add(d[0], None if d[1] is None else unary("neg", d[1]))


def _mul_rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    return _add(_mul(d[0], a[1]), _mul(d[1], a[0]))


def _div_rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    x, y = a
    db = None if d[1] is None else unary("neg", binary("div", binary("mul", d[1], x),
                                                       binary("mul", y, y)))
    return _add(None if d[0] is None else binary("div", d[0], y), db)


def _pow_rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    x, y = a
    zero = _f(0.0)
    dx = None if d[0] is None else binary("mul", d[0], where(
        binary("eq", y, zero), zero, binary("mul", y, binary("pow", x, binary("sub", y, _f(1.0))))))
    dy = None if d[1] is None else binary("mul", d[1], where(
        binary("and", binary("eq", x, zero), binary("ge", y, zero)), zero,
        binary("mul", n, unary("log", x))))
    return _add(dx, dy)


def _mod_rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    if n.dtype is not F32:
        return None
    dy = None if d[1] is None else binary("mul", d[1], unary("neg", binary("floordiv", *a)))
    return _add(d[0], dy)


def _minmax(n: Node, a: tuple[Node, ...], d: tuple[D, ...], clamp: bool) -> D:
    """max/min; `clamp`: the second operand depends on nothing differentiated."""
    if n.dtype is not F32 or (d[0] is None and d[1] is None):
        return None
    x, y = a
    win = "gt" if n.op == "max" else "lt"
    lose = "lt" if n.op == "max" else "gt"
    if clamp:  # torch.clamp(x, bound): x takes ties whole
        return where(binary(lose, x, y), _f(0.0), d[0])
    # torch.maximum/minimum: half each at a tie; a NaN operand passes the gradient to both
    tie = binary("eq", x, y)
    wx = where(tie, _f(0.5), where(binary(lose, x, y), _f(0.0), _f(1.0)))
    wy = where(tie, _f(0.5), where(binary(win, x, y), _f(0.0), _f(1.0)))
    return _add(_mul(d[0], wx), _mul(d[1], wy))


def _where_rule(n: Node, a: tuple[Node, ...], d: tuple[D, ...]) -> D:
    if n.dtype is not F32 or (d[1] is None and d[2] is None):
        return None
    return where(a[0], _or0(d[1]), _or0(d[2]))


_RULES: dict[str, Rule] = {
    **{op: _zero for op in ("var", "const", "param", "load", "vec", "floor", "floordiv",
                            "to_f32", "to_i32", "not", "lt", "le", "gt", "ge", "eq", "ne",
                            "and", "or")},
    "neg": _neg,
    "abs": _chain(_abs),
    "exp": _chain(lambda x, r: r),
    "exp2": _chain(lambda x, r: binary("mul", r, _f(_LN2))),
    "log": _chain(lambda x, r: binary("div", _f(1.0), x)),
    "log2": _chain(lambda x, r: binary("div", _f(1.0), binary("mul", x, _f(_LN2)))),
    "tanh": _chain(lambda x, r: binary("sub", _f(1.0), binary("mul", r, r))),
    "sigmoid": _chain(lambda x, r: binary("mul", r, binary("sub", _f(1.0), r))),
    "sqrt": _chain(lambda x, r: binary("div", _f(0.5), r)),
    "rsqrt": _chain(lambda x, r: binary("mul", _f(-0.5), binary("mul", r, binary("mul", r, r)))),
    "sin": _chain(lambda x, r: unary("cos", x)),
    "cos": _chain(lambda x, r: unary("neg", unary("sin", x))),
    "add": _add_rule, "sub": _sub_rule, "mul": _mul_rule, "div": _div_rule, "pow": _pow_rule,
    "mod": _mod_rule, "where": _where_rule,
}


def _live(expr: Node, leaves: frozenset[Node]) -> set[int]:
    """Ids of the F32 nodes of `expr` that depend on one of `leaves`."""
    live: set[int] = set()
    for n in walk(expr):
        if n in leaves or (n.dtype is F32 and any(id(a) in live for a in n.args)):
            live.add(id(n))
    return live


def _raw_derivative(expr: Node, wrt: Node, leaves: frozenset[Node]) -> D:
    """Forward-mode derivative of `expr` w.r.t. the leaf `wrt` (unsimplified; None = 0)."""
    live = _live(expr, leaves | {wrt})
    memo: dict[int, D] = {}
    for n in walk(expr):
        if n is wrt:
            memo[id(n)] = _f(1.0)
        elif n.dtype is not F32:  # ints and bools are piecewise constant
            memo[id(n)] = None
        else:
            d = tuple(memo[id(x)] for x in n.args)
            if n.args and all(x is None for x in d):
                memo[id(n)] = None
            elif n.op in ("min", "max"):
                memo[id(n)] = _minmax(n, n.args, d, id(n.args[1]) not in live)
            else:
                memo[id(n)] = _RULES[n.op](n, n.args, d)
    return memo[id(expr)]


def derivative(expr: Node, wrt: Node, leaves: Iterable[Node] = ()) -> Node:
    """`d expr / d wrt`, simplified (an F32 node; `0.0` when `expr` does not depend on it).

    `wrt` is `var("score")` or a `load` node of `expr` (one captured-tensor read). `leaves`:
    everything else being differentiated (the score, reads of tensors requiring grad); it only
    decides which `max` / `min` are clamps (module doc).

    Example:
        >>> from attncc.ir.nodes import var, load, I32
        >>> from attncc.ir.printer import format_expr
        >>> b = load("bias", (var("h"),), F32)
        >>> format_expr(derivative(var("score") * b, b))
        'score'
    """
    if wrt.dtype is not F32 or wrt.op not in ("var", "load"):
        raise ValueError(f"derivative: differentiate w.r.t. score or a float load, not {wrt!r}")
    d = _raw_derivative(expr, wrt, frozenset(leaves))
    return simplify(_or0(d))


# ----------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class CapturedRead:
    """One read `tensor[indices...]` of a score_mod and `d score_mod / d` that element."""

    tensor: str
    indices: tuple[Node, ...]
    grad: Node  # F32, a function of score, b, h, q_idx, kv_idx (and captured values)


@dataclass(frozen=True)
class ScoreModGrad:
    """What a backward kernel needs from a score_mod (docs/backward.md, section 2)."""

    logits: Node  # d score_mod / d score
    reads: tuple[CapturedRead, ...]  # in IR order (tensor order, then first use)

    @property
    def has_logits_grad(self) -> bool:
        """False when d/dscore is exactly 1 (no score_mod, or score + f(indices))."""
        return not (self.logits.op == "const" and self.logits.attr == 1.0)


def _where(ir: VariantIR, hook: str) -> str:
    h = ir.hooks.get(hook)
    return f"{h.source}: " if h is not None and h.source is not None else f"{hook}: "


def check_grad_tensors(ir: VariantIR, grad_tensors: Iterable[str]) -> tuple[str, ...]:
    """`grad_tensors` in IR order, after checking each is a captured float tensor that no
    mask_mod reads (a mask is discrete: it has no gradient to give the tensor).

    Example:
        >>> check_grad_tensors(VariantIR(), ("bias",))
        Traceback (most recent call last):
        ...
        attncc.errors.DifferentiationError: grad_tensors names 'bias', which the variant does not capture; captured tensors: (none)
    """
    want = set(grad_tensors)
    known = {t.name: t for t in ir.tensors}
    for name in sorted(want):
        if name not in known:
            have = ", ".join(known) or "(none)"
            raise DifferentiationError(f"grad_tensors names {name!r}, which the variant does not "
                                       f"capture; captured tensors: {have}")
        if known[name].dtype is not F32:
            raise DifferentiationError(f"captured tensor {name!r} holds {known[name].elem}, which "
                                       f"cannot require grad; pass a float tensor or detach it")
    if "mask_mod" in ir.hooks:
        read = {n.attr for n in walk(ir.expr("mask_mod")) if n.op == "load"} & want
        if read:
            raise DifferentiationError(
                f"{_where(ir, 'mask_mod')}mask_mod reads captured tensor {sorted(read)[0]!r}, "
                f"which requires grad; a mask is discrete and has no gradient for it. Pass "
                f"`{sorted(read)[0]}.detach()` to the mask, or move the dependence into score_mod "
                f"(e.g. return -inf there)")
    return tuple(t.name for t in ir.tensors if t.name in want)


def score_mod_grad(ir: VariantIR, grad_tensors: Iterable[str] = ()) -> ScoreModGrad:
    """The derivatives of `ir`'s score_mod w.r.t. the score and every read of the captured
    tensors in `grad_tensors` (checked with `check_grad_tensors`).

    Example:
        >>> import torch, attncc
        >>> from attncc.ir.printer import format_expr
        >>> slopes = torch.rand(4)
        >>> ir, _ = attncc.Variant(score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
        ...                        name="alibi").trace()
        >>> g = score_mod_grad(ir, [ir.tensors[0].name])
        >>> g.has_logits_grad, [format_expr(r.grad) for r in g.reads]
        (False, ['f32(kv_idx - q_idx)'])
    """
    names = check_grad_tensors(ir, grad_tensors)
    expr = ir.expr("score_mod")
    loads = [n for t in names for n in walk(expr)
             if n.op == "load" and n.attr == t and n.dtype is F32]
    leaves = frozenset([var("score"), *loads])
    logits = derivative(expr, var("score"), leaves)
    reads = []
    for n in loads:
        g = derivative(expr, n, leaves)
        if not (g.op == "const" and g.attr == 0.0):
            reads.append(CapturedRead(n.attr, n.args, g))
    return ScoreModGrad(logits, tuple(reads))

