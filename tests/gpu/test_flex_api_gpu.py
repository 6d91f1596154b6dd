"""`attncc.flex_attention` on CUDA bf16/fp16 tensors runs the compiled kernel (not the reference):
checked against the fp64 reference, with a BlockMask from attncc.create_block_mask on the GPU."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import attncc
from attncc.runtime.reference import attention_reference
from attncc.gym import causal


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flex_attention_cuda_runs_compiled_kernel(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1234)
    B, H, S, D = 2, 4, 1000, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    cap = 30.0

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)

    bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the compiled path must not fall back with a warning
        out, lse = attncc.flex_attention(q, k, v, score_mod=softcap, block_mask=bm,
                                         return_lse=True)
    ir, bind = attncc.Variant(score_mod=softcap, mask_mod=causal).trace()
    ref, ref_lse = attention_reference(q, k, v, ir, bind)
    assert out.dtype == dtype and out.shape == (B, H, S, D)
    assert _rel(out, ref) < 2e-2
    assert _rel(lse, ref_lse) < 2e-2
