"""The attention-state merge kernel (kernels/small/merge_state.cuh, serving/merge_kernel.py) against
the float64 composition formula: storage types, empty states holding garbage, unnormalised
states, poisoned outputs, and the routing of `attncc.merge_state` to it."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.runtime.serving.merge import merge_pair

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _states(shape: tuple[int, ...], d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    o_a, o_b = (torch.randn(*shape, d, generator=g, device="cuda").to(dtype) for _ in "ab")
    lse_a, lse_b = (3 * torch.randn(*shape, generator=g, device="cuda") for _ in "ab")
    flat_a, flat_b = lse_a.view(-1), lse_b.view(-1)
    n = flat_a.numel()
    ninf = float("-inf")
    # some rows with one empty state (garbage o), one row with both empty
    flat_a[1: n: 7] = ninf
    flat_b[2: n: 5] = ninf
    flat_a[0], flat_b[0] = ninf, ninf
    o_a.view(-1, d)[flat_a == ninf] = float("nan")
    o_b.view(-1, d)[flat_b == ninf] = float("nan")
    return o_a, lse_a, o_b, lse_b


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,d", [((37, 32), 128), ((5,), 64), ((3, 7, 4), 256), ((9,), 8)])
def test_merge_kernel_matches_float64(dtype: torch.dtype, shape: tuple[int, ...], d: int) -> None:
    from attncc.runtime.serving.merge_kernel import fits_kernel, merge_state_cuda

    o_a, lse_a, o_b, lse_b = _states(shape, d, dtype, seed=d + len(shape))
    assert fits_kernel(o_a, lse_a, o_b, lse_b)
    out = torch.full_like(o_a, float("nan"))  # poisoned: every element must be written
    lse_out = torch.full_like(lse_a, float("nan"))
    got, lse = merge_state_cuda(o_a, lse_a, o_b, lse_b, out=out, lse_out=lse_out)
    assert got is out and lse is lse_out
    clean_a = torch.where(torch.isneginf(lse_a).unsqueeze(-1), 0.0, o_a.double())
    clean_b = torch.where(torch.isneginf(lse_b).unsqueeze(-1), 0.0, o_b.double())
    ref, lref = merge_pair(clean_a, lse_a.double(), clean_b, lse_b.double())
    assert not torch.isnan(got).any() and not torch.isnan(lse).any()
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < TOL[dtype], err
    both_empty = torch.isneginf(lref)
    assert torch.equal(torch.isneginf(lse), both_empty)
    assert torch.all(got[both_empty] == 0)
    assert torch.allclose(lse[~both_empty].double(), lref[~both_empty], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_merge_kernel_unnormalised_sum_and_no_lse() -> None:
    from attncc.runtime.serving.merge_kernel import merge_state_cuda

    g = torch.Generator(device="cuda").manual_seed(4)
    o_a, o_b = (torch.randn(50, 8, 128, generator=g, device="cuda").bfloat16() for _ in "ab")
    got, lse = merge_state_cuda(o_a, None, o_b, None)
    assert lse is None
    ref = o_a.double() + o_b.double()
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2
    # softmax states without an lse output
    lse_a, lse_b = torch.zeros(50, 8, device="cuda"), torch.full((50, 8), math.log(3.0),
                                                                 device="cuda")
    got, lse = merge_state_cuda(o_a, lse_a, o_b, lse_b, want_lse=False)
    assert lse is None
    ref = 0.25 * o_a.double() + 0.75 * o_b.double()
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
def test_merge_state_routes_cuda_states_to_the_kernel() -> None:
    """attncc.merge_state on fitting CUDA states gives the float64 result (float32 math even for
    bf16 o); states the kernel does not take (head dim 6, a view) still merge correctly."""
    o_a, lse_a, o_b, lse_b = _states((64, 4), 128, torch.bfloat16, seed=9)
    o_a, o_b = torch.nan_to_num(o_a), torch.nan_to_num(o_b)
    got, lse = attncc.merge_state(o_a, lse_a, o_b, lse_b)
    ref, _ = merge_pair(o_a.double(), lse_a.double(), o_b.double(), lse_b.double())
    assert got.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2
    g = torch.Generator(device="cuda").manual_seed(2)
    a, b = (torch.randn(10, 6, generator=g, device="cuda") for _ in "ab")
    la, lb = (torch.randn(10, generator=g, device="cuda") for _ in "ab")
    got, _ = attncc.merge_state(a, la, b, lb)
    ref, _ = merge_pair(a.double(), la.double(), b.double(), lb.double())
    assert torch.allclose(got.double(), ref, atol=1e-5)
