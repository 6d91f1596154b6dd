"""The interval analysis stays sound for the integer ops torch's bitwise, shift, fmod and sign
functions trace to: every value an expression takes over a domain lies in its interval."""
from __future__ import annotations

import pytest
import torch

from attncc.ir.evaluator import evaluate
from attncc.ir.intervals import Domain, interval
from attncc.ir.nodes import binary, const, unary, var

q, kv, h = var("q_idx"), var("kv_idx"), var("h")
EXPRS = {
    "fmod": binary("fmod", q - kv, const(5)), "fmod_neg": binary("fmod", kv - q, const(-3)),
    "fmod_var": binary("fmod", q * 7 - 20, h + 1),
    "and_mask": binary("bitand", q, const(7)), "and_neg": binary("bitand", q - kv, const(12)),
    "and_both": binary("bitand", q - kv, kv - q), "or": binary("bitor", q, kv),
    "xor": binary("bitxor", q, kv * 3), "xor_neg": binary("bitxor", q - kv, q),
    "shl": binary("lshift", q, const(3)), "shl_var": binary("lshift", q - 4, binary("mod", h, const(8))),
    "shr": binary("rshift", q - kv, const(2)), "shr_var": binary("rshift", kv - 9, h),
    "shr_far": binary("rshift", q, const(40)), "sign": unary("sign", q - kv),
    "not": unary("bitnot", q - kv), "fmin": binary("fmin", q, kv - 3),
    "fmax": binary("fmax", q - kv, h),
}


@pytest.mark.parametrize("name", sorted(EXPRS))
@pytest.mark.parametrize("sizes", [(12, 9, 4), (1, 33, 2), (40, 40, 31)])
def test_interval_holds_every_value(name: str, sizes: tuple[int, int, int]) -> None:
    sq, skv, sh = sizes
    e = EXPRS[name]
    env = {"q_idx": torch.arange(sq)[:, None, None], "kv_idx": torch.arange(skv)[None, :, None],
           "h": torch.arange(sh)[None, None, :]}
    values = evaluate(e, env)
    r = interval(e, Domain({"q_idx": sq, "kv_idx": skv, "h": sh}))
    if r is None:
        return  # unbounded is sound
    lo, hi = int(values.min()), int(values.max())
    assert r[0] <= lo and hi <= r[1], f"{name}: values {lo}..{hi} outside {r}"


def test_bitwise_intervals_are_tight_where_the_signs_allow() -> None:
    dom = Domain({"q_idx": 100, "kv_idx": 100})
    assert interval(binary("bitand", q - kv, const(7)), dom) == (0, 7)
    assert interval(binary("rshift", q, const(2)), dom) == (0, 24)
    assert interval(binary("fmod", q - kv, const(8)), dom) == (-7, 7)
    assert interval(unary("sign", q + 1), dom) == (1, 1)
