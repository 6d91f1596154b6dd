// attncc FA2-class attention backward for sm_80+ (mma.sync): dQ, dK, dV and the gradients of
// captured tensors of one variant, recomputing the forward's probabilities from Q, K and the saved
// LSE (nothing of size S^2 is stored). Written for attncc from the FlashAttention-2 paper's
// backward algorithm; docs/backward.md, "Kernels", is the design note.
//
// Self-contained: no #include. Comes after attncc_types.cuh, backward_params.cuh, common.cuh and
// fa2_config.cuh, and before the generated Variant_<name> (ATTNCC_FA2_BWD_ENTRY at the bottom).
//
// Grid: (ceil(kv_len / TKV) C, num_kv_heads / C, batch), KV heads in chunks of C (bwd_cta). One
// CTA owns one KV tile of one KV head: it keeps K and V in shared memory and dK, dV in registers,
// and visits every query tile of every query head of the GQA group that touches it (all of them,
// or the block mask's KV-major lists), so dK and dV are written once, without atomics. Per query
// tile (Q, dO, LSE, delta through a two-stage cp.async ring):
//   S^T = K Q^T (scaled)           -> S' = LogitsTransform(S), LogitsMask (partial blocks)
//   P^T = exp(S' - LSE)            (normalize none: W^T = S', masked 0)
//   dV += P^T dO;  dP^T = V dO^T;  dS'^T = P^T (dP^T - delta)   (none: dS' = dP)
//   dS = dS' * LogitsGrad(S);  CapturedGrad(dS', S) where the element is live
//   dK += dS^T Q;  dQ += dS K (through shared memory; fp32 atomics into dq_accum)
// Warp layout: warp w owns KV rows [16 (w % G), 16 (w % G) + 16) of the tile, G = TKV / 16; with
// DSPLIT = 2 (always at head dim 256) two warps share those rows and split dK/dV's columns (each
// recomputes S^T and dP^T, so the accumulators fit in registers). For dQ the warps split the
// query rows x head dim instead. The kernel cache picks the form (docs/backward.md, "Kernels").
#ifndef ATTNCC_FA2_BACKWARD_CUH
#define ATTNCC_FA2_BACKWARD_CUH

namespace attncc {
namespace fa2 {

template <int HEAD_DIM, int TQ, int TKV, int STAGES, int DSPLIT>
struct BwdConfig {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head dim 64/128/256");
  // each lane holds TQ / 2 elements of a warp's S^T tile: their liveness bits fit one u32
  static_assert(TQ == 16 || TQ == 32 || TQ == 64, "TQ in {16, 32, 64}");
  static_assert(TKV == 64 || TKV == 128, "TKV in {64, 128}");
  static_assert(STAGES == 2, "the query ring has two stages");
  // DSPLIT warps share each 16-row KV group, splitting dK/dV's columns (each recomputes S^T
  // and dP^T): 2 at head dim 256, where one warp's dK/dV would take 256 registers
  static_assert(DSPLIT == 1 || DSPLIT == 2, "DSPLIT in {1, 2}");
  static_assert(HEAD_DIM != 256 || DSPLIT == 2, "head dim 256 needs DSPLIT = 2");
  static constexpr int kDSplit = DSPLIT;
  static constexpr int kDW = HEAD_DIM / kDSplit;           // dK/dV columns per warp
  static constexpr int kKvGroups = TKV / 16;
  static constexpr int kWarps = kKvGroups * kDSplit;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kQRowFrags = TQ / 16;
  static_assert(kWarps % kQRowFrags == 0, "dQ: warps cover the query row fragments evenly");
  static constexpr int kDqSlices = kWarps / kQRowFrags;  // dQ column slices
  static constexpr int kDqCols = HEAD_DIM / kDqSlices;
  static_assert(kDqCols % 16 == 0, "dQ slices of whole 16-column fragment pairs");
  static constexpr int kKvElems = TKV * HEAD_DIM;
  static constexpr int kQElems = TQ * HEAD_DIM;
  // K, V; Q and dO per stage; dS [TQ][TKV]; then fp32 LSE (base 2) and delta per stage.
  static constexpr int kSmemBytes =
      2 * (2 * kKvElems + 2 * STAGES * kQElems + TQ * TKV) + 2 * STAGES * TQ * 4;
};

// ---------------------------------------------------------------------------------------------
// Warp-level MMA building blocks over swizzled shared tiles (common.cuh's swz). Every tile row
// index a lane addresses is (multiple of 8) + (lane & 7), so each operand's swizzle key is a
// per-lane constant (see fa2_attend.cuh's fragment comments for the lane -> row/chunk maps).
// ---------------------------------------------------------------------------------------------

// Lane's address of an A fragment's rows (row0 a multiple of 16), and its swizzle key.
__device__ __forceinline__ u32 a_rows_addr(const u16* tile, int row_bytes, int row0, int lane) {
  return smem_addr(tile) + row_bytes * (row0 + (lane & 15));
}
__device__ __forceinline__ u32 a_key(int lane) { return (u32)(lane >> 4) ^ (u32)(lane & 7); }
// B operand whose n index is the tile's rows (K in the forward's S = Q K^T).
__device__ __forceinline__ u32 bn_rows_addr(const u16* tile, int row_bytes, int lane) {
  return smem_addr(tile) + row_bytes * ((lane >> 4) * 8 + (lane & 7));
}
__device__ __forceinline__ u32 bn_key(int lane) {
  return (u32)((lane >> 3) & 1) ^ (u32)(lane & 7);
}
// B operand whose k index is the tile's rows (V in the forward's O = P V): ldmatrix.trans.
__device__ __forceinline__ u32 bk_rows_addr(const u16* tile, int row_bytes, int lane) {
  return smem_addr(tile) + row_bytes * (((lane >> 3) & 1) * 8 + (lane & 7));
}
__device__ __forceinline__ u32 bk_key(int lane) { return (u32)(lane >> 4) ^ (u32)(lane & 7); }

// acc[16 x 8NF] += A[16 x 16KS] B[8NF x 16KS]^T, both operands row-major tiles in shared memory.
// The k loop is unrolled by two (fully unrolled, ptxas hoists every fragment load and spills);
// loops over accumulator fragments are always fully unrolled (else the array goes to local
// memory). docs/backward.md, "Kernels".
template <typename DType, int KS, int NF, int ROW_BYTES>
__device__ __forceinline__ void mma_smem_abt(float (&acc)[NF][4], u32 a_addr, u32 a_x,
                                             u32 b_addr, u32 b_x) {
#pragma unroll 2
  for (int ks = 0; ks < KS; ++ks) {
    u32 a[4];
    ldmatrix_x4(a, chunk_addr(a_addr, 2 * ks, a_x));
#pragma unroll
    for (int np = 0; np < NF / 2; ++np) {
      u32 bb[4];
      ldmatrix_x4(bb, chunk_addr(b_addr + np * 16 * ROW_BYTES, 2 * ks, b_x));
      mma_16816<DType>(acc[2 * np], a, bb[0], bb[1]);
      mma_16816<DType>(acc[2 * np + 1], a, bb[2], bb[3]);
    }
  }
}

// acc[16 x 8NF] += A[16 x 16KS] B[16KS x 8NF]: A in registers (packed A fragments), B the columns
// [8 chunk0, 8 chunk0 + 8NF) of a row-major [k][n] tile in shared memory.
template <typename DType, int KS, int NF, int ROW_BYTES>
__device__ __forceinline__ void mma_reg_ab(float (&acc)[NF][4], const u32 (&a)[KS][4],
                                           u32 b_addr, u32 b_x, int chunk0) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int dp = 0; dp < NF / 2; ++dp) {
      u32 bb[4];
      ldmatrix_x4_trans(bb, chunk_addr(b_addr + kk * 16 * ROW_BYTES, chunk0 + 2 * dp, b_x));
      mma_16816<DType>(acc[2 * dp], a[kk], bb[0], bb[1]);
      mma_16816<DType>(acc[2 * dp + 1], a[kk], bb[2], bb[3]);
    }
}

// The accumulators of a 16 x 8NF tile as NF/2 A fragments (16-bit), as fa2_attend packs P.
template <typename DType, int NF>
__device__ __forceinline__ void pack_a(u32 (&pa)[NF / 2][4], const float (&acc)[NF][4]) {
#pragma unroll
  for (int kk = 0; kk < NF / 2; ++kk) {
    pa[kk][0] = pack2<DType>(acc[2 * kk][0], acc[2 * kk][1]);
    pa[kk][1] = pack2<DType>(acc[2 * kk][2], acc[2 * kk][3]);
    pa[kk][2] = pack2<DType>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    pa[kk][3] = pack2<DType>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
}

template <int NF>
__device__ __forceinline__ void zero_acc(float (&acc)[NF][4]) {
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nf][i] = 0.f;
}

// The CTA's batch, KV head and first KV position. Grid (n_tiles C, num_kv_heads / C, batch):
// KV heads in chunks of C, x enumerating (KV tile, head of the chunk) with the head fastest, so
// the chunk's first tiles -- a causal mask's longest -- launch first. C = num_kv_heads /
// gridDim.y is 4, 2 or 1 (runtime/flex/backward.py kv_head_chunk), found by comparisons rather
// than a division. The special registers are read by volatile asm so that each call re-derives
// the values (a few instructions) where it is used instead of keeping them live across the
// query loop: one more live register there spilled the FA3-class kernel at head dim 128.
struct BwdCta {
  int b, h_kv, kv0;
};
template <int TKV>
__device__ __forceinline__ BwdCta bwd_cta(const attncc::BackwardParams& p) {
  u32 x, y, z, ny;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(y));
  asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(z));
  asm volatile("mov.u32 %0, %%nctaid.y;\n" : "=r"(ny));
  const int hy = (int)ny;
  const int lc = 4 * hy == p.num_kv_heads ? 2 : 2 * hy == p.num_kv_heads ? 1 : 0;
  const int tile = ((int)x >> lc) + p.kv_tile0;
  return BwdCta{(int)z, ((int)y << lc) + ((int)x & ((1 << lc) - 1)), tile * TKV};
}

// ---------------------------------------------------------------------------------------------
// Where one warp's S^T tile sits: the hooks' batch, query head, the tile's first query position,
// the warp's first KV position, and the sequence bounds. Accumulator element (nf, i) of a lane is
// KV row (lane / 4) + 8 (i / 2) and query column 8 nf + 2 (lane % 4) + i % 2.
// ---------------------------------------------------------------------------------------------
struct BwdTileView {
  int b, hq, q0, kv_row0, q_len, kv_len, lane;
  __device__ __forceinline__ int q_col(int nf, int i) const {
    return nf * 8 + 2 * (lane & 3) + (i & 1);
  }
  __device__ __forceinline__ int kv_at(int i) const { return kv_row0 + (lane >> 2) + 8 * (i >> 1); }
  // The positions a hook sees: where it indexes a captured tensor by position (kClamp:
  // Variant::loads_at_positions) real ones only, a row or key past the end as the last.
  template <bool kClamp>
  __device__ __forceinline__ int hook_q(int qi) const {
    return kClamp ? min(qi, q_len - 1) : qi;
  }
  template <bool kClamp>
  __device__ __forceinline__ int hook_kv(int kv) const {
    return kClamp ? min(kv, kv_len - 1) : kv;
  }
};

// P^T (softmax) or W^T (normalize none) of the tile, in place of the raw dot products st; `live`
// gets bit 4 nf + i for each element inside the sequence and unmasked; `sc` the scaled scores
// (what LogitsGrad / CapturedGrad take). Every hook runs on every element, its result selected,
// so the tile has no branches (a guarded exp2 and LSE load cost ~20 instructions an element in
// reconvergence, a guarded table read its latency: docs/backward.md, "Per-element code"). A
// hook that indexes a captured tensor by position (Variant::loads_at_positions) sees real
// positions only, as the forward's: a row or key past the end as the last (BwdTileView::hook_q).
// sLse2: the stage's LSE in base 2 per query column (+inf for a row with no weight: P = 0).
// mask_here: with kMask, whether this tile applies LogitsMask (false on a full block); the FA3-
// class kernel decides at run time, so that its tile body is inlined once (docs/backward.md).
// The bits 4 nf + i of every column block nf with 8 nf < cols (bounds_mask's and band_mask's
// prefixes of a thread's column blocks).
template <int NF>
__device__ __forceinline__ u32 nf_prefix(int cols) {
  const int n = min(max((cols + 7) >> 3, 0), NF);
  return n >= 8 ? 0xffffffffu : (1u << (4 * n)) - 1u;
}

// Bit 4 nf + i set for each element of the thread's tile inside both sequences, built once a
// tile from the bounds: query column 8 nf + 2 (lane % 4) + (i & 1) < q_len - q0, KV row
// kv_at(i) < kv_len. The columns inside are a prefix of nf per column parity, the rows one bit
// per row: a few instructions a tile, where a compare and two bit operations an element were
// (docs/backward.md, "Per-element code").
template <int NF>
__device__ __forceinline__ u32 bounds_mask(const BwdTileView& t) {
  static_assert(NF >= 1 && NF <= 8, "4 bits an nf in a u32");
  const int qlim = t.q_len - t.q0 - 2 * (t.lane & 3);
  const u32 cols = (nf_prefix<NF>(qlim) & 0x55555555u) | (nf_prefix<NF>(qlim - 1) & 0xaaaaaaaau);
  const u32 rows = (t.kv_at(0) < t.kv_len ? 0x33333333u : 0u) |
                   (t.kv_at(2) < t.kv_len ? 0xccccccccu : 0u);
  return cols & rows;
}

// Bit 4 nf + i set for each element of the thread's tile that a band mask lo <= kv - q <= hi
// (Variant::has_kv_window: causal, a sliding window) keeps: row kv_at(i) keeps the query
// columns [kv - hi - q0, kv - lo - q0], an interval, so per row and column parity a difference
// of two prefixes (nf_prefix); the forward's mask_band is the same test on its own layout.
template <typename Variant, int NF>
__device__ __forceinline__ u32 band_mask(const BwdTileView& t, const typename Variant::Params& vp) {
  // the bounds: constants (has_kv_window), or read from captured scalars at run time
  // (has_runtime_kv_window: a sliding window of a captured width)
  constexpr bool kRt = !Variant::has_kv_window;
  constexpr bool kLo = kRt ? Variant::runtime_kv_window_lo_bounded
                           : Variant::kv_window_lo > -(1LL << 40);  // (unbounded: -+2^62)
  constexpr bool kHi = kRt ? Variant::runtime_kv_window_hi_bounded
                           : Variant::kv_window_hi < (1LL << 40);
  // in 32 bits: only where a row's interval meets the tile's 8 NF columns matters, so the
  // bounds and the row offset are clamped to +-2^29 first
  constexpr int kLim = 1 << 29;
  auto clamp_ll = [](long long x) {
    return x > kLim ? kLim : x < -kLim ? -kLim : (int)x;
  };
  const int kLoI =
      !kLo ? 0 : clamp_ll(kRt ? Variant::runtime_kv_window_lo(vp) : Variant::kv_window_lo);
  const int kHiI =
      !kHi ? 0 : clamp_ll(kRt ? Variant::runtime_kv_window_hi(vp) : Variant::kv_window_hi);
  u32 keep = 0u;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // columns qc of row r kept: kv - hi - q0 <= qc <= kv - lo - q0, qc = 8 nf + a2 + parity
    const int d = max(min(t.kv_at(2 * r) - t.q0 - 2 * (t.lane & 3), kLim), -kLim);
    u32 row = 0u;
#pragma unroll
    for (int par = 0; par < 2; ++par) {
      const u32 upto = kLo ? nf_prefix<NF>(d - kLoI + 1 - par) : 0xffffffffu;
      const u32 below = kHi ? nf_prefix<NF>(d - kHiI - par) : 0u;
      row |= (upto & ~below) & (par ? 0xaaaaaaaau : 0x55555555u);
    }
    keep |= row & (r ? 0xccccccccu : 0x33333333u);
  }
  return keep;
}

template <typename Variant, bool kMask, int NF>
__device__ __forceinline__ void probs_tile(const BwdTileView& t, const typename Variant::Params& vp,
                                           float (&st)[NF][4], float (&sc)[NF][4], u32& live,
                                           const float* sLse2, float sm_scale,
                                           float sm_scale_log2,
                                           bool mask_here = true) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kClamp = Variant::loads_at_positions;
  // the elements inside the sequences, and (a band mask: the mask too) kept, per tile; a mask
  // of another form is evaluated per element (the hook), its bits packed there
  constexpr bool kBand =
      kMask && (Variant::has_kv_window || Variant::has_runtime_kv_window);
  const u32 inside = bounds_mask<NF>(t);
  if constexpr (kBand)  // (computed on a full block too: a branch here cost the descriptors
                        // their uniform registers)
    live = inside & (band_mask<Variant, NF>(t, vp) | (0u - (u32)!mask_here));
  else
    live = kMask ? 0u : inside;
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qc = t.q_col(nf, i);
      const int qi = t.q0 + qc, kv = t.kv_at(i);
      const int qh = t.hook_q<kClamp>(qi), kvh = t.hook_kv<kClamp>(kv);
      const float score = st[nf][i] * sm_scale;
      sc[nf][i] = score;
      bool ok;
      if constexpr (kMask && !kBand)
        ok = (qi < t.q_len && kv < t.kv_len) &
             (!mask_here | Variant::LogitsMask(vp, t.b, t.hq, qh, kvh));
      else
        ok = (live >> (nf * 4 + i)) & 1u;
      float s1 = score;
      if constexpr (Variant::has_logits_transform)
        s1 = Variant::LogitsTransform(vp, score, t.b, t.hq, qh, kvh);
      float val;
      if constexpr (Variant::use_softmax) {
        // without a logits transform the scale folds into the exp2's FFMA, the forward's
        // product (its LSE was summed from it)
        const float e = Variant::has_logits_transform
                            ? fast_exp2(s1 * kLog2e - sLse2[qc])
                            : fast_exp2(st[nf][i] * sm_scale_log2 - sLse2[qc]);
        val = ok ? e : 0.f;
      } else {
        val = ok ? s1 : 0.f;
      }
      st[nf][i] = val;
      if constexpr (kMask && !kBand) live |= (ok ? 1u : 0u) << (nf * 4 + i);
    }
}

// One diagonal's sum of a diagonal captured read (docs/backward.md, "Diagonal captured reads"):
// at one accumulator slot, lane (a, r) = (lane % 4, lane / 4) holds query column 2a (+1) and KV
// row r, so lanes (a, r), (a + 1, r + 2), (a + 2, r + 4), (a + 3, r + 6) share the diagonal.
// Each such chain is summed by two shuffles onto its head (a == 0 or r < 2), which adds the
// total at its own position -- the diagonal's index -- if any element of the chain was live.
template <typename Variant>
__device__ __forceinline__ void diag_group_add(const typename Variant::Params& vp,
                                               const typename Variant::Grads& vg,
                                               float (&v)[Variant::kDiagGradSlots], bool live,
                                               int lane, int b, int hq, int qi, int kv) {
  constexpr int K = Variant::kDiagGradSlots;
  const int a = lane & 3, r = lane >> 2;
  const bool s1 = a <= 2 && r <= 5, s2 = a <= 1 && r <= 3, s3 = a == 0 && r <= 1;
  const unsigned m = __ballot_sync(0xffffffffu, live);
  const bool any = live || (s1 && ((m >> (lane + 9)) & 1u)) || (s2 && ((m >> (lane + 18)) & 1u)) ||
                   (s3 && ((m >> (lane + 27)) & 1u));
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const float o = __shfl_down_sync(0xffffffffu, v[j], 9);
    if (s1) v[j] += o;
  }
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const float o = __shfl_down_sync(0xffffffffu, v[j], 18);
    if (s2) v[j] += o;
  }
  if ((a == 0 || r <= 1) && any) Variant::DiagGradAdd(vp, vg, v, b, hq, qi, kv);
}

// dS^T in place of dP^T: dS' = P (dP - delta) (softmax) or dP (none), then CapturedGrad(dS') and
// dS = dS' * LogitsGrad(S) at live elements; 0 elsewhere (docs/backward.md, "Kernels"). As in
// probs_tile, LogitsGrad runs on every element (at real positions); CapturedGrad (atomics) only
// ever at live ones. Reads at a tile-uniform index (slopes[h]) are
// summed in registers and over the warp, and lane 0 adds the total: one atomic a warp and tile
// instead of one an element, all on the same address. Reads along diagonals (t[q - kv]) pair
// element (nf, i) with (nf + 1, i + 2) -- 8 rows and 8 columns on, the same diagonal -- and
// sum the lanes of each diagonal (diag_group_add).
template <typename Variant, int NF>
__device__ __forceinline__ void dscores_tile(const BwdTileView& t,
                                             const typename Variant::Params& vp,
                                             const typename Variant::Grads& vg,
                                             const float (&pt)[NF][4], const float (&sc)[NF][4],
                                             float (&dpt)[NF][4], u32 live, const float* sDelta,
                                             bool grads_here) {
  constexpr bool kClamp = Variant::loads_at_positions;
  float tacc[Variant::kTileGradSlots];  // docs/backward.md, "Tile-uniform captured reads"
  if constexpr (Variant::has_tile_grads) {
#pragma unroll
    for (int j = 0; j < Variant::kTileGradSlots; ++j) tacc[j] = 0.f;
  }
  constexpr int KD = Variant::kDiagGradSlots;
  float dprev[2][KD], dcur[2][KD];  // row r's terms of the last / this column block
  bool lprev[2] = {false, false}, lcur[2] = {false, false};
  if constexpr (Variant::has_diag_grads) {
#pragma unroll
    for (int j = 0; j < KD; ++j) dprev[0][j] = dprev[1][j] = 0.f;
  }
#pragma unroll
  for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qc = t.q_col(nf, i);
      const bool lv = (live >> (nf * 4 + i)) & 1u;
      float dl = dpt[nf][i];
      if constexpr (Variant::use_softmax) dl = pt[nf][i] * (dl - sDelta[qc]);
      const int qi = t.q0 + qc, kv = t.kv_at(i);
      if constexpr (Variant::has_captured_grad) {
        if (lv && grads_here) Variant::CapturedGrad(vp, vg, dl, sc[nf][i], t.b, t.hq, qi, kv);
      }
      if constexpr (Variant::has_tile_grads) {
        if (lv) Variant::TileGradTerms(vp, tacc, dl, sc[nf][i], t.b, t.hq, qi, kv);
      }
      if constexpr (Variant::has_diag_grads) {
        float term[KD];
#pragma unroll
        for (int j = 0; j < KD; ++j) term[j] = 0.f;
        if (lv) Variant::DiagGradTerms(vp, term, dl, sc[nf][i], t.b, t.hq, qi, kv);
        if (i < 2) {  // row r: waits for row r + 8 of the next column block
#pragma unroll
          for (int j = 0; j < KD; ++j) dcur[i][j] = term[j];
          lcur[i] = lv;
        } else {  // row r + 8: completes the diagonal begun at row r one block before
#pragma unroll
          for (int j = 0; j < KD; ++j) term[j] += dprev[i - 2][j];
          if (grads_here)
            diag_group_add<Variant>(vp, vg, term, lv || lprev[i - 2], t.lane, t.b, t.hq, qi, kv);
        }
      }
      float ds = dl;
      if constexpr (Variant::has_logits_grad) {
        ds = dl * Variant::LogitsGrad(vp, sc[nf][i], t.b, t.hq, t.hook_q<kClamp>(qi),
                                      t.hook_kv<kClamp>(kv));
      }
      dpt[nf][i] = lv ? ds : 0.f;
    }
    if constexpr (Variant::has_diag_grads) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < KD; ++j) dprev[i][j] = dcur[i][j];
        lprev[i] = lcur[i];
      }
    }
  }
  if constexpr (Variant::has_diag_grads) {  // row r of the last block: no row r + 8 after it
    if (grads_here) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
        diag_group_add<Variant>(vp, vg, dprev[i], lprev[i], t.lane, t.b, t.hq,
                                t.q0 + t.q_col(NF - 1, i), t.kv_at(i));
    }
  }
  if constexpr (Variant::has_tile_grads) {
    // grads_here is warp-uniform: every lane takes part in the butterfly. A warp with no live
    // element adds nothing (its index need not be one the variant ever reads).
    if (grads_here && __any_sync(0xffffffffu, live != 0u)) {
#pragma unroll
      for (int j = 0; j < Variant::kTileGradSlots; ++j)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) tacc[j] += __shfl_xor_sync(0xffffffffu, tacc[j], o);
      if (t.lane == 0) Variant::TileGradFlush(vp, vg, tacc, t.b, t.hq);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Loads. Each thread copies one 16-byte column chunk of every ROWS_PER_PASS-th row; rows outside
// [0, len) are zero-filled (cp_async_16's predicate), so padding never carries stale values.
// ---------------------------------------------------------------------------------------------
template <typename DType, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile_rows(const DType* g, i64 stride_s, u16* dst, int row0,
                                               int len, int tid) {
  constexpr int CHUNKS = D / 8;
  constexpr int ROWS_PER_PASS = NT / CHUNKS;
  static_assert(NT % CHUNKS == 0 && ROWS % ROWS_PER_PASS == 0, "loader layout");
  const int ld_row = tid / CHUNKS, ld_ch = tid % CHUNKS;
  const u32 base = smem_addr(dst);
#pragma unroll
  for (int j = 0; j < ROWS / ROWS_PER_PASS; ++j) {
    const int r = ld_row + j * ROWS_PER_PASS;
    const bool ok = (unsigned)(row0 + r) < (unsigned)len;
    const DType* src = ok ? g + (i64)(row0 + r) * stride_s + ld_ch * 8 : g;
    cp_async_16(base + 2 * swz<D>(r, ld_ch * 8), src, ok);
  }
}

// The query tiles of query head hq that touch this CTA's KV tile: all of them, or the block
// mask's KV-major lists for the tile's KV block (TileList's "block_kv" is the mask's block_q here:
// positions per listed block along the visited axis).
template <int TQ>
__device__ __forceinline__ TileList query_tiles(const attncc::BackwardParams& p, int b, int hq,
                                                int kv0) {
  TileList t;
  t.tile = TQ;
  if (p.q_num_blocks == nullptr) {
    t.partial = nullptr;
    t.full = nullptr;
    t.n_partial = (p.q_len + TQ - 1) / TQ;
    t.n_full = 0;
    t.sub = 1;
    t.block_kv = TQ;
    t.count = t.n_partial;
    return t;
  }
  const int kvb = kv0 / p.block_kv;  // the launcher checks block_kv % TKV == 0
  const i64 nb_off = b * p.qm_stride_b + hq * p.qm_stride_h + kvb;
  const i64 ix_off = b * p.qi_stride_b + hq * p.qi_stride_h + kvb * p.qi_stride_kv;
  t.partial = p.q_indices + ix_off;
  t.n_partial = __ldg(p.q_num_blocks + nb_off);
  if (p.full_q_num_blocks != nullptr) {
    t.full = p.full_q_indices + ix_off;
    t.n_full = __ldg(p.full_q_num_blocks + nb_off);
  } else {
    t.full = nullptr;
    t.n_full = 0;
  }
  t.sub = p.block_q / TQ;
  t.block_kv = p.block_q;
  t.count = (t.n_partial + t.n_full) * t.sub;
  return t;
}

// Shared-memory carve-up of one CTA (BwdConfig::kSmemBytes).
template <int D, int TQ, int TKV, int STAGES>
struct BwdSmem {
  u16 *k, *v, *q, *dout, *ds;
  float *lse2, *delta;
  __device__ __forceinline__ explicit BwdSmem(unsigned char* base) {
    k = reinterpret_cast<u16*>(base);
    v = k + TKV * D;
    q = v + TKV * D;
    dout = q + STAGES * TQ * D;
    ds = dout + STAGES * TQ * D;
    lse2 = reinterpret_cast<float*>(ds + TQ * TKV);
    delta = lse2 + STAGES * TQ;
  }
};

// cp.async query tile i (Q and dO rows) of head hq into its stage and stage its LSE (base 2) and
// delta with plain stores; commits one group even when i is past the list (see fa2_attend.cuh's
// load_kv_tile for the commit discipline).
template <typename DType, int D, int TQ, int TKV, int STAGES, int NT>
__device__ __forceinline__ void load_q_tile(const attncc::BackwardParams& p,
                                            const BwdSmem<D, TQ, TKV, STAGES>& sm,
                                            const TileList& tl, int i, int b, int hq, int tid) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (i < tl.count) {
    bool is_full;
    const int q0 = tl.start(i, is_full);
    const int st = i % STAGES;
    load_tile_rows<DType, D, TQ, NT>(
        reinterpret_cast<const DType*>(p.q) + b * p.q_stride_b + hq * p.q_stride_h, p.q_stride_s,
        sm.q + st * TQ * D, q0, p.q_len, tid);
    load_tile_rows<DType, D, TQ, NT>(
        reinterpret_cast<const DType*>(p.dout) + b * p.do_stride_b + hq * p.do_stride_h,
        p.do_stride_s, sm.dout + st * TQ * D, q0, p.q_len, tid);
    if (p.lse != nullptr && tid < TQ) {
      const int qi = q0 + tid;
      const bool in = (unsigned)qi < (unsigned)p.q_len;
      const i64 off = b * p.lse_stride_b + hq * p.lse_stride_h + qi;
      const float l = in ? p.lse[off] : 0.f;
      // a row with no weight (LSE -inf) has P = 0 everywhere: exp2(s - +inf) = 0, never NaN
      sm.lse2[st * TQ + tid] = l == neg_inf() ? attncc::pos_inf() : l * kLog2e;
      sm.delta[st * TQ + tid] = in ? p.delta[off] : 0.f;
    }
  }
  cp_async_commit();
}

// dQ[TQ x D] += dS K * sm_scale for this CTA's tile: warp w takes query-row fragment w % R and
// column slice w / R (R = TQ / 16), reads dS from shared memory and adds into dq_accum.
template <typename DType, int D, int TQ, int TKV, int STAGES, int DSPLIT>
__device__ __forceinline__ void dq_tile(const attncc::BackwardParams& p,
                                        const BwdSmem<D, TQ, TKV, STAGES>& sm, int b, int hq,
                                        int q0, int warp, int lane) {
  using Cfg = BwdConfig<D, TQ, TKV, STAGES, DSPLIT>;
  constexpr int NF = Cfg::kDqCols / 8;
  const int rf = warp % Cfg::kQRowFrags, slice = warp / Cfg::kQRowFrags;
  float acc[NF][4];
  zero_acc(acc);
  const u32 a_addr = opaque(a_rows_addr(sm.ds, 2 * TKV, 16 * rf, lane));
  const u32 b_addr = opaque(bk_rows_addr(sm.k, 2 * D, lane));
  const int chunk0 = slice * Cfg::kDqCols / 8;
#pragma unroll
  for (int kk = 0; kk < TKV / 16; ++kk) {
    u32 a[1][4];
    ldmatrix_x4(a[0], chunk_addr(a_addr, 2 * kk, opaque(a_key(lane))));
    mma_reg_ab<DType, 1, NF, 2 * D>(acc, a, b_addr + kk * 16 * 2 * D, opaque(bk_key(lane)),
                                    chunk0);
  }
  float* dq = p.dq_accum + b * p.dq_stride_b + hq * p.dq_stride_h;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int qi = q0 + 16 * rf + (lane >> 2) + 8 * hr;
    if (qi >= p.q_len) continue;
    float* row = dq + (i64)qi * p.dq_stride_s + slice * Cfg::kDqCols + 2 * (lane & 3);
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) {
      atomicAdd(row + nf * 8, acc[nf][2 * hr] * p.sm_scale);
      atomicAdd(row + nf * 8 + 1, acc[nf][2 * hr + 1] * p.sm_scale);
    }
  }
}

// dS^T of the warp's rows to shared memory as dS [TQ][TKV] (query-major), dQ's A operand.
template <typename DType, int TKV, int NF>
__device__ __forceinline__ void store_ds(u16* sds, const float (&ds)[NF][4], int kv_local0,
                                         int lane) {
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qc = nf * 8 + 2 * (lane & 3) + (i & 1);
      const int kr = kv_local0 + (lane >> 2) + 8 * (i >> 1);
      sds[swz<TKV>(qc, kr)] = float_to_elem<DType>(ds[nf][i]);
    }
}

// dK (times sm_scale) and dV rows of this warp, 32-bit stores of element pairs.
template <typename DType, int NF>
__device__ __forceinline__ void store_dkdv(const attncc::BackwardParams& p, int b, int h_kv,
                                           int kv_row0, int col0, int lane,
                                           const float (&dk)[NF][4], const float (&dv)[NF][4]) {
  DType* gk = reinterpret_cast<DType*>(p.dk) + b * p.dk_stride_b + h_kv * p.dk_stride_h;
  DType* gv = reinterpret_cast<DType*>(p.dv) + b * p.dv_stride_b + h_kv * p.dv_stride_h;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int kv = kv_row0 + (lane >> 2) + 8 * hr;
    if (kv >= p.kv_len) continue;
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) {
      const int col = col0 + nf * 8 + 2 * (lane & 3);
      *reinterpret_cast<u32*>(gk + (i64)kv * p.dk_stride_s + col) =
          pack2<DType>(dk[nf][2 * hr] * p.sm_scale, dk[nf][2 * hr + 1] * p.sm_scale);
      *reinterpret_cast<u32*>(gv + (i64)kv * p.dv_stride_s + col) =
          pack2<DType>(dv[nf][2 * hr], dv[nf][2 * hr + 1]);
    }
  }
}

// One query tile against the CTA's KV tile: the per-tile body of the header comment's loop.
template <typename Variant, typename DType, int D, int TQ, int TKV, int STAGES, int DSPLIT,
          bool kMask>
__device__ __forceinline__ void bwd_tile(const attncc::BackwardParams& p,
                                         const typename Variant::Params& vp,
                                         const typename Variant::Grads& vg,
                                         const BwdSmem<D, TQ, TKV, STAGES>& sm,
                                         const BwdTileView& t, int st, int warp,
                                         float (&dk)[BwdConfig<D, TQ, TKV, STAGES, DSPLIT>::kDW / 8][4],
                                         float (&dv)[BwdConfig<D, TQ, TKV, STAGES, DSPLIT>::kDW / 8][4]) {
  using Cfg = BwdConfig<D, TQ, TKV, STAGES, DSPLIT>;
  constexpr int NF = TQ / 8;  // S^T fragments of the warp's 16 KV rows
  const int lane = t.lane;
  const int group = warp % Cfg::kKvGroups, dpart = warp / Cfg::kKvGroups;
  const u16* sq = sm.q + st * TQ * D;
  const u16* sdo = sm.dout + st * TQ * D;
  const int chunk0 = dpart * Cfg::kDW / 8;

  // S^T = K Q^T, P^T
  float pt[NF][4], sc[NF][4];
  u32 live;
  zero_acc(pt);
  mma_smem_abt<DType, D / 16, NF, 2 * D>(pt, opaque(a_rows_addr(sm.k, 2 * D, 16 * group, lane)),
                                         a_key(lane), opaque(bn_rows_addr(sq, 2 * D, lane)),
                                         bn_key(lane));
  probs_tile<Variant, kMask>(t, vp, pt, sc, live, sm.lse2 + st * TQ, p.sm_scale,
                             p.sm_scale_log2);

  // dV += P^T dO
  {
    u32 pa[NF / 2][4];
    pack_a<DType, NF>(pa, pt);
    mma_reg_ab<DType, NF / 2, Cfg::kDW / 8, 2 * D>(dv, pa, opaque(bk_rows_addr(sdo, 2 * D, lane)),
                                                   bk_key(lane), chunk0);
  }

  // dP^T = V dO^T, then dS^T in place
  float dpt[NF][4];
  zero_acc(dpt);
  mma_smem_abt<DType, D / 16, NF, 2 * D>(dpt, opaque(a_rows_addr(sm.v, 2 * D, 16 * group, lane)),
                                         a_key(lane), opaque(bn_rows_addr(sdo, 2 * D, lane)),
                                         bn_key(lane));
  dscores_tile<Variant, NF>(t, vp, vg, pt, sc, dpt, live, sm.delta + st * TQ, dpart == 0);

  // dK += dS^T Q; dS to shared memory for dQ
  {
    u32 da[NF / 2][4];
    pack_a<DType, NF>(da, dpt);
    mma_reg_ab<DType, NF / 2, Cfg::kDW / 8, 2 * D>(dk, da, opaque(bk_rows_addr(sq, 2 * D, lane)),
                                                   bk_key(lane), chunk0);
  }
  if (dpart == 0) store_ds<DType, TKV, NF>(sm.ds, dpt, 16 * group, lane);
  __syncthreads();  // dS complete
  dq_tile<DType, D, TQ, TKV, STAGES, DSPLIT>(p, sm, t.b, t.hq, t.q0, warp, lane);
}

// ---------------------------------------------------------------------------------------------
// The kernel body: K/V tile in, for each query head of the group and each listed query tile run
// bwd_tile (two-stage ring: tile it+1 loads while tile it computes), then dK/dV out.
// ---------------------------------------------------------------------------------------------
template <typename Variant, typename DType, int D, int TQ, int TKV, int STAGES, int DSPLIT>
__device__ __forceinline__ void fa2_backward(const attncc::BackwardParams& p,
                                             const typename Variant::Params& vp,
                                             const typename Variant::Grads& vg) {
  using Cfg = BwdConfig<D, TQ, TKV, STAGES, DSPLIT>;
  static_assert(!Variant::has_query_transform && !Variant::has_key_transform &&
                    !Variant::has_value_transform && !Variant::has_output_transform,
                "the backward kernel runs on materialized q/k/v (docs/backward.md, Kernels)");
  extern __shared__ __attribute__((aligned(128))) unsigned char attncc_fa2_bwd_smem[];
  const BwdSmem<D, TQ, TKV, STAGES> sm(attncc_fa2_bwd_smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const BwdCta cta = bwd_cta<TKV>(p);
  const int b = cta.b, h_kv = cta.h_kv, kv0 = cta.kv0;
  const int group = warp % Cfg::kKvGroups;
  const int gsize = p.num_q_heads / p.num_kv_heads;

  load_tile_rows<DType, D, TKV, Cfg::kThreads>(
      reinterpret_cast<const DType*>(p.k) + b * p.k_stride_b + h_kv * p.k_stride_h, p.k_stride_s,
      sm.k, kv0, p.kv_len, tid);
  load_tile_rows<DType, D, TKV, Cfg::kThreads>(
      reinterpret_cast<const DType*>(p.v) + b * p.v_stride_b + h_kv * p.v_stride_h, p.v_stride_s,
      sm.v, kv0, p.kv_len, tid);
  cp_async_commit();

  float dk[Cfg::kDW / 8][4], dv[Cfg::kDW / 8][4];
  zero_acc(dk);
  zero_acc(dv);

#pragma unroll 1
  for (int j = 0; j < gsize; ++j) {
    const int hq = h_kv * gsize + j;
    const TileList tl = query_tiles<TQ>(p, b, hq, kv0);
    load_q_tile<DType, D, TQ, TKV, STAGES, Cfg::kThreads>(p, sm, tl, 0, b, hq, tid);
#pragma unroll 1
    for (int it = 0; it < tl.count; ++it) {
      cp_async_wait<0>();  // tile it (and K/V) landed for this thread ...
      __syncthreads();     // ... and for all; stage (it + 1) % 2 and dS are free
      load_q_tile<DType, D, TQ, TKV, STAGES, Cfg::kThreads>(p, sm, tl, it + 1, b, hq, tid);
      bool is_full;
      const int q0 = tl.start(it, is_full);
      const BwdTileView t{b, hq, q0, kv0 + 16 * group, p.q_len, p.kv_len, lane};
      if (Variant::has_logits_mask && !is_full)
        bwd_tile<Variant, DType, D, TQ, TKV, STAGES, DSPLIT, Variant::has_logits_mask>(
            p, vp, vg, sm, t, it % STAGES, warp, dk, dv);
      else
        bwd_tile<Variant, DType, D, TQ, TKV, STAGES, DSPLIT, false>(p, vp, vg, sm, t,
                                                                    it % STAGES, warp, dk, dv);
    }
    cp_async_wait<0>();
    __syncthreads();  // the last tile's stages are read before the next head refills them
  }
  store_dkdv<DType, Cfg::kDW / 8>(p, b, h_kv, kv0 + 16 * group,
                                  (warp / Cfg::kKvGroups) * Cfg::kDW, lane, dk, dv);
}

}  // namespace fa2
}  // namespace attncc

// The entry point codegen emits for a backward unit. Launch with grid (ceil(kv_len / TKV) C,
// num_kv_heads / C, batch) (bwd_cta), block (BwdConfig::kThreads), dynamic shared memory
// BwdConfig::kSmemBytes (attncc.codegen.tiles.BackwardTiles mirrors both); dq_accum zeroed first.
#define ATTNCC_FA2_BWD_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, DSPLIT)              \
  extern "C" __global__ void __launch_bounds__(                                                    \
      attncc::fa2::BwdConfig<HEAD_DIM, TQ, TKV, STAGES, DSPLIT>::kThreads, 1)                      \
      NAME(attncc::BackwardParams p, VARIANT::Params vp, VARIANT::Grads vg) {                      \
    attncc::fa2::fa2_backward<VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, DSPLIT>(p, vp, vg);       \
  }

#endif  // ATTNCC_FA2_BACKWARD_CUH
