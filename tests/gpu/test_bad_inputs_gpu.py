"""Bad inputs on the GPU path: the same exception types as on the CPU path, raised before any
launch; and zero keys answered without a launch (issue 27, point 6)."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import InvalidArgument, InvalidArgumentType, TraceError
from attncc.runtime.flex import gpu_flex
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.reference import attention_reference


def _randn(*shape: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
           seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, device=device, dtype=dtype, generator=g)


def _no_launch(*args, **kwargs):
    raise AssertionError("Skv=0 reached launch planning")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("with_output_mod", [False, True])
def test_zero_keys_give_output_mod_of_zero_and_minus_inf_lse(dtype, D, with_output_mod,
                                                             monkeypatch) -> None:
    B, H, Sq = 2, 4, 200
    q = _randn(B, H, Sq, D, dtype=dtype, seed=D)
    k = v = torch.empty(B, H, 0, D, device="cuda", dtype=dtype)
    shift = torch.rand(H, device="cuda")
    variant = attncc.Variant(
        output_mod=(lambda o, b, h, q_idx, d: o[d] + shift[h]) if with_output_mod else None)
    ir, bindings = variant.trace()
    monkeypatch.setattr(gpu_flex, "plan_launch", _no_launch)
    out = torch.full((B, H, Sq, D), float("nan"), device="cuda", dtype=dtype)   # poisoned
    lse = torch.full((B, H, Sq), float("nan"), device="cuda", dtype=torch.float32)
    got, got_lse = gpu_flex.gpu_flex_attention(q, k, v, ir, bindings, return_lse=True, out=out,
                                               lse_out=lse)
    assert got is out and got_lse is lse
    want = shift.view(1, H, 1, 1).expand(B, H, Sq, D) if with_output_mod else torch.zeros(
        B, H, Sq, D, device="cuda")
    assert torch.allclose(out.float(), want.to(dtype).float(), atol=0, rtol=0)
    assert bool(torch.all(lse == -math.inf))
    ref, ref_lse = attention_reference(q, k, v, ir, bindings, float_dtype=torch.float64)
    assert torch.allclose(out.double(), ref, atol=1e-2) and torch.equal(lse.double(), ref_lse)


@pytest.mark.gpu
def test_zero_keys_through_flex_attention_match_the_cpu_path() -> None:
    q = _randn(1, 2, 130, 64)
    k = v = torch.empty(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = attncc.flex_attention(q, k, v, return_lse=True)
    cpu_out, cpu_lse = attncc.flex_attention(q.cpu(), k.cpu(), v.cpu(), return_lse=True)
    assert torch.equal(out.cpu(), cpu_out) and torch.equal(lse.cpu(), cpu_lse)


def _same_error_on_both(call) -> None:
    """call(device) raises; the exception type is the same on the CPU and on CUDA."""
    types = []
    for device in ("cpu", "cuda"):
        with pytest.raises(Exception) as e:
            call(device)
        types.append(type(e.value))
    assert types[0] is types[1], types


@pytest.mark.gpu
def test_same_mistake_same_exception_type_on_cpu_and_gpu() -> None:
    def qkv(device, Hq=2, Hkv=2, D=64):
        return (_randn(1, Hq, 128, D, device=device), _randn(1, Hkv, 128, D, device=device),
                _randn(1, Hkv, 128, D, device=device))

    def zero_heads(device):
        q, k, v = qkv(device)
        attncc.flex_attention(q, k[:, :0], v[:, :0], enable_gqa=True)

    def gqa_string(device):
        attncc.flex_attention(*qkv(device), enable_gqa="yes")

    def tuple_mod(device):
        attncc.flex_attention(*qkv(device), score_mod=lambda s, b, h, qi, ki: (s, s))

    def float_block(device):
        attncc.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 128, 128,
                                 device=device, BLOCK_SIZE=1.5)

    for call, want in ((zero_heads, InvalidArgument), (gqa_string, InvalidArgumentType),
                       (tuple_mod, TraceError), (float_block, InvalidArgumentType)):
        _same_error_on_both(call)
        with pytest.raises(want):
            call("cuda")


@pytest.mark.gpu
def test_forced_fa3_on_another_gpu_is_refused_before_compiling(monkeypatch) -> None:
    q, k, v = (_randn(1, 2, 256, 128, seed=i) for i in range(3))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **kw: (8, 0))
    gpu_flex._CALLS.clear()
    with pytest.raises(InvalidArgument, match="sm_80"):
        attncc.flex_attention(q, k, v, kernel_options={"KERNEL": "fa3"})


@pytest.mark.gpu
def test_plan_and_reference_reject_the_same_batch() -> None:
    ba = BatchAttention(attncc.Variant())
    q = _randn(1, 4, 64).double().cpu()
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.float64)
    for bad in ({"kv_indices": [-1], "kv_last_page_len": [4]},
                {"kv_indices": [0], "kv_last_page_len": [17]}):
        with pytest.raises(ValueError) as from_plan:
            ba.plan([0, 1], [0, 1], bad["kv_indices"], bad["kv_last_page_len"],
                    num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
        with pytest.raises(ValueError) as from_reference:
            batch_attention_reference(q, (cache, cache), [0, 1], [0, 1], bad["kv_indices"],
                                      bad["kv_last_page_len"], page_size=16)
        assert type(from_plan.value) is type(from_reference.value)
        assert str(from_plan.value) == str(from_reference.value)
    with pytest.raises(InvalidArgument, match="num_kv_heads"):
        ba.plan([0, 1], [0, 1], [0], [4], num_qo_heads=4, num_kv_heads=0, head_dim=64,
                page_size=16)
