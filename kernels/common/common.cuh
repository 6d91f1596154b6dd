// attncc building blocks shared by the FA2 kernels (fa2_prefill.cuh, fa2_batch.cuh) and the FA3
// kernels (fa3_*.cuh): element conversions, PTX wrappers (cp.async, ldmatrix, mma.sync), the
// swizzled shared-memory tile layout, row transforms, FastDiv and the KV TileList.
//
// Written for attncc from the FlashAttention-2 paper's algorithm. Self-contained: no #include. It
// must come AFTER attncc_types.cuh (attncc::bf16, attncc::f16, attncc::i64) in the translation
// unit.
#ifndef ATTNCC_COMMON_CUH
#define ATTNCC_COMMON_CUH
namespace attncc {
namespace common {

// u32 and u16 are attncc_types.cuh's.
struct __attribute__((aligned(16))) u32x4 { u32 x, y, z, w; };

// ---------------------------------------------------------------------------------------------
// Element types: the MMA needs the raw 16-bit patterns, so conversions are done here by PTX and
// bit operations (no cuda_bf16.h / cuda_fp16.h).
// ---------------------------------------------------------------------------------------------
template <typename T> struct ElemTraits;
template <> struct ElemTraits<attncc::bf16> { static constexpr bool kIsBf16 = true; };
template <> struct ElemTraits<attncc::f16> { static constexpr bool kIsBf16 = false; };

template <typename DType>
__device__ __forceinline__ float elem_to_float(u16 bits) {
  float f;
  if constexpr (ElemTraits<DType>::kIsBf16) {
    // bf16 is the top half of an fp32: widening is exact.
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(((u32)bits) << 16));
  } else {
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
  }
  return f;
}

template <typename DType>
__device__ __forceinline__ u16 float_to_elem(float f) {
  u16 bits;
  if constexpr (ElemTraits<DType>::kIsBf16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(f));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f));
  }
  return bits;
}

// Two floats -> one 32-bit register of two 16-bit values, `lo` in the low half: the order the
// MMA's A fragment and our row-major O stores expect. (cvt's first source goes to the HIGH half.)
template <typename DType>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (ElemTraits<DType>::kIsBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  // MUFU.EX2; ex2.approx(-inf) = +0, which is what masked logits need.
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The larger of a and b, NaN if either is (fmaxf drops a NaN): one FMNMX, as fmaxf. The online
// softmax's running maximum takes it so that a NaN logit makes the row's maximum, and its LSE,
// NaN (as torch) even when the row also holds a +inf logit.
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <bool B> struct BoolTag { static constexpr bool value = B; };
template <int I> struct IntTag { static constexpr int value = I; };

// Attention sinks (docs/flex-api.md, "Attention sinks"): join the sink logit `sink` (natural
// log, finite) to a finished row's softmax denominator, given the row's 1/l (`inv`) and LSE:
// LSE' = logaddexp(LSE, sink) and inv' = inv * exp(LSE - LSE'), the exponent taken of the
// smaller side so nothing overflows. A row with no weight (LSE -inf) keeps inv (0) and gets
// LSE' = sink; a NaN LSE stays NaN, +inf stays +inf with inv unchanged. Used once per row: in
// the epilogue of a whole row, or after the merge of a split one, never on a partial state.
__device__ __forceinline__ void join_sink(float sink, float& inv, float& lse) {
  if (lse == neg_inf()) {
    lse = sink;
    return;
  }
  const float d = sink - lse;             // NaN for a NaN LSE, -inf for a +inf one
  const float e = __expf(-fabsf(d));      // exp(-|d|) in (0, 1]
  const float lp = __logf(1.f + e);       // log1p(e): e >= exp(-88) or the sum rounds to 1
  if (d > 0.f) {                          // the sink dominates: exp(LSE - LSE') = e / (1 + e)
    inv *= e / (1.f + e);
    lse = sink + lp;
  } else {                                // exp(LSE - LSE') = 1 / (1 + e); NaN stays NaN
    inv *= 1.f / (1.f + e);
    lse = lse + lp;
  }
}

// ---------------------------------------------------------------------------------------------
// PTX wrappers: cp.async, ldmatrix, mma.sync.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global->shared copy that bypasses L1 (.cg: K/V are streamed once per CTA). When `pred`
// is false the source size is 0, so the 16 destination bytes are zero-filled: rows past the end of
// the sequence become zeros, never stale shared memory (stale NaNs times a zero weight are NaN).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool pred) {
  int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D(16x8, f32) += A(16x16, row) * B(16x8, col).
template <typename DType>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0,
                                          u32 b1) {
  if constexpr (ElemTraits<DType>::kIsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---------------------------------------------------------------------------------------------
// Shared-memory tile layout. A tile is [rows][D] 16-bit elements, each row D*2 bytes (a multiple of
// 128 B for D in {64,128,256}). Rows are split in 16-byte chunks; chunk c of row r is stored at
// chunk position c ^ (r % 8). Why: ldmatrix has 8 lanes fetch 16 bytes each from 8 consecutive
// rows at the SAME logical chunk. Unswizzled, all 8 would map to the same 4 banks (row stride is a
// multiple of 128 B) -- an 8-way conflict. XOR-ing with r%8 spreads them over the 8 distinct 16-byte
// slots of a 128-byte line, covering all 32 banks. cp.async writes (8 lanes, consecutive chunks of
// one row) are a permutation within an aligned group of 8 chunks, so they stay conflict-free too.
// No padding is needed, which keeps the shared-memory footprint at exactly rows*D*2 bytes.
// ---------------------------------------------------------------------------------------------
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Byte address of 16-byte chunk `chunk` (compile-time) of a tile row at byte address `row_addr`,
// for a thread whose row has (row % 8) folded into `x` (run time, < 8): row_addr + ((chunk^x)<<4).
// Split so that chunk's high bits become an instruction immediate and only (chunk & 7) ^ x -- 4
// distinct values for the even chunks the fragment loops use -- is computed at run time.
__device__ __forceinline__ u32 chunk_addr(u32 row_addr, int chunk, u32 x) {
  return row_addr + ((u32)(chunk & ~7) << 4) + ((((u32)(chunk & 7)) ^ x) << 4);
}

// Returns x, hidden from the optimizer. Used on the per-lane address bases at the top of each main
// loop iteration so the compiler re-derives the ~50 fragment addresses inside the iteration instead
// of hoisting them all out of the loop into registers the accumulators need.
__device__ __forceinline__ u32 opaque(u32 x) {
  u32 r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// n / d for 0 <= n < 2^31 and a divisor fixed per CTA (the head-group fusion factor: fused row ->
// token), as a multiply-high, an add and a shift instead of the ~10-instruction integer division
// sequence that would otherwise run for every row in the hooks, loaders and epilogue.
// With l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1: n / d = (umulhi(m, n) + n) >> l.
struct FastDiv {
  unsigned mul;
  int shift;
  __device__ __forceinline__ explicit FastDiv(int d) {
    int l = 0;
    while ((1 << l) < d) ++l;
    shift = l;
    mul = (unsigned)((((unsigned long long)((1ull << l) - d)) << 32) / (unsigned)d) + 1u;
  }
  __device__ __forceinline__ int div(int n) const {
    return (int)((__umulhi(mul, (unsigned)n) + (unsigned)n) >> shift);
  }
};

// A row of a shared-memory tile seen as the `Vec` the interface's transforms take.
template <typename DType, int D>
struct SmemRow {
  const u16* tile;
  int row;
  __device__ __forceinline__ float operator[](int d) const {
    return elem_to_float<DType>(tile[swz<D>(row, d)]);
  }
};

// Apply `f(row_view, d) -> float` to every element of row `row` in place, by one warp. All reads of
// the row finish (into registers) before any write, because a transform may read any element of
// the row (RoPE reads q[(d + D/2) % D]).
template <typename DType, int D, typename F>
__device__ __forceinline__ void transform_row(u16* tile, int row, int lane, F&& f) {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  SmemRow<DType, D> view{tile, row};
  float vals[D / 32];
#pragma unroll
  for (int j = 0; j < D / 32; ++j) vals[j] = f(view, lane + 32 * j);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < D / 32; ++j) tile[swz<D>(row, lane + 32 * j)] = float_to_elem<DType>(vals[j]);
  __syncwarp();
}

// Which KV tiles a CTA visits: all of them (no block mask), or FlexAttention's BSR lists for the
// CTA's query block, partial blocks first (LogitsMask applies), then full blocks (it does not).
// Mask blocks are block_kv wide; each is visited as block_kv / TKV sub-tiles.
struct TileList {
  const int* partial;  // kv_indices row of this (b, h, q-block), or null when dense
  const int* full;     // full_kv_indices row, or null
  int n_partial;       // number of listed partial blocks (dense: number of KV tiles)
  int n_full;
  int sub;             // sub-tiles per mask block (dense: 1)
  int block_kv;        // kv positions per mask block (dense: the tile width)
  int tile;            // kv positions per tile (TKV)
  int count;           // total tiles to visit

  // First kv position of tile `i` and whether it comes from the full list.
  __device__ __forceinline__ int start(int i, bool& is_full) const {
    if (partial == nullptr) {
      is_full = false;
      return i * tile;
    }
    const int blk = i / sub;
    const int s = i - blk * sub;
    int kvb;
    if (blk < n_partial) {
      is_full = false;
      kvb = __ldg(partial + blk);
    } else {
      is_full = true;
      kvb = __ldg(full + (blk - n_partial));
    }
    return kvb * block_kv + s * tile;
  }
};

}  // namespace common
}  // namespace attncc

#endif  // ATTNCC_COMMON_CUH
