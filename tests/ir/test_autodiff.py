"""attncc.ir.autodiff: derivatives of a score_mod match torch.autograd on the user's Python,
including at the points where torch picks a subgradient (clamp bounds, max ties, abs at 0)."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import DifferentiationError
from attncc.ir.autodiff import derivative, score_mod_grad
from attncc.ir.evaluator import evaluate
from attncc.ir.nodes import F32, binary, const, load, unary, var
from attncc.ir.printer import format_expr

F64 = torch.float64
H = 3
# scores with the interesting points: the clamp bounds, 0, ties with bias, ordinary values
POINTS = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0], dtype=F64)
BIAS = torch.tensor([0.5, 1.0, -1.0], dtype=F64)


def _env(score: torch.Tensor) -> dict:
    return {"score": score[None, :], "b": torch.tensor(0), "h": torch.arange(H)[:, None],
            "q_idx": torch.tensor(5), "kv_idx": torch.tensor(2)}


MODS = {
    "clamp": lambda s, b, h, q, kv: torch.clamp(s, min=0.5, max=2.0),
    "clamp_min_tensor": lambda s, b, h, q, kv: torch.clamp(s, min=BIAS_NG[h]),
    "relu": lambda s, b, h, q, kv: torch.clamp(s, min=0.0),
    "maximum_live": lambda s, b, h, q, kv: torch.maximum(s, BIAS_G[h]),
    "minimum_self": lambda s, b, h, q, kv: torch.minimum(s, 2 * s),
    "abs": lambda s, b, h, q, kv: torch.abs(s) * 3,
    "where": lambda s, b, h, q, kv: torch.where(s > 0, s * 2, -s),
    "floor": lambda s, b, h, q, kv: torch.floor(s) + s,
    "remainder": lambda s, b, h, q, kv: s % 1.5 + torch.remainder(s + 4.0, BIAS_G[h] + 2.0),
    "pow": lambda s, b, h, q, kv: s ** 2 + s ** 0 + 2.0 ** s + (s * s) ** BIAS_G[h],
    "exp_log": lambda s, b, h, q, kv: torch.exp(s) + torch.log(s * s + 1) + torch.log2(s + 3),
    "sqrt_rsqrt": lambda s, b, h, q, kv: torch.sqrt(s + 2.5) + torch.rsqrt(s + 2.5),
    "trig": lambda s, b, h, q, kv: torch.sin(s) * torch.cos(s) + torch.sigmoid(s) * torch.exp2(s),
    "softcap_bias": lambda s, b, h, q, kv: 30 * torch.tanh(s / 30) * BIAS_G[h] + BIAS_G[h] / (s + 4),
    "int_cast": lambda s, b, h, q, kv: s * (s * 4).int() + BIAS_G[(kv - q).abs() % H],
}
BIAS_G = BIAS.clone()  # the tensor whose gradient is asked for
BIAS_NG = BIAS.clone()  # a captured tensor that does not require grad


@pytest.mark.parametrize("name", sorted(MODS))
def test_derivatives_match_torch_autograd(name: str) -> None:
    fn = MODS[name]
    bias = BIAS_G.clone().requires_grad_(True)
    ir, bind = attncc.Variant(score_mod=fn, name=name).trace()
    grads = [n for n, t in bind.tensors.items() if t is BIAS_G]
    g = score_mod_grad(ir, grads)
    # torch.autograd on the user's Python, with the grad tensor swapped in
    score = POINTS.clone().requires_grad_(True)
    env = _env(score)
    out = _call_with(fn, bias, env).expand(H, POINTS.numel())  # one value per (h, score)
    ds, db = torch.autograd.grad(out.sum(), (score, bias), allow_unused=True)
    ev_env = _env(POINTS)
    tensors = {n: t.detach() for n, t in bind.tensors.items()}
    dlog = evaluate(g.logits, ev_env, tensors, bind.scalars, float_dtype=F64)
    want_ds = ds if ds is not None else torch.zeros_like(score)
    torch.testing.assert_close(torch.broadcast_to(dlog, (H, POINTS.numel())).sum(0), want_ds, rtol=1e-6, atol=1e-9,
                               equal_nan=True, msg=f"{name}: d/dscore {format_expr(g.logits)}")
    if grads:
        got_db = torch.zeros_like(BIAS)
        for r in g.reads:
            d = evaluate(r.grad, ev_env, tensors, bind.scalars, float_dtype=F64)
            idx = evaluate(r.indices[0], ev_env, tensors, bind.scalars, float_dtype=F64)
            full = (H, POINTS.numel())
            got_db.index_put_((torch.broadcast_to(idx, full).long().flatten(),),
                              torch.broadcast_to(d, full).flatten(), accumulate=True)
        want_db = db if db is not None else torch.zeros_like(BIAS)
        torch.testing.assert_close(got_db, want_db, rtol=1e-6, atol=1e-9,
                                   msg=f"{name}: d/dbias")


def _call_with(fn, bias, env):
    """fn on real tensors, with BIAS_G's reads going through `bias` (which requires grad)."""
    global BIAS_G
    old = BIAS_G
    BIAS_G = bias
    try:
        return fn(env["score"], env["b"], env["h"], env["q_idx"], env["kv_idx"])
    finally:
        BIAS_G = old


def test_ties_follow_torch_conventions() -> None:
    s = var("score")
    clamp = binary("max", s, const(0.5))
    assert format_expr(derivative(clamp, s)) == "where(score < 0.5, 0.0, 1.0)"  # clamp: all
    b = load("bias", (var("h"),), F32)
    d = derivative(binary("max", s, b), s, leaves=(s, b))
    at_tie = evaluate(d, {"score": torch.tensor(1.0, dtype=F64), "h": torch.tensor(0)},
                      {"bias": torch.tensor([1.0], dtype=F64)}, float_dtype=F64)
    assert float(at_tie) == 0.5  # torch.maximum: half
    assert format_expr(derivative(unary("abs", s), s)) == \
        "where(score > 0.0, 1.0, where(score < 0.0, -1.0, 0.0))"


def test_evaluator_autograd_is_clamps_at_a_bound() -> None:
    """The CPU path differentiates through the evaluator: torch.clamp's tie rule there too."""
    ir, bind = attncc.Variant(score_mod=MODS["clamp"], name="c").trace()
    score = POINTS.clone().requires_grad_(True)
    out = evaluate(ir.expr("score_mod"), {"score": score}, float_dtype=F64)
    (got,) = torch.autograd.grad(out.sum(), score)
    p = POINTS.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(torch.clamp(p, min=0.5, max=2.0).sum(), p)
    assert torch.equal(got, want)
    assert torch.equal(out.detach(), torch.clamp(POINTS, min=0.5, max=2.0))


def test_reads_of_one_tensor_each_contribute() -> None:
    t = torch.rand(8, requires_grad=True)
    ir, _ = attncc.Variant(score_mod=lambda s, b, h, q, kv: s * t[h] + t[h + 1] * t[h],
                           name="two").trace()
    g = score_mod_grad(ir, [ir.tensors[0].name])
    assert sorted(format_expr(r.indices[0]) for r in g.reads) == ["h", "h + 1"]
    assert format_expr(g.logits) == "t[h]"


def test_mask_reading_a_grad_tensor_is_an_error_naming_the_line() -> None:
    t = torch.rand(4, requires_grad=True)

    def gate(b, h, q_idx, kv_idx):
        return t[h] > 0.5

    ir, _ = attncc.Variant(mask_mod=gate, name="gate").trace()
    with pytest.raises(DifferentiationError, match=r"test_autodiff\.py:\d+ \(gate\).*'t'"):
        score_mod_grad(ir, ["t"])
    assert score_mod_grad(ir, []).reads == ()  # not asked: fine


def test_softcap_derivative_is_simplified() -> None:
    s = var("score")
    e = binary("mul", const(30.0), unary("tanh", binary("div", s, const(30.0))))
    d = derivative(e, s)
    x = torch.linspace(-50, 50, 11, dtype=F64)
    got = evaluate(d, {"score": x}, float_dtype=F64)
    assert torch.allclose(got, 1 - torch.tanh(x / 30) ** 2, rtol=1e-6)
    assert format_expr(d).count("tanh") == 2 and "/ 30.0" in format_expr(d)
    assert math.isfinite(float(got[0]))
