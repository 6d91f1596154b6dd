// attncc FA3 for sm_90a: the epilogue's pieces -- a consumer warpgroup's rows of O (the
// wgmma accumulator layout) normalized and written to global memory from registers, or
// staged in shared memory (plain or in the 128B-swizzled TMA layout) for bulk / tensor
// stores, and the rows' final softmax statistics. Used by fa3_prefill.cuh and
// fa3_batch.cuh.
//
// Self-contained: no #include. Comes after fa3_consumer.cuh.
#ifndef ATTNCC_FA3_STORE_CUH
#define ATTNCC_FA3_STORE_CUH

namespace attncc {
namespace fa3 {

// Store this thread's half-row hr of O (its 2 x D/8 columns), times inv, as 16-bit pairs; of a
// padded form (the value head dim DV < D), the columns below DV only.
template <typename DType, int D, int DV = D>
__device__ __forceinline__ void store_row(DType* row, const float (&o)[D / 64][32], int hr,
                                          float inv) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (64 * blk + 8 * j >= DV) continue;  // (a multiple of 8: whole 8-column groups)
      const int col = 64 * blk + 8 * j + 2 * (lane & 3);
      *reinterpret_cast<u32*>(row + col) =
          common::pack2<DType>(o[blk][4 * j + 2 * hr] * inv, o[blk][4 * j + 2 * hr + 1] * inv);
    }
}

// Four 16-bit pairs transposed across a quad: on entry lane t holds v[i], its pair of chunk i of
// a group of four 8-column chunks (columns 8i + 2t, +1); on return it holds chunk t whole, lane
// l's pair in word l. Two shfl.xor rounds; every lane of the warp must call it.
__device__ __forceinline__ uint4 quad_transpose(const u32 (&v)[4]) {
  const int t = threadIdx.x & 3;
  const bool hi2 = t & 2, hi1 = t & 1;
  // round 1 (lanes t, t^2): keep the chunks with bit 1 equal to t's, trade the others
  const u32 a0 = hi2 ? v[2] : v[0], a1 = hi2 ? v[3] : v[1];
  const u32 b0 = __shfl_xor_sync(0xffffffffu, hi2 ? v[0] : v[2], 2);
  const u32 b1 = __shfl_xor_sync(0xffffffffu, hi2 ? v[1] : v[3], 2);
  // round 2 (lanes t, t^1): chunk t from lanes t, t^2 is in hand, from t^1, t^3 traded
  const u32 own = hi1 ? a1 : a0, far = hi1 ? b1 : b0;  // pairs of lanes t, t^2
  const u32 n1 = __shfl_xor_sync(0xffffffffu, hi1 ? a0 : a1, 1);  // of lane t^1
  const u32 n3 = __shfl_xor_sync(0xffffffffu, hi1 ? b0 : b1, 1);  // of lane t^3
  // w[l] = lane l's pair of chunk t
  const u32 w_t = own, w_t1 = n1, w_t2 = far, w_t3 = n3;
  const u32 w0 = t == 0 ? w_t : t == 1 ? w_t1 : t == 2 ? w_t2 : w_t3;
  const u32 w1 = t == 0 ? w_t1 : t == 1 ? w_t : t == 2 ? w_t3 : w_t2;
  const u32 w2 = t == 0 ? w_t2 : t == 1 ? w_t3 : t == 2 ? w_t : w_t1;
  const u32 w3 = t == 0 ? w_t3 : t == 1 ? w_t2 : t == 2 ? w_t1 : w_t;
  return make_uint4(w0, w1, w2, w3);
}

// This lane's 16-byte chunk of half-row hr, column block blk, chunk group g of O times inv
// (columns 64 blk + 8 (4 g + t) .. + 7, t = lane & 3; quad_transpose, so every lane calls it).
template <typename DType, int D>
__device__ __forceinline__ uint4 o_chunk(const float (&o)[D / 64][32], float inv, int hr, int blk,
                                         int g) {
  u32 v[4];  // v[i]: this lane's pair of chunk 4g + i
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int j = 4 * g + i;
    v[i] = common::pack2<DType>(o[blk][4 * j + 2 * hr] * inv, o[blk][4 * j + 2 * hr + 1] * inv);
  }
  return quad_transpose(v);
}

// Store this thread's rows of O (half-row hr at row_ptr(hr), null: not a real query), times
// inv, as 16-byte chunks: the four lanes of a quad hold 8 columns of a row in 4-byte pairs, so
// four chunks at a time are transposed across the quad (two shfl.xor rounds) and lane t stores
// chunk t -- a quarter of store_row's store instructions, each writing whole 32-byte sectors.
// Every lane of the warp must call it (shuffles); row pointers must be 16-byte aligned
// (v4_aligned); unaligned rows take store_row. (The dense kernel stages O in shared memory and
// writes it with TMA tensor stores where it can: fa3_prefill's kBulkO.) A padded form (DV < D)
// stores the chunks below DV.
template <typename DType, int D, int DV = D, typename RowPtr>
__device__ __forceinline__ void store_rows_v4(const float (&o)[D / 64][32], const float (&inv)[2],
                                              RowPtr&& row_ptr) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    DType* const row = row_ptr(hr);
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const uint4 c = o_chunk<DType, D>(o, inv[hr], hr, blk, g);
        const int col = 64 * blk + 8 * (4 * g + t);
        if (row != nullptr && col < DV) *reinterpret_cast<uint4*>(row + col) = c;
      }
  }
}

// This warp's 16 rows of O times inv, as 16-bit values, into a warpgroup's 64 rows at `tile` in
// the TMA / wgmma layout (D/64 column blocks of [64 rows][64], 128B-swizzled, wgmma.cuh's
// sw128_offset) -- what a TMA tensor store of [64 rows][64] boxes writes out as plain rows. One
// stmatrix.x4 stores a 16 x 16 block: its four 8 x 8 matrices are the accumulator's pairs as they
// are (matrix i: rows 8 (i & 1) .., columns 8 (i >> 1) ..; each thread's register holds its
// element pair of row lane / 4), and lane l gives the address of row l % 8 of matrix l / 8. The
// swizzle puts a matrix's 8 rows in 8 different 16-byte bank groups, so each store is
// conflict-free. (Unswizzled rows, staged for plain bulk copies, needed the quad transposes --
// shuffles -- to write whole 16-byte chunks: 2 D/32 shuffle rounds where this takes D/16
// stores; docs/fa3.md, "TMA, O through shared memory, L2 hints".)
template <typename DType, int D>
__device__ __forceinline__ void stage_rows_sw(const float (&o)[D / 64][32], const float (&inv)[2],
                                              u32 tile) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int i = lane >> 3;                                   // the matrix this lane addresses
  const int row = 16 * warp + 8 * (i & 1) + (lane & 7);      // its row of the warpgroup's 64
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    const int blk = k >> 2, j = (2 * k) & 7;  // 8-column blocks j and j + 1 of column block blk
    const u32 r0 = common::pack2<DType>(o[blk][4 * j] * inv[0], o[blk][4 * j + 1] * inv[0]);
    const u32 r1 = common::pack2<DType>(o[blk][4 * j + 2] * inv[1], o[blk][4 * j + 3] * inv[1]);
    const u32 r2 = common::pack2<DType>(o[blk][4 * j + 4] * inv[0], o[blk][4 * j + 5] * inv[0]);
    const u32 r3 = common::pack2<DType>(o[blk][4 * j + 6] * inv[1], o[blk][4 * j + 7] * inv[1]);
    const u32 addr = tile + wg::sw128_offset(row, 16 * k + 8 * (i >> 1), 64);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  }
}

// Whether O at `o` with element strides whose OR is `strides` takes store_rows_v4.
__device__ __forceinline__ bool v4_aligned(const void* o, long long strides) {
  return (strides & 7) == 0 &&
         (reinterpret_cast<unsigned long long>(o) & 15) == 0;
}

// The row's final softmax statistics: 1 / l and the natural-log LSE. A row with no weight
// (l == 0 exactly: every logit masked or -inf) gets inv 0 and LSE -inf; a NaN logit left l NaN,
// so inv and LSE are NaN; a +inf logit made m +inf (and l NaN), LSE +inf as torch's logsumexp.
// Per-thread partial sums are reduced across the quad here.
template <bool kSoftmax>
__device__ __forceinline__ void finish_row(float m, float l, float& inv, float& lse) {
  inv = 1.f;
  lse = 0.f;
  if constexpr (kSoftmax) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv = l == 0.f ? 0.f : 1.f / l;
    lse = l == 0.f ? common::neg_inf() : (m == attncc::pos_inf() ? m : (m + __log2f(l)) * kLn2);
  }
}

// Attention sinks: the query head's sink logit joins both rows' denominators (common.cuh
// join_sink), scaling inv; nothing when `sinks` is null. Whole rows only, never a partial state.
__device__ __forceinline__ void join_sinks(const float* sinks, int hq, float (&inv)[2],
                                           float (&lse)[2]) {
  if (sinks == nullptr) return;
  const float s = __ldg(sinks + hq);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) common::join_sink(s, inv[hr], lse[hr]);
}

// Rows with no weight (inv == 0, see finish_row; 1 / l is never 0 for a real l) store 0, even
// where their accumulator caught a NaN or inf value row at a masked key of a tile they read
// (0 * NaN is NaN in P V). Selects in the epilogue only.
template <int D>
__device__ __forceinline__ void clear_empty_rows(float (&o)[D / 64][32], const float (&inv)[2]) {
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[blk][i] = inv[(i >> 1) & 1] == 0.f ? 0.f : o[blk][i];
}

}  // namespace fa3
}  // namespace attncc

#endif  // ATTNCC_FA3_STORE_CUH
