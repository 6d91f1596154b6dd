"""Proxies: stand-ins for `score`, `b`, `h`, `q_idx`, ... that record IR as user code runs.

A `Proxy` wraps an IR node. Python operators and torch functions applied to it (through
`__torch_function__`) build new nodes. Anything that would need a concrete value (`if`, `int()`,
`range()`, `math.tanh`) raises `TraceError` naming the user's line and what to write instead.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

from ..errors import TraceError
from ..ir import nodes as N
from ..ir.nodes import BOOL, F32, I32, Node

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def user_frame() -> tuple[str, int, str]:
    """(file, line, source text) of the innermost stack frame that is user code."""
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(_PKG_DIR) and not fn.startswith(_TORCH_DIR) and "<frozen" not in fn:
            import linecache

            return fn, f.f_lineno, linecache.getline(fn, f.f_lineno).strip()
        f = f.f_back
    return "<unknown>", 0, ""


def trace_error(what: str, hint: str) -> TraceError:
    """A TraceError pointing at the user's current line."""
    file, line, text = user_frame()
    where = f"{file}:{line}: " if line else ""
    shown = f"\n    {text}" if text else ""
    return TraceError(f"{where}{what}{shown}\n  hint: {hint}")


def numpy_error(func: str) -> TraceError:
    """numpy was called on a traced value: it computes on arrays now, not in the kernel."""
    return trace_error(f"numpy's {func}() is called on a traced value inside a mod",
                       "use torch functions on traced values (torch.exp, torch.where, "
                       "torch.maximum, ...): numpy computes eagerly on arrays and cannot be "
                       "compiled")


class NeedsStatic(Exception):
    """Internal: a captured scalar was used as a concrete Python value; retrace it as a constant."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(", ".join(sorted(names)))
        self.names = names


class TensorRegistry:
    """Captured tensors seen during one trace, named by closure/global name or in order of use."""

    def __init__(self, known_names: dict[int, str]) -> None:
        self.known_names = known_names
        self.by_id: dict[int, tuple[str, torch.Tensor]] = {}
        self.taken: set[str] = set()

    def name_of(self, t: torch.Tensor) -> str:
        hit = self.by_id.get(id(t))
        if hit is not None:
            return hit[0]
        base = self.known_names.get(id(t), "tensor")
        name, i = base, 0
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        self.by_id[id(t)] = (name, t)
        return name


_REGISTRY: list[TensorRegistry] = []  # stack; the active trace's registry is last


def _registry() -> TensorRegistry:
    if not _REGISTRY:
        raise TraceError("a traced value was used outside of attncc tracing")
    return _REGISTRY[-1]


def _elem_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def tensor_load(t: torch.Tensor, indices: tuple[Any, ...]) -> "Proxy":
    from ..ir.program import ir_dtype_for_elem

    elem = _elem_name(t)
    dt = ir_dtype_for_elem(elem)
    if dt is None:
        raise trace_error(f"a captured tensor of dtype {t.dtype} cannot be read inside a mod",
                          "capture a float, integer or bool tensor (convert it with .float() or "
                          ".int() outside the mod)")
    if len(indices) != t.dim():
        raise trace_error(f"a captured tensor of shape {tuple(t.shape)} is indexed with "
                          f"{len(indices)} index(es); a mod must read single elements",
                          f"index all {t.dim()} dims, e.g. t[h, q_idx]")
    idx = []
    for i in indices:
        n = to_node(i)
        if n.dtype is F32:
            raise trace_error("a float value is used as a tensor index",
                              "use integer arithmetic for indices: `//` instead of `/`, or "
                              "convert with .long()")
        if n.dtype is BOOL:
            raise trace_error("a boolean is used as a tensor index (mask indexing)",
                              "index with integer expressions of b, h, q_idx, kv_idx")
        idx.append(n)
    name = _registry().name_of(t)
    return Proxy(N.load(name, tuple(idx), dt))


def to_node(x: Any) -> Node:
    """Lift a proxy / Python scalar / 0-d captured tensor into an IR node."""
    if isinstance(x, Proxy):
        return x.node
    if isinstance(x, bool):
        return N.const(x)
    if isinstance(x, int):
        if not -(2**31) <= x < 2**31:
            raise trace_error(f"the integer {x} does not fit in 32 bits", "use a smaller constant")
        return N.const(x)
    if isinstance(x, float):
        return N.const(x)
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return tensor_load(x, ()).node
        raise trace_error(f"a captured tensor of shape {tuple(x.shape)} is used as a value",
                          "index it with the mod's arguments, e.g. bias[h, q_idx]")
    if isinstance(x, PartialIndex):
        raise trace_error(f"a captured tensor is only partially indexed ({len(x.indices)} of "
                          f"{x.tensor.dim()} dims)", "index every dim of the tensor")
    raise trace_error(f"a value of type {type(x).__name__} cannot be used inside a mod",
                      "use numbers, the mod's arguments, captured tensors and torch functions")


def _guard_static(node: Node, what: str, hint: str) -> None:
    """Using a traced value concretely: fine to retry if it only involves captured scalars."""
    kinds = {n.op for n in N.walk(node)}
    if "var" not in kinds and "load" not in kinds and "vec" not in kinds and "param" in kinds:
        raise NeedsStatic(N.params_of(node))
    raise trace_error(what, hint)


def _bin(op: str, swap: bool = False) -> Callable[[Any, Any], "Proxy"]:
    def f(self: "Proxy", other: Any) -> "Proxy":
        a, b = self.node, to_node(other)
        if swap:
            a, b = b, a
        return Proxy(_binary(op, a, b))

    return f


_BITWISE = {"and": ("&", "bitand"), "or": ("|", "bitor"), "xor": ("^", "bitxor"),
            "lshift": ("<<", "lshift"), "rshift": (">>", "rshift")}


def _binary(op: str, a: Node, b: Node) -> Node:
    """`a op b` as torch computes it on scalars: & | ^ of booleans are logical, of integers
    (a boolean promoted to 0 / 1) bitwise; a float operand is an error, as in torch."""
    if op not in _BITWISE:
        return N.binary(op, a, b)
    if a.dtype is BOOL and b.dtype is BOOL and op in ("and", "or", "xor"):
        return N.binary("ne" if op == "xor" else op, a, b)
    symbol, int_op = _BITWISE[op]
    if a.dtype is F32 or b.dtype is F32:
        raise trace_error(f"'{symbol}' on a float value (torch has no bitwise ops on floats)",
                          "combine comparisons with & | ^, and use & | ^ << >> on integer "
                          "values only (convert with .long())")
    return N.binary(int_op, a, b)


def invert(node: Node) -> Node:
    """`~x`: logical not of a boolean, bitwise not of an integer."""
    if node.dtype is BOOL:
        return N.unary("not", node)
    if node.dtype is F32:
        raise trace_error("'~' on a float value (torch has no bitwise not on floats)",
                          "use ~ on comparisons/masks or on integer values")
    return N.unary("bitnot", node)


class Proxy:
    """A traced scalar value (i32 / f32 / bool) at one (b, h, q_idx, kv_idx[, d]) position."""

    __slots__ = ("node",)

    def __init__(self, node: Node) -> None:
        self.node = node

    def __repr__(self) -> str:
        from ..ir.printer import format_expr

        return f"Proxy({format_expr(self.node)} : {self.node.dtype.value})"

    # -- torch interop: torch.where(proxy, ...), tensor[proxy], torch.tanh(proxy), ...
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        from .torch_ops import dispatch

        return dispatch(func, args, kwargs or {})

    # -- arithmetic
    __add__, __radd__ = _bin("add"), _bin("add", True)
    __sub__, __rsub__ = _bin("sub"), _bin("sub", True)
    __mul__, __rmul__ = _bin("mul"), _bin("mul", True)
    __truediv__ = _bin("div")

    def __rtruediv__(self, other: Any) -> "Proxy":
        # torch's Tensor.__rtruediv__ is `self.reciprocal() * other`: two roundings, which a
        # discrete value can see (3.0 / x is not 3.0 * (1 / x) in float32 for every x)
        recip = N.binary("div", N.const(1.0), self.node)
        return Proxy(N.binary("mul", recip, to_node(other)))

    __floordiv__, __rfloordiv__ = _bin("floordiv"), _bin("floordiv", True)
    __mod__, __rmod__ = _bin("mod"), _bin("mod", True)
    __pow__, __rpow__ = _bin("pow"), _bin("pow", True)
    __and__, __rand__ = _bin("and"), _bin("and", True)
    __or__, __ror__ = _bin("or"), _bin("or", True)
    __xor__, __rxor__ = _bin("xor"), _bin("xor", True)
    __lshift__, __rlshift__ = _bin("lshift"), _bin("lshift", True)
    __rshift__, __rrshift__ = _bin("rshift"), _bin("rshift", True)
    __lt__, __le__ = _bin("lt"), _bin("le")
    __gt__, __ge__ = _bin("gt"), _bin("ge")
    __eq__, __ne__ = _bin("eq"), _bin("ne")  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]

    def __neg__(self) -> "Proxy":
        return Proxy(N.unary("neg", self.node))

    def __pos__(self) -> "Proxy":
        return self

    def __abs__(self) -> "Proxy":
        return Proxy(N.unary("abs", self.node))

    def __invert__(self) -> "Proxy":
        return Proxy(invert(self.node))

    # -- concrete uses: not traceable
    def __bool__(self) -> bool:
        _guard_static(self.node, "a traced value is used in Python control flow "
                                 "(`if`, `while`, `and`, `or`, `not`, or a chained comparison)",
                      "use torch.where(cond, a, b) for a choice, and & | ~ to combine conditions")
        raise AssertionError("unreachable")

    def __index__(self) -> int:
        _guard_static(self.node, "a traced value is used where Python needs a concrete integer "
                                 "(range(), a list index, a loop count)",
                      "loops over traced values cannot be compiled; write the computation "
                      "without a loop, or index a captured tensor instead of a list")
        raise AssertionError("unreachable")

    def __int__(self) -> int:
        _guard_static(self.node, "int() of a traced value", "use .int() / .long() to convert")
        raise AssertionError("unreachable")

    def __float__(self) -> float:
        _guard_static(self.node, "a traced value is passed to a function that needs a Python "
                                 "float (e.g. math.tanh, math.exp)",
                      "use the torch function instead: torch.tanh(x), torch.exp(x), ...")
        raise AssertionError("unreachable")

    def __iter__(self) -> Any:
        raise trace_error("iterating over a traced value", "mods compute one scalar per position; "
                                                           "there is nothing to iterate")

    def __getitem__(self, item: Any) -> Any:
        raise trace_error("indexing a traced scalar", "only captured tensors and the head vector "
                                                      "(q/k/v/o in transforms) can be indexed")

    # -- numpy: its functions would ask a Proxy for an array (__array_struct__ ...); say what
    # to write instead. numpy looks these up on the type, before any conversion.
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise numpy_error(getattr(ufunc, "__name__", "a ufunc"))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise numpy_error(getattr(func, "__name__", "a function"))

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise numpy_error("asarray")

    # -- tensor-style methods users write
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            # protocol lookups (copy, pickle, numpy's __array_interface__) are not methods a mod
            # calls: a missing attribute lets them fall back
            raise AttributeError(name)
        from .torch_ops import attribute

        return attribute(self, name)


class PartialIndex:
    """`table[h]` on a 2-D captured tensor: waits for the remaining indices (`table[h][q_idx]`)."""

    def __init__(self, tensor: torch.Tensor, indices: tuple[Any, ...]) -> None:
        self.tensor = tensor
        self.indices = indices

    def __getitem__(self, item: Any) -> Any:
        more = item if isinstance(item, tuple) else (item,)
        return index_tensor(self.tensor, self.indices + more)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise trace_error("a partially indexed captured tensor is used as a value",
                          "index every dim of the tensor")


def index_tensor(t: torch.Tensor, indices: tuple[Any, ...]) -> Any:
    for i in indices:
        if i is None or i is Ellipsis or isinstance(i, slice):
            raise trace_error("slices, None and ... cannot index a captured tensor inside a mod",
                              "index single elements: t[h, q_idx]")
    if len(indices) < t.dim():
        return PartialIndex(t, indices)
    return tensor_load(t, indices)


class VectorProxy:
    """The head vector in query/key/value/output mods: `q[d]`, `q[(d + D // 2) % D]`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, item: Any) -> Proxy:
        n = to_node(item)
        if n.dtype is not I32:
            raise trace_error(f"the head vector {self.name} is indexed with a {n.dtype.value} value",
                              "index it with an integer expression of d, e.g. "
                              f"{self.name}[(d + D // 2) % D]")
        return Proxy(N.vec(self.name, n))

    def __repr__(self) -> str:
        return f"VectorProxy({self.name})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        raise trace_error("the head vector is used as a whole",
                          "a transform returns one element: write it in terms of q[d] and "
                          "q[other index]")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise numpy_error(getattr(ufunc, "__name__", "a ufunc"))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise numpy_error(getattr(func, "__name__", "a function"))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise trace_error(f"the head vector has no attribute {name!r} inside a mod",
                          "a transform returns element d of the new vector, e.g. "
                          "q[d] * cos - q[(d + D // 2) % D] * sin")
