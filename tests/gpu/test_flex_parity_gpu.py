"""torch's FlexAttention surface on CUDA bf16: return_aux, torch's kernel_options, and block
masks that were adjusted or built without full blocks, against the fp64 reference."""
from __future__ import annotations

import warnings

import pytest
import torch

import attncc
from attncc import AuxOutput, AuxRequest, create_block_mask, flex_attention
from attncc.errors import InvalidArgument
from attncc.runtime.flex import torch_compat
from attncc.runtime.reference import attention_reference

pytestmark = pytest.mark.gpu

B, H, S, D = 2, 4, 1000, 128


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def _qkv(seed: int, S_: int = S, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, H, S_, D, device="cuda", dtype=dtype, generator=g)
                 for _ in range(3))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _reference(q, k, v, S_: int = S):
    ir, bind = attncc.Variant(score_mod=softcap, mask_mod=causal).trace()
    return attention_reference(q, k, v, ir, bind)


def test_return_aux_lse_on_cuda_is_the_kernels_lse():
    q, k, v = _qkv(1)
    bm = create_block_mask(causal, None, None, S, S, device="cuda")
    out, aux = flex_attention(q, k, v, score_mod=softcap, block_mask=bm,
                              return_aux=AuxRequest(lse=True))
    assert isinstance(aux, AuxOutput) and aux.max_scores is None
    assert aux.lse.dtype == torch.float32 and aux.lse.shape == (B, H, S)
    ref, ref_lse = _reference(q, k, v)
    assert _rel(out, ref) < 2e-2
    assert _rel(aux.lse, ref_lse) < 2e-2


def test_max_scores_on_cuda_bf16_is_refused_before_launch():
    q, k, v = _qkv(2)
    with pytest.raises(InvalidArgument, match="max_scores"):
        flex_attention(q, k, v, score_mod=softcap, return_aux=AuxRequest(max_scores=True))


def test_max_scores_on_cuda_float32_matches_the_cpu():
    q, k, v = _qkv(3, S_=200, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float32 CUDA runs the exact path
        _, aux = flex_attention(q, k, v, score_mod=softcap,
                                return_aux=AuxRequest(lse=True, max_scores=True))
    _, cpu = flex_attention(q.cpu(), k.cpu(), v.cpu(), score_mod=softcap,
                            return_aux=AuxRequest(lse=True, max_scores=True))
    torch.testing.assert_close(aux.max_scores.cpu(), cpu.max_scores)
    torch.testing.assert_close(aux.lse.cpu(), cpu.lse)


def test_torchs_kernel_options_run_on_cuda(monkeypatch):
    monkeypatch.setattr(torch_compat, "_warned", set())
    q, k, v = _qkv(4)
    bm = create_block_mask(causal, None, None, S, S, device="cuda")
    opts = {"PRESCALE_QK": True, "BACKEND": "AUTO", "USE_TMA": True, "WRITE_DQ": True,
            "ROWS_GUARANTEED_SAFE": True, "bwd_BLOCK_M1": 64}
    with pytest.warns(UserWarning, match="PRESCALE_QK"):
        out = flex_attention(q, k, v, score_mod=softcap, block_mask=bm, kernel_options=opts)
    assert _rel(out, _reference(q, k, v)[0]) < 2e-2


@pytest.mark.parametrize("how", ["adjusted", "no_full_blocks", "tuple_block"])
def test_block_masks_made_the_torch_ways_run_on_cuda(how):
    """Lists that _adjust rebuilt, lists with every block PARTIAL, and a (q, kv) BLOCK_SIZE
    reach the kernel and mean the same mask."""
    S_ = 640
    q, k, v = _qkv(5, S_=S_)
    if how == "adjusted":
        bm = create_block_mask(causal, None, None, 2048, 2048, device="cuda")._adjust(S_, S_)
    elif how == "no_full_blocks":
        bm = create_block_mask(causal, B, H, S_, S_, device="cuda", separate_full_blocks=False)
    else:
        bm = create_block_mask(causal, None, None, S_, S_, device="cuda", BLOCK_SIZE=(128, 64))
    out = flex_attention(q, k, v, score_mod=softcap, block_mask=bm)
    assert _rel(out, _reference(q, k, v, S_)[0]) < 2e-2
