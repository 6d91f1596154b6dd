"""kernels/hopper/tma.cuh + runtime/jit/tma.py on the GPU: a TMA copy with the 128-byte swizzle lands in
exactly the layout kernels/hopper/wgmma.cuh's descriptors read (sw128_offset), signalled by an mbarrier.
The NVRTC test (no GPU) compiles the probe for sm_90a."""
from __future__ import annotations

import pytest
import torch

from attncc.codegen.layout import struct_layout

PROBE_SRC = r"""
struct TmaArgs {
  const void* tmap;
  unsigned short* out;
  int row0;
  int col0;
  int blocks;
};
struct Unused { int x; };

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// copy `blocks` 64 x 64 boxes (64 x 64*blocks elements) at (row0, col0) with TMA, then write the
// tile back out in row-major order, reading shared memory through the sw128 layout
extern "C" __global__ void __launch_bounds__(128) tma_probe(TmaArgs p, Unused) {
  __shared__ __attribute__((aligned(1024))) unsigned char tile[2 * 64 * 128];
  __shared__ __attribute__((aligned(8))) unsigned long long bar;
  const unsigned b = smem_u32(&bar), s = smem_u32(tile);
  if (threadIdx.x == 0) {
    attncc::tma::mbar_init(b, 1);
    attncc::tma::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    attncc::tma::mbar_arrive_expect_tx(b, p.blocks * 64 * 128);
    for (int blk = 0; blk < p.blocks; ++blk)
      attncc::tma::load_2d(s + blk * 64 * 128, p.tmap, b, p.col0 + 64 * blk, p.row0);
  }
  attncc::tma::mbar_wait(b, 0);
  const int cols = 64 * p.blocks;
  for (int i = threadIdx.x; i < 64 * cols; i += blockDim.x)
    p.out[i] = *reinterpret_cast<const unsigned short*>(
        tile + attncc::wg::sw128_offset(i / cols, i % cols, 64));
}
"""


def probe_source() -> str:
    from attncc.codegen.generate import form_text
    from attncc.kernels import read_template

    return "\n".join([read_template("common/attncc_types.cuh"), form_text(),
                      *(read_template(f) for f in ("common/common.cuh", "hopper/wgmma.cuh",
                                                   "hopper/tma.cuh"))]) + PROBE_SRC


ARGS = struct_layout("TmaArgs", [("tmap", "const void*"), ("out", "void*"), ("row0", "int"),
                                 ("col0", "int"), ("blocks", "int")])
UNUSED = struct_layout("Unused", [("x", "int")])


@pytest.mark.nvrtc
def test_tma_probe_compiles_for_sm90a() -> None:
    from attncc.runtime.jit.nvrtc import compile_cuda

    res = compile_cuda(probe_source(), arch="sm_90a", verbose=True)
    assert "tma_probe" in res.log


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
