"""The kernel holding every discrete-semantics case as the hooks emit it (tests/helpers/
discrete_kernel.py) compiles with NVRTC (no GPU); tests/gpu/test_discrete_gpu.py runs it."""
from __future__ import annotations

import pytest

from tests.helpers.discrete_kernel import kernel_source


@pytest.mark.nvrtc
def test_discrete_cases_kernel_compiles() -> None:
    """Front end and NVVM on every case's spelling (~6 s; ptxas on all 1040 functions takes
    ~50 s here, so the cubin is left to the GPU test)."""
    from attncc.runtime.jit import nvrtc

    if not nvrtc.available():
        pytest.skip("NVRTC is not installed")
    ptx = nvrtc.compile_cuda(kernel_source(), arch="sm_90a", emit="ptx").ptx
    assert ptx is not None and ".entry discrete_cases" in ptx
