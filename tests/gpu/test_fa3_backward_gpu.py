"""The FA3-class backward (kernels/fa3/fa3_backward.cuh) on an sm_90 GPU, beyond the correctness
matrix that tests/gpu/test_backward_gpu.py runs on both templates: with this machine's NVRTC,
every AttentionGym and learnable-bias variant at head dims 64 and 128 loads its FA3-class form
(the kernel cache falls back to the FA2-class kernel quietly where a form spills, which is
correct but slow), and the default on sm_90 is FA3. docs/backward.md, "The FA3-class kernel"."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc.gym import GYM
from attncc.runtime.flex.backward import backward_kernel, backward_spec
from attncc.runtime.jit.kernels import get_kernel
from tests.helpers.learnable import LEARNABLE
from tests.runtime.flex.test_backward_kernel import _ir

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _sm90() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FA3-class backward runs on sm_90 only")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", [*sorted(GYM), *sorted(LEARNABLE)])
def test_fa3_form_is_what_runs(name: str, d: int) -> None:
    ir, grads = _ir(name, d)
    kern = get_kernel(backward_spec("fa3", ir, d, "bfloat16", None, fast_math=True, device=0,
                                    grad_tensors=grads))
    assert kern.spec.kind == "fa3_backward", (
        f"{name} at head dim {d} fell back to the FA2-class kernel with this NVRTC: "
        f"{kern.record}")
    assert kern.record.spill_bytes == 0 and kern.record.local_bytes == 0


def test_sm90_default_is_fa3_and_its_gradients_are_finite() -> None:
    assert backward_kernel(None, 128, None, sm90=True) == "fa3"
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    attncc.flex_attention(q, k, v).float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("scale", [1.0, 128 ** -0.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,sq", [(64, 197), (128, 256), (128, 1)])
def test_dq_conversion_matches_the_torch_copy(dtype: torch.dtype, d: int, sq: int,
                                              scale: float) -> None:
    """The dQ conversion kernel (kernels/small/bwd_dq.cuh) against `fa3_dq`'s strided torch copy
    of the same accumulator (the staging order's definition), times the same sm_scale, bit for
    bit but for NaN's payload (a NaN where torch has one): both round the fp32 product to nearest
    even; inf kept; padded rows not written."""
    import math

    from attncc.runtime.flex.backward import fa3_dq

    g = torch.Generator(device="cuda").manual_seed(d + sq)
    B, H = 2, 3
    rows = -(-sq // 64) * 64
    acc = torch.randn(B, H, rows * d, device="cuda", generator=g) * 100
    acc[0, 1, 7] = math.nan
    acc[1, 2, 70 % acc.shape[2]] = -math.inf
    got = fa3_dq(acc, sq, d, dtype, scale)
    want = fa3_dq(acc.cpu(), sq, d, dtype, scale)
    assert got.shape == (B, H, sq, d) and got.is_contiguous()
    got = got.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,sq", [(64, 197), (128, 256), (256, 70)])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_row_kernel_matches_torch(dtype: torch.dtype, d: int, sq: int, with_dlse: bool) -> None:
    """The row kernel (kernels/small/bwd_rows.cuh) against torch's formula: LSE base 2 with +inf
    for a row with no weight, delta = rowsum(dO * O) - dLSE in fp32, padded rows +inf / 0, NaN
    propagated; O read through a transposed view ([B, S, H, D] storage)."""
    import math

    from attncc.runtime.flex.backward import _fa3_rows

    g = torch.Generator(device="cuda").manual_seed(d + sq)
    B, H = 2, 3
    do = torch.randn(B, H, sq, d, device="cuda", dtype=dtype, generator=g)
    out = torch.randn(B, sq, H, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    lse = torch.randn(B, H, sq, device="cuda", generator=g)
    lse[0, 1, 5] = -math.inf
    do[1, 2, 7, 3] = float("nan")
    dlse = torch.randn(B, H, sq, device="cuda", generator=g) if with_dlse else None
    rows = -(-sq // 64) * 64
    got = _fa3_rows(do, out, lse, dlse, rows, "bfloat16" if dtype == torch.bfloat16 else
                    "float16", do.device)
    delta = (do.float() * out.float()).sum(-1) - (dlse if with_dlse else 0)
    lse2 = torch.where(lse == -math.inf, math.inf, lse * 1.4426950408889634)
    got_lse = got[:, :, :, 0].reshape(B, H, rows)
    got_delta = got[:, :, :, 1].reshape(B, H, rows)
    assert torch.equal(got_lse[..., :sq], lse2)
    assert torch.isinf(got_lse[..., sq:]).all() and (got_lse[..., sq:] > 0).all()
    assert (got_delta[..., sq:] == 0).all()
    assert torch.isnan(got_delta[1, 2, 7]) and torch.isnan(delta[1, 2, 7])
    ok = ~torch.isnan(delta)
    torch.testing.assert_close(got_delta[..., :sq][ok], delta[ok], rtol=1e-5, atol=1e-5)
