// attncc FA2 prefill kernel for FlexAttention-style calls: dense [B, H, S, D] tensors with any
// strides, optionally a FlexAttention BlockMask (BSR lists of partial and full KV blocks).
//
// Self-contained: no #include. Comes after attncc_types.cuh, attention_params.cuh,
// common.cuh and fa2_attend.cuh, and before the generated Variant_<name> functors' entry
// point (ATTNCC_FA2_ENTRY at the bottom).
//
// Grid: (ceil(q_len * gf / TQ), num_q_heads / gf, batch), gf = num_q_heads / gridDim.y query
//   heads per CTA: 1, or the whole GQA group (head-group fusion, fa2_attend.cuh). The launcher
//   chooses gf; the kernel reads it back from gridDim.y, so AttentionParams needs no extra field.
#ifndef ATTNCC_FA2_PREFILL_CUH
#define ATTNCC_FA2_PREFILL_CUH

namespace attncc {
namespace fa2 {

// ---------------------------------------------------------------------------------------------
// DenseWork: fa2_attend's view of one CTA of a dense (optionally BSR-masked) prefill launch.
// ---------------------------------------------------------------------------------------------
template <typename DType, int D, int TQ, int TKV, int NT, int DQK = D, int DV = D>
struct DenseWork {
  static constexpr bool kMaySplit = false;
  // A padded form: D is the padded width (64/128/256) of the real head dims DQK (q, k) and DV
  // (v, o), multiples of 8, so a 16-byte chunk is all in or all out. Chunks past them load as
  // zeros (zero-fill copies: no global read) and are not stored (docs/flex-api.md, "Head dims").
  // (an enumerator, not a static data member: that would add a global symbol to the PTX, and
  // ptxas then schedules some native forms differently)
  enum : bool { kPadded = DQK != D || DV != D };
  static constexpr bool kTreeMask = false;  // (BatchWork's multi-token decode tree mask)
  __device__ __forceinline__ bool tree_tile(int, int) const { return false; }
  __device__ __forceinline__ bool tree_keeps(int, int) const { return true; }
  static constexpr bool kKv8 = false;  // q's dtype in K and V (fa2_kv8.cuh is the batch kernel's)
  static constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
  // Loader layout: each thread owns one 16-byte column chunk (tid % CHUNKS) and every
  // ROWS_PER_PASS-th row from tid / CHUNKS. Fixed chunk + compile-time pass count let the compiler
  // strength-reduce the addresses to one pointer increment per pass instead of keeping a 64-bit
  // address per copy live across the main loop (which is what pushed an earlier version into
  // spills).
  static constexpr int ROWS_PER_PASS = NT / CHUNKS;
  static_assert(NT % CHUNKS == 0 && TQ % ROWS_PER_PASS == 0 && TKV % ROWS_PER_PASS == 0,
                "loader layout");

  const attncc::AttentionParams& p;
  static constexpr int kv_pos0 = 0;  // positions are the tensors' own indices
  int b, gf, head0, h_kv, row0, rows, kv_len, count;
  TileList tiles;

  __device__ __forceinline__ explicit DenseWork(const attncc::AttentionParams& params)
      : p(params) {
    b = blockIdx.z;
    gf = p.num_q_heads / gridDim.y;
    head0 = blockIdx.y * gf;                        // first query head of this CTA
    h_kv = head0 / (p.num_q_heads / p.num_kv_heads);  // KV head shared by all of them
    // Tiles in reverse order: under a causal mask the last query tiles have the most KV tiles,
    // and the hardware starts CTAs in blockIdx order, so the longest work starts first and the
    // short tiles fill the tail (better balance than leaving the long ones for the end).
    row0 = (gridDim.x - 1 - blockIdx.x) * TQ;
    rows = p.q_len * gf;
    kv_len = p.kv_len;
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
      // gf > 1, that the mask is the same for all heads of the group; so head0's list is the
      // list.
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
    count = tiles.count;
  }

  __device__ __forceinline__ int tile_start(int i, bool& is_full) const {
    return tiles.start(i, is_full);
  }
  __device__ __forceinline__ int q_position(int tok) const { return tok; }

  __device__ __forceinline__ void load_q(u32 sq, int tid) const {
    const DType* gQ = reinterpret_cast<const DType*>(p.q);
    const int ld_row = tid / CHUNKS, ld_ch = tid % CHUNKS;
    const FastDiv gdiv(gf);
#pragma unroll
    for (int j = 0; j < TQ / ROWS_PER_PASS; ++j) {
      const int r = ld_row + j * ROWS_PER_PASS;
      const int fr = row0 + r;
      const int qi = gdiv.div(fr);
      const int hq = head0 + (fr - qi * gf);
      const bool ok = fr < rows && col_in(ld_ch, DQK);
      const DType* src =
          ok ? gQ + b * p.q_stride_b + hq * p.q_stride_h + qi * p.q_stride_s + ld_ch * 8 : gQ;
      cp_async_16(sq + 2 * swz<D>(r, ld_ch * 8), src, ok);
    }
  }

  // Whether 16-byte chunk `ch` lies inside a real head dim `width` (always, unpadded).
  __device__ __forceinline__ static bool col_in(int ch, int width) {
    return !kPadded || ch * 8 < width;
  }
  __device__ __forceinline__ bool o_chunk(int ch) const { return col_in(ch, DV); }

  __device__ __forceinline__ void load_rows(const DType* __restrict__ g, attncc::i64 stride_s,
                                            u32 stage_addr, int kv0, int tid, int width) const {
    const int ld_row = tid / CHUNKS, ld_ch = tid % CHUNKS;
    const bool col = col_in(ld_ch, width);
    const DType* src = g + (kv0 + ld_row) * stride_s + ld_ch * 8;
    const attncc::i64 step = ROWS_PER_PASS * stride_s;
#pragma unroll
    for (int j = 0; j < TKV / ROWS_PER_PASS; ++j) {
      const int r = ld_row + j * ROWS_PER_PASS;
      // unsigned compare: also rejects negative positions from a malformed block list
      const bool ok = (unsigned)(kv0 + r) < (unsigned)kv_len && col;
      cp_async_16(stage_addr + 2 * swz<D>(r, ld_ch * 8), ok ? src : g, ok);
      src += step;
    }
  }

  __device__ __forceinline__ void load_kv(u32 sk, u32 sv, int kv0, int tid) const {
    load_rows(reinterpret_cast<const DType*>(p.k) + b * p.k_stride_b + h_kv * p.k_stride_h,
              p.k_stride_s, sk, kv0, tid, DQK);
    load_rows(reinterpret_cast<const DType*>(p.v) + b * p.v_stride_b + h_kv * p.v_stride_h,
              p.v_stride_s, sv, kv0, tid, DV);
  }

  __device__ __forceinline__ DType* o_row(int tok, int hq) const {
    return reinterpret_cast<DType*>(p.o) + b * p.o_stride_b + hq * p.o_stride_h +
           tok * p.o_stride_s;
  }
  __device__ __forceinline__ bool has_lse() const { return p.lse != nullptr; }
  __device__ __forceinline__ float* lse_at(int tok, int hq) const {
    return p.lse + b * p.lse_stride_b + hq * p.lse_stride_h + tok;
  }
  __device__ __forceinline__ float* partial_o() const { return nullptr; }
  __device__ __forceinline__ float* partial_lse() const { return nullptr; }
  __device__ __forceinline__ const float* sinks() const { return p.sinks; }
};

template <typename Variant, typename DType, int HEAD_DIM, int TQ, int TKV, int STAGES,
          int M_FRAGS, int KV_WARPS, int DQK = HEAD_DIM, int DV = HEAD_DIM>
__device__ __forceinline__ void fa2_prefill(const attncc::AttentionParams& p,
                                            const typename Variant::Params& vp) {
  using Cfg = Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>;
  const DenseWork<DType, HEAD_DIM, TQ, TKV, Cfg::kThreads, DQK, DV> w(p);
  fa2_attend<Variant, DType, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>(w, vp, p.sm_scale);
}

}  // namespace fa2
}  // namespace attncc

// The one line codegen emits per kernel: the extern "C" entry point with the interface's signature.
// Launch it with grid (ceil(q_len * gf / TQ), num_q_heads / gf, batch), block (kThreads), dynamic
// shared memory kSmemBytes (attncc.runtime.jit.tiles.fa2_config mirrors both in Python; the
// launcher checks kThreads against the function's CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK).
// Launch bounds (Config::kMinBlocks): one CTA per SM is all we ask of the prefill tiles, so ptxas
// may use up to 255 registers (with no minimum it sometimes capped small CTAs at 128 registers
// and spilled). DQK, DV: the real head dims (HEAD_DIM both, or a padded form: DenseWork).
#define ATTNCC_FA2_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS, DQK,  \
                         DV)                                                                       \
  extern "C" __global__ void ATTNCC_FA2_LAUNCH_BOUNDS(HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS)\
      NAME(attncc::AttentionParams p, VARIANT::Params vp) {                                        \
    attncc::fa2::fa2_prefill<VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS, DQK,    \
                             DV>(p, vp);                                                           \
  }

#endif  // ATTNCC_FA2_PREFILL_CUH
