"""torch.autograd.gradcheck (fp64, small shapes) of attncc.flex_attention on the CPU: every
AttentionGym variant and the learnable-bias variants, whose captured tensors get `.grad`."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc.gym import GYM
from tests.helpers.learnable import LEARNABLE

F64 = torch.float64


def _qkv(B, Hq, Hkv, Sq, Skv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, s, D, generator=g, dtype=F64).requires_grad_(True)
                 for h, s in ((Hq, Sq), (Hkv, Skv), (Hkv, Skv)))


@pytest.mark.parametrize("name", sorted(GYM))
def test_gradcheck_gym_variant(name: str) -> None:
    B, Hq, Hkv, S, D = 1, 2, 1, 7, 4
    variant = GYM[name](B, Hq, S, D)
    q, k, v = _qkv(B, Hq, Hkv, S, S, D, seed=sorted(GYM).index(name))

    def f(q, k, v):
        return attncc.flex_attention(q, k, v, score_mod=variant, enable_gqa=True)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(LEARNABLE))
def test_gradcheck_learnable_bias(name: str) -> None:
    B, H, Sq, Skv, D = 1, 2, 5, 7, 4
    mod, tensors = LEARNABLE[name](H, Sq, Skv, dtype=F64)
    (bias,) = tensors.values()
    q, k, v = _qkv(B, H, H, Sq, Skv, D, seed=5)

    def f(q, k, v, bias):
        return attncc.flex_attention(q, k, v, score_mod=mod)

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-7, rtol=1e-5)
    # a training step: the captured tensor's .grad is filled
    bias.grad = None
    attncc.flex_attention(q, k, v, score_mod=mod).square().sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_gradcheck_causal_bias_and_the_lse_gradient() -> None:
    mod, tensors = LEARNABLE["rel_table"](2, 6, 6, dtype=F64)
    (bias,) = tensors.values()
    q, k, v = _qkv(1, 2, 2, 6, 6, 4, seed=9)
    variant = attncc.Variant(score_mod=mod, mask_mod=lambda b, h, qi, kv: qi >= kv, name="rc")

    def f(q, k, v, bias):
        return attncc.flex_attention(q, k, v, score_mod=variant)

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-7, rtol=1e-5)
    # the LSE is float32 (FlexAttention's convention), too coarse for finite differences: its
    # gradient is checked against the backward oracle instead
    from attncc.runtime.reference_backward import attention_backward_reference

    _, lse = attncc.flex_attention(q, k, v, score_mod=variant, return_lse=True)
    dlse = torch.randn(lse.shape, dtype=F64)
    got = torch.autograd.grad((lse.double() * dlse).sum(), (q, k, v, bias), allow_unused=True)
    assert got[2] is None  # the LSE does not depend on v
    ir, bind = variant.trace()
    want = attention_backward_reference(q, k, v, torch.zeros_like(q), ir, bind, dlse=dlse,
                                        grad_tensors=list(bind.tensors))
    assert want.dv.abs().max() == 0
    for g, w in zip(got[:2] + got[3:], (want.dq, want.dk, *want.captured.values())):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
