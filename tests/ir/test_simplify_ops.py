"""Simplifier rules and constant folding for the ops torch's math, bitwise and shift functions
trace to: exact for int32 (and bit for bit for float rounding), folded as torch computes."""
from __future__ import annotations

import math

import pytest
import torch

from attncc.ir.nodes import I32, binary, const, unary, var
from attncc.ir.simplify import simplify

q = var("q_idx")
s = var("score")


def test_bitwise_identities() -> None:
    assert simplify(binary("bitand", q, const(-1))) is q
    assert simplify(binary("bitor", const(0), q)) is q
    assert simplify(binary("bitxor", q, const(0))) is q
    assert simplify(binary("lshift", q, const(0))) is q
    assert simplify(binary("rshift", q, const(0))) is q
    assert simplify(binary("bitand", q, q)) is q
    assert simplify(unary("bitnot", unary("bitnot", q))) is q
    # not identities: a shift of 0 by q, an xor of q with itself kept (exact, but not rewritten)
    assert simplify(binary("lshift", const(0), q)).op == "lshift"


def test_rounding_of_a_rounded_value_is_itself() -> None:
    r = unary("round", s)
    for op in ("floor", "ceil", "trunc", "round"):
        assert simplify(unary(op, r)) is r


@pytest.mark.parametrize("op,a,b,torch_fn", [
    ("fmod", -7, 3, torch.fmod), ("fmod", 7, -3, torch.fmod), ("lshift", 1, 31, None),
    ("lshift", 5, 32, None), ("rshift", -1024, 40, None), ("rshift", -1024, -1, None),
    ("bitand", -8, 12, torch.bitwise_and), ("bitxor", -1, 5, torch.bitwise_xor),
])
def test_integer_constants_fold_as_torch_int32(op, a, b, torch_fn) -> None:
    got = simplify(binary(op, const(a), const(b)))
    ta, tb = torch.tensor(a, dtype=torch.int32), torch.tensor(b, dtype=torch.int32)
    if torch_fn is None:
        torch_fn = torch.bitwise_left_shift if op == "lshift" else torch.bitwise_right_shift
    assert got.op == "const" and got.dtype is I32 and got.attr == int(torch_fn(ta, tb))


@pytest.mark.parametrize("op,x", [("sign", -0.0), ("sign", math.nan), ("round", 2.5),
                                  ("round", -0.5), ("trunc", -0.7), ("ceil", -0.2),
                                  ("erf", 0.5), ("log1p", 1e-8), ("expm1", 1e-8)])
def test_float_constants_fold_as_torch_float32(op, x) -> None:
    got = simplify(unary(op, const(x)))
    want = getattr(torch, op)(torch.tensor(x, dtype=torch.float32))
    assert got.op == "const"
    assert torch.tensor(got.attr, dtype=torch.float32).view(torch.int32) == want.view(torch.int32) \
        or (math.isnan(got.attr) and bool(want.isnan()))
