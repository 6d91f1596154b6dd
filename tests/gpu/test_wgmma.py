"""kernels/hopper/wgmma.cuh on the GPU: the Hopper warpgroup MMA building blocks of the FA3 template.

Three small kernels, each one warpgroup, checked against torch in fp32:
- S = Q K^T with both operands in shared memory, K-major, 128-byte swizzle (D = 64 and 128: the
  second case walks two 64-element column blocks);
- O = P V with P from registers (the mma.sync A-fragment layout attention keeps P in) and V
  N-major in shared memory (the transposed-B descriptor). Its leading/stride byte offsets are a
  probe: the test tries the candidate encodings and reports which one the hardware accepts, so
  the FA3 template can be written against a measured fact.
tests/kernels/test_probes_compile.py compiles them for sm_90a (NVRTC only).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.wgmma_probe import ARGS, UNUSED, probe_source, run_probe, sw128_offset


@pytest.fixture(scope="module")
def kernels() -> dict:
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda

    res = compile_cuda(probe_source(), arch="sm_90a")
    return {n: load_kernel(res.cubin, n, ARGS, UNUSED) for n in ("wg_ss", "wg_rs_v", "sw_offsets")}


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 128])
def test_wgmma_ss_kmajor_matches_torch(kernels: dict, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(k)
    a = torch.randn(64, k, generator=g, device="cuda").bfloat16()
    b = torch.randn(64, k, generator=g, device="cuda").bfloat16()
    got = run_probe(kernels["wg_ss"], a, b, k)
    ref = a.float() @ b.float().T
    assert not torch.isnan(got).any()
    assert float((got - ref).norm() / ref.norm()) < 1e-3


@pytest.mark.gpu
def test_wgmma_rs_nmajor_b_descriptor_probe(kernels: dict) -> None:
    """P (registers) x V (N-major smem): which (LBO, SBO) encodings the hardware accepts.

    Measured on the H200: with N = 64 the whole tile width is one 128-byte swizzle
    atom, so LBO is unused and SBO must be the 1024-byte distance between 8-row groups; the FA3
    template's ATTNCC_FA3_V_LBO / ATTNCC_FA3_V_SBO (8192, 1024) must be among them."""
    g = torch.Generator(device="cuda").manual_seed(5)
    p = torch.randn(64, 64, generator=g, device="cuda").bfloat16()
    v = torch.randn(64, 64, generator=g, device="cuda").bfloat16()
    ref = p.float() @ v.float()
    ok = []
    for lbo in (16, 128, 1024, 2048, 8192):
        for sbo in (16, 128, 1024, 2048):
            got = run_probe(kernels["wg_rs_v"], p, v, 64, lbo, sbo)
            err = float((got - ref).norm() / ref.norm())
            if err < 1e-3:
                ok.append((lbo, sbo))
    print(f"\nN-major B (V) descriptors that match torch, (LBO, SBO) bytes: {ok}")
    assert ok == [(lbo, 1024) for lbo in (16, 128, 1024, 2048, 8192)], ok


@pytest.mark.gpu
def test_sw128_offsets_of_accumulator_elements(kernels: dict) -> None:
    """Every accumulator element's swizzled offset, computed on the GPU the way the FA3 epilogue
    stages O, equals the formula (the signed spelling NVRTC miscompiled put the odd columns in
    the wrong 16-byte chunk)."""
    got = torch.full((128 * 32,), -1, dtype=torch.int32, device="cuda")
    vals = {"a": 0, "b": 0, "d": got.data_ptr(), "k": 0, "lbo": 0, "sbo": 0}
    kl = kernels["sw_offsets"]
    kl.launch((1, 1, 1), (128, 1, 1), 0, kl.ap.flatten(vals), kl.vp.flatten({"x": 0}),
              stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    want = [sw128_offset(16 * (t >> 5) + ((t & 31) >> 2) + 8 * hr, 8 * j + 2 * (t & 3) + e, 64)
            for t in range(128) for hr in range(2) for j in range(8) for e in range(2)]
    assert got.cpu().tolist() == want
