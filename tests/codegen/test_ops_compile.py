"""Every op case's CUDA spelling (tests/helpers/op_kernel.py: fast_math off, on, and a discrete
value's exact spelling) compiles with NVRTC in one translation unit (no GPU needed)."""
from __future__ import annotations

import pytest

from attncc.frontend.torch_ops import COVERAGE, UNSUPPORTED
from tests.helpers.op_cases import NO_CASE
from tests.helpers.op_kernel import SPELLINGS, case_nodes, kernel_source


def test_every_supported_op_is_in_the_kernel() -> None:
    names = {name for name, _, _ in case_nodes()}
    assert names == {n for n in COVERAGE if n not in UNSUPPORTED} - NO_CASE


@pytest.mark.nvrtc
def test_op_cases_kernel_compiles() -> None:
    from attncc.runtime.jit import nvrtc

    if not nvrtc.available():
        pytest.skip("NVRTC is not installed")
    src = kernel_source()
    assert src.count("__noinline__") >= len(SPELLINGS) * len(case_nodes())
    ptx = nvrtc.compile_cuda(src, arch="sm_90a", emit="ptx").ptx
    assert ptx is not None and ".entry op_cases" in ptx
