"""kernels/hopper/tma.cuh + runtime/jit/tma.py on the GPU: a TMA copy with the 128-byte swizzle lands in
exactly the layout kernels/hopper/wgmma.cuh's descriptors read (sw128_offset), signalled by an mbarrier.
tests/kernels/test_probes_compile.py compiles the probe for sm_90a (NVRTC only)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tma_probe import ARGS, UNUSED, probe_source


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [1, 2])
def test_tma_lands_in_the_sw128_layout(blocks: int) -> None:
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda
    from attncc.runtime.jit.tma import tensor_map_2d

    src = torch.randn(200, 256, device="cuda").bfloat16()
    tmap = tensor_map_2d(src, 64, 64)
    out = torch.zeros(64, 64 * blocks, device="cuda", dtype=torch.bfloat16)
    kl = load_kernel(compile_cuda(probe_source(), arch="sm_90a").cubin, "tma_probe", ARGS, UNUSED)
    vals = {"tmap": tmap.data_ptr(), "out": out.data_ptr(), "row0": 37, "col0": 64,
            "blocks": blocks}
    kl.launch((1, 1, 1), (128, 1, 1), 0, kl.ap.flatten(vals), kl.vp.flatten({"x": 0}),
              stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(out, src[37:101, 64:64 + 64 * blocks])


def test_tensor_map_rejects_bad_input() -> None:
    from attncc.runtime.jit.tma import tensor_map_2d

    with pytest.raises(ValueError, match="2-D bf16/fp16 CUDA tensor"):
        tensor_map_2d(torch.zeros(4, 4), 4, 4)
