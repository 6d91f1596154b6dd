"""Which torch functions and tensor methods a mod may call, and the IR each one builds.

A mod computes one float32 / int32 / bool scalar per position, as FlexAttention's mods compute
on float32 scores and int32 indices (docs/semantics.md). Every torch function here builds IR
that means what the function means there; one whose result cannot be represented exactly (a
float64 or float16 intermediate, an int8 wrap, `round(decimals=2)`) raises a `TraceError`
naming the call. docs/ops.md lists every elementwise torch op and what it traces to
(`scripts/ops_table.py` writes it from `COVERAGE` below).

Example:
    >>> import torch
    >>> from attncc.frontend import Variant
    >>> ir, _ = Variant(mask_mod=lambda b, h, q, kv: ((q >> 2) ^ (kv >> 2)) == 0).trace()
    >>> print(ir.expr("mask_mod"))
    <bitxor(rshift(q_idx, 2), rshift(kv_idx, 2)) == 0 : bool>
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..ir import nodes as N
from ..ir.nodes import BOOL, F32, I32, Node
from .proxy import Proxy, _binary, index_tensor, invert, to_node, trace_error

_FLOAT_UNARY = ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos",
                "log1p", "expm1", "log10", "erf", "erfc", "erfinv", "lgamma", "tan", "asin",
                "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")
_INF = math.inf


def _unary(op: str) -> Callable[..., Proxy]:
    def f(x: Any) -> Proxy:
        return Proxy(N.unary(op, to_node(x)))

    return f


def _rounding(op: str) -> Callable[..., Proxy]:
    def f(x: Any) -> Proxy:
        n = to_node(x)
        if n.dtype is not F32:
            return Proxy(n)  # rounding an integer is itself (torch keeps the dtype too)
        return Proxy(N.unary(op, n))

    return f


def _round(x: Any, *, decimals: int = 0) -> Proxy:
    if decimals != 0:
        raise trace_error(f"torch.round(decimals={decimals}) cannot be computed exactly here",
                          "scale explicitly: torch.round(x * 100.0) / 100.0")
    return _rounding("round")(x)


def _sign(x: Any) -> Proxy:
    n = to_node(x)
    return Proxy(n if n.dtype is BOOL else N.unary("sign", n))


def _frac(x: Any) -> Proxy:
    n = to_node(x)
    if n.dtype is not F32:
        raise trace_error("torch.frac of an integer value (torch has no integer frac)",
                          "convert first: torch.frac(x.float())")
    return Proxy(N.binary("sub", n, N.unary("trunc", n)))  # torch's frac: x - trunc(x)


def _square(x: Any) -> Proxy:
    n = to_node(x)
    return Proxy(N.binary("mul", n, n))


def _reciprocal(x: Any) -> Proxy:
    return Proxy(N.binary("div", N.const(1.0), to_node(x)))


def _identity(x: Any, *args: Any, **kw: Any) -> Proxy:
    return x if isinstance(x, Proxy) else Proxy(to_node(x))


def _float_test(fn: Callable[[Node], Node], for_ints: bool) -> Callable[..., Proxy]:
    """isnan / isinf / ...: a comparison on floats, a constant on integers and booleans."""
    def f(x: Any) -> Proxy:
        n = to_node(x)
        return Proxy(fn(n) if n.dtype is F32 else N.const(for_ints))

    return f


def _signbit(x: Any) -> Proxy:
    n = to_node(x)
    if n.dtype is F32:  # the sign bit, -0.0 and NaN's included: copysign carries it exactly
        return Proxy(N.binary("lt", N.binary("copysign", N.const(1.0), n), N.const(0.0)))
    return Proxy(N.binary("lt", N.cast(n, I32), N.const(0)))


def _nan_to_num(x: Any, nan: float | None = 0.0, posinf: float | None = None,
                neginf: float | None = None) -> Proxy:
    n = to_node(x)
    if n.dtype is not F32:
        return Proxy(n)
    big = 3.4028234663852886e38  # torch's default: the dtype's largest finite value
    hi = N.const(big if posinf is None else float(posinf))
    lo = N.const(-big if neginf is None else float(neginf))
    out = N.where(N.binary("eq", n, N.const(_INF)), hi, n)
    out = N.where(N.binary("eq", n, N.const(-_INF)), lo, out)
    return Proxy(N.where(N.binary("ne", n, n), N.const(0.0 if nan is None else float(nan)), out))


def _scale(factor: float) -> Callable[..., Proxy]:
    def f(x: Any) -> Proxy:  # deg2rad / rad2deg: x times a Python constant, as torch does
        return Proxy(N.binary("mul", N.cast(to_node(x), F32), N.const(factor)))

    return f


def _heaviside(x: Any, values: Any) -> Proxy:
    n, v = to_node(x), to_node(values)  # torch: x == 0 ? values : (x > 0), so NaN gives 0
    zero = N.cast(N.const(0), n.dtype)
    step = N.cast(N.binary("gt", n, zero), F32 if F32 in (n.dtype, v.dtype) else I32)
    return Proxy(N.where(N.binary("eq", n, zero), v, step))


def _clip_where(x: Any, lo: Any, hi: Any) -> Proxy:
    """x < lo ? lo : (x > hi ? hi : x): torch's activations keep -0.0 and NaN as they are."""
    n = to_node(x)
    if hi is not None:
        n = N.where(N.binary("gt", n, to_node(hi)), to_node(hi), n)
    return Proxy(N.where(N.binary("lt", to_node(x), to_node(lo)), to_node(lo), n))


def _relu(x: Any, inplace: bool = False) -> Proxy:
    return _clip_where(x, 0, None)


def _hardtanh(x: Any, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False
              ) -> Proxy:
    return _clip_where(x, float(min_val), float(max_val))


def _leaky_relu(x: Any, negative_slope: float = 0.01, inplace: bool = False) -> Proxy:
    n = to_node(x)  # torch: x > 0 ? x : x * slope (NaN and -0.0 take the slope)
    return Proxy(N.where(N.binary("gt", n, N.const(0)), n, N.binary("mul", n, to_node(
        negative_slope))))


def _threshold(x: Any, threshold: float, value: float, inplace: bool = False) -> Proxy:
    n = to_node(x)  # torch: x <= threshold ? value : x (NaN stays)
    return Proxy(N.where(N.binary("le", n, to_node(threshold)), to_node(value), n))


def _hardshrink(x: Any, lambd: float = 0.5) -> Proxy:
    n, lam = to_node(x), to_node(lambd)  # torch: -lambd <= x <= lambd ? 0 : x
    inside = N.binary("and", N.binary("ge", n, N.unary("neg", lam)), N.binary("le", n, lam))
    return Proxy(N.where(inside, N.const(0.0), n))


def _tanhshrink(x: Any) -> Proxy:
    n = to_node(x)
    return Proxy(N.binary("sub", n, N.unary("tanh", n)))


def _logit(x: Any, eps: float | None = None) -> Proxy:
    n = N.cast(to_node(x), F32)
    if eps is not None:  # torch clamps to [eps, 1 - eps] first, NaN staying
        n = _clip_where(Proxy(n), float(eps), 1.0 - float(eps)).node
    return Proxy(N.unary("log", N.binary("div", n, N.binary("sub", N.const(1.0), n))))


def _isclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08,
             equal_nan: bool = False) -> Proxy:
    x, y = to_node(a), to_node(b)  # torch's isclose, step by step
    if x.dtype is not F32 or y.dtype is not F32:
        raise trace_error("torch.isclose of integer or boolean values (torch computes their "
                          "error in integers, which can wrap)",
                          "compare with == or (a - b).abs() <= tol")
    close = N.binary("eq", x, y)
    if equal_nan:
        close = N.binary("or", close, N.binary("and", N.binary("ne", x, x),
                                               N.binary("ne", y, y)))
    allowed = N.binary("add", N.const(float(atol)),
                       N.unary("abs", N.binary("mul", N.const(float(rtol)), y)))
    actual = N.unary("abs", N.binary("sub", x, y))
    finite = N.binary("lt", actual, N.const(_INF))
    return Proxy(N.binary("or", close, N.binary("and", finite,
                                                N.binary("le", actual, allowed))))


def _clamp(x: Any, min: Any = None, max: Any = None) -> Proxy:
    n = to_node(x)
    if min is not None:
        n = N.binary("max", n, to_node(min))
    if max is not None:
        n = N.binary("min", n, to_node(max))
    return Proxy(n)


def _where(cond: Any, a: Any, b: Any) -> Proxy:
    c = to_node(cond)
    if c.dtype is not BOOL:
        raise trace_error("torch.where's condition is not boolean",
                          "pass a comparison, e.g. torch.where(q_idx >= kv_idx, score, -inf)")
    return Proxy(N.where(c, to_node(a), to_node(b)))


def _masked_fill(x: Any, mask: Any, value: Any) -> Proxy:
    n = to_node(x)  # torch converts the fill value to the tensor's dtype
    return _where(mask, Proxy(_value_as(to_node(value), n.dtype, "masked_fill")), Proxy(n))


def _binop(op: str, swap: bool = False) -> Callable[..., Proxy]:
    def f(a: Any, b: Any) -> Proxy:
        x, y = to_node(a), to_node(b)
        return Proxy(_binary(op, y, x) if swap else _binary(op, x, y))

    return f


def _with_alpha(op: str, swap: bool = False) -> Callable[..., Proxy]:
    """add / sub / rsub with torch's `alpha`: exact for integers; torch fuses a float alpha
    into one rounding (an FMA), which float32 IR cannot spell."""
    def f(a: Any, b: Any, *, alpha: Any = 1) -> Proxy:
        x, y = to_node(a), to_node(b)
        if swap:
            x, y = y, x
        if alpha != 1:
            if F32 in (x.dtype, y.dtype) or isinstance(alpha, float):
                raise trace_error(f"torch.{op}(..., alpha={alpha!r}) on float values fuses the "
                                  "multiply into one rounding, which a mod cannot compute exactly",
                                  f"write a {'+' if op == 'add' else '-'} alpha * b")
            y = N.binary("mul", y, to_node(alpha))
        return Proxy(N.binary(op, x, y))

    return f


def _div(a: Any, b: Any, *, rounding_mode: str | None = None) -> Proxy:
    x, y = to_node(a), to_node(b)
    if rounding_mode is None:
        return Proxy(N.binary("div", x, y))
    if rounding_mode == "floor":
        return Proxy(N.binary("floordiv", x, y))
    if rounding_mode != "trunc":
        raise trace_error(f"torch.div(rounding_mode={rounding_mode!r}) is not a rounding mode",
                          "use None, 'trunc' or 'floor'")
    if F32 in (x.dtype, y.dtype):
        return Proxy(N.unary("trunc", N.binary("div", x, y)))  # torch: trunc(a / b)
    # integers: a - fmod(a, b) is a multiple of b, so flooring it divides exactly
    return Proxy(N.binary("floordiv", N.binary("sub", x, N.binary("fmod", x, y)), y))


def _logical_not(x: Any) -> Proxy:
    return Proxy(N.unary("not", N.cast(to_node(x), BOOL)))


def _logical(op: str) -> Callable[..., Proxy]:
    def f(a: Any, b: Any) -> Proxy:
        return Proxy(N.binary(op, N.cast(to_node(a), BOOL), N.cast(to_node(b), BOOL)))

    return f


def _bitwise_not(x: Any) -> Proxy:
    return Proxy(invert(to_node(x)))


def _getitem(t: Any, item: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        raise trace_error("indexing a traced value", "only captured tensors can be indexed")
    return index_tensor(t, item if isinstance(item, tuple) else (item,))


# ----------------------------------------------------------------------------- dtypes

_EXACT_DTYPES = {torch.float32: F32, torch.int32: I32, torch.int64: I32, torch.bool: BOOL}
TORCH_DTYPES = {F32: torch.float32, I32: torch.int32, BOOL: torch.bool}


def _ir_dtype(dtype: Any, what: str) -> N.DType:
    """The IR type computing `dtype` exactly; int64 is int32 (docs/semantics.md, "Integers")."""
    dt = _EXACT_DTYPES.get(dtype)
    if dt is None:
        raise trace_error(f"{what} to {dtype}: a mod computes in float32, int32 and bool, so "
                          f"{dtype} values cannot be represented exactly",
                          "convert with .float(), .int()/.long() or .bool()")
    return dt


def _value_as(n: Node, dt: N.DType, what: str) -> Node:
    """A fill value converted as torch converts a Python number to a tensor's dtype."""
    if n.op == "const" and dt is I32 and n.dtype is F32 and not math.isfinite(n.attr):
        raise trace_error(f"{what}: {n.attr} cannot be converted to an integer",
                          "fill with a finite value")
    if n.op == "const" and dt is I32 and not isinstance(n.attr, bool):
        v = math.trunc(n.attr)
        if not -(2**31) <= v < 2**31:
            raise trace_error(f"{what}: {v} does not fit in 32 bits", "use a smaller value")
        return N.const(v, I32)
    return N.cast(n, dt)


def _convert(dtype: Any, what: str) -> Callable[..., Proxy]:
    def f(x: Any, *args: Any, **kw: Any) -> Proxy:
        return Proxy(N.cast(to_node(x), _ir_dtype(dtype, what)))

    return f


def _to(x: Any, *args: Any, **kw: Any) -> Any:
    """Tensor.to / Tensor.type: only the dtype matters (devices, copy= ... change nothing)."""
    dtype = kw.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, Proxy):
            dtype = TORCH_DTYPES[a.node.dtype]
        elif isinstance(a, torch.Tensor):
            dtype = a.dtype
    if dtype is None:
        return _identity(x)
    return _convert(dtype, ".to()")(x)


def _size_is_scalar(size: tuple, kw: dict, what: str) -> None:
    size = kw.pop("size", size[0] if len(size) == 1 and isinstance(size[0], (tuple, list,
                                                                               torch.Size))
                  else size)
    if tuple(size) not in ((), (1,)):
        raise trace_error(f"{what} of size {tuple(size)}: a mod computes one value per position",
                          f"use size (), e.g. {what}((), dtype=torch.bool)")


def _fill(x: Any, value: Any, dtype: Any, what: str) -> Proxy:
    dt = to_node(x).dtype if dtype is None else _ir_dtype(dtype, what)
    return Proxy(_value_as(to_node(value), dt, what))


def _full_like(x: Any, fill_value: Any, *, dtype: Any = None, **kw: Any) -> Proxy:
    return _fill(x, fill_value, dtype, "torch.full_like")


def _const_like(value: int, what: str) -> Callable[..., Proxy]:
    def f(x: Any, *, dtype: Any = None, **kw: Any) -> Proxy:
        return _fill(x, value, dtype, what)

    return f


def _new_const(value: int, what: str) -> Callable[..., Proxy]:
    def f(x: Any, *size: Any, dtype: Any = None, **kw: Any) -> Proxy:
        _size_is_scalar(size, kw, what)
        return _fill(x, value, dtype, what)

    return f


def _new_full(x: Any, size: Any, fill_value: Any, *, dtype: Any = None, **kw: Any) -> Proxy:
    _size_is_scalar((size,), kw, "Tensor.new_full")
    return _fill(x, fill_value, dtype, "Tensor.new_full")


def _unexact(name: str, hint: str) -> Callable[..., Any]:
    def f(*args: Any, **kw: Any) -> Any:
        raise trace_error(f"torch.{name} cannot be computed exactly in a mod", hint)

    return f


# ----------------------------------------------------------------------------- registry

# functions reached through __torch_function__ (torch.xxx, Tensor.xxx and Tensor dunders)
_FUNCS: dict[Any, Callable[..., Any]] = {}
# name -> how it traces (the coverage table's notes): every name registered below
COVERAGE: dict[str, str] = {}


def _register(names: tuple[str, ...], impl: Callable[..., Any], *owners: Any,
              note: str = "") -> None:
    for owner in owners:
        for name in names:
            fn = getattr(owner, name, None)
            if callable(fn):  # (Tensor.real is a property: an attribute, see _ATTRS)
                _FUNCS[fn] = impl
                prefix = {torch: "torch.", torch.Tensor: "Tensor.", torch.special: "torch.special.",
                          torch.nn.functional: "torch.nn.functional."}[owner]
                COVERAGE.setdefault(prefix + name, note)


_T = (torch, torch.Tensor)
for _u in _FLOAT_UNARY:
    _register((_u,), _unary(_u), *_T)
for _u in ("log1p", "expm1", "erf", "erfc", "erfinv", "exp2"):
    _register((_u,), _unary(_u), torch.special)
_register(("expit",), _unary("sigmoid"), torch.special)
_register(("sigmoid",), _unary("sigmoid"), torch.nn.functional)
_register(("gammaln",), _unary("lgamma"), torch.special)
_register(("arcsin",), _unary("asin"), *_T)
_register(("arccos",), _unary("acos"), *_T)
_register(("arctan",), _unary("atan"), *_T)
_register(("arcsinh",), _unary("asinh"), *_T)
_register(("arccosh",), _unary("acosh"), *_T)
_register(("arctanh",), _unary("atanh"), *_T)
_register(("arctan2",), _binop("atan2"), *_T)
for _u in ("floor", "ceil", "trunc", "fix"):
    _register((_u,), _rounding("trunc" if _u == "fix" else _u), *_T,
              note="an integer stays itself")
_register(("round",), _round, *_T, torch.special, note="half to even; decimals=0 only")
_register(("neg", "negative", "__neg__"), _unary("neg"), *_T)
_register(("abs", "absolute", "__abs__"), _unary("abs"), *_T, note="int32 abs(INT_MIN) wraps")
_register(("sign", "sgn"), _sign, *_T, note="NaN and -0.0 give 0.0, as torch")
_register(("frac",), _frac, *_T, note="x - trunc(x)")
_register(("square",), _square, *_T, note="x * x")
_register(("reciprocal",), _reciprocal, *_T, note="1 / x")
_register(("positive", "clone", "detach", "contiguous", "real", "conj", "conj_physical",
           "resolve_conj", "resolve_neg", "__pos__"), _identity, *_T, note="the value itself")
_register(("isnan",), _float_test(lambda n: N.binary("ne", n, n), False), *_T, note="x != x")
_register(("isinf",), _float_test(lambda n: N.binary("eq", N.unary("abs", n), N.const(_INF)),
                                  False), *_T)
_register(("isposinf",), _float_test(lambda n: N.binary("eq", n, N.const(_INF)), False), *_T)
_register(("isneginf",), _float_test(lambda n: N.binary("eq", n, N.const(-_INF)), False), *_T)
_register(("isfinite",), _float_test(lambda n: N.binary("lt", N.unary("abs", n), N.const(_INF)),
                                     True), *_T)
_register(("isreal",), lambda x: Proxy(N.const(True)), *_T, note="always True (no complex)")
_register(("signbit",), _signbit, *_T, note="copysign(1.0, x) < 0")
_register(("nan_to_num",), _nan_to_num, *_T)
_register(("deg2rad",), _scale(math.pi / 180), *_T, note="x * (pi / 180)")
_register(("rad2deg",), _scale(180 / math.pi), *_T, note="x * (180 / pi)")
_register(("heaviside",), _heaviside, *_T)
_register(("logit",), _logit, *_T, torch.special, note="log(x / (1 - x)), eps clamps first")
_register(("isclose",), _isclose, *_T, note="floats: torch's formula, step by step")
_register(("clamp", "clip"), _clamp, *_T, note="NaN propagates")
_F = torch.nn.functional
_register(("relu",), _relu, *_T, _F, note="x < 0 ? 0 : x (-0.0 and NaN stay)")
_register(("relu6",), lambda x, inplace=False: _hardtanh(x, 0.0, 6.0), _F,
          note="hardtanh(x, 0, 6)")
_register(("hardtanh",), _hardtanh, _F, note="x < lo ? lo : x > hi ? hi : x")
_register(("leaky_relu",), _leaky_relu, _F, note="x > 0 ? x : x * slope")
_register(("threshold",), _threshold, _F, note="x <= threshold ? value : x")
_register(("hardshrink",), _hardshrink, *_T, _F, note="|x| <= lambd ? 0 : x")
_register(("tanhshrink",), _tanhshrink, _F, note="x - tanh(x)")
_register(("clamp_min",), lambda x, m: _clamp(x, min=m), *_T)
_register(("clamp_max",), lambda x, m: _clamp(x, max=m), *_T)
_register(("where",), _where, torch, note="scalars promote as in torch")
_register(("where",), lambda x, cond, other: _where(cond, x, other), torch.Tensor)
_register(("masked_fill",), _masked_fill, *_T)
_register(("minimum", "min"), _binop("min"), *_T, note="NaN propagates")
_register(("maximum", "max"), _binop("max"), *_T, note="NaN propagates")
_register(("fmin",), _binop("fmin"), *_T, note="NaN is ignored")
_register(("fmax",), _binop("fmax"), *_T, note="NaN is ignored")
_register(("pow", "__pow__"), _binop("pow"), *_T, note="always float")
_register(("__rpow__",), _binop("pow", True), torch.Tensor)
_register(("float_power",), _unexact("float_power", "it computes in float64; use torch.pow"),
          *_T, note="error: computes in float64")
_register(("add", "__add__", "__radd__"), _with_alpha("add"), *_T)
_register(("sub", "subtract", "__sub__"), _with_alpha("sub"), *_T)
_register(("rsub",), _with_alpha("sub", True), *_T)
_register(("div", "divide"), _div, *_T, note="rounding_mode None, 'trunc', 'floor'")
_register(("atan2",), _binop("atan2"), *_T)
_register(("hypot",), _binop("hypot"), *_T)
_register(("copysign",), _binop("copysign"), *_T)
_register(("nextafter",), _binop("nextafter"), *_T)
_register(("fmod",), _binop("fmod"), *_T, note="the dividend's sign (C's %)")
_register(("floor_divide", "__floordiv__"), _binop("floordiv"), *_T, note="floors, as Python")
_register(("remainder", "__mod__"), _binop("mod"), *_T, note="the divisor's sign, as Python")
_register(("bitwise_left_shift", "__lshift__"), _binop("lshift"), *_T,
          note="int32; a count outside [0, 32) gives 0")
_register(("bitwise_right_shift", "__rshift__"), _binop("rshift"), *_T,
          note="int32, arithmetic; a count outside [0, 32) gives the sign")
_register(("logical_and",), _logical("and"), *_T)
_register(("logical_or",), _logical("or"), *_T)
_register(("logical_xor",), _logical("ne"), *_T)
_register(("logical_not",), _logical_not, *_T)
_register(("bitwise_not", "__invert__"), _bitwise_not, *_T,
          note="logical on bool, bitwise on integers")
for _names, _op in ((("mul", "multiply", "__mul__", "__rmul__"), "mul"),
                    (("true_divide", "__truediv__"), "div"),
                    (("lt", "less", "__lt__"), "lt"), (("le", "less_equal", "__le__"), "le"),
                    (("gt", "greater", "__gt__"), "gt"), (("ge", "greater_equal", "__ge__"), "ge"),
                    (("eq", "__eq__"), "eq"), (("ne", "not_equal", "__ne__"), "ne"),
                    (("__and__", "bitwise_and"), "and"), (("__or__", "bitwise_or"), "or"),
                    (("__xor__", "bitwise_xor"), "xor")):
    _register(_names, _binop(_op), *_T,
              note="logical on bool, bitwise on integers" if _op in ("and", "or", "xor") else "")
_register(("__rtruediv__", "__rdiv__"), lambda x, other: Proxy(to_node(x)).__rtruediv__(other),
          torch.Tensor, note="torch's reciprocal(x) * other")
for _names, _op in ((("__rsub__",), "sub"),
                    (("__rfloordiv__",), "floordiv"), (("__rmod__",), "mod"), (("__rand__",), "and"),
                    (("__ror__",), "or"), (("__rxor__",), "xor"), (("__rlshift__",), "lshift"),
                    (("__rrshift__",), "rshift")):
    _register(_names, _binop(_op, True), torch.Tensor)
_register(("__getitem__",), _getitem, torch.Tensor)
_register(("full_like",), _full_like, torch, note="the value converted to the dtype")
_register(("zeros_like",), _const_like(0, "torch.zeros_like"), torch)
_register(("ones_like",), _const_like(1, "torch.ones_like"), torch)
_register(("new_ones",), _new_const(1, "Tensor.new_ones"), torch.Tensor, note="size () only")
_register(("new_zeros",), _new_const(0, "Tensor.new_zeros"), torch.Tensor, note="size () only")
_register(("new_full",), _new_full, torch.Tensor, note="size () only")
_register(("float",), _convert(torch.float32, ".float()"), torch.Tensor)
_register(("int",), _convert(torch.int32, ".int()"), torch.Tensor)
_register(("long",), _convert(torch.int64, ".long()"), torch.Tensor, note="computed in int32")
_register(("bool",), _convert(torch.bool, ".bool()"), torch.Tensor)
for _name, _dt in (("double", torch.float64), ("half", torch.float16),
                   ("bfloat16", torch.bfloat16), ("short", torch.int16), ("char", torch.int8),
                   ("byte", torch.uint8)):
    _register((_name,), _convert(_dt, f".{_name}()"), torch.Tensor,
              note=f"error: {_dt} cannot be represented exactly")
_register(("to", "type"), _to, torch.Tensor, note="float32, int32/int64 and bool only")
_register(("is_floating_point",), lambda x: to_node(x).dtype is F32, *_T)

SUPPORTED = sorted({getattr(f, "__name__", str(f)) for f in _FUNCS})
# registered names that raise a TraceError (their notes start with "error:")
UNSUPPORTED = frozenset(name for name, note in COVERAGE.items() if note.startswith("error:"))


def _name_of(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    impl = _FUNCS.get(func)
    if impl is None:
        raise trace_error(f"torch.{_name_of(func)} is not supported inside a mod",
                          "docs/ops.md lists the torch functions a mod can call: elementwise "
                          "math, comparisons, & | ^ ~ << >>, torch.where, clamp, conversions")
    if "out" in kwargs:
        raise trace_error("out= is not supported inside a mod", "return the value instead")
    return _call(impl, _name_of(func), args, kwargs)


def _call(impl: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> Any:
    try:
        return impl(*args, **kwargs)
    except TypeError as e:  # a signature torch accepts but a mod cannot mean (dim=, a reduction)
        raise trace_error(f"torch.{name} is called with arguments a mod cannot use ({e})",
                          "call it elementwise on scalars, e.g. torch.maximum(a, b)") from None


# attributes a mod may read off a traced value
_ATTRS: dict[str, Callable[[Proxy], Any]] = {
    "dtype": lambda p: TORCH_DTYPES[p.node.dtype],
    "device": lambda p: None,  # a mod's values live wherever the kernel runs
    "shape": lambda p: torch.Size(()),
    "ndim": lambda p: 0,
    "real": lambda p: p,
}
_METHODS: dict[str, Callable[..., Any]] = {
    "dim": lambda p: 0, "numel": lambda p: 1, "size": lambda p, *a: torch.Size(()),
}


def attribute(p: Proxy, name: str) -> Any:
    """`p.name`: a tensor attribute, or a bound tensor method that builds IR."""
    if name in _ATTRS:
        return _ATTRS[name](p)
    impl = _METHODS.get(name)
    if impl is None:
        impl = _FUNCS.get(getattr(torch.Tensor, name, None))
    if impl is None:
        raise trace_error(f"traced values have no method .{name}() inside a mod",
                          "docs/ops.md lists the tensor methods a mod can call")
    return lambda *a, **kw: _call(impl, f"Tensor.{name}", (p, *a), kw)

