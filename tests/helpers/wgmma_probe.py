"""The wgmma probe kernels of kernels/hopper/wgmma.cuh (tests/gpu/test_wgmma.py; the descriptor sweep
one process per encoding in scripts/experiments/probe_wgmma_rs.py): their source, argument
structs and a launch helper."""
from __future__ import annotations

from typing import Any

import torch

from attncc.codegen.layout import struct_layout

PROBE_SRC = r"""
namespace probe {
typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// a [rows][cols] row-major bf16 matrix from global into the 128B-swizzled layout
__device__ void stage(unsigned char* s, const u16* g, int rows, int cols) {
  for (int i = threadIdx.x; i < rows * cols; i += blockDim.x)
    *reinterpret_cast<u16*>(s + attncc::wg::sw128_offset(i / cols, i % cols, rows)) = g[i];
}

// the accumulator of a 64 x 64 wgmma tile into a row-major fp32 matrix
__device__ void store(float* out, const float (&d)[32]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * warp + (lane >> 2);
  for (int j = 0; j < 8; ++j) {
    const int c = 8 * j + 2 * (lane & 3);
    out[r * 64 + c] = d[4 * j];
    out[r * 64 + c + 1] = d[4 * j + 1];
    out[(r + 8) * 64 + c] = d[4 * j + 2];
    out[(r + 8) * 64 + c + 1] = d[4 * j + 3];
  }
}
}  // namespace probe

struct ProbeArgs {
  const void* a;
  const void* b;
  float* d;
  int k;
  int lbo;
  int sbo;
};
struct Unused { int x; };

// S[64 x 64] = A[64 x K] B[64 x K]^T, K = 64 or 128
extern "C" __global__ void __launch_bounds__(128) wg_ss(ProbeArgs p, Unused) {
  __shared__ __attribute__((aligned(1024))) unsigned char smem[2 * 64 * 256];
  unsigned char* sa = smem;
  unsigned char* sb = smem + 64 * 2 * p.k;
  probe::stage(sa, (const probe::u16*)p.a, 64, p.k);
  probe::stage(sb, (const probe::u16*)p.b, 64, p.k);
  attncc::wg::fence_proxy_async();
  __syncthreads();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  attncc::wg::fence();
  for (int ks = 0; ks < p.k / 16; ++ks) {
    // k-step ks: column block ks / 4 (64 elements each), 32 bytes per 16 elements inside it
    const unsigned off = (ks >> 2) * 64 * 128 + (ks & 3) * 32;
    attncc::wg::mma_ss_m64n64k16<0>(
        d, attncc::wg::make_desc(probe::smem_u32(sa) + off, 16, 1024),
        attncc::wg::make_desc(probe::smem_u32(sb) + off, 16, 1024), ks > 0);
  }
  attncc::wg::commit();
  attncc::wg::wait<0>();
  probe::store(p.d, d);
}

// O[64 x 64] = P[64 x 64] (registers) V[64 x 64] (V row-major [k][n]: N-major)
extern "C" __global__ void __launch_bounds__(128) wg_rs_v(ProbeArgs p, Unused) {
  // 32 KB although V takes 8: a wrong candidate stride must read shared memory, not fault
  __shared__ __attribute__((aligned(1024))) unsigned char sv[4 * 64 * 128];
  probe::stage(sv, (const probe::u16*)p.b, 64, 64);
  attncc::wg::fence_proxy_async();
  __syncthreads();
  const probe::u16* P = (const probe::u16*)p.a;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = 16 * warp + (lane >> 2), q = 2 * (lane & 3);
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  attncc::wg::fence();
  for (int ks = 0; ks < 4; ++ks) {
    const int k = 16 * ks + q;
    attncc::u32 a[4];
    a[0] = P[r * 64 + k] | ((probe::u32)P[r * 64 + k + 1] << 16);
    a[1] = P[(r + 8) * 64 + k] | ((probe::u32)P[(r + 8) * 64 + k + 1] << 16);
    a[2] = P[r * 64 + k + 8] | ((probe::u32)P[r * 64 + k + 9] << 16);
    a[3] = P[(r + 8) * 64 + k + 8] | ((probe::u32)P[(r + 8) * 64 + k + 9] << 16);
    // k-step ks covers V rows 16ks .. 16ks+15: 16 rows of 128 bytes further. The A registers
    // were just written by ordinary instructions: fence before the wgmma reads them.
    attncc::wg::fence();
    attncc::wg::mma_rs_m64n64k16<1>(
        d, a, attncc::wg::make_desc(probe::smem_u32(sv) + ks * 2048, p.lbo, p.sbo), ks > 0);
  }
  attncc::wg::commit();
  attncc::wg::wait<0>();
  probe::store(p.d, d);
}

// Offsets of a 64-row accumulator's elements in the swizzled layout, spelled exactly as the FA3
// epilogue stages O (kernels/fa3/fa3_prefill.cuh transform_o): the unrolled odd columns
// 8j + 2*(lane & 3) + 1 are the pattern NVRTC once miscompiled (kernels/hopper/wgmma.cuh).
extern "C" __global__ void __launch_bounds__(128) sw_offsets(ProbeArgs p, Unused) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r0 = 16 * warp + (lane >> 2);
  int* out = reinterpret_cast<int*>(p.d) + threadIdx.x * 32;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        out[16 * hr + 2 * j + e] =
            (int)attncc::wg::sw128_offset(r0 + 8 * hr, 8 * j + 2 * (lane & 3) + e, 64);
}
"""


def sw128_offset(row: int, col: int, rows: int) -> int:
    """The 128-byte swizzle in Python (kernels/hopper/wgmma.cuh's top comment)."""
    return (col // 64) * rows * 128 + row * 128 + ((((col % 64) >> 3) ^ (row % 8)) << 4) \
        + (col % 8) * 2


def probe_source() -> str:
    """The probe translation unit: shipped types, the (unpaired) kernel form, common.cuh
    helpers, wgmma.cuh, the kernels."""
    from attncc.codegen.generate import form_text
    from attncc.kernels import read_template

    return "\n".join([read_template("common/attncc_types.cuh"), form_text(),
                      read_template("common/common.cuh"),
                      read_template("hopper/wgmma.cuh")]) + PROBE_SRC


ARGS = struct_layout("ProbeArgs", [("a", "const void*"), ("b", "const void*"), ("d", "float*"),
                                   ("k", "int"), ("lbo", "int"), ("sbo", "int")])
UNUSED = struct_layout("Unused", [("x", "int")])


def run_probe(kl: Any, a: torch.Tensor, b: torch.Tensor, k: int, lbo: int = 0, sbo: int = 0
              ) -> torch.Tensor:
    """Launch probe kernel `kl` on one warpgroup with operands `a`, `b` (K = `k`, the descriptor
    offsets `lbo` / `sbo`) into a NaN-filled 64 x 64 fp32 output, and return it."""
    out = torch.full((64, 64), float("nan"), device="cuda")
    vals = {"a": a.data_ptr(), "b": b.data_ptr(), "d": out.data_ptr(), "k": k, "lbo": lbo,
            "sbo": sbo}
    kl.launch((1, 1, 1), (128, 1, 1), 0, kl.ap.flatten(vals), kl.vp.flatten({"x": 0}),
              stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out
