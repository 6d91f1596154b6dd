"""The attncc IR: small, typed, immutable, hash-consed expression nodes.

Every hook of a variant (score_mod, mask_mod, query_mod, ...) is one expression DAG of
`Node`s. Nodes are interned: building the same expression twice returns the very same
object, so structural equality is `is`, common subexpressions are shared for free, and
nodes can key dicts cheaply.

Example:
    >>> from attncc.ir.nodes import var, const
    >>> q, kv = var("q_idx"), var("kv_idx")
    >>> (q - kv) is (var("q_idx") - var("kv_idx"))
    True
    >>> (q >= kv).dtype
    <DType.BOOL: 'bool'>
"""
from __future__ import annotations

import enum
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


class DType(enum.Enum):
    I32 = "i32"
    F32 = "f32"
    BOOL = "bool"


I32, F32, BOOL = DType.I32, DType.F32, DType.BOOL

# The index variables every hook may read, and their types. `d` is the position inside a
# head vector (query/key/value/output mods only).
INDEX_VARS = ("b", "h", "q_idx", "kv_idx", "d")
VAR_TYPES = {"score": F32, "b": I32, "h": I32, "q_idx": I32, "kv_idx": I32, "d": I32}
VECTORS = ("q", "k", "v", "o")


@dataclass(frozen=True)
class OpInfo:
    """What the IR knows about one operator: arity and result typing."""

    name: str
    arity: int  # -1: variadic (load)
    kind: str  # "leaf" | "unary" | "binary" | "compare" | "logic" | "select" | "load"
    symbol: str | None = None  # infix spelling for the printer


_OPS: dict[str, OpInfo] = {}


def _op(name: str, arity: int, kind: str, symbol: str | None = None) -> None:
    _OPS[name] = OpInfo(name, arity, kind, symbol)


for _n in ("var", "const", "param"):
    _op(_n, 0, "leaf")
_op("load", -1, "load")  # captured tensor element: attr = tensor name, args = indices
_op("vec", 1, "load")  # element of the hook's head vector: attr = "q"|"k"|"v"|"o"
for _n in ("neg", "abs", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt",
           "rsqrt", "sin", "cos", "floor", "to_f32", "to_i32"):
    _op(_n, 1, "unary")
# More of torch's elementwise math (docs/ops.md lists what each torch function traces to).
for _n in ("log1p", "expm1", "log10", "erf", "erfc", "erfinv", "lgamma", "tan", "asin", "acos",
           "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "ceil", "trunc", "round", "sign",
           "bitnot"):
    _op(_n, 1, "unary")
_op("not", 1, "logic", "~")
for _n, _s in (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("floordiv", "//"),
               ("mod", "%"), ("pow", "**")):
    _op(_n, 2, "binary", _s)
_op("min", 2, "binary")
_op("max", 2, "binary")
for _n in ("atan2", "hypot", "copysign", "nextafter", "fmod", "fmin", "fmax", "bitand", "bitor",
           "bitxor", "lshift", "rshift"):
    _op(_n, 2, "binary")
for _n, _s in (("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="), ("eq", "=="), ("ne", "!=")):
    _op(_n, 2, "compare", _s)
_op("and", 2, "logic", "&")
_op("or", 2, "logic", "|")
_op("where", 3, "select")

FLOAT_ONLY_UNARY = frozenset({"exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt",
                              "sin", "cos", "log1p", "expm1", "log10", "erf", "erfc", "erfinv",
                              "lgamma", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
                              "acosh", "atanh"})
# Rounding to an integer value: float in, float out (the frontend keeps an integer as it is).
ROUNDING_UNARY = frozenset({"floor", "ceil", "trunc", "round"})
# Binary ops computed in float whatever the operands (like `/` and `**`).
FLOAT_ONLY_BINARY = frozenset({"div", "pow", "atan2", "hypot", "copysign", "nextafter"})
# Bitwise ops: int32 only (booleans are promoted to 0 / 1 first, as torch promotes them).
INT_ONLY = frozenset({"bitnot", "bitand", "bitor", "bitxor", "lshift", "rshift"})


def op_info(op: str) -> OpInfo:
    return _OPS[op]


def all_ops() -> Iterable[str]:
    return _OPS.keys()


def _attr_key(attr: Any) -> Any:
    # float keys by exact bits so 0.0 / -0.0 stay distinct and NaN interns to one node
    if isinstance(attr, bool):
        return ("b", attr)
    if isinstance(attr, float):
        return ("f", attr.hex())
    if isinstance(attr, int):
        return ("i", attr)
    return attr


_INTERN: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()


class Node:
    """One interned IR node: `op(args...) : dtype`, with an optional attribute.

    Do not construct directly: use the builders below (`var`, `const`, `binary`, ...).
    """

    __slots__ = ("op", "dtype", "args", "attr", "__weakref__")
    op: str
    dtype: DType
    args: tuple["Node", ...]
    attr: Any

    def __new__(cls, op: str, dtype: DType, args: tuple["Node", ...] = (), attr: Any = None) -> "Node":
        key = (op, dtype, tuple(id(a) for a in args), _attr_key(attr))
        hit = _INTERN.get(key)
        if hit is not None:
            return hit
        self = object.__new__(cls)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "attr", attr)
        _INTERN[key] = self
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("IR nodes are immutable")

    def __reduce__(self):
        return (Node, (self.op, self.dtype, self.args, self.attr))

    # Identity is structure (thanks to interning).
    def __eq__(self, other: object) -> bool:  # pragma: no cover - identity semantics
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        from .printer import format_expr

        return f"<{format_expr(self)} : {self.dtype.value}>"

    # Convenience infix builders for passes and tests (the frontend has its own Proxy).
    def __add__(self, o: "Node | int | float") -> "Node":
        return binary("add", self, lift(o))

    def __sub__(self, o: "Node | int | float") -> "Node":
        return binary("sub", self, lift(o))

    def __mul__(self, o: "Node | int | float") -> "Node":
        return binary("mul", self, lift(o))

    def __ge__(self, o: "Node | int | float") -> "Node":  # type: ignore[override]
        return binary("ge", self, lift(o))

    def __le__(self, o: "Node | int | float") -> "Node":  # type: ignore[override]
        return binary("le", self, lift(o))

    def __gt__(self, o: "Node | int | float") -> "Node":  # type: ignore[override]
        return binary("gt", self, lift(o))

    def __lt__(self, o: "Node | int | float") -> "Node":  # type: ignore[override]
        return binary("lt", self, lift(o))

    def __and__(self, o: "Node") -> "Node":
        return binary("and", self, o)

    def __or__(self, o: "Node") -> "Node":
        return binary("or", self, o)

    def __invert__(self) -> "Node":
        return unary("not", self)

    @property
    def is_const(self) -> bool:
        return self.op == "const"


# ----------------------------------------------------------------------------- builders


class IRTypeError(TypeError):
    """An IR node was built with operands of the wrong type (a frontend bug or misuse)."""


def var(name: str) -> Node:
    if name not in VAR_TYPES:
        raise IRTypeError(f"unknown index variable {name!r}; known: {sorted(VAR_TYPES)}")
    return Node("var", VAR_TYPES[name], (), name)


def const(value: bool | int | float, dtype: DType | None = None) -> Node:
    if dtype is None:
        dtype = BOOL if isinstance(value, bool) else I32 if isinstance(value, int) else F32
    if dtype is BOOL:
        value = bool(value)
    elif dtype is I32:
        if isinstance(value, float) and not float(value).is_integer():
            raise IRTypeError(f"{value!r} is not an integer constant")
        value = int(value)
        if not -(2**31) <= value < 2**31:
            raise IRTypeError(f"integer constant {value} does not fit in i32")
    else:
        value = float(value)
    return Node("const", dtype, (), value)


def param(name: str, dtype: DType) -> Node:
    """A captured Python scalar: a kernel parameter, so new values never recompile."""
    if dtype is BOOL:
        raise IRTypeError("boolean parameters are folded as constants, not passed")
    return Node("param", dtype, (), name)


def load(tensor: str, indices: tuple[Node, ...], dtype: DType) -> Node:
    for i in indices:
        if i.dtype is not I32:
            raise IRTypeError(f"index into {tensor!r} must be i32, got {i.dtype.value}")
    return Node("load", dtype, tuple(indices), tensor)


def vec(name: str, index: Node) -> Node:
    if name not in VECTORS:
        raise IRTypeError(f"unknown head vector {name!r}")
    if index.dtype is not I32:
        raise IRTypeError(f"index into {name} must be i32, got {index.dtype.value}")
    return Node("vec", F32, (index,), name)


def lift(x: "Node | bool | int | float") -> Node:
    return x if isinstance(x, Node) else const(x)


def cast(x: Node, dtype: DType) -> Node:
    """Convert between i32/f32/bool with C semantics (bool->0/1, f32->i32 truncates)."""
    if x.dtype is dtype:
        return x
    if x.is_const:
        v = x.attr
        if dtype is F32:
            return const(float(v), F32)
        if dtype is I32:
            return const(int(v), I32)
        return const(bool(v), BOOL)
    if dtype is F32:
        return Node("to_f32", F32, (x,))
    if dtype is I32:
        return Node("to_i32", I32, (x,))
    return Node("ne", BOOL, (x, const(0, x.dtype)))


def _promote(a: Node, b: Node) -> tuple[Node, Node, DType]:
    """Arithmetic promotion like torch on scalars: bool < i32 < f32."""
    order = {BOOL: 0, I32: 1, F32: 2}
    t = a.dtype if order[a.dtype] >= order[b.dtype] else b.dtype
    if t is BOOL:
        t = I32
    return cast(a, t), cast(b, t), t


def _int_operand(op: str, x: Node) -> Node:
    if x.dtype is F32:
        raise IRTypeError(f"{op} needs integer operands, got f32")
    return cast(x, I32)


def unary(op: str, x: Node) -> Node:
    info = _OPS[op]
    if info.kind == "logic":  # not
        if x.dtype is not BOOL:
            raise IRTypeError("~ needs a boolean operand")
        return Node(op, BOOL, (x,))
    if op == "to_f32":
        return cast(x, F32)
    if op == "to_i32":
        return cast(x, I32)
    if op in FLOAT_ONLY_UNARY or op in ROUNDING_UNARY:
        x = cast(x, F32)
        return Node(op, F32, (x,))
    if op in INT_ONLY:
        return Node(op, I32, (_int_operand(op, x),))
    if x.dtype is BOOL:
        x = cast(x, I32)
    return Node(op, x.dtype, (x,))


def binary(op: str, a: Node, b: Node) -> Node:
    kind = _OPS[op].kind
    if kind == "logic":
        if a.dtype is not BOOL or b.dtype is not BOOL:
            raise IRTypeError(f"'{_OPS[op].symbol}' needs boolean operands, got "
                              f"{a.dtype.value} and {b.dtype.value}")
        return Node(op, BOOL, (a, b))
    if op in FLOAT_ONLY_BINARY:  # true division, pow, atan2, ... are always float, like torch
        return Node(op, F32, (cast(a, F32), cast(b, F32)))
    if op in INT_ONLY:
        return Node(op, I32, (_int_operand(op, a), _int_operand(op, b)))
    a, b, t = _promote(a, b)
    if kind == "compare":
        return Node(op, BOOL, (a, b))
    return Node(op, t, (a, b))


def where(c: Node, a: Node, b: Node) -> Node:
    if c.dtype is not BOOL:
        c = cast(c, BOOL)
    if a.dtype is BOOL and b.dtype is BOOL:
        return Node("where", BOOL, (c, a, b))
    a, b, t = _promote(a, b)
    return Node("where", t, (c, a, b))


# ----------------------------------------------------------------------------- traversal


def walk(root: Node) -> Iterator[Node]:
    """All nodes reachable from `root`, each once, children before parents."""
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        n, expanded = stack.pop()
        if id(n) in seen:
            continue
        if expanded:
            seen.add(id(n))
            yield n
        else:
            stack.append((n, True))
            for a in reversed(n.args):
                if id(a) not in seen:
                    stack.append((a, False))


def rewrite(root: Node, fn: Callable[[Node, tuple[Node, ...]], Node]) -> Node:
    """Bottom-up rebuild: `fn(old_node, new_args)` returns the replacement node."""
    memo: dict[int, Node] = {}
    for n in walk(root):
        memo[id(n)] = fn(n, tuple(memo[id(a)] for a in n.args))
    return memo[id(root)]


def rebuild(n: Node, args: tuple[Node, ...]) -> Node:
    """Rebuild `n` with new children through the typed builders (re-promotes types)."""
    if not n.args:
        return n
    if all(x is y for x, y in zip(args, n.args)):
        return n
    kind = _OPS[n.op].kind
    if n.op == "load":
        return load(n.attr, args, n.dtype)
    if n.op == "vec":
        return vec(n.attr, args[0])
    if n.op in ("to_f32", "to_i32"):
        return cast(args[0], F32 if n.op == "to_f32" else I32)
    if kind in ("unary",) or n.op == "not":
        return unary(n.op, args[0])
    if kind == "select":
        return where(*args)
    return binary(n.op, args[0], args[1])


def free_vars(root: Node) -> frozenset[str]:
    """Index variables (and `score`) an expression reads."""
    return frozenset(n.attr for n in walk(root) if n.op == "var")


def params_of(root: Node) -> frozenset[str]:
    return frozenset(n.attr for n in walk(root) if n.op == "param")


def tensors_of(root: Node) -> frozenset[str]:
    return frozenset(n.attr for n in walk(root) if n.op == "load")


def const_value(n: Node) -> Any:
    if n.op != "const":
        raise ValueError("not a constant")
    return n.attr


def is_finite_const(n: Node) -> bool:
    return n.op == "const" and (n.dtype is not F32 or math.isfinite(n.attr))
