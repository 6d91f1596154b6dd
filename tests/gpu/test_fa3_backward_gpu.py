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
