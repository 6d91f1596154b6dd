"""The probe kernels of the Hopper building blocks (kernels/hopper/wgmma.cuh, kernels/hopper/tma.cuh) and of the
fast sin/cos compile for sm_90a with NVRTC (no GPU); tests/gpu/test_wgmma.py, test_tma.py and
test_fast_math.py run them."""
from __future__ import annotations

import pytest

from tests.helpers import fast_math_probe, tma_probe, wgmma_probe


@pytest.mark.nvrtc
def test_wgmma_probes_compile_for_sm90a() -> None:
    from attncc.runtime.jit.nvrtc import compile_cuda

    res = compile_cuda(wgmma_probe.probe_source(), arch="sm_90a", verbose=True)
    assert "wg_ss" in res.log and "wg_rs_v" in res.log and "sw_offsets" in res.log


@pytest.mark.nvrtc
def test_tma_probe_compiles_for_sm90a() -> None:
    from attncc.runtime.jit.nvrtc import compile_cuda

    res = compile_cuda(tma_probe.probe_source(), arch="sm_90a", verbose=True)
    assert "tma_probe" in res.log


@pytest.mark.nvrtc
def test_fast_math_probe_compiles() -> None:
    from attncc.runtime.jit import nvrtc

    if not nvrtc.available():
        pytest.skip("NVRTC is not installed")
    nvrtc.compile_cuda(fast_math_probe.source(), arch="sm_90a")
