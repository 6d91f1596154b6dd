"""The fast-math functions of kernels/common/attncc_types.cuh (codegen's fast_math=True spelling of the
hooks' math) against float64 torch on the GPU: each one's documented error bound holds over the
range it claims, and NaN / inf / huge arguments give what libm gives."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.fast_math_probe import ARGS, UNUSED, source


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["sin", "cos"])
def test_fast_sin_cos_within_1e6_up_to_1e5(fn: str) -> None:
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda, device_arch

    res = compile_cuda(source(), arch=device_arch())
    kl = load_kernel(res.cubin, "fast_fns", ARGS, UNUSED)
    g = torch.Generator(device="cuda").manual_seed(len(fn))
    # RoPE-like angles (integer positions times frequencies), uniform ones, and near-multiples of
    # pi / 2 where the reduction matters most
    pos = torch.randint(0, 100_000, (1 << 16,), generator=g, device="cuda").float()
    freq = torch.rand(1 << 16, generator=g, device="cuda")
    near = (torch.randint(-60_000, 60_000, (1 << 14,), generator=g, device="cuda").double()
            * (math.pi / 2)).float()
    x = torch.cat([pos * freq, (torch.rand(1 << 16, generator=g, device="cuda") - 0.5) * 2e5,
                   near, torch.tensor([0.0, -0.0, 1e-30, 1e5, -1e5], device="cuda")])
    x = x[x.abs() <= 1e5]
    special = torch.tensor([1e6, -3.5e7, 1e30, float("inf"), float("-inf"), float("nan")],
                           device="cuda")
    x = torch.cat([x, special]).contiguous()
    y = torch.full_like(x, float("nan"))
    kl.launch((-(-x.numel() // 256), 1, 1), (256, 1, 1), 0,
              kl.ap.flatten({"x": x.data_ptr(), "y": y.data_ptr(), "n": x.numel(),
                             "fn": 0 if fn == "sin" else 1}),
              kl.vp.flatten({"x": 0}), stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ref = getattr(torch, fn)(x.double())
    body = slice(0, x.numel() - special.numel())
    err = (y[body].double() - ref[body]).abs().max().item()
    assert err < 1e-6, f"max |fast_{fn} - {fn}| = {err:.3e}"
    # beyond 1e5 libm takes over: accurate to float rounding; inf / nan give nan
    tail, ref_tail = y[body.stop:], ref[body.stop:]
    finite = torch.isfinite(x[body.stop:])
    assert (tail[finite].double() - ref_tail[finite]).abs().max().item() < 1e-6
    assert torch.isnan(tail[~finite]).all()
