"""One or more mod bodies for every torch function a mod can call (`torch_ops.COVERAGE`).

Each case is Python source for the value a `score_mod(score, b, h, q_idx, kv_idx)` returns,
reading edge values from captured tables indexed by the positions: `X` / `Y` floats (0, -0.0,
+-inf, NaN, huge, tiny, halves for rounding, random), `I` ints (int32 extremes, small values,
random), `J` nonzero int divisors (no -1: torch's int32 INT_MIN / -1 traps), `K` shift counts
(negative, 0..31, 32 and past), `Z` floats inside the int32 range (casting others is undefined in
torch), `P` / `Q` booleans. `tests/frontend/test_ops.py` runs every case with torch on float32 / int32 tensors and
with attncc (trace, simplify, evaluate), `tests/codegen/test_ops_compile.py` compiles them all
with NVRTC, and `tests/gpu/test_ops_gpu.py` runs them on the GPU.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from attncc.frontend import Variant
from attncc.ir.nodes import F32, I32, Node, const

NQ = NK = 40
_FLOATS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e30, -1e30, 3.4028234663852886e38,
           1e-40, -1e-40, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 1.0, -1.0, 0.3, -0.7, 7.0, -7.0,
           3.0, 100.5, -2.0, 0.999, 1e-7, 12345.678, -8388609.0, 16777217.0]
_INTS = [-2**31, -2**31 + 1, 2**31 - 1, -7, -1, 0, 1, 2, 5, 31, 32, -32, 1000, -1000,
         123456789, -987654321, 0x5555, 7, 3, 64]
_DIVISORS = [-7, -3, -2, 1, 2, 3, 5, 8, 16, 1000, 2**31 - 1, -2**31]
_IN_RANGE = [0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 2.5, 0.999, -0.999, 1e-40, 7.0, 1e9, -2e9,
             2147483520.0, -2147483648.0, 16777217.0, -3.7]
_SHIFTS = [-1, 0, 1, 2, 5, 16, 30, 31, 32, 33, 100, -100]


def _table(values: list, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`values`, then seeded random values of the same kind, `n` in all."""
    g = torch.Generator().manual_seed(seed)
    rest = n - len(values)
    if dtype.is_floating_point:
        extra = (torch.randn(rest, generator=g) * 10).tolist()
    else:
        pool = torch.tensor(values, dtype=torch.int64)
        extra = pool[torch.randint(len(values), (rest,), generator=g)].tolist()
    return torch.tensor(values + extra, dtype=dtype)


def tables() -> dict[str, torch.Tensor]:
    """The captured tables (X and I read at q_idx, Y, J, K at kv_idx)."""
    return {"x": _table(_FLOATS, NQ, torch.float32, 1),
            "y": _table(list(reversed(_FLOATS)), NK, torch.float32, 2),
            "i": _table(_INTS, NQ, torch.int32, 3), "j": _table(_DIVISORS, NK, torch.int32, 4),
            "k": _table(_SHIFTS, NK, torch.int32, 5), "z": _table(_IN_RANGE, NQ, torch.float32, 6)}


_VALUES = {"X": "x[q_idx]", "Y": "y[kv_idx]", "I": "i[q_idx]", "J": "j[kv_idx]",
           "K": "k[kv_idx]", "Z": "z[q_idx]", "P": "(i[q_idx] > 0)", "Q": "(j[kv_idx] > 2)"}

# base name -> argument lists (names from _VALUES, Python literals, keywords)
_FLOAT_UNARY = ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos",
                "log1p", "expm1", "log10", "erf", "erfc", "erfinv", "lgamma", "tan", "asin",
                "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "arcsin", "arccos",
                "arctan", "arcsinh", "arccosh", "arctanh", "expit", "gammaln", "deg2rad",
                "rad2deg", "reciprocal", "frac", "nan_to_num", "isnan", "isinf", "isposinf",
                "isneginf", "isfinite", "signbit")
ARGS: dict[str, list[tuple[str, ...]]] = {
    **{n: [("X",)] for n in _FLOAT_UNARY},
    **{n: [("X",), ("I",)] for n in ("floor", "ceil", "trunc", "fix", "neg",
                                      "negative", "abs", "absolute", "sign", "sgn", "square",
                                      "positive", "clone", "detach", "contiguous", "real",
                                      "conj", "conj_physical", "resolve_conj", "resolve_neg",
                                      "isreal", "is_floating_point")},
    "round": [("X",), ("X", "decimals=0")],  # torch has no integer round
    "nan_to_num": [("X",), ("X", "1.0", "2.0", "-3.0")],
    "exp": [("X",), ("I",)],  # an integer argument computes in float
    "sqrt": [("X",), ("I",)],
    **{n: [("X", "Y")] for n in ("atan2", "arctan2", "hypot", "copysign", "nextafter",
                                  "heaviside")},
    **{n: [("X", "Y"), ("I", "J")] for n in ("fmin", "fmax", "minimum", "maximum", "min",
                                              "max", "add", "sub", "subtract", "rsub", "mul",
                                              "multiply", "lt", "less", "le", "less_equal", "gt",
                                              "greater", "ge", "greater_equal", "eq", "ne",
                                              "not_equal", "fmod", "remainder", "floor_divide",
                                              "div", "divide", "true_divide")},
    "add": [("X", "Y"), ("I", "J"), ("I", "J", "alpha=3")],
    "sub": [("X", "Y"), ("I", "J"), ("I", "J", "alpha=-2")],
    "div": [("X", "Y"), ("I", "J"), ("X", "Y", "rounding_mode='trunc'"),
            ("I", "J", "rounding_mode='trunc'"), ("I", "J", "rounding_mode='floor'"),
            ("X", "Y", "rounding_mode='floor'")],
    "pow": [("X", "Y"), ("X", "2.0"), ("I", "0.5")],
    "clamp": [("X", "-1.0", "2.0"), ("I", "None", "3"), ("X", "Y")],
    "clip": [("X", "-1.0", "2.0")],
    "relu": [("X",), ("I",)], "relu6": [("X",)], "tanhshrink": [("X",)],
    "hardtanh": [("X",), ("X", "-0.5", "0.5")], "leaky_relu": [("X",), ("X", "0.2")],
    "threshold": [("X", "0.5", "-2.0")],
    "logit": [("X",), ("X", "1e-3")],
    "isclose": [("X", "Y"), ("X", "Y", "rtol=0.5", "atol=1.0", "equal_nan=True")], "hardshrink": [("X",), ("X", "1.5")],
    "clamp_min": [("X", "0.5"), ("I", "0")],
    "clamp_max": [("X", "Y"), ("I", "J")],
    "where": [("P", "X", "Y"), ("P", "1.0", "0"), ("P", "I", "0.5"), ("P", "True", "Q")],
    "masked_fill": [("X", "P", "-1.5"), ("I", "Q", "2.7")],
    **{n: [("I", "K")] for n in ("bitwise_left_shift", "bitwise_right_shift")},
    **{n: [("I", "J"), ("P", "Q"), ("P", "J")] for n in ("bitwise_and", "bitwise_or",
                                                          "bitwise_xor")},
    "bitwise_not": [("I",), ("P",)],
    **{n: [("P", "Q"), ("I", "X")] for n in ("logical_and", "logical_or", "logical_xor")},
    "logical_not": [("P",), ("X",)],
    "full_like": [("X", "2.5"), ("I", "-7.9"), ("X", "1", "dtype=torch.bool"),
                  ("P", "3", "dtype=torch.int32")],
    "zeros_like": [("X",), ("I", "dtype=torch.float32")],
    "ones_like": [("P",), ("X", "dtype=torch.int64")],
    "new_ones": [("I", "()"), ("P", "size=()", "dtype=torch.bool")],
    "new_zeros": [("X", "()"), ("I", "()", "dtype=torch.bool")],
    "new_full": [("I", "()", "9.5"), ("X", "()", "-1", "dtype=torch.int32")],
    "float": [("I",), ("P",)], "int": [("Z",), ("P",)], "long": [("Z",), ("I",)],
    "bool": [("X",), ("I",)],
    "to": [("I", "torch.float32"), ("Z", "dtype=torch.int64"), ("X", "torch.bool"),
           ("I", "'cpu'"), ("Z", "y[kv_idx]")],
    "type": [("Z", "torch.int32")],
}
# Tensor methods whose arguments differ from the torch function's
TENSOR_ARGS = {"where": [("X", "P", "Y"), ("I", "Q", "0.5"), ("P", "Q", "False")]}
# Python operators: Tensor dunder name -> source (reflected ones with a Python number left)
OPERATORS = {
    "__add__": [("{X} + {Y}"), ("{I} + {J}")], "__radd__": ["2.5 + {X}", "3 + {I}"],
    "__sub__": ["{X} - {Y}", "{I} - {J}"], "__rsub__": ["1.5 - {X}", "3 - {I}"],
    "__mul__": ["{X} * {Y}", "{I} * {J}"], "__rmul__": ["0.1 * {X}", "65537 * {I}"],
    "__truediv__": ["{X} / {Y}", "{I} / {J}"], "__rtruediv__": ["1.0 / {X}", "7 / {J}"],
    "__rdiv__": ["3.0 / {Y}"],
    "__floordiv__": ["{X} // {Y}", "{I} // {J}"], "__rfloordiv__": ["7.5 // {Y}", "100 // {J}"],
    "__mod__": ["{X} % {Y}", "{I} % {J}"], "__rmod__": ["7.5 % {Y}", "100 % {J}"],
    "__pow__": ["{X} ** {Y}", "{X} ** 3.0"], "__rpow__": ["2.0 ** {X}"],
    "__neg__": ["-{X}", "-{I}"], "__abs__": ["abs({X})", "abs({I})"], "__pos__": ["+{X}"],
    "__lt__": ["{X} < {Y}"], "__le__": ["{I} <= {J}"], "__gt__": ["{X} > {Y}"],
    "__ge__": ["{I} >= {J}"], "__eq__": ["{X} == {Y}"], "__ne__": ["{X} != {Y}"],
    "__and__": ["{I} & {J}", "{P} & {Q}", "{P} & {J}"], "__rand__": ["6 & {I}", "True & {P}"],
    "__or__": ["{I} | {J}", "{P} | {Q}"], "__ror__": ["6 | {I}"],
    "__xor__": ["{I} ^ {J}", "{P} ^ {Q}"], "__rxor__": ["6 ^ {I}", "True ^ {P}"],
    "__invert__": ["~{I}", "~{P}"],
    "__lshift__": ["{I} << {K}", "{I} << 3"], "__rlshift__": ["1 << {K}"],
    "__rshift__": ["{I} >> {K}", "{I} >> 31"], "__rrshift__": ["-1024 >> {K}"],
}
# COVERAGE names without a case: indexing is tested by the trace tests
NO_CASE = frozenset({"Tensor.__getitem__"})


def _call(qualname: str, args: tuple[str, ...]) -> str:
    vals = [_VALUES.get(a, a) for a in args]
    owner, name = qualname.rsplit(".", 1)
    if owner == "Tensor":
        return f"({vals[0]}).{name}({', '.join(vals[1:])})"
    return f"{owner}.{name}({', '.join(vals)})"


def sources(qualname: str) -> list[str]:
    """Mod bodies exercising one COVERAGE name (`torch.erf`, `Tensor.__lshift__`, ...)."""
    name = qualname.rsplit(".", 1)[1]
    if name in OPERATORS:
        return [s.format(**{k: v for k, v in _VALUES.items()}) for s in OPERATORS[name]]
    table = TENSOR_ARGS if qualname.startswith("Tensor.") and name in TENSOR_ARGS else ARGS
    return [_call(qualname, a) for a in table.get(name, [])]


def make_mod(source: str, tabs: dict[str, torch.Tensor]) -> Callable:
    """`score_mod` returning `source`, closing over the tables."""
    code = ("def make(x, y, i, j, k, z):\n"
            "    def mod(score, b, h, q_idx, kv_idx):\n"
            f"        return {source}\n"
            "    return mod\n")
    namespace = {"torch": torch, "math": math}
    exec(compile(code, f"<op case {source[:50]}>", "exec"), namespace)
    return namespace["make"](**tabs)


def grid() -> dict[str, torch.Tensor]:
    """FlexAttention's arguments as torch passes them: int32 indices, a float32 zero score."""
    return {"score": torch.zeros(()), "b": torch.zeros((), dtype=torch.int32),
            "h": torch.zeros((), dtype=torch.int32),
            "q_idx": torch.arange(NQ, dtype=torch.int32)[:, None],
            "kv_idx": torch.arange(NK, dtype=torch.int32)[None, :]}


def traced(fn: Callable, want: torch.Tensor) -> tuple[Node, dict[str, torch.Tensor]]:
    """The IR node of a case's value in the type the mod computes it in (a score_mod casts
    an integer result to float: this is the value before that cast), and its tensors."""
    if want.dtype == torch.bool:
        ir, bind = Variant(mask_mod=lambda b, h, q, kv: fn(0.0, b, h, q, kv)).trace()
        return ir.expr("mask_mod"), bind.tensors
    ir, bind = Variant(score_mod=fn).trace()
    node = ir.expr("score_mod")
    if want.is_floating_point():
        assert node.dtype is F32
        return node, bind.tensors
    if node.op == "const" and float(node.attr).is_integer():  # the cast of a constant folded
        return const(int(node.attr), I32), bind.tensors
    assert node.op == "to_f32" and node.args[0].dtype is I32, (node, want.dtype)
    return node.args[0], bind.tensors


def all_cases() -> list[tuple[str, str]]:
    """(COVERAGE name, source) of every case."""
    from attncc.frontend.torch_ops import COVERAGE, UNSUPPORTED

    return [(n, s) for n in sorted(COVERAGE) if n not in UNSUPPORTED for s in sources(n)]
