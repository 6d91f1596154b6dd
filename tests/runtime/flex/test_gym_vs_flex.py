"""Every AttentionGym variant through attncc.flex_attention matches torch's FlexAttention (eager,
CPU, float32) to 1e-5 relative error, output and LSE, including fully masked rows, lengths that
are not multiples of the 128 block, GQA and D=64. Hooks torch lacks are checked against direct
torch computations: RoPE (torch flex on pre-rotated q/k) and sigmoid attention."""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import attncc
from attncc.runtime.flex.api import flex_attention
from attncc.gym import GYM, causal, rope

TOL = 1e-5
# variants FlexAttention can express with score_mod + block mask alone
FLEX_EXPRESSIBLE = [n for n in GYM if n not in ("sigmoid", "rope", "rope_interleaved")]


def torch_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               score_mod: Callable | None = None, mask_mod: Callable | None = None,
               enable_gqa: bool = False, scale: float | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """torch's eager FlexAttention: (out, lse, its block mask); its eager warnings silenced."""
    B, Hq, Sq, _ = q.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bm = None
        if mask_mod is not None:
            bm = torch_create_block_mask(mask_mod, B, Hq, Sq, k.shape[2], device=q.device)
        out, lse = torch_flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale,
                                        enable_gqa=enable_gqa, return_lse=True)
    return out, lse, bm


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    n = float(ref.norm())
    return float((x - ref).norm()) / (n if n > 0 else 1.0)


def assert_matches(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor,
                   ref_lse: torch.Tensor | None) -> None:
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert rel_err(out, ref_out) <= TOL, f"out rel err {rel_err(out, ref_out):.3g}"
    if ref_lse is None:
        return
    assert lse is not None and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    # fully masked rows: -inf in both, at the same places
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.isfinite(lse[fin]).all()
    assert rel_err(lse[fin], ref_lse[fin]) <= TOL, f"lse rel err {rel_err(lse[fin], ref_lse[fin])}"


def check_variant(variant: attncc.Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  enable_gqa: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """attncc with the variant's own mask, and with torch's block mask instead: both match torch."""
    ref_out, ref_lse, bm = torch_flex(q, k, v, variant.score_mod, variant.mask_mod, enable_gqa)
    out, lse = flex_attention(q, k, v, score_mod=variant, enable_gqa=enable_gqa, return_lse=True)
    assert_matches(out, lse, ref_out, ref_lse)
    if bm is not None:  # the same mask, given as a BlockMask (partial blocks run its mask_mod)
        out2, lse2 = flex_attention(q, k, v, score_mod=variant.score_mod, block_mask=bm,
                                    enable_gqa=enable_gqa, return_lse=True)
        assert_matches(out2, lse2, ref_out, ref_lse)
    return ref_out, ref_lse


@pytest.mark.parametrize("shape", [(1, 2, 300, 64), (2, 2, 17, 64), (1, 2, 1, 64)],
                         ids=["S300", "S17", "S1"])
@pytest.mark.parametrize("name", FLEX_EXPRESSIBLE)
def test_gym_variant_matches_torch_flex(name: str, shape: tuple[int, ...], rng: Any) -> None:
    B, H, S, D = shape
    q, k, v = rng.qkv(B, H, S, D)
    check_variant(GYM[name](B, H, S, D), q, k, v)


@pytest.mark.parametrize("name", ["alibi_causal", "relative_bias", "prefix_lm"])
def test_query_and_key_lengths_differ(name: str, rng: Any) -> None:
    q, k, v = rng.qkv(1, 2, 17, 64, Skv=300)
    check_variant(GYM[name](1, 2, 300, 64), q, k, v)


@pytest.mark.parametrize("name", ["alibi_causal", "relative_bias", "document_causal"])
def test_gqa_matches_torch_flex(name: str, rng: Any) -> None:
    # query head h reads kv head h // 2; alibi / relative_bias index by the query head
    q, k, v = rng.qkv(2, 4, 130, 64, Hkv=2)
    check_variant(GYM[name](2, 4, 130, 64), q, k, v, enable_gqa=True)


@pytest.mark.parametrize("S", [17, 300])
def test_fully_masked_rows_give_zero_output_and_neg_inf_lse(S: int, rng: Any) -> None:
    def causal_skip_rows(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx % 3 != 1)  # rows 1, 4, 7, ... see no key

    variant = dataclasses.replace(GYM["softcap"](1, 2, S, 64), mask_mod=causal_skip_rows)
    q, k, v = rng.qkv(1, 2, S, 64)
    ref_out, ref_lse = check_variant(variant, q, k, v)
    out, lse = flex_attention(q, k, v, score_mod=variant, return_lse=True)
    dead = torch.arange(S) % 3 == 1
    assert (out[:, :, dead] == 0).all() and (ref_out[:, :, dead] == 0).all()
    assert torch.isneginf(lse[:, :, dead]).all() and torch.isneginf(ref_lse[:, :, dead]).all()
    assert torch.isfinite(lse[:, :, ~dead]).all()


def test_value_head_dim_differs_from_query_head_dim(rng: Any) -> None:
    q, k, _ = rng.qkv(1, 2, 70, 64)
    v = rng.randn(1, 2, 70, 32)
    check_variant(GYM["alibi_causal"](1, 2, 70, 64), q, k, v)


# ----------------------------------------------------------------------------------- RoPE
def rotate_reference(x: torch.Tensor, interleaved: bool, base: float = 10000.0) -> torch.Tensor:
    """RoPE on [B, H, S, D] written the usual way (cos/sin tables), independent of attncc.gym."""
    S, D = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)       # [D/2]
    angles = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [S, D/2]
    xd = x.double()
    if interleaved:  # pairs (2i, 2i+1) as complex numbers
        z = torch.view_as_complex(xd.reshape(*x.shape[:-1], D // 2, 2).contiguous())
        out = torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles))
        return out.reshape(x.shape).to(x.dtype)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    x1, x2 = xd[..., : D // 2], xd[..., D // 2:]
    rotated = torch.cat([-x2, x1], -1)
    return (xd * cos + rotated * sin).to(x.dtype)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("S", [17, 300])
def test_rope_hooks_match_torch_flex_on_prerotated_qk(interleaved: bool, S: int, rng: Any) -> None:
    D = 64
    q, k, v = rng.qkv(1, 2, S, D)
    variant = dataclasses.replace(rope(D, interleaved=interleaved), mask_mod=causal)
    ref_out, ref_lse, _ = torch_flex(rotate_reference(q, interleaved),
                                     rotate_reference(k, interleaved), v, mask_mod=causal)
    out, lse = flex_attention(q, k, v, score_mod=variant, return_lse=True)
    assert_matches(out, lse, ref_out, ref_lse)
    # and the rotation matters: without it the result is different
    plain = flex_attention(q, k, v, score_mod=attncc.Variant(mask_mod=causal))
    assert rel_err(plain, ref_out) > 1e-2


def test_rope_gym_entries_are_the_two_layouts(rng: Any) -> None:
    q, k, v = rng.qkv(1, 1, 40, 16)
    for name, interleaved in (("rope", False), ("rope_interleaved", True)):
        ref_out, ref_lse, _ = torch_flex(rotate_reference(q, interleaved),
                                         rotate_reference(k, interleaved), v)
        out, lse = flex_attention(q, k, v, score_mod=GYM[name](1, 1, 40, 16), return_lse=True)
        assert_matches(out, lse, ref_out, ref_lse)


# ------------------------------------------------------------------------- sigmoid attention
def sigmoid_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: float,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    w = torch.sigmoid(s + bias)
    if mask is not None:
        w = w * mask
    return (w @ v.double()).to(q.dtype)


@pytest.mark.parametrize("S", [1, 17, 300])
def test_sigmoid_attention_matches_direct_torch(S: int, rng: Any) -> None:
    q, k, v = rng.qkv(2, 2, S, 64)
    variant = GYM["sigmoid"](2, 2, S, 64)
    out = flex_attention(q, k, v, score_mod=variant)
    bias = -math.log(max(S, 2))
    assert rel_err(out, sigmoid_reference(q, k, v, bias)) <= TOL
    # with a causal mask: masked keys contribute nothing (weight 0, not sigmoid(-inf) = 0 by luck)
    causal_sig = dataclasses.replace(variant, mask_mod=causal)
    mask = torch.ones(S, S).tril()
    out = flex_attention(q, k, v, score_mod=causal_sig)
    assert rel_err(out, sigmoid_reference(q, k, v, bias, mask)) <= TOL


def test_sigmoid_attention_with_gqa(rng: Any) -> None:
    q, k, v = rng.qkv(1, 4, 33, 64, Hkv=2)
    out = flex_attention(q, k, v, score_mod=GYM["sigmoid"](1, 4, 33, 64), enable_gqa=True)
    ref = sigmoid_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                            -math.log(33))
    assert rel_err(out, ref) <= TOL


# ------------------------------------------------------------- attncc's own create_block_mask
@pytest.mark.parametrize("name", ["document_causal", "sliding_window"])
def test_attncc_block_mask_matches_torch_flex(name: str, rng: Any) -> None:
    block_mask_mod = pytest.importorskip("attncc.runtime.flex.block_mask")
    B, H, S, D = 2, 2, 130, 64
    variant = GYM[name](B, H, S, D)
    q, k, v = rng.qkv(B, H, S, D)
    ref_out, ref_lse, _ = torch_flex(q, k, v, variant.score_mod, variant.mask_mod)
    bm = block_mask_mod.create_block_mask(variant.mask_mod, B, H, S, S, device="cpu")
    out, lse = flex_attention(q, k, v, score_mod=variant.score_mod, block_mask=bm,
                              return_lse=True)
    assert_matches(out, lse, ref_out, ref_lse)
