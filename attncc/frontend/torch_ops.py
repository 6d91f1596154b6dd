"""Which torch functions and tensor methods a mod may call, and the IR each one builds."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..ir import nodes as N
from ..ir.nodes import BOOL, F32, I32
from .proxy import Proxy, _binary, index_tensor, to_node, trace_error

_UNARY = ("abs", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos",
          "floor", "neg")


def _unary(op: str) -> Callable[..., Proxy]:
    def f(x: Any) -> Proxy:
        n = to_node(x)
        if op == "floor" and n.dtype is not F32:
            return Proxy(n)  # floor of an integer is itself (torch keeps the dtype too)
        return Proxy(N.unary(op, n))

    return f


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


def _binop(op: str, swap: bool = False) -> Callable[..., Proxy]:
    def f(a: Any, b: Any) -> Proxy:
        x, y = to_node(a), to_node(b)
        return Proxy(_binary(op, y, x) if swap else _binary(op, x, y))

    return f


def _to_float(x: Any, *args: Any, **kw: Any) -> Proxy:
    return Proxy(N.cast(to_node(x), F32))


def _to_int(x: Any, *args: Any, **kw: Any) -> Proxy:
    return Proxy(N.cast(to_node(x), I32))


def _to_bool(x: Any, *args: Any, **kw: Any) -> Proxy:
    return Proxy(N.cast(to_node(x), BOOL))


def _to(x: Any, dtype: Any = None, *args: Any, **kw: Any) -> Proxy:
    dtype = kw.get("dtype", dtype)
    if dtype is None or isinstance(dtype, (str, torch.device)):
        return x if isinstance(x, Proxy) else Proxy(to_node(x))
    if dtype.is_floating_point:
        return _to_float(x)
    if dtype == torch.bool:
        return _to_bool(x)
    return _to_int(x)


def _logical_not(x: Any) -> Proxy:
    n = to_node(x)
    return Proxy(N.unary("not", N.cast(n, BOOL)))


def _logical(op: str) -> Callable[..., Proxy]:
    def f(a: Any, b: Any) -> Proxy:
        return Proxy(N.binary(op, N.cast(to_node(a), BOOL), N.cast(to_node(b), BOOL)))

    return f


def _getitem(t: Any, item: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        raise trace_error("indexing a traced value", "only captured tensors can be indexed")
    return index_tensor(t, item if isinstance(item, tuple) else (item,))


# functions reached through __torch_function__ (torch.xxx, Tensor.xxx and Tensor dunders)
_FUNCS: dict[Any, Callable[..., Any]] = {}


def _register(names: tuple[str, ...], impl: Callable[..., Any], *owners: Any) -> None:
    for owner in owners:
        for name in names:
            fn = getattr(owner, name, None)
            if fn is not None:
                _FUNCS[fn] = impl


for _u in _UNARY:
    _register((_u,), _unary(_u), torch, torch.Tensor)
_register(("expit",), _unary("sigmoid"), torch.special)
_register(("exp2",), _unary("exp2"), torch.special)
_register(("sigmoid",), _unary("sigmoid"), torch.nn.functional)
_register(("negative",), _unary("neg"), torch, torch.Tensor)
_register(("__neg__",), _unary("neg"), torch.Tensor)
_register(("__abs__", "absolute"), _unary("abs"), torch.Tensor, torch)
_register(("clamp", "clip"), _clamp, torch, torch.Tensor)
_register(("clamp_min",), lambda x, m: _clamp(x, min=m), torch, torch.Tensor)
_register(("clamp_max",), lambda x, m: _clamp(x, max=m), torch, torch.Tensor)
_register(("where",), _where, torch, torch.Tensor)
_register(("minimum", "min"), _binop("min"), torch, torch.Tensor)
_register(("maximum", "max"), _binop("max"), torch, torch.Tensor)
_register(("pow", "__pow__", "float_power"), _binop("pow"), torch, torch.Tensor)
_register(("__rpow__",), _binop("pow", True), torch.Tensor)
for _names, _op in ((("add", "__add__", "__radd__"), "add"), (("mul", "multiply", "__mul__", "__rmul__"), "mul"),
                    (("sub", "subtract", "__sub__"), "sub"), (("div", "divide", "true_divide", "__truediv__"), "div"),
                    (("floor_divide", "__floordiv__"), "floordiv"), (("remainder", "__mod__"), "mod"),
                    (("lt", "less", "__lt__"), "lt"), (("le", "less_equal", "__le__"), "le"),
                    (("gt", "greater", "__gt__"), "gt"), (("ge", "greater_equal", "__ge__"), "ge"),
                    (("eq", "__eq__"), "eq"), (("ne", "not_equal", "__ne__"), "ne"),
                    (("__and__", "bitwise_and"), "and"), (("__or__", "bitwise_or"), "or"),
                    (("__xor__", "bitwise_xor"), "xor")):
    _register(_names, _binop(_op), torch, torch.Tensor)
for _names, _op in ((("__rsub__",), "sub"), (("__rtruediv__", "__rdiv__"), "div"),
                    (("__rfloordiv__",), "floordiv"), (("__rmod__",), "mod"), (("__rand__",), "and"),
                    (("__ror__",), "or"), (("__rxor__",), "xor")):
    _register(_names, _binop(_op, True), torch.Tensor)
_register(("logical_and",), _logical("and"), torch, torch.Tensor)
_register(("logical_or",), _logical("or"), torch, torch.Tensor)
_register(("logical_not", "bitwise_not", "__invert__"), _logical_not, torch, torch.Tensor)
_register(("__getitem__",), _getitem, torch.Tensor)
_register(("float", "double", "half", "bfloat16"), _to_float, torch.Tensor)
_register(("int", "long", "short"), _to_int, torch.Tensor)
_register(("bool",), _to_bool, torch.Tensor)
_register(("to", "type"), _to, torch.Tensor)

SUPPORTED = sorted({getattr(f, "__name__", str(f)) for f in _FUNCS})


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    impl = _FUNCS.get(func)
    if impl is None:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise trace_error(f"torch.{name} is not supported inside a mod",
                          "supported: arithmetic, // % ** comparisons & | ~, torch.where, tanh, "
                          "exp, exp2, log, log2, sigmoid, abs, minimum, maximum, clamp, sqrt, "
                          "rsqrt, sin, cos, floor, pow")
    # torch passes keyword forms like torch.clamp(x, min=..); fold `out=` etc. into an error
    if "out" in kwargs:
        raise trace_error("out= is not supported inside a mod", "return the value instead")
    return impl(*args, **kwargs)


_METHODS: dict[str, Callable[..., Any]] = {
    **{u: _unary(u) for u in _UNARY},
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda x, m: _clamp(x, min=m), "clamp_max": lambda x, m: _clamp(x, max=m),
    "float": _to_float, "double": _to_float, "half": _to_float, "bfloat16": _to_float,
    "int": _to_int, "long": _to_int, "bool": _to_bool, "to": _to, "type": _to,
    "minimum": _binop("min"), "maximum": _binop("max"), "pow": _binop("pow"),
    "logical_not": _logical_not, "logical_and": _logical("and"), "logical_or": _logical("or"),
    "where": lambda x, cond, other: _where(cond, x, other),
}


def method(p: Proxy, name: str) -> Callable[..., Any]:
    impl = _METHODS.get(name)
    if impl is None:
        raise trace_error(f"traced values have no method .{name}() inside a mod",
                          f"supported methods: {', '.join(sorted(_METHODS))}")
    return lambda *a, **kw: impl(p, *a, **kw)
