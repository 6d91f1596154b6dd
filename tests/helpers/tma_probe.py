"""The TMA probe kernel of kernels/hopper/tma.cuh (tests/gpu/test_tma.py runs it, tests/kernels/
test_probes_compile.py compiles it): its source and argument structs."""
from __future__ import annotations

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
