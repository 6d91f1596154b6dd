"""The backward oracle (runtime/reference_backward.py), which uses only attncc.ir.autodiff's
derived expressions, against torch.autograd through the fp64 forward reference: the derivation
is exact wherever torch's autograd is defined (docs/backward.md, section 3)."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.gym import GYM
from attncc.runtime.reference import attention_reference
from attncc.runtime.reference_backward import attention_backward_reference
from tests.helpers.learnable import LEARNABLE

F64 = torch.float64


def _inputs(B, Hq, Hkv, Sq, Skv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, Skv, D, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, Skv, D, generator=g, dtype=F64)
    do = torch.randn(B, Hq, Sq, D, generator=g, dtype=F64)
    return q, k, v, do


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    assert not got.isnan().any(), f"{what}: NaN"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= 1e-9 * max(1.0, want.abs().max().item() if want.numel() else 0.0), \
        f"{what}: max abs error {err:.3g}"


def _check(variant, q, k, v, do, *, captured=None, enable_gqa=False, block_mask=None,
           dlse=None, scale=None):
    """Oracle vs torch.autograd through attention_reference; returns the oracle's result."""
    ir, bind = variant.trace()
    names = {id(t): n for n, t in bind.tensors.items()}
    grads = [names[id(t)] for t in (captured or {}).values()]
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    leaves = [bind.tensors[n] for n in grads]
    out, lse = attention_reference(*xs, ir, bind, block_mask=block_mask, enable_gqa=enable_gqa,
                                   scale=scale)
    loss = (out * do).sum() + ((lse * dlse).sum() if dlse is not None else 0)
    want = torch.autograd.grad(loss, [*xs, *leaves], allow_unused=True)
    got = attention_backward_reference(q, k, v, do, ir, bind, grad_tensors=grads,
                                       block_mask=block_mask, enable_gqa=enable_gqa, dlse=dlse,
                                       scale=scale)
    for name, g, w in (("dq", got.dq, want[0]), ("dk", got.dk, want[1]), ("dv", got.dv, want[2])):
        _close(g, w if w is not None else torch.zeros_like(g), f"{ir.name} {name}")
    for n, w in zip(grads, want[3:]):
        _close(got.captured[n], w.to(F64), f"{ir.name} d{n}")
    return got


@pytest.mark.parametrize("name", sorted(GYM))
@pytest.mark.parametrize("shape", [(2, 4, 4, 37, 37), (1, 4, 2, 29, 45)],
                         ids=["mha-odd", "gqa-sq-ne-skv"])
def test_every_gym_variant(name: str, shape) -> None:
    B, Hq, Hkv, Sq, Skv = shape
    D = 16
    variant = GYM[name](B, Hq, max(Sq, Skv), D)
    _check(variant, *_inputs(B, Hq, Hkv, Sq, Skv, D, seed=sorted(GYM).index(name)),
           enable_gqa=Hq != Hkv)


@pytest.mark.parametrize("name", sorted(LEARNABLE))
@pytest.mark.parametrize("shape", [(2, 4, 4, 37, 37), (1, 4, 2, 29, 45)],
                         ids=["mha-odd", "gqa-sq-ne-skv"])
def test_learnable_bias_gradients(name: str, shape) -> None:
    B, Hq, Hkv, Sq, Skv = shape
    mod, tensors = LEARNABLE[name](Hq, Sq, Skv, dtype=F64)
    got = _check(attncc.Variant(score_mod=mod, mask_mod=GYM["causal"](1, 1, 1, 1).mask_mod
                                if name == "rel_table" else None, name=name),
                 *_inputs(B, Hq, Hkv, Sq, Skv, 16, seed=3), captured=tensors,
                 enable_gqa=Hq != Hkv)
    (g,) = got.captured.values()
    assert g.abs().sum() > 0  # the gradient is not vacuous


def test_fully_masked_rows_give_zero_gradients() -> None:
    B, H, S, D = 1, 2, 23, 16
    table = LEARNABLE["rel_table"](H, S, S, dtype=F64)[1]["bias"]

    def late(b, h, q_idx, kv_idx):  # rows 0..4 keep nothing
        return q_idx >= kv_idx + 5

    def minus_inf_rows(score, b, h, q_idx, kv_idx):  # rows 5..6 keep only -inf scores
        return torch.where(q_idx < 7, -math.inf, score + table[h, q_idx - kv_idx + S - 1])

    q, k, v, do = _inputs(B, H, H, S, S, D)
    got = _check(attncc.Variant(score_mod=minus_inf_rows, mask_mod=late, name="masked"),
                 q, k, v, do, captured={"bias": table})
    assert (got.dq[:, :, :7] == 0).all()
    assert got.dq[:, :, 7:].abs().sum() > 0


def test_sigmoid_attention_normalize_none() -> None:
    variant = GYM["sigmoid"](1, 2, 31, 16)
    assert variant.trace()[0].normalize == "none"
    _check(variant, *_inputs(1, 2, 2, 31, 31, 16), scale=0.3)


def test_lse_gradient() -> None:
    q, k, v, do = _inputs(2, 2, 2, 19, 27, 16)
    dlse = torch.randn(2, 2, 19, dtype=F64)
    _check(GYM["softcap_causal"](2, 2, 27, 16), q, k, v, do, dlse=dlse)


def test_block_mask_and_transforms() -> None:
    S = 40
    bm = attncc.create_block_mask(lambda b, h, q, kv: (q // 8) != (kv // 8) + 1, None, None, S, S,
                                  BLOCK_SIZE=8)
    mod, tensors = LEARNABLE["head_scale"](2, S, S, dtype=F64)
    rope = GYM["rope"](1, 2, S, 16)
    variant = attncc.Variant(score_mod=mod, query_mod=rope.query_mod, key_mod=rope.key_mod,
                             name="rope_scaled")
    _check(variant, *_inputs(1, 2, 2, S, S, 16), captured=tensors, block_mask=bm)
