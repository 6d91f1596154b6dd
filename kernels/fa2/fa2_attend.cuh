// attncc FlashAttention-2-style attention of one CTA tile, for sm_80+ (Ampere, Hopper).
//
// Written for attncc from the FlashAttention-2 paper's algorithm; see docs/kernel-interface.md for
// the functor interface. Self-contained: no #include; comes after common.cuh.
//
// fa2_attend computes TQ "fused rows" of one (batch, KV head) against a list of KV tiles:
//   Q tile [TQ x D] -> shared memory (cp.async), QueryTransform in place;
//   for each KV tile: K,V tiles [TKV x D] stream through a STAGES-deep cp.async ring;
//     S = Q K^T with ldmatrix + mma.sync.m16n8k16 (fp32 accumulate) in registers;
//     LogitsTransform / LogitsMask on each fragment element; online softmax (exp2 domain);
//     O += P V (P re-packed from the S accumulators to bf16/fp16 A fragments in registers);
//   O /= l, staged through shared memory (re-using the Q tile), OutputTransform, 16-byte
//   coalesced stores; LSE (natural log) per row.  Or, for a split unit, fp32 O and LSE to a
//   workspace slot, to be merged (fa2_batch.cuh).
//
// Fused rows: head-group fusion stacks the gf query heads that share a KV head into the row
// dimension (fused row = token * gf + head_in_group), so each K/V tile read serves the group.
//
// Warp layout: TQ / (16 * M_FRAGS) row warps; warp w owns tile rows [16*M_FRAGS*w,
// 16*M_FRAGS*(w+1)) -- M_FRAGS 16-row MMA fragments. Each warp reads only its own Q rows and
// writes only its own O rows, so the Q transform and the epilogue need just __syncwarp(); K/V
// tiles are shared by all warps and need __syncthreads().
// Decode (KV_WARPS > 1, TQ = 16): KV_WARPS warps share the one 16-row fragment and each takes a
// TKV / KV_WARPS-row slice of every KV tile, keeping its own (m, l, O); at the end the slices'
// states are merged through shared memory and warp 0 runs the epilogue.
//
// What the caller's `Work` provides (DenseWork in fa2_prefill.cuh, BatchWork in fa2_batch.cuh):
//   int b, gf, head0, h_kv;      batch index the hooks see; heads fused per KV head; first query
//                                head of the rows; the KV head
//   int row0, rows;              first fused row of the tile; fused rows [0, rows) exist
//   int q_position(int tok) const;  the query position the hooks see for token `tok`
//   int kv_pos0;                 kv position i is position i + kv_pos0 for the hooks
//   int kv_len, count;           kv positions [0, kv_len) exist; KV tiles to visit
//   int tile_start(int i, bool& is_full) const;   first kv position of tile i; is_full: the
//                                                 block is known fully unmasked (skip LogitsMask)
//   void load_q(u32 sQ, int tid) const;           cp.async the tile's Q rows (zero-fill padding)
//   void load_kv(u32 sK, u32 sV, int kv0, int tid) const;  cp.async K and V rows kv0..kv0+TKV-1
//   DType* o_row(int tok, int hq) const;          output row of (token, head)
//   kPadded (a constant); bool o_chunk(int ch) const;  D is the padded width of the
//                                real head dims; o_chunk: 16-byte chunk ch of O is stored
//   bool has_lse() const; float* lse_at(int tok, int hq) const;
//   static constexpr bool kMaySplit; float* partial_o() const; float* partial_lse() const;
//   const float* sinks() const;                   per-query-head sink logits, or null
//   static constexpr bool kTreeMask; bool tree_tile(int kv0, int kv_end) const;  a multi-token
//                                decode tree mask: whether tile [kv0, kv_end) needs it, and
//   bool tree_keeps(int qi, int kv) const;        whether it keeps (query position, key)
//   static constexpr bool kKv8;  an fp8 cache (fa2_kv8.cuh); then also `using KvT` (its format)
//                                and `float value_scale()`, and load_kv copies fp8 bytes
#ifndef ATTNCC_FA2_ATTEND_CUH
#define ATTNCC_FA2_ATTEND_CUH

namespace attncc {
namespace fa2 {

// ---------------------------------------------------------------------------------------------
// Decode (KV_WARPS > 1): merge the KV slices' states of the shared 16-row fragment into warp 0.
// Each warp holds rows lane/4 and lane/4 + 8 (hr = 0, 1) with its own running max m (base 2),
// per-lane partial sum l and unnormalized O. The softmax merge is the composition operator:
// m = max_k m_k, l = sum_k l_k 2^(m_k - m), O = sum_k O_k 2^(m_k - m). `red` is the K/V stage
// memory, free once every warp has left the KV loop.
// ---------------------------------------------------------------------------------------------
template <bool kSoftmax, int D, int KV_WARPS>
__device__ __forceinline__ void merge_kv_slices(float* red, int kvw, int lane, float (&o)[D / 8][4],
                                                float (&m)[2], float (&l)[2]) {
  float* red_m = red;                      // [KV_WARPS][16] row maxima
  float* red_l = red + KV_WARPS * 16;      // [KV_WARPS][16] row sums
  float* red_o = red + 2 * KV_WARPS * 16;  // [KV_WARPS - 1][16][D] rescaled O of warps 1..
  __syncthreads();  // every warp is past its last read of the K/V stages
  if constexpr (kSoftmax) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float lq = l[hr];
      lq += __shfl_xor_sync(0xffffffffu, lq, 1);
      lq += __shfl_xor_sync(0xffffffffu, lq, 2);
      const int r = (lane >> 2) + 8 * hr;
      if ((lane & 3) == 0) {
        red_m[kvw * 16 + r] = m[hr];
        red_l[kvw * 16 + r] = lq;
      }
    }
    __syncthreads();
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = (lane >> 2) + 8 * hr;
      float mx = neg_inf();
#pragma unroll
      for (int k = 0; k < KV_WARPS; ++k) mx = fmax_nan(mx, red_m[k * 16 + r]);
      const float m_use = mx == neg_inf() ? 0.f : mx;  // all masked: every factor is 0, not NaN
      float lsum = 0.f;
#pragma unroll
      for (int k = 0; k < KV_WARPS; ++k)
        lsum += red_l[k * 16 + r] * fast_exp2(red_m[k * 16 + r] - m_use);
      const float f = fast_exp2(m[hr] - m_use);
#pragma unroll
      for (int nf = 0; nf < D / 8; ++nf) {
        o[nf][2 * hr] *= f;
        o[nf][2 * hr + 1] *= f;
      }
      m[hr] = mx;
      l[hr] = (lane & 3) == 0 ? lsum : 0.f;  // the epilogue sums l over the lane quad
    }
  }
  if (kvw > 0) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int nf = 0; nf < D / 8; ++nf)
        *reinterpret_cast<float2*>(red_o + ((kvw - 1) * 16 + (lane >> 2) + 8 * hr) * D + nf * 8 +
                                   2 * (lane & 3)) = make_float2(o[nf][2 * hr], o[nf][2 * hr + 1]);
  }
  __syncthreads();
  if (kvw == 0) {
#pragma unroll
    for (int k = 1; k < KV_WARPS; ++k)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int nf = 0; nf < D / 8; ++nf) {
          const float2 v = *reinterpret_cast<const float2*>(
              red_o + ((k - 1) * 16 + (lane >> 2) + 8 * hr) * D + nf * 8 + 2 * (lane & 3));
          o[nf][2 * hr] += v.x;
          o[nf][2 * hr + 1] += v.y;
        }
  }
}

// ---------------------------------------------------------------------------------------------
// Where this thread sits in the tile, and what the hooks see besides its rows. Built once per
// tile; the roles below read it instead of a dozen loose arguments.
// MMA accumulator layout (m16n8): lane holds rows lane/4 and lane/4 + 8 of each 16-row fragment,
// columns 2*(lane%4) + {0,1} of each 8-column fragment.
// ---------------------------------------------------------------------------------------------
template <typename Work, int M_FRAGS>
struct TileView {
  enum : bool { kPadded = Work::kPadded };  // a padded head dim (fa2_prefill.cuh DenseWork)
  const Work& w;
  int lane, warp, kvw;  // lane; row warp (its M_FRAGS fragments); KV slice of each tile (decode)
  int b, gf, head0, h_kv;  // hooks' batch index; heads fused per KV head; first query head; KV head
  int row0, rows;       // first fused row (fused row = token * gf + head_in_group); rows [0, rows)
  int kv_pos0, kv_len;  // the hooks see kv position kv + kv_pos0; positions [0, kv_len) exist
  FastDiv gdiv;         // fused row -> token

  // Tile row of accumulator row (mf, hr) of this lane.
  __device__ __forceinline__ int tile_row(int mf, int hr) const {
    return (warp * M_FRAGS + mf) * 16 + (lane >> 2) + 8 * hr;
  }
  // fr: fused row; qi: its query position as the hooks see it; hq: its query head.
  // Recomputed where needed (hooks, epilogue) rather than kept in registers across the main loop,
  // where every register is taken by the O and S accumulators.
  __device__ __forceinline__ void row_of(int mf, int hr, int& fr, int& qi, int& hq) const {
    fr = row0 + (warp * M_FRAGS + mf) * 16 + (lane >> 2) + 8 * hr;
    const int tok = gdiv.div(fr);
    qi = w.q_position(tok);
    hq = head0 + (fr - tok * gf);
  }
};

// Apply a Query/OutputTransform to the warp's own rows of the tile in shared memory `s`; padding
// rows never reach the hooks. hook(row, hq, qi, d) returns the new element d.
template <typename DType, int D, int M_FRAGS, typename View, typename Hook>
__device__ __forceinline__ void transform_warp_rows(const View& t, u16* s, Hook&& hook) {
#pragma unroll 1
  for (int r = t.warp * M_FRAGS * 16; r < (t.warp + 1) * M_FRAGS * 16; ++r) {
    const int fr = t.row0 + r;
    if (fr >= t.rows) continue;
    const int tok = t.gdiv.div(fr);
    const int qi = t.w.q_position(tok);
    const int hq = t.head0 + (fr - tok * t.gf);
    transform_row<DType, D>(s, r, t.lane, [&](const SmemRow<DType, D>& x, int d) {
      return hook(x, hq, qi, d);
    });
  }
}

// Issue the cp.async copies of KV tile i into its ring stage, and commit its group.
// Commit-group discipline: Q is one group; then every tile (its K and V rows) is one group,
// committed even when empty, so at the top of iteration `it` exactly STAGES-2 groups are newer
// than tile `it` and cp.async.wait_group takes a compile-time count. (An fp8 cache's ring:
// load_kv8_tile, fa2_kv8.cuh.)
template <int STAGES, int TILE_ELEMS, typename Work>
__device__ __forceinline__ void load_kv_tile(const Work& w, int i, u16* sK, u16* sV, int tid) {
  if (i < w.count) {
    bool f;
    const int kv0 = w.tile_start(i, f);
    const int st = i % STAGES;
    w.load_kv(smem_addr(sK + st * TILE_ELEMS), smem_addr(sV + st * TILE_ELEMS), kv0, tid);
  }
  cp_async_commit();
}

// Key/ValueTransform of the tile's rows in place, all warps sharing the rows.
template <typename Variant, typename DType, int D, int TKV, int WARPS, typename View>
__device__ __forceinline__ void transform_kv_tile(const View& t, const typename Variant::Params& vp,
                                                  u16* sKs, u16* sVs, int kv0, int tid) {
#pragma unroll 1
  for (int r = tid >> 5; r < TKV; r += WARPS) {
    const int kv = kv0 + r;
    if (kv >= t.kv_len) break;
    if constexpr (Variant::has_key_transform)
      transform_row<DType, D>(sKs, r, t.lane, [&](const SmemRow<DType, D>& k, int d) {
        return Variant::KeyTransform(vp, k, t.b, t.h_kv, kv + t.kv_pos0, d);
      });
    if constexpr (Variant::has_value_transform)
      transform_row<DType, D>(sVs, r, t.lane, [&](const SmemRow<DType, D>& v, int d) {
        return Variant::ValueTransform(vp, v, t.b, t.h_kv, kv + t.kv_pos0, d);
      });
  }
  __syncthreads();
}

// Logits of one tile: scale, LogitsTransform, LogitsMask; kBounds masks rows and kv positions
// outside the sequence (they never reach the hooks) and, for a Work with a tree mask, the keys
// it hides (ANDed with the LogitsMask); kMask applies the LogitsMask.
template <typename Variant, bool kBounds, bool kMask, int M_FRAGS, int TKVW, typename Work,
          typename View>
__device__ __forceinline__ void logits_tile(const View& t, const typename Variant::Params& vp,
                                            float (&s_acc)[M_FRAGS][TKVW / 8][4], int kv0,
                                            float qk_scale, bool half_tile) {
  constexpr bool kSoftmax = Variant::use_softmax;
  constexpr float kLog2e = 1.4426950408889634f;
  const float masked = kSoftmax ? neg_inf() : 0.f;
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      if (hr == 1 && half_tile) continue;  // a half tile's padding row: the softmax skips it
      int fr = 0, qi = 0, hq = 0;
      if constexpr (Variant::has_logits_transform || kMask || kBounds) t.row_of(mf, hr, fr, qi, hq);
      const bool row_in = !kBounds || fr < t.rows;
#pragma unroll
      for (int nf = 0; nf < TKVW / 8; ++nf)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kv = kv0 + TKVW * t.kvw + nf * 8 + 2 * (t.lane & 3) + e;
          float sc = s_acc[mf][nf][2 * hr + e] * qk_scale;
          if (kBounds && (!row_in || (unsigned)kv >= (unsigned)t.kv_len ||
                          (Work::kTreeMask && !t.w.tree_keeps(qi, kv)))) {
            sc = masked;
          } else {
            if constexpr (Variant::has_logits_transform) {
              sc = Variant::LogitsTransform(vp, sc, t.b, hq, qi, kv + t.kv_pos0);
              if constexpr (kSoftmax) sc *= kLog2e;
            }
            if constexpr (kMask) {
              if (!Variant::LogitsMask(vp, t.b, hq, qi, kv + t.kv_pos0)) sc = masked;
            }
          }
          s_acc[mf][nf][2 * hr + e] = sc;
        }
    }
}

// Normalize O by the row sums and compute each row's LSE (natural log); see docs/fa3.md,
// "NaN and inf in the epilogue" for the no-weight, NaN and +inf rows.
template <bool kSoftmax, int M_FRAGS, int N_FRAGS_O>
__device__ __forceinline__ void normalize_rows(float (&o_acc)[M_FRAGS][N_FRAGS_O][4],
                                               const float (&row_m)[M_FRAGS][2],
                                               const float (&row_l)[M_FRAGS][2],
                                               float (&lse_val)[M_FRAGS][2]) {
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float inv = 1.f;
      if constexpr (kSoftmax) {
        float l = row_l[mf][hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        // No weight (l == 0 exactly: every logit masked or -inf): output 0 and lse -inf, even
        // if a NaN value row at a masked key reached the accumulator (0 * NaN). A NaN logit
        // left l NaN: output and lse NaN. A +inf logit made m +inf: lse +inf (torch's logsumexp).
        inv = l == 0.f ? 0.f : 1.f / l;
        const float m = row_m[mf][hr];
        lse_val[mf][hr] =
            l == 0.f ? neg_inf() : (m == attncc::pos_inf() ? m : (m + __log2f(l)) * kLn2);
      } else {
        lse_val[mf][hr] = 0.f;
      }
#pragma unroll
      for (int nf = 0; nf < N_FRAGS_O; ++nf) {
        o_acc[mf][nf][2 * hr] = inv == 0.f ? 0.f : o_acc[mf][nf][2 * hr] * inv;
        o_acc[mf][nf][2 * hr + 1] = inv == 0.f ? 0.f : o_acc[mf][nf][2 * hr + 1] * inv;
      }
    }
}

// Attention sinks: each whole row's sink logit (its query head's) joins its denominator once
// (common.cuh join_sink); a split unit's partial state goes to the merge without it.
template <int M_FRAGS, int N_FRAGS_O, typename View>
__device__ __forceinline__ void add_sinks(const View& t, float (&o_acc)[M_FRAGS][N_FRAGS_O][4],
                                          float (&lse_val)[M_FRAGS][2]) {
  const float* sinks = t.w.sinks();
  if (sinks == nullptr) return;
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      int fr, qi, hq;
      t.row_of(mf, hr, fr, qi, hq);  // hq stays inside the KV head's group, padding rows too
      float f = 1.f;
      join_sink(__ldg(sinks + hq), f, lse_val[mf][hr]);
#pragma unroll
      for (int nf = 0; nf < N_FRAGS_O; ++nf) {
        o_acc[mf][nf][2 * hr] *= f;
        o_acc[mf][nf][2 * hr + 1] *= f;
      }
    }
}

// A unit that covers only part of its rows' KV range writes its partial state -- normalized O in
// fp32 and the LSE, tile rows [0, TQ) of its workspace slot -- for the merge (fa2_batch.cuh),
// which combines the parts in a fixed order and applies the OutputTransform.
template <int D, int M_FRAGS, typename View>
__device__ __forceinline__ void store_partial(const View& t, float* po, float* pl,
                                              const float (&o_acc)[M_FRAGS][D / 8][4],
                                              const float (&lse_val)[M_FRAGS][2]) {
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = t.tile_row(mf, hr);
      if (t.row0 + r >= t.rows) continue;
#pragma unroll
      for (int nf = 0; nf < D / 8; ++nf) {
        float2 v2;
        v2.x = o_acc[mf][nf][2 * hr];
        v2.y = o_acc[mf][nf][2 * hr + 1];
        *reinterpret_cast<float2*>(po + r * D + nf * 8 + 2 * (t.lane & 3)) = v2;
      }
      if ((t.lane & 3) == 0) pl[r] = lse_val[mf][hr];
    }
}

// Stage the normalized O tile through shared memory (the warp's own Q rows, no longer read), so
// the OutputTransform sees whole rows and global stores are 16 bytes wide and coalesced.
template <typename DType, int D, int M_FRAGS, typename View>
__device__ __forceinline__ void stage_o(const View& t, u16* sQ,
                                        const float (&o_acc)[M_FRAGS][D / 8][4]) {
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = t.tile_row(mf, hr);
#pragma unroll
      for (int nf = 0; nf < D / 8; ++nf) {
        const int col = nf * 8 + 2 * (t.lane & 3);
        *reinterpret_cast<u32*>(sQ + swz<D>(r, col)) =
            pack2<DType>(o_acc[mf][nf][2 * hr], o_acc[mf][nf][2 * hr + 1]);
      }
    }
  __syncwarp();
}

// 16-byte stores of the warp's staged rows: lanes sweep a row's chunks, then the next row.
template <int D, int M_FRAGS, typename View>
__device__ __forceinline__ void store_o(const View& t, const u16* sQ) {
  constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
#pragma unroll
  for (int c = t.lane; c < M_FRAGS * 16 * CHUNKS; c += 32) {
    const int r = (t.warp * M_FRAGS) * 16 + c / CHUNKS;
    const int ch = c % CHUNKS;
    const int fr = t.row0 + r;
    if constexpr (View::kPadded) {  // (if constexpr: the native forms' code is unchanged)
      if (!t.w.o_chunk(ch)) continue;  // past the real value head dim
    }
    if (fr < t.rows) {
      const int tok = t.gdiv.div(fr);
      const int hq = t.head0 + (fr - tok * t.gf);
      const u32x4 val = *reinterpret_cast<const u32x4*>(sQ + swz<D>(r, ch * 8));
      *reinterpret_cast<u32x4*>(t.w.o_row(tok, hq) + ch * 8) = val;
    }
  }
}

// The LSE of each real row, by the quad's first lane.
template <int M_FRAGS, typename View>
__device__ __forceinline__ void store_lse(const View& t, const float (&lse_val)[M_FRAGS][2]) {
  if (t.w.has_lse() && (t.lane & 3) == 0) {
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        int fr, qi, hq;
        t.row_of(mf, hr, fr, qi, hq);
        if (fr < t.rows) *t.w.lse_at(t.gdiv.div(fr), hq) = lse_val[mf][hr];
      }
  }
}

// ---------------------------------------------------------------------------------------------
// One CTA tile of attention: TQ fused query rows against the KV tiles `w` lists. Roles in
// order: load Q and the first K/V tiles (load_kv_tile), QueryTransform (transform_warp_rows);
// per KV tile: wait and prefetch, K/V transforms (transform_kv_tile), S = Q K^T, logits
// (logits_tile), online softmax, O += P V; merge_kv_slices (decode); epilogue: normalize_rows,
// then store_partial (a split unit) or add_sinks, stage_o, OutputTransform, store_o, store_lse.
// S = Q K^T, the softmax and P V stay in the loop body: as functions they reorder the loop's
// accumulator PHIs and change the SASS (docs/kernel-interface.md, "The FA2 tile body").
// ---------------------------------------------------------------------------------------------
template <typename Variant, typename DType, int HEAD_DIM, int TQ, int TKV, int STAGES,
          int M_FRAGS, int KV_WARPS = 1, bool kHalf = false, typename Work>
__device__ __forceinline__ void fa2_attend(const Work& w, const typename Variant::Params& vp,
                                           float sm_scale) {
  using Cfg = Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>;
  constexpr int D = HEAD_DIM;
  constexpr int TKVW = TKV / KV_WARPS;  // KV rows of a tile this warp computes on
  constexpr int N_FRAGS_S = TKVW / 8;  // S accumulator fragments per 16-row fragment
  static_assert(KV_WARPS == 1 || 4 * (2 * KV_WARPS * 16 + (KV_WARPS - 1) * 16 * HEAD_DIM) <=
                                     2 * 2 * STAGES * TKV * HEAD_DIM,
                "the KV slices' merge must fit in the K/V stage memory");
  constexpr int N_FRAGS_O = D / 8;     // O accumulator fragments per 16-row fragment
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kSoftmax = Variant::use_softmax;
  // An fp8 cache (fa2_kv8.cuh) streams fp8 tiles through a ring in the same shared memory, after
  // one 16-bit K and V tile that each landed tile is widened into: 2 * (STAGES - 1) ring stages.
  constexpr bool kKv8 = Work::kKv8;
  constexpr int RING = kKv8 ? 2 * (STAGES - 1) : STAGES;
  // decode forms read the fp8 ring straight into registers (fa2_kv8.cuh, Kv8Frags), but at
  // D = 64, whose form runs under 128 registers: there it spilled 16 bytes
  constexpr bool kKv8Regs = kKv8 && KV_WARPS > 1 && D >= 128;
  // ... and with bf16 queries and softmax weights (P <= 1) in fp16: Q's rows rescaled into fp16
  // once per unit (q_bf16_to_f16), so K and V widen in one instruction
  constexpr bool kF16Mma = kKv8Regs && kSoftmax && ElemTraits<DType>::kIsBf16;
  using MmaT = typename MmaType<kF16Mma, DType>::T;  // the MMAs' 16-bit operand type
  static_assert(!kKv8Regs || M_FRAGS == 1, "decode tiles are one 16-row fragment");
  static_assert(!kKv8 || (STAGES >= 2 && !Variant::has_key_transform &&
                          !Variant::has_value_transform),
                "an fp8 cache needs 2+ stages and no K/V transform (the host refuses those)");
  // A padded head dim (Work::kPadded): the row hooks would see the padding columns
  static_assert(!Work::kPadded || !(kKv8 || Variant::has_query_transform ||
                                    Variant::has_key_transform || Variant::has_value_transform ||
                                    Variant::has_output_transform),
                "a padded head dim has no q/k/v/output transform and no fp8 cache (the host "
                "refuses those)");

  extern __shared__ __attribute__((aligned(128))) unsigned char attncc_fa2_smem[];
  u16* sQ = reinterpret_cast<u16*>(attncc_fa2_smem);
  u16* sK = sQ + TQ * D;
  u16* sV = sK + (kKv8 ? 1 : STAGES) * Cfg::kTileElems;
  const unsigned char* ring = reinterpret_cast<const unsigned char*>(sV + Cfg::kTileElems);
  const u32 ring_addr = kKv8 ? smem_addr(ring) : 0u;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int kvw = KV_WARPS > 1 ? tid >> 5 : 0;   // this warp's KV slice of each tile
  const int warp = KV_WARPS > 1 ? 0 : tid >> 5;  // this warp's rows: row warp `warp`
  const TileView<Work, M_FRAGS> t{w,      lane,   warp,     kvw,      w.b,         w.gf,
                                  w.head0, w.h_kv, w.row0, w.rows, w.kv_pos0, w.kv_len,
                                  FastDiv(w.gf)};
  // every fused row of this tile is a real query row (all but the last tile of a sequence)
  const bool tile_rows_in = t.row0 + TQ <= t.rows;
  // kHalf (the decode form planned for 8 fused rows a request: KernelTiles.half_rows): in a tile
  // of exactly 8 rows each thread's first row (lane/4) is real and its second (lane/4 + 8)
  // padding, so interior KV tiles take the plain path and skip that row's logits and softmax
  // instead of masking it element by element. Other forms compile it out; other tiles of this
  // form run as before (docs/serving.md#decode, "GQA-8 tiles").
  static_assert(!kHalf || KV_WARPS > 1, "half tiles are decode tiles");
  const bool half_tile = kHalf && t.row0 + 8 == t.rows;

  // ---- prologue: Q and the first STAGES-1 K/V tiles in flight (see load_kv_tile) ------------
  w.load_q(smem_addr(sQ), tid);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < RING - 1; ++s) {
    if constexpr (kKv8) load_kv8_tile<RING, 2 * Cfg::kTileElems>(w, s, ring_addr, tid);
    else load_kv_tile<STAGES, Cfg::kTileElems>(w, s, sK, sV, tid);
  }
  cp_async_wait<RING - 1>();  // Q landed (this thread's copies) ...
  __syncthreads();              // ... and everyone's

  if constexpr (Variant::has_query_transform) {
    // Each warp transforms only the rows it will read (its own fragments): __syncwarp suffices.
    // KV-slice warps share their rows: the first transforms them, the block barrier publishes.
    if (kvw == 0) {
      transform_warp_rows<DType, D, M_FRAGS>(t, sQ, [&](const SmemRow<DType, D>& q, int hq, int qi,
                                                        int d) {
        return Variant::QueryTransform(vp, q, t.b, hq, qi, d);
      });
    }
    if constexpr (KV_WARPS > 1) __syncthreads();
  }
  float q_pow[2] = {1.f, 1.f};  // kF16Mma: 2^e of this thread's rows (lane/4, lane/4 + 8)
  if constexpr (kKv8Regs) {  // Q's columns in the order of the register-widened K fragments
    permute_q_cols<D, TQ, Cfg::kThreads>(sQ, tid);
    __syncthreads();
    if constexpr (kF16Mma) {  // (other threads own the rows; the unused 16-bit K tile is scratch)
      int* row_exp = reinterpret_cast<int*>(sK);
      q_bf16_to_f16<D, TQ, Cfg::kThreads>(sQ, row_exp, tid);
      __syncthreads();
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        q_pow[hr] = pow2i(row_exp[(lane >> 2) + 8 * hr]);
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
  const float qk_scale = (kSoftmax && !Variant::has_logits_transform) ? sm_scale * kLog2e
                                                                      : sm_scale;

  // Per-lane fragment address bases (see the ldmatrix comments below for the lane -> row/chunk
  // mapping). Every row index used with them is (multiple of 8) + (lane & 7), so row % 8 == lane & 7
  // and the swizzle key of each operand is a per-lane constant.
  const u32 l7 = lane & 7;
  const u32 q_row_addr =
      smem_addr(sQ) + 2 * D * ((warp * M_FRAGS) * 16 + (lane & 15));
  const u32 q_x = (u32)(lane >> 4) ^ l7;
  const u32 k_lane_off = 2 * D * ((lane >> 4) * 8 + l7);
  const u32 k_x = (u32)((lane >> 3) & 1) ^ l7;
  const u32 v_lane_off = 2 * D * (((lane >> 3) & 1) * 8 + l7);
  const u32 v_x = (u32)(lane >> 4) ^ l7;
  // this warp's KV slice starts TKVW rows into each tile
  const u32 sK_addr = smem_addr(sK) + 2 * D * TKVW * kvw;
  const u32 sV_addr = smem_addr(sV) + 2 * D * TKVW * kvw;

  // Q fragments stay in registers for the whole KV loop when they fit (D/16 * 4 registers per
  // 16-row fragment: 32 at D=128): saves D/16 ldmatrix per KV tile. At D=256 (64 registers on top
  // of a 128-register O accumulator) they are re-read from shared memory instead, and so in decode
  // (KV_WARPS > 1), which is bound by memory, not ldmatrix, and runs under a 128-register cap.
  constexpr bool kQInRegs = D * M_FRAGS <= 128 && KV_WARPS == 1;
  u32 q_frag[kQInRegs ? M_FRAGS : 1][kQInRegs ? D / 16 : 1][4];
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
  for (int it = 0; it < w.count; ++it) {
    const int stage = it % RING;
    if constexpr (STAGES == 1) {  // no prefetch: refill the only stage once everyone is done
      __syncthreads();
      load_kv_tile<STAGES, Cfg::kTileElems>(w, it, sK, sV, tid);
      cp_async_wait<0>();
      __syncthreads();
    } else {
      cp_async_wait<RING - 2>();  // tile it landed (this thread's copies) ...
      __syncthreads();            // ... and everyone's; stage (it-1) % RING is free
      if constexpr (kKv8)
        load_kv8_tile<RING, 2 * Cfg::kTileElems>(w, it + RING - 1, ring_addr, tid);  // prefetch
      else
        load_kv_tile<STAGES, Cfg::kTileElems>(w, it + STAGES - 1, sK, sV, tid);  // prefetch
    }
    if constexpr (kKv8 && !kKv8Regs) {  // widen the landed fp8 tile into the one 16-bit tile
      widen_kv_tile<DType, typename Work::KvT, D, TKV, KV_WARPS, Cfg::kThreads>(
          ring + stage * 2 * Cfg::kTileElems, sK, sV, kvw, tid);
    }
    // this warp's slice of the landed fp8 tile (decode forms: K rows, then V rows)
    const u32 kv8_k = ring_addr + stage * 2 * Cfg::kTileElems + TKVW * D * kvw;
    const int cst = kKv8 ? 0 : stage;  // the 16-bit stage the MMAs read

    bool is_full;
    const int kv0 = w.tile_start(it, is_full);
    if constexpr (Variant::has_key_transform || Variant::has_value_transform)
      transform_kv_tile<Variant, DType, D, TKV, Cfg::kWarps>(
          t, vp, sK + cst * Cfg::kTileElems, sV + cst * Cfg::kTileElems, kv0, tid);

    // S = Q K^T for this warp's rows: M_FRAGS x (TKV/8) fragments.
    float s_acc[M_FRAGS][N_FRAGS_S][4];
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
      for (int nf = 0; nf < N_FRAGS_S; ++nf)
#pragma unroll
        for (int i = 0; i < 4; ++i) s_acc[mf][nf][i] = 0.f;

    if constexpr (kKv8Regs) {
      const Kv8Frags<MmaT, typename Work::KvT, D, TKV> kv8(opaque(kv8_k), lane);
      const u32 qa = opaque(q_row_addr), qx = opaque(q_x);
#pragma unroll
      for (int j = 0; j < D / 32; ++j) {  // k-steps 2j, 2j+1 (Q's columns permuted to match)
        u32 a[2][4];
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) ldmatrix_x4(a[ks], chunk_addr(qa, 2 * (2 * j + ks), qx));
#pragma unroll
        for (int g = 0; g < TKVW / 16; ++g) {
          u32 bk[2][2][2];
          kv8.k_frags(g, j, bk);
#pragma unroll
          for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int ks = 0; ks < 2; ++ks)
              mma_16816<MmaT>(s_acc[0][2 * g + n], a[ks], bk[n][ks][0], bk[n][ks][1]);
        }
      }
      if constexpr (kF16Mma) {  // undo each row's 2^-e (exact): S is the bf16 path's
#pragma unroll
        for (int nf = 0; nf < N_FRAGS_S; ++nf)
#pragma unroll
          for (int i = 0; i < 4; ++i) s_acc[0][nf][i] *= q_pow[i >> 1];
      }
    } else {
      const u32 qa = opaque(q_row_addr), qx = opaque(q_x), kx = opaque(k_x);
      const u32 ka = opaque(sK_addr + 2 * cst * Cfg::kTileElems + k_lane_off);
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        u32 a[M_FRAGS][4];
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
        for (int np = 0; np < TKVW / 16; ++np) {
          // B fragments of two 8-column n-fragments (K rows are the n index); lane groups of 8
          // address matrices (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7) (n8-15,k8-15).
          u32 bk[4];
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
    // (a multi-token decode tree mask rides on the bounds path: only the tiles holding the
    // request's last q_len keys test it, BatchWork::tree_tile)
    const bool bounds = kv0 < 0 || kv0 + TKV > t.kv_len || !(tile_rows_in || half_tile) ||
                        (Work::kTreeMask && w.tree_tile(kv0, kv0 + TKV));
    const bool apply_mask = Variant::has_logits_mask && !is_full;
    auto logits = [&](auto bounds_tag, auto mask_tag) {
      logits_tile<Variant, decltype(bounds_tag)::value, decltype(mask_tag)::value, M_FRAGS, TKVW,
                  Work>(
          t, vp, s_acc, kv0, qk_scale, half_tile);
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
          if (hr == 1 && half_tile) {  // padding row: no weight, its state stays empty
            corr[mf][hr] = 1.f;
#pragma unroll
            for (int nf = 0; nf < N_FRAGS_S; ++nf) s_acc[mf][nf][2] = s_acc[mf][nf][3] = 0.f;
            continue;
          }
          float mx = row_m[mf][hr];
#pragma unroll
          for (int nf = 0; nf < N_FRAGS_S; ++nf)
            mx = fmax_nan(mx, fmax_nan(s_acc[mf][nf][2 * hr], s_acc[mf][nf][2 * hr + 1]));
          mx = fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
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
      if (__any_sync(0xffffffffu, grew)) {
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
    u32 pa[M_FRAGS][TKVW / 16][4];
#pragma unroll
    for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
      for (int kk = 0; kk < TKVW / 16; ++kk) {
        pa[mf][kk][0] = pack2<MmaT>(s_acc[mf][2 * kk][0], s_acc[mf][2 * kk][1]);
        pa[mf][kk][1] = pack2<MmaT>(s_acc[mf][2 * kk][2], s_acc[mf][2 * kk][3]);
        pa[mf][kk][2] = pack2<MmaT>(s_acc[mf][2 * kk + 1][0], s_acc[mf][2 * kk + 1][1]);
        pa[mf][kk][3] = pack2<MmaT>(s_acc[mf][2 * kk + 1][2], s_acc[mf][2 * kk + 1][3]);
      }
    if constexpr (kKv8Regs) {
      const Kv8Frags<MmaT, typename Work::KvT, D, TKV> kv8(opaque(kv8_k), lane);
#pragma unroll
      for (int kk = 0; kk < TKVW / 16; ++kk)
#pragma unroll
        for (int q = 0; q < D / 16; ++q) {  // head-dim block q
          u32 bv[2][2];
          kv8.v_frags(kk, q, bv);
#pragma unroll
          for (int h = 0; h < 2; ++h)
            mma_16816<MmaT>(o_acc[0][2 * q + h], pa[0][kk], bv[h][0], bv[h][1]);
        }
    } else {
      const u32 va = opaque(sV_addr + 2 * cst * Cfg::kTileElems + v_lane_off);
      const u32 vx = opaque(v_x);
#pragma unroll
      for (int kk = 0; kk < TKVW / 16; ++kk) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          // V is [kv][d] row-major = B row-major: ldmatrix.trans yields the col fragment. Lane
          // groups address (kv0-7,d0-7) (kv8-15,d0-7) (kv0-7,d8-15) (kv8-15,d8-15).
          u32 bv[4];
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
  // (every warp, while the warps are converged: after merge_kv_slices only warp 0 is left)
  if constexpr (kKv8Regs) unpermute_o<N_FRAGS_O>(o_acc[0], lane);
  if constexpr (KV_WARPS > 1) {
    merge_kv_slices<kSoftmax, D, KV_WARPS>(reinterpret_cast<float*>(sK), kvw, lane, o_acc[0],
                                           row_m[0], row_l[0]);
    if (kvw != 0) return;  // warp 0 holds the merged state; the epilogue is per warp
  }

  // ---- epilogue --------------------------------------------------------------------------------
  float lse_val[M_FRAGS][2];
  normalize_rows<kSoftmax>(o_acc, row_m, row_l, lse_val);

  if constexpr (Work::kMaySplit) {
    float* po = w.partial_o();
    if (po != nullptr) {
      if constexpr (kKv8) scale_o(o_acc, w.value_scale());
      store_partial<D, M_FRAGS>(t, po, w.partial_lse(), o_acc, lse_val);
      return;
    }
  }
  if constexpr (kSoftmax) add_sinks<M_FRAGS>(t, o_acc, lse_val);
  if constexpr (kKv8) scale_o(o_acc, w.value_scale());
  stage_o<DType, D, M_FRAGS>(t, sQ, o_acc);
  if constexpr (Variant::has_output_transform) {
    transform_warp_rows<DType, D, M_FRAGS>(t, sQ, [&](const SmemRow<DType, D>& o, int hq, int qi,
                                                      int d) {
      return Variant::OutputTransform(vp, o, t.b, hq, qi, d);
    });
  }
  store_o<D, M_FRAGS>(t, sQ);
  if constexpr (kSoftmax) store_lse<M_FRAGS>(t, lse_val);
}

}  // namespace fa2
}  // namespace attncc

#endif  // ATTNCC_FA2_ATTEND_CUH
