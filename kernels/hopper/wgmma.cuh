// attncc Hopper warpgroup MMA (wgmma) building blocks, for the FA3 kernels (docs/fa3.md).
//
// Compiled with NVRTC for sm_90a; tests/gpu/test_wgmma.py checks them against torch on the
// GPU. Self-contained: no #include; needs
// common.cuh's u32 (and comes after it).
//
// wgmma.mma_async: one warpgroup (4 consecutive warps, 128 threads) computes D[64 x N] (+)= A[64 x
// 16] * B[16 x N] per instruction. B always comes from shared memory through a 64-bit matrix
// descriptor; A from shared memory too (SS) or from registers (RS, the same per-warp fragment
// layout as mma.sync m16n8k16's A -- which is how attention feeds P, straight from the S
// accumulators). The accumulator of warp w holds rows 16w .. 16w+15: for each 8-column block j,
// d[4j + 0..1] = (row lane/4, cols 8j + 2*(lane%4) + {0,1}) and d[4j + 2..3] = the same columns
// of row lane/4 + 8 -- mma.sync's C layout repeated over N/8 blocks.
//
// Shared-memory layout these helpers assume: "128-byte swizzle", the tensor core's canonical
// layout, which is also common.cuh's swizzle at D = 64: a 64-element (128-byte) row r keeps
// 16-byte chunk c at chunk position c ^ (r % 8), and 8 rows form a 1024-byte atom. Wider rows
// are split into 64-element column blocks stored one after another (block b of a [rows][D] tile
// starts at b * rows * 128 bytes).
#ifndef ATTNCC_WGMMA_CUH
#define ATTNCC_WGMMA_CUH

namespace attncc {
namespace wg {

typedef unsigned long long u64;

// Byte offset of element (row, col) in a 128B-swizzled tile with `rows` rows (see the top).
// Unsigned on purpose: NVRTC 12.9 and 13 miscompile the signed-int spelling of this formula when
// the column is 8j + 2*(lane & 3) + 1 -- an odd column assembled from disjoint bits, as an
// accumulator's second element is. The PTX XORed the whole column, not its chunk (col >> 3),
// into the row's swizzle bits, so such elements landed in the wrong 16-byte chunk
// (tests/gpu/test_wgmma.py checks every accumulator offset on the GPU; docs/fa3.md,
// "The 128-byte swizzle offset").
__device__ __forceinline__ unsigned sw128_offset(int row, int col, int rows) {
  const unsigned c = (unsigned)col, r = (unsigned)row;
  const unsigned chunk = (c >> 3) & 7u;  // 16-byte chunk within the 128-byte row
  return (c >> 6) * (unsigned)rows * 128u + r * 128u + ((chunk ^ (r & 7u)) << 4) + ((c & 7u) << 1);
}

// Matrix descriptor: start address, leading / stride byte offsets (all in 16-byte units, 14 bits
// each) and the swizzle mode (bits 62-63: 1 = 128-byte swizzle), kept as its two 32-bit words
// for loops that issue many wgmmas a tile (FA3's issue_qk / issue_pv). wgmma reads descriptors
// from uniform registers; with warp-uniform addresses the words stay in the uniform datapath and
// a k-step's descriptor is one UIADD3 on the low word. Shared-memory addresses are below 2^18
// (228 KB on sm_90; outside cluster launches, below), so:
//  - the start field is addr >> 4 without a mask, and the leading byte offset is added (not
//    ORed) above it, so a constant byte offset folds into a k-step's single add (desc_plus: no
//    carry reaches the other fields);
//  - addr >> 18 is zero, and is added to the high word anyway (opaque_zero): ptxas cannot prove
//    it zero, so the high word is a register value of its own, which it leaves in place in the
//    uniform register the wgmma reads, instead of a constant it re-materializes (UMOV) before
//    every wgmma. Two descriptors from different addresses keep distinct high words for the
//    same reason (A's and B's slots of the wgmma each keep theirs).
// In a cluster launch (the dense FA3 kernel's CTA pairs: the paired form, attncc::form::paired()
// from codegen's form block ahead of this file) a shared::cta address also carries the CTA's rank in the cluster from
// bit 24; a descriptor takes the offset only. Without the mask, rank 1's bit 24 landed in the
// leading byte offset and every wgmma of that CTA read the wrong rows. The unprovable zero is
// then addr >> 31 (ranks stay below 2^7).
constexpr bool kClusterSmemAddrs = attncc::form::paired();
// The descriptor's view of a shared-memory address, and a zero ptxas cannot prove (above).
__device__ __forceinline__ unsigned smem_offset(unsigned addr) {
  return kClusterSmemAddrs ? addr & 0xFFFFFFu : addr;
}
__device__ __forceinline__ unsigned opaque_zero(unsigned addr) {
  return addr >> (kClusterSmemAddrs ? 31 : 18);
}
struct DescWords {
  unsigned lo, hi;
};
__device__ __forceinline__ DescWords desc_words(unsigned smem_byte_addr, unsigned lbo_bytes,
                                                unsigned sbo_bytes) {
  return {(smem_offset(smem_byte_addr) >> 4) + (((lbo_bytes >> 4) & 0x3FFF) << 16),
          (((sbo_bytes >> 4) & 0x3FFF) | (1u << 30)) + opaque_zero(smem_byte_addr)};
}
// The same matrix `bytes` (a multiple of 16) further on.
__device__ __forceinline__ DescWords desc_plus(DescWords d, unsigned bytes) {
  return {d.lo + (bytes >> 4), d.hi};
}
__device__ __forceinline__ u64 desc_u64(DescWords d) {
  return ((u64)d.hi << 32) | (u64)d.lo;
}
// A one-off descriptor as wgmma takes it (the probes of tests/gpu/test_wgmma.py).
__device__ __forceinline__ u64 make_desc(unsigned smem_byte_addr, unsigned lbo_bytes,
                                         unsigned sbo_bytes) {
  return desc_u64(desc_words(smem_byte_addr, lbo_bytes, sbo_bytes));
}

// Order generic-proxy shared-memory writes (st.shared, cp.async) before the async proxy
// (wgmma, TMA) reads them.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Make the accumulator registers' prior writes visible to the next wgmma (required before the
// first wgmma of a group and whenever registers it reads were written by other instructions).
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

#define ATTNCC_WG_D32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),    \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),          \
      "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),       \
      "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),       \
      "+f"(d[31])
#define ATTNCC_WG_D32_LIST                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// Each wrapper below is one asm statement per input type: T is "bf16" or "f16" (the PTX type
// of both operands; F16 picks it), spliced into the instruction's string literal.

// D[64x64] (+)= A[64x16] (shared, K-major) * B[16x64] (shared; K-major, or N-major when
// TRANS_B), bf16 (or fp16 with F16) in, fp32 accumulate. accumulate = 0 overwrites D.
#define ATTNCC_WG_SS_N64(T)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " " ATTNCC_WG_D32_LIST \
               ", %32, %33, p, 1, 1, 0, %35;\n}\n"                                          \
               : ATTNCC_WG_D32                                                               \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))
template <int TRANS_B, bool F16 = false>
__device__ __forceinline__ void mma_ss_m64n64k16(float (&d)[32], u64 desc_a, u64 desc_b,
                                                 int accumulate) {
  if constexpr (F16) ATTNCC_WG_SS_N64("f16"); else ATTNCC_WG_SS_N64("bf16");
}

// D[64x64] (+)= A[64x16] (registers, mma.sync A-fragment layout per warp) * B[16x64] (shared).
#define ATTNCC_WG_RS_N64(T)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " " ATTNCC_WG_D32_LIST \
               ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                            \
               : ATTNCC_WG_D32                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate),   \
                 "n"(TRANS_B))
template <int TRANS_B, bool F16 = false>
__device__ __forceinline__ void mma_rs_m64n64k16(float (&d)[32], const u32 (&a)[4],
                                                 u64 desc_b, int accumulate) {
  if constexpr (F16) ATTNCC_WG_RS_N64("f16"); else ATTNCC_WG_RS_N64("bf16");
}

#define ATTNCC_WG_D16                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),    \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),          \
      "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define ATTNCC_WG_D16_LIST "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// D[64x32] (+)= A[64x16] (shared, K-major) * B[16x32] (shared; K-major, or N-major when
// TRANS_B): the FA3-class backward's half query tiles at head dim 128 (fa3_backward.cuh).
#define ATTNCC_WG_SS_N32(T)                                                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " " ATTNCC_WG_D16_LIST \
               ", %16, %17, p, 1, 1, 0, %19;\n}\n"                                          \
               : ATTNCC_WG_D16                                                               \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))
template <int TRANS_B, bool F16 = false>
__device__ __forceinline__ void mma_ss_m64n32k16(float (&d)[16], u64 desc_a, u64 desc_b,
                                                 int accumulate) {
  if constexpr (F16) ATTNCC_WG_SS_N32("f16"); else ATTNCC_WG_SS_N32("bf16");
}

#define ATTNCC_WG_D8 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define ATTNCC_WG_D8_LIST "{%0, %1, %2, %3, %4, %5, %6, %7}"

// D[64x16] (+)= A[64x16] * B[16x16], both in shared memory as for mma_ss_m64n32k16: the
// FA3-class backward's quarter query tiles in its low-pressure form (fa3_backward.cuh).
#define ATTNCC_WG_SS_N16(T)                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                              \
               "wgmma.mma_async.sync.aligned.m64n16k16.f32." T "." T " " ATTNCC_WG_D8_LIST \
               ", %8, %9, p, 1, 1, 0, %11;\n}\n"                                          \
               : ATTNCC_WG_D8                                                               \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))
template <int TRANS_B, bool F16 = false>
__device__ __forceinline__ void mma_ss_m64n16k16(float (&d)[8], u64 desc_a, u64 desc_b,
                                                 int accumulate) {
  if constexpr (F16) ATTNCC_WG_SS_N16("f16"); else ATTNCC_WG_SS_N16("bf16");
}

#define ATTNCC_WG_D64                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),    \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),          \
      "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),       \
      "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),       \
      "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),       \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),       \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),       \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),       \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),       \
      "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define ATTNCC_WG_D64_LIST                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "  \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "  \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// D[64x128] (+)= A[64x16] (shared, K-major) * B[16x128] (shared, K-major): the S = Q K^T of a
// 128-key tile, 64 fp32 accumulators per thread (the m64nN layout of mma_ss_m64n64k16, over
// 16 8-column blocks).
#define ATTNCC_WG_SS_N128(T)                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " ATTNCC_WG_D64_LIST \
               ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                            \
               : ATTNCC_WG_D64                                                               \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))
template <bool F16 = false>
__device__ __forceinline__ void mma_ss_m64n128k16(float (&d)[64], u64 desc_a, u64 desc_b,
                                                  int accumulate) {
  if constexpr (F16) ATTNCC_WG_SS_N128("f16"); else ATTNCC_WG_SS_N128("bf16");
}

// D[64x128] (+)= A[64x16] (registers, as mma_rs_m64n64k16) * B[16x128] (shared; N-major when
// TRANS_B: two 64-column swizzle atoms the descriptor's LBO apart).
#define ATTNCC_WG_RS_N128(T)                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " " ATTNCC_WG_D64_LIST \
               ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                            \
               : ATTNCC_WG_D64                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate),   \
                 "n"(TRANS_B))
template <int TRANS_B, bool F16 = false>
__device__ __forceinline__ void mma_rs_m64n128k16(float (&d)[64], const u32 (&a)[4],
                                                  u64 desc_b, int accumulate) {
  if constexpr (F16) ATTNCC_WG_RS_N128("f16"); else ATTNCC_WG_RS_N128("bf16");
}

// Warp-specialized kernels hand registers from the producer to the consumers: every warp of a
// warpgroup executes one of these (the count must be a multiple of 8 in 24..256).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Pin a register across an asm boundary: the compiler may not move reads or writes of `r` across
// this point. wgmma accumulators are written asynchronously (between the wgmma and the
// wait_group that completes it), which the compiler cannot see; fencing them right after the
// wait keeps their uses after it, and fencing them before the next wgmma keeps the writes
// (rescale, packing P) before it.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(u32& r) {
  asm volatile("" : "+r"(r)::"memory");
}
template <typename T, int N>
__device__ __forceinline__ void fence_operands(T (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(r[i]);
}
template <typename T, int M, int N>
__device__ __forceinline__ void fence_operands(T (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i) fence_operands(r[i]);
}

#undef ATTNCC_WG_D32
#undef ATTNCC_WG_D32_LIST
#undef ATTNCC_WG_D64
#undef ATTNCC_WG_D64_LIST
#undef ATTNCC_WG_SS_N64
#undef ATTNCC_WG_D16
#undef ATTNCC_WG_D16_LIST
#undef ATTNCC_WG_SS_N32
#undef ATTNCC_WG_RS_N64
#undef ATTNCC_WG_SS_N128

}  // namespace wg
}  // namespace attncc

#endif  // ATTNCC_WGMMA_CUH
