// attncc FlashAttention-2-style forward (prefill) template for sm_80+ (Ampere, Hopper).
//
// Written for attncc from the FlashAttention-2 paper's algorithm; see KERNEL_INTERFACE.md for the
// functor interface. Self-contained: no #include. It must come AFTER attncc_types.cuh (attncc::bf16,
// attncc::f16, attncc::i64) and attention_params.cuh (attncc::AttentionParams) in the translation
// unit, and BEFORE the generated Variant_<name> functors' entry point.
//
// Shape of the computation, per CTA (one query tile x one KV head-slot x one batch):
//   grid = (ceil(q_len * gf / TQ), num_q_heads / gf, batch)       gf = num_q_heads / gridDim.y
//   gf = 1: one query head per CTA.  gf = num_q_heads / num_kv_heads ("head-group fusion"): all
//   query heads that share a KV head are stacked into the tile's row dimension (fused row
//   r = q_idx * gf + head_in_group), so each K/V tile read from memory serves the whole group.
//   The launcher chooses gf; the kernel reads it back from gridDim.y, so AttentionParams needs no
//   extra field.
//
// Per CTA:  Q tile [TQ x D] -> shared memory (cp.async), QueryTransform in place;
//           for each KV tile (dense, or the BSR block list of a FlexAttention BlockMask):
//             K,V tiles [TKV x D] stream through a STAGES-deep cp.async ring;
//             S = Q K^T with ldmatrix + mma.sync.m16n8k16 (fp32 accumulate) in registers;
//             LogitsTransform / LogitsMask on each fragment element; online softmax (exp2 domain);
//             O += P V (P re-packed from the S accumulators to bf16/fp16 A fragments in registers);
//           O /= l, staged through shared memory (re-using the Q tile), OutputTransform, 16-byte
//           coalesced stores; LSE (natural log) per row.
//
// Warp layout: NUM_WARPS = TQ / (16 * M_FRAGS) warps; warp w owns query-tile rows
// [16*M_FRAGS*w, 16*M_FRAGS*(w+1)) -- M_FRAGS 16-row MMA fragments. Because each warp reads only
// its own Q rows and writes only its own O rows, the Q transform and the output epilogue need just
// __syncwarp(); K/V tiles are shared by all warps and need __syncthreads().
#ifndef ATTNCC_FA2_PREFILL_CUH
#define ATTNCC_FA2_PREFILL_CUH

#ifndef ATTNCC_FA2_LAZY_RESCALE
#define ATTNCC_FA2_LAZY_RESCALE 1
#endif

namespace attncc {
namespace fa2 {

typedef unsigned int fa2_u32;
typedef unsigned short fa2_u16;
struct __attribute__((aligned(16))) fa2_u32x4 { fa2_u32 x, y, z, w; };

// ---------------------------------------------------------------------------------------------
// Element types: the MMA needs the raw 16-bit patterns, so conversions are done here by PTX and
// bit operations (no cuda_bf16.h / cuda_fp16.h).
// ---------------------------------------------------------------------------------------------
template <typename T> struct ElemTraits;
template <> struct ElemTraits<attncc::bf16> { static constexpr bool kIsBf16 = true; };
template <> struct ElemTraits<attncc::f16> { static constexpr bool kIsBf16 = false; };

template <typename DType>
__device__ __forceinline__ float elem_to_float(fa2_u16 bits) {
  float f;
  if constexpr (ElemTraits<DType>::kIsBf16) {
    // bf16 is the top half of an fp32: widening is exact.
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(((fa2_u32)bits) << 16));
  } else {
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
  }
  return f;
}

template <typename DType>
__device__ __forceinline__ fa2_u16 float_to_elem(float f) {
  fa2_u16 bits;
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
__device__ __forceinline__ fa2_u32 pack2(float lo, float hi) {
  fa2_u32 r;
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

template <bool B> struct BoolTag { static constexpr bool value = B; };

// ---------------------------------------------------------------------------------------------
// PTX wrappers: cp.async, ldmatrix, mma.sync.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ fa2_u32 smem_addr(const void* p) {
  fa2_u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global->shared copy that bypasses L1 (.cg: K/V are streamed once per CTA). When `pred`
// is false the source size is 0, so the 16 destination bytes are zero-filled: rows past the end of
// the sequence become zeros, never stale shared memory (stale NaNs times a zero weight are NaN).
__device__ __forceinline__ void cp_async_16(fa2_u32 dst, const void* src, bool pred) {
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

__device__ __forceinline__ void ldmatrix_x4(fa2_u32 (&r)[4], fa2_u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(fa2_u32 (&r)[4], fa2_u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D(16x8, f32) += A(16x16, row) * B(16x8, col).
template <typename DType>
__device__ __forceinline__ void mma_16816(float (&d)[4], const fa2_u32 (&a)[4], fa2_u32 b0,
                                          fa2_u32 b1) {
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
__device__ __forceinline__ fa2_u32 chunk_addr(fa2_u32 row_addr, int chunk, fa2_u32 x) {
  return row_addr + ((fa2_u32)(chunk & ~7) << 4) + ((((fa2_u32)(chunk & 7)) ^ x) << 4);
}

// Returns x, hidden from the optimizer. Used on the per-lane address bases at the top of each main
// loop iteration so the compiler re-derives the ~50 fragment addresses inside the iteration instead
// of hoisting them all out of the loop into registers the accumulators need.
__device__ __forceinline__ fa2_u32 opaque(fa2_u32 x) {
  fa2_u32 r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// A row of a shared-memory tile seen as the `Vec` the interface's transforms take.
template <typename DType, int D>
struct SmemRow {
  const fa2_u16* tile;
  int row;
  __device__ __forceinline__ float operator[](int d) const {
    return elem_to_float<DType>(tile[swz<D>(row, d)]);
  }
};

// Apply `f(row_view, d) -> float` to every element of row `row` in place, by one warp. All reads of
// the row finish (into registers) before any write, because a transform may read any element of
// the row (RoPE reads q[(d + D/2) % D]).
template <typename DType, int D, typename F>
__device__ __forceinline__ void transform_row(fa2_u16* tile, int row, int lane, F&& f) {
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

// ---------------------------------------------------------------------------------------------
// Compile-time configuration shared by the kernel, the entry-point macro and (mirrored) the Python
// launcher (attncc.runtime.gpu_flex.fa2_config).
// ---------------------------------------------------------------------------------------------
template <int HEAD_DIM, int TQ, int TKV, int STAGES, int M_FRAGS>
struct Config {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head dim 64/128/256");
  static_assert(TQ == 16 || TQ == 32 || TQ == 64 || TQ == 128, "TQ in {16,32,64,128}");
  static_assert(TKV == 32 || TKV == 64 || TKV == 128, "TKV in {32,64,128}");
  static_assert(STAGES >= 1 && STAGES <= 4, "1..4 pipeline stages");
  // M_FRAGS 16-row MMA fragments per warp. Two (FA2's 4 warps x 32 rows) let every K/V ldmatrix
  // feed two MMAs, halving shared-memory traffic per MMA -- at one fragment per warp ldmatrix
  // bandwidth, not the tensor cores, bounds the loop. The price is registers: the O and S
  // accumulators take M_FRAGS*(D/8 + TKV/8)*4 of them, so the launcher uses 2 only where ptxas
  // reports no spills (bench/NOTES.md).
  static_assert(M_FRAGS == 1 || M_FRAGS == 2, "1 or 2 fragments per warp");
  static_assert(TQ % (16 * M_FRAGS) == 0, "TQ must be a multiple of 16 * M_FRAGS");
  static constexpr int kMFrags = M_FRAGS;
  static constexpr int kWarps = TQ / (16 * kMFrags);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileElems = TKV * HEAD_DIM;
  static constexpr int kSmemBytes = 2 * HEAD_DIM * (TQ + 2 * STAGES * TKV);
};

template <int HEAD_DIM, int TQ, int TKV, int STAGES, int M_FRAGS>
__host__ __device__ constexpr int fa2_smem_bytes() {
  return Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS>::kSmemBytes;
}
template <int HEAD_DIM, int TQ, int TKV, int STAGES, int M_FRAGS>
__host__ __device__ constexpr int fa2_num_threads() {
  return Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS>::kThreads;
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

// ---------------------------------------------------------------------------------------------
// The kernel body.
// ---------------------------------------------------------------------------------------------
template <typename Variant, typename DType, int HEAD_DIM, int TQ, int TKV, int STAGES,
          int M_FRAGS>
__device__ __forceinline__ void fa2_prefill(const attncc::AttentionParams& p,
                                            const typename Variant::Params& vp) {
  using Cfg = Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS>;
  constexpr int D = HEAD_DIM;
  constexpr int NT = Cfg::kThreads;
  constexpr int N_FRAGS_S = TKV / 8;   // S accumulator fragments per 16-row fragment
  constexpr int N_FRAGS_O = D / 8;     // O accumulator fragments per 16-row fragment
  constexpr int CHUNKS = D / 8;        // 16-byte chunks per row
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr bool kSoftmax = Variant::use_softmax;

  extern __shared__ __attribute__((aligned(128))) unsigned char attncc_fa2_smem[];
  fa2_u16* sQ = reinterpret_cast<fa2_u16*>(attncc_fa2_smem);
  fa2_u16* sK = sQ + TQ * D;
  fa2_u16* sV = sK + STAGES * Cfg::kTileElems;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int b = blockIdx.z;
  const int slot = blockIdx.y;
  // Head-group fusion factor: the launcher encodes it in the grid (see top of file).
  const int gf = p.num_q_heads / gridDim.y;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head0 = slot * gf;           // first query head of this CTA
  const int h_kv = head0 / group;        // KV head shared by all of them
  // Tiles in reverse order: under a causal mask the last query tiles have the most KV tiles, and
  // the hardware starts CTAs in blockIdx order, so the longest work starts first and the short
  // tiles fill the tail (better balance than leaving the long ones for the end).
  const int row0 = (gridDim.x - 1 - blockIdx.x) * TQ;  // first fused row of this tile
  const int q_len = p.q_len;
  const int kv_len = p.kv_len;
  // every fused row of this tile is a real query row (all but the last tile of a sequence)
  const bool tile_rows_in = row0 + TQ <= q_len * gf;

  const DType* __restrict__ gQ = reinterpret_cast<const DType*>(p.q);
  const DType* __restrict__ gK =
      reinterpret_cast<const DType*>(p.k) + b * p.k_stride_b + h_kv * p.k_stride_h;
  const DType* __restrict__ gV =
      reinterpret_cast<const DType*>(p.v) + b * p.v_stride_b + h_kv * p.v_stride_h;

  // ---- which KV tiles to visit ---------------------------------------------------------------
  TileList tiles;
  if (p.kv_num_blocks == nullptr) {
    tiles.partial = nullptr;
    tiles.full = nullptr;
    tiles.n_partial = (kv_len + TKV - 1) / TKV;
    tiles.n_full = 0;
    tiles.sub = 1;
    tiles.block_kv = TKV;
    tiles.tile = TKV;
    tiles.count = tiles.n_partial;
  } else {
    // The launcher guarantees the tile's query rows lie inside one mask query block and, when
    // gf > 1, that the mask is the same for all heads of the group; so head0's list is the list.
    const int qb = (row0 / gf) / p.block_q;
    const attncc::i64 nb_off = b * p.bm_stride_b + head0 * p.bm_stride_h + qb;
    const attncc::i64 ix_off = b * p.bi_stride_b + head0 * p.bi_stride_h + qb * p.bi_stride_q;
    tiles.partial = p.kv_indices + ix_off;
    tiles.n_partial = __ldg(p.kv_num_blocks + nb_off);
    if (p.full_kv_num_blocks != nullptr) {
      tiles.full = p.full_kv_indices + ix_off;
      tiles.n_full = __ldg(p.full_kv_num_blocks + nb_off);
    } else {
      tiles.full = nullptr;
      tiles.n_full = 0;
    }
    tiles.sub = p.block_kv / TKV;
    tiles.block_kv = p.block_kv;
    tiles.tile = TKV;
    tiles.count = (tiles.n_partial + tiles.n_full) * tiles.sub;
  }
  auto tile_start = [&](int i, bool& is_full) -> int { return tiles.start(i, is_full); };

  // ---- async loaders ---------------------------------------------------------------------------
  // Each thread owns one 16-byte column chunk (tid % CHUNKS) and every ROWS_PER_PASS-th row from
  // tid / CHUNKS. Fixed chunk + compile-time pass count let the compiler strength-reduce the
  // addresses to one pointer increment per pass instead of keeping a 64-bit address per copy live
  // across the main loop (which is what pushed an earlier version into spills).
  constexpr int ROWS_PER_PASS = NT / CHUNKS;
  static_assert(NT % CHUNKS == 0 && TQ % ROWS_PER_PASS == 0 && TKV % ROWS_PER_PASS == 0,
                "loader layout");
  const int ld_row = tid / CHUNKS;
  const int ld_ch = tid % CHUNKS;
  auto load_q = [&]() {
    const fa2_u32 base = smem_addr(sQ);
#pragma unroll
    for (int j = 0; j < TQ / ROWS_PER_PASS; ++j) {
      const int r = ld_row + j * ROWS_PER_PASS;
      const int fr = row0 + r;
      const int qi = fr / gf;
      const int hq = head0 + (fr - qi * gf);
      const bool ok = qi < q_len;
      const DType* src =
          ok ? gQ + b * p.q_stride_b + hq * p.q_stride_h + qi * p.q_stride_s + ld_ch * 8 : gQ;
      cp_async_16(base + 2 * swz<D>(r, ld_ch * 8), src, ok);
    }
  };
  auto load_kv = [&](const DType* __restrict__ g, attncc::i64 stride_s, fa2_u32 stage_addr,
                     int kv0) {
    const DType* src = g + (kv0 + ld_row) * stride_s + ld_ch * 8;
    const attncc::i64 step = ROWS_PER_PASS * stride_s;
#pragma unroll
    for (int j = 0; j < TKV / ROWS_PER_PASS; ++j) {
      const int r = ld_row + j * ROWS_PER_PASS;
      // unsigned compare: also rejects negative positions from a malformed block list
      const bool ok = (unsigned)(kv0 + r) < (unsigned)kv_len;
      cp_async_16(stage_addr + 2 * swz<D>(r, ld_ch * 8), ok ? src : g, ok);
      src += step;
    }
  };

  // ---- per-thread row bookkeeping --------------------------------------------------------------
  // MMA accumulator layout (m16n8): lane holds rows lane/4 and lane/4 + 8 of each 16-row fragment,
  // columns 2*(lane%4) + {0,1} of each 8-column fragment.
  // Recomputed where needed (hooks, epilogue) rather than kept in registers across the main loop,
  // where every register is taken by the O and S accumulators.
  auto row_of = [&](int mf, int hr, int& qi, int& hq) {
    const int fr = row0 + (warp * M_FRAGS + mf) * 16 + (lane >> 2) + 8 * hr;
    qi = fr / gf;
    hq = head0 + (fr - qi * gf);
  };

  // ---- prologue: Q and the first STAGES-1 K/V tiles in flight ---------------------------------
  // Commit-group discipline: Q is one group; then every tile (its K and V rows) is one group,
  // committed even when empty, so at the top of iteration `it` exactly STAGES-2 groups are newer
  // than tile `it` and cp.async.wait_group takes a compile-time count.
  auto load_tile = [&](int i) {
    if (i < tiles.count) {
      bool f;
      const int kv0 = tile_start(i, f);
      const int st = i % STAGES;
      load_kv(gK, p.k_stride_s, smem_addr(sK + st * Cfg::kTileElems), kv0);
      load_kv(gV, p.v_stride_s, smem_addr(sV + st * Cfg::kTileElems), kv0);
    }
    cp_async_commit();
  };
  load_q();
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_tile(s);
  cp_async_wait<STAGES - 1>();  // Q landed (this thread's copies) ...
  __syncthreads();              // ... and everyone's

  if constexpr (Variant::has_query_transform) {
    // Each warp transforms only the rows it will read (its own fragments): __syncwarp suffices.
#pragma unroll 1
    for (int r = warp * M_FRAGS * 16; r < (warp + 1) * M_FRAGS * 16; ++r) {
      const int fr = row0 + r;
      const int qi = fr / gf;
      if (qi >= q_len) continue;  // out-of-range rows never reach the hooks
      const int hq = head0 + (fr - qi * gf);
      transform_row<DType, D>(sQ, r, lane, [&](const SmemRow<DType, D>& q, int d) {
        return Variant::QueryTransform(vp, q, b, hq, qi, d);
      });
    }
  }

  // ---- accumulators ----------------------------------------------------------------------------
  float o_acc[M_FRAGS][N_FRAGS_O][4];
  float row_m[M_FRAGS][2], row_l[M_FRAGS][2];
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf) {
#pragma unroll
    for (int nf = 0; nf < N_FRAGS_O; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) o_acc[mf][nf][i] = 0.f;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      row_m[mf][hr] = neg_inf();
      row_l[mf][hr] = 0.f;
    }
  }
  // exp2-domain scale: with no LogitsTransform, dot * sm_scale * log2(e) is one multiply.
  const float qk_scale = (kSoftmax && !Variant::has_logits_transform) ? p.sm_scale * kLog2e
                                                                      : p.sm_scale;

  // Per-lane fragment address bases (see the ldmatrix comments below for the lane -> row/chunk
  // mapping). Every row index used with them is (multiple of 8) + (lane & 7), so row % 8 == lane & 7
  // and the swizzle key of each operand is a per-lane constant.
  const fa2_u32 l7 = lane & 7;
  const fa2_u32 q_row_addr =
      smem_addr(sQ) + 2 * D * ((warp * M_FRAGS) * 16 + (lane & 15));
  const fa2_u32 q_x = (fa2_u32)(lane >> 4) ^ l7;
  const fa2_u32 k_lane_off = 2 * D * ((lane >> 4) * 8 + l7);
  const fa2_u32 k_x = (fa2_u32)((lane >> 3) & 1) ^ l7;
  const fa2_u32 v_lane_off = 2 * D * (((lane >> 3) & 1) * 8 + l7);
  const fa2_u32 v_x = (fa2_u32)(lane >> 4) ^ l7;
  const fa2_u32 sK_addr = smem_addr(sK);
  const fa2_u32 sV_addr = smem_addr(sV);

  // Q fragments stay in registers for the whole KV loop when they fit (D/16 * 4 registers per
  // 16-row fragment: 32 at D=128): saves D/16 ldmatrix per KV tile. At D=256 (64 registers on top
  // of a 128-register O accumulator) they are re-read from shared memory instead.
  constexpr bool kQInRegs = D * M_FRAGS <= 128;
  fa2_u32 q_frag[kQInRegs ? M_FRAGS : 1][kQInRegs ? D / 16 : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
        ldmatrix_x4(q_frag[mf][ks], chunk_addr(q_row_addr + mf * 16 * 2 * D, 2 * ks, q_x));
  }

  // ---- main loop over KV tiles -----------------------------------------------------------------
  // One barrier per iteration: after it, tile `it` is visible to every warp AND every warp has
  // finished iteration it-1, so the stage that tile it-1 used can be refilled right away.
#pragma unroll 1
  for (int it = 0; it < tiles.count; ++it) {
    const int stage = it % STAGES;
    if constexpr (STAGES == 1) {  // no prefetch: refill the only stage once everyone is done
      __syncthreads();
      load_tile(it);
      cp_async_wait<0>();
      __syncthreads();
    } else {
      cp_async_wait<STAGES - 2>();  // tile it landed (this thread's copies) ...
      __syncthreads();              // ... and everyone's; stage (it-1) % STAGES is free
      load_tile(it + STAGES - 1);   // prefetch into it
    }

    bool is_full;
    const int kv0 = tile_start(it, is_full);
    fa2_u16* sKs = sK + stage * Cfg::kTileElems;
    fa2_u16* sVs = sV + stage * Cfg::kTileElems;
    if constexpr (Variant::has_key_transform || Variant::has_value_transform) {
#pragma unroll 1
      for (int r = warp; r < TKV; r += Cfg::kWarps) {
        const int kv = kv0 + r;
        if (kv >= kv_len) break;
        if constexpr (Variant::has_key_transform)
          transform_row<DType, D>(sKs, r, lane, [&](const SmemRow<DType, D>& k, int d) {
            return Variant::KeyTransform(vp, k, b, h_kv, kv, d);
          });
        if constexpr (Variant::has_value_transform)
          transform_row<DType, D>(sVs, r, lane, [&](const SmemRow<DType, D>& v, int d) {
            return Variant::ValueTransform(vp, v, b, h_kv, kv, d);
          });
      }
      __syncthreads();
    }

    // S = Q K^T for this warp's rows: M_FRAGS x (TKV/8) fragments.
    float s_acc[M_FRAGS][N_FRAGS_S][4];
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
      for (int nf = 0; nf < N_FRAGS_S; ++nf)
#pragma unroll
        for (int i = 0; i < 4; ++i) s_acc[mf][nf][i] = 0.f;

    {
      const fa2_u32 qa = opaque(q_row_addr), qx = opaque(q_x), kx = opaque(k_x);
      const fa2_u32 ka = opaque(sK_addr + 2 * stage * Cfg::kTileElems + k_lane_off);
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        fa2_u32 a[M_FRAGS][4];
#pragma unroll
        for (int mf = 0; mf < M_FRAGS; ++mf) {
          // A fragment (16x16): lanes 0-15 address rows 0-15 at k-chunk 2ks, lanes 16-31 the same
          // rows at k-chunk 2ks+1 -> registers a0..a3 in mma order.
          if constexpr (kQInRegs) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mf][i] = q_frag[mf][ks][i];
          } else {
            ldmatrix_x4(a[mf], chunk_addr(qa + mf * 16 * 2 * D, 2 * ks, qx));
          }
        }
#pragma unroll
        for (int np = 0; np < TKV / 16; ++np) {
          // B fragments of two 8-column n-fragments (K rows are the n index); lane groups of 8
          // address matrices (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7) (n8-15,k8-15).
          fa2_u32 bk[4];
          ldmatrix_x4(bk, chunk_addr(ka + np * 16 * 2 * D, 2 * ks, kx));
#pragma unroll
          for (int mf = 0; mf < M_FRAGS; ++mf) {
            mma_16816<DType>(s_acc[mf][2 * np], a[mf], bk[0], bk[1]);
            mma_16816<DType>(s_acc[mf][2 * np + 1], a[mf], bk[2], bk[3]);
          }
        }
      }
    }

    // Logits: scale, hooks, masking. Out-of-range rows/columns never reach the hooks. Four
    // compile-time specializations so that the common tile -- inside the sequence, and a full
    // block (or no mask) -- pays only for the scale and, if present, the LogitsTransform; bounds
    // checks and the mask cost only on edge tiles and partial blocks.
    const bool bounds = kv0 < 0 || kv0 + TKV > kv_len || !tile_rows_in;
    const bool apply_mask = Variant::has_logits_mask && !is_full;
    auto logits = [&](auto bounds_tag, auto mask_tag) {
      constexpr bool kBounds = decltype(bounds_tag)::value;
      constexpr bool kMask = decltype(mask_tag)::value;
      const float masked = kSoftmax ? neg_inf() : 0.f;
#pragma unroll
      for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          int qi = 0, hq = 0;
          if constexpr (Variant::has_logits_transform || kMask || kBounds) row_of(mf, hr, qi, hq);
          const bool row_in = !kBounds || qi < q_len;
#pragma unroll
          for (int nf = 0; nf < N_FRAGS_S; ++nf)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int kv = kv0 + nf * 8 + 2 * (lane & 3) + e;
              float sc = s_acc[mf][nf][2 * hr + e] * qk_scale;
              if (kBounds && (!row_in || (unsigned)kv >= (unsigned)kv_len)) {
                sc = masked;
              } else {
                if constexpr (Variant::has_logits_transform) {
                  sc = Variant::LogitsTransform(vp, sc, b, hq, qi, kv);
                  if constexpr (kSoftmax) sc *= kLog2e;
                }
                if constexpr (kMask) {
                  if (!Variant::LogitsMask(vp, b, hq, qi, kv)) sc = masked;
                }
              }
              s_acc[mf][nf][2 * hr + e] = sc;
            }
        }
    };
    if (!bounds && !apply_mask) {
      logits(BoolTag<false>{}, BoolTag<false>{});
    } else if constexpr (Variant::has_logits_mask) {
      if (!bounds)
        logits(BoolTag<false>{}, BoolTag<true>{});
      else if (!apply_mask)
        logits(BoolTag<true>{}, BoolTag<false>{});
      else
        logits(BoolTag<true>{}, BoolTag<true>{});
    } else {
      logits(BoolTag<true>{}, BoolTag<false>{});
    }

    if constexpr (kSoftmax) {
      // Online softmax, base 2. A row's 8*N_FRAGS_S columns are spread over the 4 lanes of a quad:
      // reduce the max with two xor-shuffles. l stays a per-lane partial sum (all quad lanes
      // rescale by the same factor) and is reduced once at the end.
      float corr[M_FRAGS][2];
      bool grew = false;  // did any row max of this thread change (then O must be rescaled)
#pragma unroll
      for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = row_m[mf][hr];
#pragma unroll
          for (int nf = 0; nf < N_FRAGS_S; ++nf)
            mx = fmaxf(mx, fmaxf(s_acc[mf][nf][2 * hr], s_acc[mf][nf][2 * hr + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          // A row with every logit so far masked has max -inf: subtract 0 instead so that
          // exp2(-inf - m) is 0, not NaN; its rescale factor is irrelevant (acc and l are 0).
          const float m_use = (mx == neg_inf()) ? 0.f : mx;
          grew |= mx != row_m[mf][hr];
          corr[mf][hr] = fast_exp2(row_m[mf][hr] - m_use);
          row_m[mf][hr] = mx;
          float sum = 0.f;
#pragma unroll
          for (int nf = 0; nf < N_FRAGS_S; ++nf) {
            const float p0 = fast_exp2(s_acc[mf][nf][2 * hr] - m_use);
            const float p1 = fast_exp2(s_acc[mf][nf][2 * hr + 1] - m_use);
            s_acc[mf][nf][2 * hr] = p0;
            s_acc[mf][nf][2 * hr + 1] = p1;
            sum += p0 + p1;
          }
          row_l[mf][hr] = row_l[mf][hr] * corr[mf][hr] + sum;
        }
      // Rescaling O costs D/2 multiplies per row-half -- more than the tile's exponentials. After
      // the first few tiles a row's max rarely grows, and when no row of the warp grew every
      // factor is exactly 1 (ex2(0) = 1), so the warp skips the rescale (a warp-uniform branch).
#if ATTNCC_FA2_LAZY_RESCALE
      if (__any_sync(0xffffffffu, grew))
#endif
      {
#pragma unroll
        for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr)
#pragma unroll
            for (int nf = 0; nf < N_FRAGS_O; ++nf) {
              o_acc[mf][nf][2 * hr] *= corr[mf][hr];
              o_acc[mf][nf][2 * hr + 1] *= corr[mf][hr];
            }
      }
    }

    // O += P V. The S accumulator of n-fragments 2kk, 2kk+1 is exactly the A-fragment layout of
    // k-step kk (rows lane/4, lane/4+8; k = 2*(lane%4) + {0,1} and + 8), so P never leaves
    // registers; it is packed to 16 bits once, halving its register footprint during PV.
    fa2_u32 pa[M_FRAGS][TKV / 16][4];
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
      for (int kk = 0; kk < TKV / 16; ++kk) {
        pa[mf][kk][0] = pack2<DType>(s_acc[mf][2 * kk][0], s_acc[mf][2 * kk][1]);
        pa[mf][kk][1] = pack2<DType>(s_acc[mf][2 * kk][2], s_acc[mf][2 * kk][3]);
        pa[mf][kk][2] = pack2<DType>(s_acc[mf][2 * kk + 1][0], s_acc[mf][2 * kk + 1][1]);
        pa[mf][kk][3] = pack2<DType>(s_acc[mf][2 * kk + 1][2], s_acc[mf][2 * kk + 1][3]);
      }
    {
      const fa2_u32 va = opaque(sV_addr + 2 * stage * Cfg::kTileElems + v_lane_off);
      const fa2_u32 vx = opaque(v_x);
#pragma unroll
      for (int kk = 0; kk < TKV / 16; ++kk) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          // V is [kv][d] row-major = B row-major: ldmatrix.trans yields the col fragment. Lane
          // groups address (kv0-7,d0-7) (kv8-15,d0-7) (kv0-7,d8-15) (kv8-15,d8-15).
          fa2_u32 bv[4];
          ldmatrix_x4_trans(bv, chunk_addr(va + kk * 16 * 2 * D, 2 * dp, vx));
#pragma unroll
          for (int mf = 0; mf < M_FRAGS; ++mf) {
            mma_16816<DType>(o_acc[mf][2 * dp], pa[mf][kk], bv[0], bv[1]);
            mma_16816<DType>(o_acc[mf][2 * dp + 1], pa[mf][kk], bv[2], bv[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups can remain; drain them before the CTA exits

  // ---- epilogue --------------------------------------------------------------------------------
  float lse_val[M_FRAGS][2];
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float inv = 1.f;
      if constexpr (kSoftmax) {
        float l = row_l[mf][hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        // Fully masked row: l = 0 -> output 0 (the accumulator is 0) and lse = -inf.
        inv = l > 0.f ? 1.f / l : 0.f;
        lse_val[mf][hr] = l > 0.f ? (row_m[mf][hr] + __log2f(l)) * kLn2 : neg_inf();
      } else {
        lse_val[mf][hr] = 0.f;
      }
#pragma unroll
      for (int nf = 0; nf < N_FRAGS_O; ++nf) {
        o_acc[mf][nf][2 * hr] *= inv;
        o_acc[mf][nf][2 * hr + 1] *= inv;
      }
    }

  // Stage the normalized O tile through shared memory (the warp's own Q rows, no longer read), so
  // the OutputTransform sees whole rows and global stores are 16 bytes wide and coalesced.
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = (warp * M_FRAGS + mf) * 16 + (lane >> 2) + 8 * hr;
#pragma unroll
      for (int nf = 0; nf < N_FRAGS_O; ++nf) {
        const int col = nf * 8 + 2 * (lane & 3);
        *reinterpret_cast<fa2_u32*>(sQ + swz<D>(r, col)) =
            pack2<DType>(o_acc[mf][nf][2 * hr], o_acc[mf][nf][2 * hr + 1]);
      }
    }
  __syncwarp();

  if constexpr (Variant::has_output_transform) {
#pragma unroll 1
    for (int r = warp * M_FRAGS * 16; r < (warp + 1) * M_FRAGS * 16; ++r) {
      const int fr = row0 + r;
      const int qi = fr / gf;
      if (qi >= q_len) continue;
      const int hq = head0 + (fr - qi * gf);
      transform_row<DType, D>(sQ, r, lane, [&](const SmemRow<DType, D>& o, int d) {
        return Variant::OutputTransform(vp, o, b, hq, qi, d);
      });
    }
  }

  // 16-byte stores of the warp's rows: lanes sweep a row's chunks, then the next row.
  DType* gO = reinterpret_cast<DType*>(p.o);
#pragma unroll
  for (int c = lane; c < M_FRAGS * 16 * CHUNKS; c += 32) {
    const int r = (warp * M_FRAGS) * 16 + c / CHUNKS;
    const int ch = c % CHUNKS;
    const int fr = row0 + r;
    const int qi = fr / gf;
    if (qi < q_len) {
      const int hq = head0 + (fr - qi * gf);
      const fa2_u32x4 val = *reinterpret_cast<const fa2_u32x4*>(sQ + swz<D>(r, ch * 8));
      *reinterpret_cast<fa2_u32x4*>(gO + b * p.o_stride_b + hq * p.o_stride_h + qi * p.o_stride_s +
                                ch * 8) = val;
    }
  }

  if constexpr (kSoftmax) {
    if (p.lse != nullptr && (lane & 3) == 0) {
#pragma unroll
      for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          int qi, hq;
          row_of(mf, hr, qi, hq);
          if (qi < q_len) p.lse[b * p.lse_stride_b + hq * p.lse_stride_h + qi] = lse_val[mf][hr];
        }
    }
  }
}

}  // namespace fa2
}  // namespace attncc

// The one line codegen emits per kernel: the extern "C" entry point with the interface's signature.
// Launch it with grid (ceil(q_len * gf / TQ), num_q_heads / gf, batch), block (kThreads), dynamic
// shared memory kSmemBytes (attncc.runtime.gpu_flex.fa2_config mirrors both in Python; the
// launcher checks kThreads against the function's CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK).
// __launch_bounds__(threads, 1): one CTA per SM is all we ask, so ptxas may use up to 255
// registers (with no minimum it sometimes capped small CTAs at 128 registers and spilled).
#define ATTNCC_FA2_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS)               \
  extern "C" __global__ void __launch_bounds__(                                                \
      attncc::fa2::Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS>::kThreads, 1)                    \
      NAME(attncc::AttentionParams p, VARIANT::Params vp) {                                    \
    attncc::fa2::fa2_prefill<VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS>(p, vp);       \
  }

#endif  // ATTNCC_FA2_PREFILL_CUH
