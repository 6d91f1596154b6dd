"""IR expression -> CUDA C++ expression text, with shared subexpressions bound to temporaries.

Every non-leaf node used more than once, and every subtree whose text grows long, becomes a
`const` local (`t0`, `t1`, ... numbered in post-order walk order): that is the CSE, and it keeps
lines readable. Nodes that read memory (captured-tensor loads, head-vector reads) are only
hoisted when they are evaluated unconditionally: under a `where` branch or the right side of
`&` / `|` they stay inline, so C's lazy `?:` / `&&` / `||` still guard them (e.g.
`where(i < n, table[i], 0)` never reads `table[n]`).

Example:
    >>> from attncc.ir.nodes import var, const, unary, binary
    >>> s = var("score")
    >>> code = emit(const(30.0) * unary("tanh", binary("div", s, const(30.0))))
    >>> code.value
    '30.0f * tanhf(score / 30.0f)'
    >>> d = var("q_idx") - var("kv_idx")
    >>> print("\\n".join(emit((d >= 0) & (d < 8)).lines()))
    const int t0 = q_idx - kv_idx;
    return t0 >= 0 && t0 < 8;
"""
from __future__ import annotations

import decimal
import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..ir.discrete import discrete_cone, is_closed, is_sink
from ..ir.nodes import BOOL, F32, I32, DType, Node, walk
from .errors import CodegenError

__all__ = ["ExprNames", "CudaCode", "emit", "float_literal", "int_literal", "ctype_of", "to_f32"]

# Binding power, higher binds tighter (C++ precedence).
_ATOM, _UNARY, _MUL, _ADD, _REL, _EQ, _AND, _OR, _COND = 100, 90, 80, 70, 60, 55, 40, 35, 20

_INFIX = {"add": ("+", _ADD), "sub": ("-", _ADD), "mul": ("*", _MUL), "div": ("/", _MUL),
          "lt": ("<", _REL), "le": ("<=", _REL), "gt": (">", _REL), "ge": (">=", _REL),
          "eq": ("==", _EQ), "ne": ("!=", _EQ), "and": ("&&", _AND), "or": ("||", _OR)}
_FLOAT_CALLS = {"exp": "expf", "exp2": "exp2f", "log": "logf", "log2": "log2f", "tanh": "tanhf",
                "sigmoid": "attncc::sigmoid", "sqrt": "sqrtf", "rsqrt": "rsqrtf", "sin": "sinf",
                "cos": "cosf", "floor": "floorf", "abs": "fabsf",
                "log1p": "log1pf", "expm1": "expm1f", "log10": "log10f", "erf": "erff",
                "erfc": "erfcf", "erfinv": "erfinvf", "lgamma": "lgammaf", "tan": "tanf",
                "asin": "asinf", "acos": "acosf", "atan": "atanf", "sinh": "sinhf",
                "cosh": "coshf", "asinh": "asinhf", "acosh": "acoshf", "atanh": "atanhf",
                "ceil": "ceilf", "trunc": "truncf", "round": "rintf", "sign": "attncc::signf"}
# fast_math=True: one-MUFU approximations (attncc_types.cuh documents each error bound); sin /
# cos reduce the angle to [-pi, pi] first (sin.approx has no range reduction, and RoPE angles
# reach thousands of radians), within 1e-6 absolute up to |x| = 1e5, libm beyond.
_FAST_FLOAT_CALLS = {**_FLOAT_CALLS, "exp": "attncc::fast_exp", "exp2": "attncc::fast_exp2",
                     "tanh": "attncc::fast_tanh", "sigmoid": "attncc::fast_sigmoid",
                     "log": "attncc::fast_log", "log2": "attncc::fast_log2",
                     "sin": "attncc::fast_sin", "cos": "attncc::fast_cos"}
_INT_CALLS = {"abs": "attncc::absi", "sign": "attncc::signi"}
# Float arithmetic that becomes a discrete value (`attncc.ir.discrete`) is spelled as torch's
# CUDA kernels compute it, one rounding per op: round-to-nearest intrinsics, which the compiler
# never contracts into an FMA, and the accurate libm functions even under fast_math.
_RN_INFIX = {"add": "__fadd_rn", "sub": "__fsub_rn", "mul": "__fmul_rn"}
# torch's x ** c for a scalar exponent (aten pow_tensor_scalar): these exponents take a
# dedicated kernel, every other one powf.
_POW_SPECIAL = {0.5: "sqrtf({x})", -0.5: "rsqrtf({x})", -1.0: "__frcp_rn({x})",
                2.0: "__fmul_rn({x}, {x})", 3.0: "__fmul_rn(__fmul_rn({x}, {x}), {x})",
                -2.0: "__frcp_rn(__fmul_rn({x}, {x}))"}
_BINARY_CALLS = {("floordiv", F32): "attncc::floordiv", ("floordiv", I32): "attncc::floordiv",
                 ("mod", F32): "attncc::pymod", ("mod", I32): "attncc::pymod",
                 ("pow", F32): "powf", ("min", F32): "attncc::minf", ("max", F32): "attncc::maxf",
                 ("min", I32): "attncc::mini", ("max", I32): "attncc::maxi",
                 ("atan2", F32): "atan2f", ("hypot", F32): "hypotf",
                 ("copysign", F32): "copysignf", ("nextafter", F32): "nextafterf",
                 ("fmod", F32): "fmodf", ("fmod", I32): "attncc::fmodi",
                 ("fmin", F32): "fminf", ("fmax", F32): "fmaxf",
                 ("fmin", I32): "attncc::mini", ("fmax", I32): "attncc::maxi",
                 ("lshift", I32): "attncc::shl", ("rshift", I32): "attncc::shr"}
# int32 bitwise ops: always parenthesised (C ranks & ^ | below ==, unlike Python).
_BITWISE = {"bitand": "&", "bitor": "|", "bitxor": "^"}
_LEAVES = ("var", "const", "param")  # never bound to temporaries: already a name or literal
_CTYPES = {F32: "float", I32: "int", BOOL: "bool"}
_LOAD_CONVERT = {F32: "attncc::to_float", I32: "attncc::to_int", BOOL: "attncc::to_bool"}
# Children evaluated only under a condition: where's branches, the right side of && / ||.
_CONDITIONAL_ARGS = {"where": (1, 2), "and": (1,), "or": (1,)}


def ctype_of(dtype: DType) -> str:
    """C type of an IR value type.

    Example:
        >>> ctype_of(F32), ctype_of(BOOL)
        ('float', 'bool')
    """
    return _CTYPES[dtype]


def to_f32(v: float) -> float:
    """Round a Python float to the nearest float32 (ties to even); overflow gives +-inf."""
    if math.isnan(v) or math.isinf(v):
        return v
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        # Beyond FLT_MAX: round-to-nearest gives inf from FLT_MAX + half an ulp (2**128 - 2**103).
        big = 2.0**128 - 2.0**103
        if abs(v) >= big:
            return math.copysign(math.inf, v)
        return math.copysign(3.4028234663852886e38, v)


def _reciprocal_literal(c: float) -> str:
    """1 / c in float32 as torch's CUDA division by a Python scalar computes it (1.0f / c)."""
    c = to_f32(c)
    if c == 0 or math.isnan(c):
        return float_literal(math.nan if math.isnan(c) else math.copysign(math.inf, c))
    return float_literal(to_f32(1.0 / c))


def float_literal(v: float) -> str:
    """An exact float32 literal for `v` (rounded to float32 first, as the kernel computes).

    Short exact decimals print as decimals, everything else as a hex float; inf and NaN use
    bit patterns (there is no literal for them and no header is included).

    Example:
        >>> float_literal(30.0), float_literal(0.5), float_literal(1 / 30)
        ('30.0f', '0.5f', '0x1.111112p-5f')
        >>> float_literal(float("-inf")), float_literal(-0.0)
        ('__uint_as_float(0xff800000u)', '-0.0f')
    """
    x = to_f32(float(v))
    if math.isnan(x):
        return "__uint_as_float(0x7fc00000u)"
    if math.isinf(x):
        return "__uint_as_float(0x7f800000u)" if x > 0 else "__uint_as_float(0xff800000u)"
    if x == 0.0:
        return "-0.0f" if math.copysign(1.0, x) < 0 else "0.0f"
    if x.is_integer() and abs(x) < 1e7:
        return f"{int(x)}.0f"
    text = repr(x)
    if len(text) <= 12 and "e" not in text and decimal.Decimal(text) == decimal.Decimal(x):
        return text + "f"
    sign, rest = ("-", x.hex()[1:]) if x < 0 else ("", x.hex())
    mant, exp = rest.split("p")
    mant = mant.rstrip("0").rstrip(".")
    return f"{sign}{mant}p{exp}f"


def int_literal(v: int) -> str:
    """A 32-bit int literal (INT_MIN has no literal spelling of type int).

    Example:
        >>> int_literal(-3), int_literal(-2**31)
        ('-3', '(-2147483647 - 1)')
    """
    if v == -(2**31):
        return "(-2147483647 - 1)"
    return str(int(v))


@dataclass(frozen=True)
class ExprNames:
    """How IR names are spelled in the generated C++ of one hook.

    `vars` renames index variables (KeyTransform calls its head `h_kv`); `tensors` / `scalars`
    map captured names to the members of the params struct, reached through `params`.
    """

    vars: Mapping[str, str] = field(default_factory=dict)
    tensors: Mapping[str, str] = field(default_factory=dict)
    scalars: Mapping[str, str] = field(default_factory=dict)
    params: str = "p"


@dataclass(frozen=True)
class CudaCode:
    """`temps` (`const T tN = ...;` statements) followed by the value expression."""

    temps: tuple[str, ...]
    value: str
    ctype: str

    def lines(self) -> list[str]:
        """The statements of a function body that returns the value."""
        return [*self.temps, f"return {self.value};"]


class _Printer:
    def __init__(self, names: ExprNames, fast_math: bool = False,
                 exact: frozenset[Node] = frozenset()) -> None:
        self.names = names
        self.fast_math = fast_math
        self.exact = exact  # F32 nodes spelled as torch computes them (discrete cone, sinks)
        self.bound: dict[int, str] = {}

    def leaf(self, n: Node) -> tuple[str, int]:
        if n.op == "var":
            return self.names.vars.get(n.attr, n.attr), _ATOM
        if n.op == "param":
            if n.attr not in self.names.scalars:
                raise CodegenError(f"the IR reads captured scalar {n.attr!r}, which the variant "
                                   f"does not declare (VariantIR.scalars); declare it")
            return f"{self.names.params}.{self.names.scalars[n.attr]}", _ATOM
        v = n.attr
        if n.dtype is BOOL:
            return ("true" if v else "false"), _ATOM
        text = float_literal(v) if n.dtype is F32 else int_literal(v)
        return text, (_UNARY if text.startswith("-") else _ATOM)

    def text(self, n: Node, texts: Mapping[int, tuple[str, int]]) -> tuple[str, int]:
        """Text of `n` given the (text, precedence) of its children."""

        def arg(i: int, need: int) -> str:
            t, prec = texts[id(n.args[i])]
            return t if prec >= need else f"({t})"

        def operand(i: int, need: int) -> str:
            # binary operands never start with '-': `a - (-b)` reads better than `a - -b`
            t = arg(i, need)
            return f"({t})" if t.startswith("-") else t

        op = n.op
        if op in _LEAVES:
            return self.leaf(n)
        if op == "load":
            return self.load(n, [operand(i, _UNARY) for i in range(len(n.args))]), _ATOM
        if op == "vec":
            return f"{n.attr}[{texts[id(n.args[0])][0]}]", _ATOM
        if op == "neg":
            return "-" + operand(0, _UNARY), _UNARY
        if op == "not":
            return "!" + operand(0, _UNARY), _UNARY
        if op == "bitnot":
            return "~" + operand(0, _UNARY), _UNARY
        if op in _BITWISE:
            return f"({operand(0, _ATOM)} {_BITWISE[op]} {operand(1, _ATOM)})", _ATOM
        if op in ("to_f32", "to_i32"):
            return f"({'float' if op == 'to_f32' else 'int'})" + operand(0, _UNARY), _UNARY
        if n in self.exact and op not in ("neg", "where", "min", "max", "to_f32"):
            return self.exact_text(n, texts), _ATOM
        if op == "div" and self.fast_math and n.dtype is F32:
            return self.fast_div(n, texts, operand)
        if op in _INFIX:
            sym, prec = _INFIX[op]
            if op in ("and", "or"):
                # && inside || (and the reverse) always gets parentheses, as compilers suggest
                lneed = prec if n.args[0].op == op else _EQ
                return f"{operand(0, lneed)} {sym} {operand(1, _EQ)}", prec
            if prec in (_REL, _EQ):  # no chained comparisons: a < b == c reads ambiguously
                return f"{operand(0, _ADD)} {sym} {operand(1, _ADD)}", prec
            # left-associative; a right operand of equal precedence keeps its parentheses, so
            # float evaluation order is exactly the IR's
            return f"{operand(0, prec)} {sym} {operand(1, prec + 1)}", prec
        if op == "where":
            return f"{arg(0, _COND + 1)} ? {arg(1, _COND + 1)} : {arg(2, _COND + 1)}", _COND
        if len(n.args) == 1:
            table = ((_FAST_FLOAT_CALLS if self.fast_math else _FLOAT_CALLS) if n.dtype is F32
                     else _INT_CALLS)
            if op not in table:
                raise CodegenError(f"no CUDA spelling for {op} on {n.dtype.value}")
            return f"{table[op]}({texts[id(n.args[0])][0]})", _ATOM
        fn = _BINARY_CALLS.get((op, n.dtype))
        if fn is None:
            raise CodegenError(f"no CUDA spelling for {op} on {n.dtype.value}")
        a, b = (texts[id(x)][0] for x in n.args)
        return f"{fn}({a}, {b})", _ATOM

    def exact_text(self, n: Node, texts: Mapping[int, tuple[str, int]]) -> str:
        """A discrete-cone float op, one IEEE rounding each, as torch's CUDA kernels do it."""
        op = n.op
        x = [texts[id(a)][0] for a in n.args]
        if op in _RN_INFIX:
            return f"{_RN_INFIX[op]}({x[0]}, {x[1]})"
        if op in ("div", "floordiv"):
            b = n.args[1]
            if not is_closed(b):
                return f"{'__fdiv_rn' if op == 'div' else 'attncc::floordiv'}({x[0]}, {x[1]})"
            # torch divides by a Python scalar as a multiply by its float32 reciprocal
            rcp = _reciprocal_literal(b.attr) if b.op == "const" else f"__frcp_rn({x[1]})"
            if op == "div":
                return f"__fmul_rn({x[0]}, {rcp})"
            return f"attncc::floordiv_rcp({x[0]}, {x[1]}, {rcp})"
        if op == "pow" and n.args[1].op == "const":
            special = _POW_SPECIAL.get(float(to_f32(n.args[1].attr)))
            if special is not None:
                return special.format(x=x[0])
        if op == "pow" and is_closed(n.args[1]):
            return f"attncc::pow_scalar({x[0]}, {x[1]})"
        if len(n.args) == 1:
            if op not in _FLOAT_CALLS:
                raise CodegenError(f"no CUDA spelling for {op} on {n.dtype.value}")
            return f"{_FLOAT_CALLS[op]}({x[0]})"
        fn = _BINARY_CALLS.get((op, n.dtype))
        if fn is None:
            raise CodegenError(f"no CUDA spelling for {op} on {n.dtype.value}")
        return f"{fn}({x[0]}, {x[1]})"

    def fast_div(self, n: Node, texts: Mapping[int, tuple[str, int]], operand: Any
                 ) -> tuple[str, int]:
        """a / c -> a * (1/c) for a constant c whose reciprocal is a normal float (<= 1 ulp from
        the division); a / b -> attncc::fast_div (a * rcp.approx(b), ~2 ulp) otherwise."""
        b = n.args[1]
        if b.op == "const" and b.attr != 0 and math.isfinite(b.attr):
            r = to_f32(1.0 / to_f32(b.attr))
            if r != 0 and math.isfinite(r) and abs(r) >= 1.1754943508222875e-38:
                return f"{operand(0, _MUL)} * {float_literal(r)}", _MUL
        a_text, b_text = (texts[id(x)][0] for x in n.args)
        return f"attncc::fast_div({a_text}, {b_text})", _ATOM

    def load(self, n: Node, idx: list[str]) -> str:
        if n.attr not in self.names.tensors:
            raise CodegenError(f"the IR reads captured tensor {n.attr!r}, which the variant "
                               f"does not declare (VariantIR.tensors); declare it")
        base = f"{self.names.params}.{self.names.tensors[n.attr]}"
        # Offsets in 64-bit: a captured tensor may have more than 2**31 elements. A constant-0
        # index adds nothing and is left out.
        terms = [f"(attncc::i64){text} * {base}_stride[{k}]"
                 for k, (a, text) in enumerate(zip(n.args, idx))
                 if not (a.op == "const" and a.attr == 0)]
        offset = " + ".join(terms) if terms else "0"
        return f"{_LOAD_CONVERT[n.dtype]}({base}[{offset}])"


def _unconditional(root: Node, order: list[Node]) -> set[int]:
    """Ids of nodes evaluated on every execution of `root` (not only under a condition)."""
    always = {id(root)}
    for n in reversed(order):  # parents before children
        if id(n) not in always:
            continue
        skip = _CONDITIONAL_ARGS.get(n.op, ())
        for i, a in enumerate(n.args):
            if i not in skip:
                always.add(id(a))
    return always


def emit(root: Node, names: ExprNames | None = None, *, inline_limit: int = 96,
         fast_math: bool = False, temp_prefix: str = "t") -> CudaCode:
    """CUDA text for `root`: temporaries for shared / long subtrees, then the value.

    `fast_math` spells exp/exp2/log/log2/tanh/sigmoid with one-instruction hardware
    approximations and float division by a constant as multiplication by its reciprocal (the
    FA2/FA3 kernels use it; results stay well inside bf16/fp16 tolerance). Float arithmetic
    that becomes a discrete value (an int cast, floor, comparison: `attncc.ir.discrete`) is
    spelled as torch's CUDA kernels compute it in either mode: `__fmul_rn`-style intrinsics
    (never contracted into an FMA), accurate libm, a Python-scalar divisor as a multiply by
    its float32 reciprocal, torch's scalar-exponent pow. Temporaries are named
    `<temp_prefix>0`, `<temp_prefix>1`, ... (distinct prefixes let several expressions share
    one C++ scope).

    Example:
        >>> from attncc.ir.nodes import var, where, load, const
        >>> i = var("kv_idx")
        >>> e = where(i < var("q_idx"), load("tab", (i,), F32), const(0.0))
        >>> emit(e, ExprNames(tensors={"tab": "tab"})).value
        'kv_idx < q_idx ? attncc::to_float(p.tab[(attncc::i64)kv_idx * p.tab_stride[0]]) : 0.0f'
        >>> from attncc.ir.nodes import unary, binary
        >>> emit(const(30.0) * unary("tanh", binary("div", var("score"), const(30.0))),
        ...      fast_math=True).value
        '30.0f * attncc::fast_tanh(score * 0x1.111112p-5f)'
        >>> from attncc.ir.nodes import cast
        >>> d = cast(var("q_idx") - var("kv_idx"), F32)
        >>> emit(cast(binary("div", unary("log", d), const(2.5)) * 8.0, I32), fast_math=True).value
        '(int)__fmul_rn(__fmul_rn(logf((float)(q_idx - kv_idx)), 0x1.99999ap-2f), 8.0f)'
    """
    names = names or ExprNames()
    order = list(walk(root))
    uses: Counter[int] = Counter()
    for n in order:
        for a in n.args:
            uses[id(a)] += 1
    always = _unconditional(root, order)
    reads_memory: set[int] = set()
    for n in order:
        if n.op in ("load", "vec") or any(id(a) in reads_memory for a in n.args):
            reads_memory.add(id(n))
    exact = discrete_cone(root) | {n for n in order if n.dtype is F32 and is_sink(n)}
    printer = _Printer(names, fast_math, frozenset(exact))
    texts: dict[int, tuple[str, int]] = {}
    temps: list[str] = []
    for n in order:
        text, prec = printer.text(n, texts)
        hoist = (n is not root and n.op not in _LEAVES
                 and (uses[id(n)] > 1 or len(text) > inline_limit)
                 and (id(n) in always or id(n) not in reads_memory))
        if hoist:
            name = f"{temp_prefix}{len(temps)}"
            temps.append(f"const {_CTYPES[n.dtype]} {name} = {text};")
            texts[id(n)] = (name, _ATOM)
        else:
            texts[id(n)] = (text, prec)
    return CudaCode(tuple(temps), texts[id(root)][0], _CTYPES[root.dtype])
