// attncc FA3 for sm_90a: what both FA3 kernels' consumer warpgroups are made of -- the
// shared-memory layout, the ping-pong turns, the S = Q K^T and O += P V wgmma issue, the
// logits hooks and the online softmax in registers, the row transforms on swizzled tiles,
// the K/V ring's barriers, and consume_tiles, one warpgroup's software-pipelined pass over
// an item's K/V tiles. fa3_prefill.cuh (the dense kernel) describes the roles and the
// overlap they implement; fa3_batch.cuh runs the same pass over a plan's work units.
//
// Self-contained: no #include. Comes after attncc_types.cuh, attention_params.cuh,
// common.cuh, wgmma.cuh and tma.cuh, and before fa3_store.cuh.
#ifndef ATTNCC_FA3_CONSUMER_CUH
#define ATTNCC_FA3_CONSUMER_CUH

// The N-major V descriptor's byte offsets, as tests/gpu/test_wgmma.py's probe measured them on
// the H200: any LBO (unused at N = 64), SBO = 1024.
#ifndef ATTNCC_FA3_V_LBO
#define ATTNCC_FA3_V_LBO 8192
#endif
#ifndef ATTNCC_FA3_V_SBO
#define ATTNCC_FA3_V_SBO 1024
#endif

namespace attncc {
namespace fa3 {


constexpr int kConsumers = 2;          // consumer warpgroups, 64 query rows each
constexpr int kTQ = 64 * kConsumers;    // query rows per CTA
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBoxBytes = 64 * 128;     // one TMA box: [64 rows][64 16-bit], 128B-swizzled
// Registers per thread after setmaxnreg. The warpgroups trade registers within the CTA's pool,
// which is what the launch allocated: one CTA per SM, 65536 / 384 rounded down to a multiple of
// 8 = 168 per thread, 64,512 in all -- not the SM's 64K. setmaxnreg.inc blocks until the pool
// has the registers, so asking for more than it holds hangs the consumers forever (a producer
// at 32: 32 x 128 + 240 x 256 = 65,536 > 64,512 -- the hang of the reverted counter scheduler).
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
static_assert(kProducerRegs * 128 + kConsumers * 128 * kConsumerRegs <=
                  65536 / kThreads / 8 * 8 * kThreads,
              "setmaxnreg would ask for more registers than the CTA's pool holds: a hang");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D, int TKV, int STAGES>
struct Smem {
  static constexpr int kKvBlockBytes = TKV * 128;  // TKV rows of K (or V), one column block
  static constexpr int kKvTileBytes = kKvBlockBytes * (D / 64);
  static constexpr int kQ = 0;                     // [consumer][column block]
  static constexpr int kK = kQ + kConsumers * 64 * 2 * D;
  static constexpr int kV = kK + STAGES * kKvTileBytes;
  // full[STAGES], empty[STAGES], q_full, q_empty, then the split ring's V-full[STAGES] and
  // K-empty[STAGES] (Ring<true>; reserved in every form, so the layout is one)
  static constexpr int kBar = kV + STAGES * kKvTileBytes;
  static constexpr int kSplitBar = kBar + 8 * (2 * STAGES + 2);
  // the dense kernel's current work item and its tiles, as the producer publishes them with its
  // Q (two int4: fa3_prefill's ItemSlot), then the launch's split tail (fa3_split.cuh)
  static constexpr int kItem = kSplitBar + 8 * (2 * STAGES);
  static constexpr int kTail = kItem + 32;
  // the dense kernel's ring stages' tiles, as its producer loaded them (fa3_prefill's TileMeta)
  static constexpr int kMeta = kTail + 16;
  static constexpr int kBytes = kMeta + 8 * STAGES + 1024;  // + alignment slack
};

// Ping-pong turns of the two consumer warpgroups: consumer c waits on named barrier 1 + c (0 is
// __syncthreads) before it issues a group of GEMMs and then arrives on the other's barrier. A
// barrier completes when all 256 consumer threads reached it: 128 waiting + 128 arriving.
// Consumer 0 issues first at every issue point. Consumer 1 passes the turn once before its
// first GEMM of the CTA and then after each of its issue points, the item's last (the tail's
// P V) included: so consumer 0 issues the next item's S(0) as soon as its own epilogue is done,
// while consumer 1 still stores its rows.
// An arrival is always consumed before the next one: between two passes consumer 1 waits for
// consumer 0's, which follows consumer 0's wait. The last item's tail pass is consumed by
// finish() (a barrier is not left half-arrived when the CTA exits).
struct Turns {
  int me;  // 0 or 1: which consumer warpgroup this thread belongs to
  __device__ __forceinline__ void wait_mine() const {
    asm volatile("bar.sync %0, 256;\n" ::"r"(1 + me) : "memory");
  }
  __device__ __forceinline__ void pass() const {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - me) : "memory");
  }
  // After a consumer's last item, when it consumed ring tiles (issued GEMMs) at all.
  __device__ __forceinline__ void finish(int tiles_consumed) const {
    if (me == 0 && tiles_consumed > 0) wait_mine();
  }
};

// ---- consumer building blocks (one warpgroup, 64 rows; every function is warpgroup-wide) ------
// Accumulator layout (wgmma m64nN): warp w holds rows 16w + lane/4 and 16w + lane/4 + 8; for
// each 8-column block j, elements [4j, 4j+1] on the first row and [4j+2, 4j+3] on the second.

// Issue S = Q K^T for one K tile (D/16 k-steps, each a 32-byte step inside a 64-column block;
// the K operand's TKV rows are 8-row swizzle atoms 1024 bytes apart) and commit it as a group.
// Q's descriptor words are made opaque to the optimizer, so that Q's D/16 descriptors are rebuilt
// at each tile (one add per k-step) rather than hoisted out of the tile loop, where they pin D/8
// registers across it and were what ptxas spilled first.
// Descriptors are 32-bit word pairs (wg::DescWords) from warp-uniform addresses, so they live in
// the uniform registers wgmma reads: a k-step is one UIADD3 per operand (before: an R2UR pair,
// IMAD.MOV and UMOVs, ~7 instructions per S k-step). Q comes as its descriptor words
// (consume_tiles builds them once); rebuilding is one add per k-step on the opaque low word. The
// rebuilt high word also takes K's address bits above 2^18 -- zero, but a per-tile value ptxas
// cannot prove zero: the word is then computed at each tile straight into the register the
// wgmmas read it from, rather than kept in a register of its own through the loop and copied
// there before every wgmma (UMOV; at D = 256 ptxas does that with a loop-invariant high word, 16
// a tile).
// HALF (TKV = 128 only; consume_tiles' trimmed tile 0): 1 / 2 issues S of keys 0..63 / 64..127
// alone, one m64n64 chain into that half of the accumulators (K rows 64..127 start 64 swizzled
// 128-byte rows into each column block); the other half keeps whatever it held, which the band
// mask then sets to -inf. 0: the whole tile.
template <typename DType, int D, int TKV, int HALF = 0>
__device__ __forceinline__ void issue_qk(float (&s)[TKV / 2], wg::DescWords q, u32 sk_tile) {
  constexpr bool F16 = !common::ElemTraits<DType>::kIsBf16;
  static_assert(HALF == 0 || (TKV == 128 && (HALF == 1 || HALF == 2)),
                "half 1 (keys 0..63) or 2 (keys 64..127) of a 128-key tile");
  asm volatile("" : "+r"(q.lo), "+r"(q.hi));
  q.hi += wg::opaque_zero(sk_tile);
  const wg::DescWords k0 = wg::desc_words(sk_tile + (HALF > 0 ? (HALF - 1) * 64 * 128 : 0), 16,
                                          1024);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const u32 inner = (ks & 3) * 32;
    const wg::u64 a = wg::desc_u64(wg::desc_plus(q, (ks >> 2) * kBoxBytes + inner));
    const wg::u64 k = wg::desc_u64(wg::desc_plus(k0, (ks >> 2) * TKV * 128 + inner));
    if constexpr (HALF > 0) {
      wg::mma_ss_m64n64k16<0, F16>(*reinterpret_cast<float(*)[32]>(s + 32 * (HALF - 1)), a, k,
                                   ks > 0);
    } else if constexpr (TKV == 128) {
      wg::mma_ss_m64n128k16<F16>(s, a, k, ks > 0);
    } else {
      wg::mma_ss_m64n64k16<0, F16>(s, a, k, ks > 0);
    }
  }
  wg::commit();
}

// Issue O += P V for one V tile (P's A fragment for k-step kk is S's columns 16kk..16kk+15; V
// rows 16kk.. of column block blk are N-major, 8-row groups SBO = 1024 bytes apart) and commit.
// HALF 1 / 2 (TKV = 128): only the k-steps of keys 0..63 / 64..127 (issue_qk's HALF).
template <typename DType, int D, int TKV, int HALF = 0>
__device__ __forceinline__ void issue_pv(float (&o)[D / 64][32], const u32 (&pa)[TKV / 16][4],
                                         u32 sv_tile) {
  constexpr bool F16 = !common::ElemTraits<DType>::kIsBf16;
  constexpr int KK0 = HALF > 0 ? (HALF - 1) * TKV / 32 : 0;
  constexpr int KK1 = HALF > 0 ? HALF * TKV / 32 : TKV / 16;
  const wg::DescWords v0 = wg::desc_words(sv_tile, ATTNCC_FA3_V_LBO, ATTNCC_FA3_V_SBO);
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int kk = KK0; kk < KK1; ++kk) {
      wg::mma_rs_m64n64k16<1, F16>(
          o[blk], pa[kk], wg::desc_u64(wg::desc_plus(v0, blk * TKV * 128 + kk * 16 * 128)), 1);
    }
  wg::commit();
}

// form::low_pressure() (codegen's low_pressure=True): the runtime compiles each FA3 kernel as it
// is first and, only if ptxas spills, again in this form (runtime/jit/policy.py compile_fa3). The
// low-pressure form (the mask evaluated unconditionally, a score_mod's logits key-outer) needs
// fewer registers but is slower as the only form (docs/fa3.md, "Low-pressure form and the spill
// policy").

// Whether softmax_step applies the logits scale itself (softmax variants without a score_mod,
// whose logits are just S * scale): apply_logits then leaves S unscaled and each element's
// scale and max subtraction are one FFMA in front of its exp2 -- 64 multiplies a tile fewer.
// Not in the low-pressure form (document_mask D 64 spilled 24 bytes there with it).
template <typename Variant>
__device__ __forceinline__ constexpr bool folds_scale() {
  return Variant::use_softmax && !Variant::has_logits_transform && !form::low_pressure();
}

// Logits of one tile in place: scale, the variant's hooks, the mask. Each thread holds two rows
// (hr = 0, 1) with their own query head, query position and validity (the batch kernel fuses a
// GQA group's heads into rows); the hooks see key position kv + kv_pos0. CHECKED handles invalid
// rows, keys past kv_len and the mask; an interior tile with no mask to apply skips all three.
// A variant whose hooks index a captured tensor by position (a document-id table:
// Variant::loads_at_positions) sees only real positions there: a key past kv_len as kv_len - 1,
// an invalid row as query position 0 -- their logits are masked anyway, and the loads stay
// inside the tensor.
template <typename Variant, int TKV, bool CHECKED, bool kOneHead>
__device__ __forceinline__ void apply_logits(float (&s)[TKV / 2], const typename Variant::Params& vp,
                                             float qk_scale, int b, const int (&hq)[2],
                                             const int (&qi)[2], const bool (&row_ok)[2], int kv0,
                                             int kv_len, int kv_pos0, bool is_full) {
  constexpr bool kSoftmax = Variant::use_softmax;
  constexpr bool kClamp = CHECKED && Variant::loads_at_positions;
  const float masked = kSoftmax ? common::neg_inf() : 0.f;
  const int lane = threadIdx.x & 31;
  // kOneHead (the dense kernel): both rows are head hq[0], at positions qi[0] and qi[0] + 8.
  // Spelled so in the score_mod loop, a per-head load (ALiBi's slope) has one address and
  // kv - q folds to a constant offset per element, which made ALiBi + causal faster with
  // bitwise-equal outputs (docs/fa3.md, "Two spellings of the logits loop").
  // The lambda loop keeps the per-row spelling.
  auto head = [&](int hr) { return kOneHead ? hq[0] : hq[hr]; };
  auto qpos = [&](int hr) { return kOneHead ? qi[0] + 8 * hr : qi[hr]; };
  // Two ways to write the same loop, each where it measured faster (ptxas schedules and
  // allocates them differently): a variant with a score_mod runs the plain nested loop below;
  // mask-only variants, and every variant's low-pressure form, run the lambda
  // (docs/fa3.md, "Two spellings of the logits loop").
  if constexpr (Variant::has_logits_transform && !form::low_pressure()) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
      for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kv = kv0 + 8 * j + 2 * (lane & 3) + e;
          const int kv_hook = (kClamp ? min(kv, kv_len - 1) : kv) + kv_pos0;
          const int q_hook = (kClamp && !row_ok[hr]) ? 0 : qpos(hr);
          float sc = Variant::LogitsTransform(vp, s[4 * j + 2 * hr + e] * qk_scale, b, head(hr),
                                              q_hook, kv_hook);
          if constexpr (kSoftmax) sc *= kLog2e;
          if constexpr (CHECKED) {
            if (!row_ok[hr] || (unsigned)kv >= (unsigned)kv_len) sc = masked;
            if constexpr (Variant::has_logits_mask) {
              if (!is_full && !Variant::LogitsMask(vp, b, head(hr), q_hook, kv_hook)) sc = masked;
            }
          }
          s[4 * j + 2 * hr + e] = sc;
        }
    }
  } else {
    auto logit = [&](int j, int e, int hr) {
      const int kv = kv0 + 8 * j + 2 * (lane & 3) + e;
      const int kv_hook = (kClamp ? min(kv, kv_len - 1) : kv) + kv_pos0;
      const int q_hook = (kClamp && !row_ok[hr]) ? 0 : qi[hr];
      // softmax without a score_mod: softmax_step applies the scale in its exp2 (folds_scale)
      float sc = s[4 * j + 2 * hr + e];
      if constexpr (!folds_scale<Variant>()) sc *= qk_scale;
      if constexpr (Variant::has_logits_transform) {
        sc = Variant::LogitsTransform(vp, sc, b, hq[hr], q_hook, kv_hook);
        if constexpr (kSoftmax) sc *= kLog2e;
      }
      if constexpr (CHECKED) {
        if (!row_ok[hr] || (unsigned)kv >= (unsigned)kv_len) sc = masked;
        if constexpr (Variant::has_logits_mask) {
          if constexpr (form::low_pressure()) {
            // evaluated whether or not the tile is full (then ignored): behind the is_full
            // branch each element's loads sat in a block of their own and were not shared
            // (document_causal loaded its row's and its key's doc id once per element, 128
            // loads a tile, and spilled); unconditional, a key's loads serve both rows
            const bool keep = Variant::LogitsMask(vp, b, hq[hr], q_hook, kv_hook);
            if (!is_full && !keep) sc = masked;
          } else {
            if (!is_full && !Variant::LogitsMask(vp, b, hq[hr], q_hook, kv_hook)) sc = masked;
          }
        }
      }
      s[4 * j + 2 * hr + e] = sc;
    };
    if constexpr (Variant::has_logits_transform) {
      // (low-pressure form) key-outer, in four chunks of TKV / 4 keys with a __syncwarp (which
      // memory accesses do not cross) between them: a score_mod's per-element loads
      // (relative_bias: 64 a tile) are then in flight a chunk at a time, not all at once next
      // to S, P and O
#pragma unroll
      for (int j = 0; j < TKV / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) logit(j, e, hr);
        if ((j + 1) % (TKV / 32) == 0 && j + 1 < TKV / 8) __syncwarp();
      }
    } else {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) logit(j, e, hr);
    }
  }
}

// Online softmax of one tile (base 2): new row maxima, s <- exp2(s * scale - m), per-thread row
// sums (reduced across the quad only in the epilogue), and the factor the old O must be scaled
// by. Lazily: a row keeps its running maximum until a tile's maximum exceeds it by more than
// kLazy (base 2), so its exps stay below 2^8 = 256 (no overflow in bf16 P, fp32 sums or O).
// O, its sum and its maximum stay consistent, so the result is the same softmax; only O's
// rescale (corr = 1) is skipped on most tiles, as a row's running maximum rarely moves that
// much after its first tiles. kFold: s holds unscaled logits and `scale` (the exp2-domain
// scale) is applied here; it must be positive for max(s) * scale to be the scaled maximum, so a
// scale <= 0 (legal, if odd) scales the tile first, keeping masked logits at -inf.
template <int TKV, bool kFold>
__device__ __forceinline__ void softmax_step(float (&s)[TKV / 2], float (&row_m)[2],
                                             float (&row_l)[2], float (&corr)[2], float scale) {
  constexpr float kLazy = 8.f;
  if (!kFold) {
    scale = 1.f;
  } else if (!(scale > 0.f)) {
#pragma unroll
    for (int i = 0; i < TKV / 2; ++i) s[i] = s[i] == common::neg_inf() ? s[i] : s[i] * scale;
    scale = 1.f;
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    // the tile's row maximum as a tree (depth log2(TKV / 4)) rather than one dependent chain
    float v[TKV / 8];
#pragma unroll
    for (int j = 0; j < TKV / 8; ++j)
      v[j] = common::fmax_nan(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]);
#pragma unroll
    for (int step = 1; step < TKV / 8; step *= 2)
#pragma unroll
      for (int j = 0; j + step < TKV / 8; j += 2 * step) v[j] = common::fmax_nan(v[j], v[j + step]);
    // NaN-keeping maxima: a NaN logit makes the row's maximum NaN (and its LSE, as torch)
    float mx = common::fmax_nan(v[0], __shfl_xor_sync(0xffffffffu, v[0], 1));
    mx = common::fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = common::fmax_nan(mx * scale, row_m[hr]);  // (-inf * scale = -inf)
    const float m_new = !(mx <= row_m[hr] + kLazy) ? mx : row_m[hr];  // (a NaN max is taken)
    const float m_use = (m_new == common::neg_inf()) ? 0.f : m_new;  // a fully masked row so far
    corr[hr] = common::fast_exp2(row_m[hr] - m_use);  // 1 while the maximum stays
    row_m[hr] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = common::fast_exp2(fmaf(s[4 * j + 2 * hr + e], scale, -m_use));
        s[4 * j + 2 * hr + e] = pe;
        sum += pe;
      }
    row_l[hr] = row_l[hr] * corr[hr] + sum;
  }
}

// The mask of a variant whose mask_mod is exactly a band lo <= kv - q <= hi
// (Variant::has_kv_window: causal, a causal sliding window) on a tile inside both sequences:
// column c = 8 j + 2 (lane & 3) + e of row hr keeps its key iff c lies in the row's range of
// columns, so each logit costs one compare of a constant with a per-row bound and a select --
// instead of the checked path's hook, row check and key bounds check (docs/fa3.md, "Band
// mask"). `kv` is the hooks' position of the tile's key 0.
template <typename Variant, int TKV>
__device__ __forceinline__ void mask_band(float (&s)[TKV / 2], const int (&qi)[2], int kv) {
  constexpr bool kLo = Variant::kv_window_lo > -(1LL << 40);  // (unbounded: -+2^62)
  constexpr bool kHi = Variant::kv_window_hi < (1LL << 40);
  const float masked = Variant::use_softmax ? common::neg_inf() : 0.f;
  const int lane_kv = kv + 2 * (threadIdx.x & 3);  // the key of this lane's column 0
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    // the row's columns [c_lo, c_hi], clamped to the tile (in 64 bits: lo / hi are literals)
    const long long d = (long long)qi[hr] - lane_kv;
    const int c_lo = kLo ? (int)max(-1LL, min((long long)TKV, d + Variant::kv_window_lo)) : 0;
    const int c_hi = kHi ? (int)max(-1LL, min((long long)TKV, d + Variant::kv_window_hi)) : TKV;
#pragma unroll
    for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 8 * j + e;
        if ((kHi && c > c_hi) || (kLo && c < c_lo)) s[4 * j + 2 * hr + e] = masked;
      }
  }
}

// apply_logits (CHECKED unless the tile is interior) then softmax_step: S(i) -> P(i) in place,
// with O's rescale factors (1 for variants without softmax). `band`: an interior tile of a
// has_kv_window variant that is not a full tile; its mask is applied by mask_band. `checked`:
// what a checked tile's logits go through before the softmax besides the variant's mask (the
// batch kernel's tree masks; nothing by default).
struct NoMoreMasks {
  template <typename S>
  __device__ __forceinline__ void operator()(S&) const {}
};
template <typename Variant, int TKV, bool kOneHead, typename Checked = NoMoreMasks>
__device__ __forceinline__ void logits_softmax_step(
    float (&s)[TKV / 2], const typename Variant::Params& vp, float qk_scale, int b,
    const int (&hq)[2], const int (&qi)[2], const bool (&row_ok)[2], int kv0, int kv_len,
    int kv_pos0, bool is_full, bool interior, float (&row_m)[2], float (&row_l)[2],
    float (&corr)[2], bool band = false, Checked&& checked = Checked{}) {
  if (interior) {
    apply_logits<Variant, TKV, false, kOneHead>(s, vp, qk_scale, b, hq, qi, row_ok, kv0, kv_len,
                                                kv_pos0, is_full);
    if constexpr (Variant::has_kv_window) {
      if (band) mask_band<Variant, TKV>(s, qi, kv0 + kv_pos0);
    }
  } else {
    apply_logits<Variant, TKV, true, kOneHead>(s, vp, qk_scale, b, hq, qi, row_ok, kv0, kv_len,
                                               kv_pos0, is_full);
    checked(s);
  }
  if constexpr (Variant::use_softmax) {
    softmax_step<TKV, folds_scale<Variant>()>(s, row_m, row_l, corr, qk_scale);
  } else {
    corr[0] = corr[1] = 1.f;
  }
}

template <int D>
__device__ __forceinline__ void rescale(float (&o)[D / 64][32], const float (&corr)[2]) {
  // most tiles keep every row's maximum (softmax_step is lazy): skip the 64 multiplies
  if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        o[blk][4 * j + 2 * hr] *= corr[hr];
        o[blk][4 * j + 2 * hr + 1] *= corr[hr];
      }
}

// P as 16-bit A fragments: k-step kk takes S's columns 16kk .. 16kk+15 (mma.sync's A layout).
template <typename DType, int TKV>
__device__ __forceinline__ void pack_p(u32 (&pa)[TKV / 16][4], const float (&s)[TKV / 2]) {
#pragma unroll
  for (int kk = 0; kk < TKV / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = common::pack2<DType>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// ---- row transforms (query/key/value/output hooks) on 128B-swizzled tiles ----------------------
// The hooks see a whole head vector (RoPE reads element (d + D/2) % D), so a tile row is
// transformed in place by one warp: every lane reads its D/32 results first, then writes. The
// tiles are the TMA/wgmma layout (wgmma.cuh's sw128_offset, ROWS rows per column block); the
// writes are generic-proxy stores, so whoever wrote must fence.proxy.async before a barrier that
// precedes the wgmma (async proxy) reading the tile.
__device__ __forceinline__ u16 lds_u16(u32 addr) {
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void sts_u16(u32 addr, u16 v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}

// Row `row` of a swizzled tile at shared address `tile`, as the transforms' `Vec`.
template <typename DType, int ROWS>
struct SwRow {
  u32 tile;
  int row;
  __device__ __forceinline__ float operator[](int d) const {
    return common::elem_to_float<DType>(lds_u16(tile + wg::sw128_offset(row, d, ROWS)));
  }
};

// f(row_view, d) -> float applied to every element of the row, by one warp.
template <typename DType, int D, int ROWS, typename F>
__device__ __forceinline__ void transform_sw_row(u32 tile, int row, F&& f) {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  const int lane = threadIdx.x & 31;
  const SwRow<DType, ROWS> view{tile, row};
  float vals[D / 32];
#pragma unroll
  for (int j = 0; j < D / 32; ++j) vals[j] = f(view, lane + 32 * j);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
    sts_u16(tile + wg::sw128_offset(row, lane + 32 * j, ROWS), common::float_to_elem<DType>(vals[j]));
  __syncwarp();
}

// Named barriers of the consumers (0 is __syncthreads; 1 and 2 are the ping-pong turns): one
// warpgroup's own four warps, after its warps wrote a tile one wgmma reads whole ...
__device__ __forceinline__ void warpgroup_sync(int me) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(3 + me) : "memory");
}
// ... and both consumer warpgroups, after they split a K/V tile's transform between them.
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 5, 256;\n" ::: "memory");
}

// hook(row_view, hq, qi, d) on this warp's 16 rows (16 * warp ..) of a warpgroup's 64-row tile,
// skipping the rows row_at(r, hq, qi) says are not real queries.
template <typename DType, int D, typename RowAt, typename Hook>
__device__ __forceinline__ void transform_warp_rows(u32 tile, RowAt&& row_at, Hook&& hook) {
  const int warp = (threadIdx.x >> 5) & 3;
#pragma unroll 1
  for (int r = 16 * warp; r < 16 * warp + 16; ++r) {
    int hq, qi;
    if (!row_at(r, hq, qi)) continue;
    transform_sw_row<DType, D, 64>(tile, r, [&](const SwRow<DType, 64>& v, int d) {
      return hook(v, hq, qi, d);
    });
  }
}

// QueryTransform on a consumer's 64 Q rows (its tile at sq_w), each warp 16 of them; row_at(r,
// hq, qi) says whether row r is a real query and gives its head and position. Ends with the
// fence and warpgroup barrier that publish the rows to the S wgmma.
template <typename Variant, typename DType, int D, typename RowAt>
__device__ __forceinline__ void transform_q(const typename Variant::Params& vp, u32 sq_w,
                                            int b, int me, RowAt&& row_at) {
  transform_warp_rows<DType, D>(sq_w, row_at, [&](const SwRow<DType, 64>& q, int hq, int qi,
                                                  int d) {
    return Variant::QueryTransform(vp, q, b, hq, qi, d);
  });
  wg::fence_proxy_async();
  warpgroup_sync(me);
}

// KeyTransform / ValueTransform on a landed K/V tile (keys kv0 .. kv0 + TKV - 1; the hooks see
// kv + kv_pos0): consumer `me` takes half of the rows, keys at or past kv_end are left alone
// (masked; the batch kernel zeroes those V rows). The caller fences and syncs the consumers.
template <typename Variant, typename DType, int D, int TKV>
__device__ __forceinline__ void transform_kv(const typename Variant::Params& vp, u32 k_tile,
                                             u32 v_tile, int me, int b, int h_kv, int kv0,
                                             int kv_end, int kv_pos0) {
  const int warp = (threadIdx.x >> 5) & 3;
#pragma unroll 1
  for (int r = me * (TKV / 2) + warp; r < (me + 1) * (TKV / 2); r += 4) {
    const int kv = kv0 + r;
    if (kv >= kv_end) break;
    if constexpr (Variant::has_key_transform)
      transform_sw_row<DType, D, TKV>(k_tile, r, [&](const SwRow<DType, TKV>& k, int d) {
        return Variant::KeyTransform(vp, k, b, h_kv, kv + kv_pos0, d);
      });
    if constexpr (Variant::has_value_transform)
      transform_sw_row<DType, D, TKV>(v_tile, r, [&](const SwRow<DType, TKV>& v, int d) {
        return Variant::ValueTransform(vp, v, b, h_kv, kv + kv_pos0, d);
      });
  }
}

// f(hr, blk, i, smem_addr) for each of this thread's accumulator elements of O: half-row hr,
// o[blk][i], and the element's address in a 64-row swizzled tile at `tile`.
template <int D, typename F>
__device__ __forceinline__ void for_each_acc(u32 tile, F&& f) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int r0 = 16 * warp + (lane >> 2);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          f(hr, blk, 4 * j + 2 * hr + e,
            tile + wg::sw128_offset(r0 + 8 * hr, 64 * blk + 8 * j + 2 * (lane & 3) + e, 64));
}

// OutputTransform on this warp's 16 rows of O (accumulator layout): O * inv is staged, rounded to
// DType as the FA2 kernels do, in the warpgroup's 64-row swizzled tile `stage` and transformed
// there row by row. row_at(r, hq, qi) as for transform_q, with r the row within the warpgroup.
// Only this warp touches its rows: __syncwarp orders it all.
template <typename Variant, typename DType, int D, typename RowAt>
__device__ __forceinline__ void stage_transform_o(const float (&o)[D / 64][32],
                                                  const float (&inv)[2],
                                                  const typename Variant::Params& vp,
                                                  u32 stage, int b, RowAt&& row_at) {
  for_each_acc<D>(stage, [&](int hr, int blk, int i, u32 addr) {
    sts_u16(addr, common::float_to_elem<DType>(o[blk][i] * inv[hr]));
  });
  __syncwarp();
  transform_warp_rows<DType, D>(stage, row_at, [&](const SwRow<DType, 64>& v, int hq, int qi,
                                                   int d) {
    return Variant::OutputTransform(vp, v, b, hq, qi, d);
  });
}

// This warp's transformed rows (stage_transform_o) straight from the staging tile to global
// memory, 16 bytes per lane: row_ptr(r) is the output row of warpgroup row r (null: not a real
// query). O's registers are dead by then, which keeps the D = 256 epilogue free of spills.
template <typename DType, int D, typename RowPtr>
__device__ __forceinline__ void store_staged_rows(u32 stage, RowPtr&& row_ptr) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
#pragma unroll 1
  for (int r = 16 * warp; r < 16 * warp + 16; ++r) {
    DType* row = row_ptr(r);
    if (row == nullptr) continue;
#pragma unroll
    for (int c = lane; c < kChunks; c += 32) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(stage + wg::sw128_offset(r, 8 * c, 64)) : "memory");
      *reinterpret_cast<uint4*>(row + 8 * c) = v;
    }
  }
}

// stage_transform_o, then the rows read back into o (accumulator layout); inv becomes 1.
template <typename Variant, typename DType, int D, typename RowAt>
__device__ __forceinline__ void transform_o(float (&o)[D / 64][32], float (&inv)[2],
                                            const typename Variant::Params& vp, u32 stage,
                                            int b, RowAt&& row_at) {
  stage_transform_o<Variant, DType, D>(o, inv, vp, stage, b, row_at);
  for_each_acc<D>(stage, [&](int, int blk, int i, u32 addr) {
    o[blk][i] = common::elem_to_float<DType>(lds_u16(addr));
  });
  inv[0] = inv[1] = 1.f;
}

// Where a consumer's K/V ring lives and how it is synchronized: the K and V tiles of stage st
// at k + st * kKvTileBytes / v + ...; "full" barriers the copies complete, "empty" barriers each
// consumer warp arrives on when it has read a stage. Tile t (counted across everything this
// CTA ran) sits in stage t % STAGES, phase (t / STAGES) & 1.
// form::paired() (codegen's paired=True): the dense kernel built to run as CTA pairs, launched by the host in
// clusters of two (fa3_prefill.cuh, tma.cuh; runtime/flex/gpu_flex.py compiles this form for the
// launches that pair): both CTAs of a pair run the same K/V tiles, each tile is read from L2
// once and multicast into both rings, so a stage is free only once the consumers of both CTAs
// released it -- each warp's release arrives on its own CTA's empty barrier and on the peer's.
// A compile-time form, not a runtime branch: the 24-register producer spilled with both loops.
__device__ __forceinline__ constexpr bool paired_ctas() { return form::paired(); }
// `count` arrivals on the ring barrier `bar`, in this CTA and, when paired, in the peer CTA;
// without a count, one (the plain local arrive, no count operand).
__device__ __forceinline__ void arrive_both(u32 bar, unsigned count) {
  tma::mbar_arrive_n(bar, count);
  if constexpr (paired_ctas()) tma::mbar_arrive_remote(bar, tma::cluster_rank() ^ 1u, count);
}
__device__ __forceinline__ void arrive_both(u32 bar) {
  tma::mbar_arrive(bar);
  if constexpr (paired_ctas()) tma::mbar_arrive_remote(bar, tma::cluster_rank() ^ 1u, 1);
}

// kSplit (the split ring; docs/fa3.md, "The split K/V ring and D = 256"): K and V of a stage
// land and are released on barriers of their own -- full = K landed, full_v = V landed,
// empty_k = every consumer warp's S read K, empty = every P V read V -- so a 2-stage ring
// refills K(t + 2) once S(t) completed, half an iteration before P(t) V(t) frees V, and
// S(t + 1) waits for K only. Without it (kSplit false) full and empty cover the whole stage
// and wait_v / release_k are nothing.
template <bool kSplit = false>
struct Ring {
  u32 k, v, full, empty;
  int tile_bytes, stages;
  u32 full_v = 0, empty_k = 0;  // kSplit: Smem::kSplitBar, + 8 * stages
  __device__ __forceinline__ void wait_full(int t) const {  // K (the whole stage unless kSplit)
    tma::mbar_wait(full + 8 * (t % stages), (t / stages) & 1);
  }
  __device__ __forceinline__ void wait_v(int t) const {
    if constexpr (kSplit) tma::mbar_wait(full_v + 8 * (t % stages), (t / stages) & 1);
  }
  __device__ __forceinline__ u32 empty_of(int t) const { return empty + 8 * (t % stages); }
  __device__ __forceinline__ void release_k(int t) const {  // this warp's S(t) completed
    if constexpr (kSplit) {
      if ((threadIdx.x & 31) == 0) arrive_both(empty_k + 8 * (t % stages));
    }
  }
  __device__ __forceinline__ void release(int t) const {  // this warp is done with tile t
    if ((threadIdx.x & 31) == 0) arrive_both(empty_of(t));
  }
  __device__ __forceinline__ u32 k_of(int t) const { return k + (t % stages) * tile_bytes; }
  __device__ __forceinline__ u32 v_of(int t) const { return v + (t % stages) * tile_bytes; }
};

// A ring stage this warp keeps after its last GEMM on it because the K half holds rows of an
// item's O until the TMA stores writing them out have read them (the dense kernel's bulk-store
// epilogue, fa3_prefill). settle() waits for those reads -- only the lane that issued the
// stores has a group to wait for -- and then makes `owe` of the stage's empty arrivals: 4 for
// the warp whose lane stored the warpgroup's rows, 0 for the warpgroup's other warps (the
// epilogue sets it). tile < 0: none held.
struct HeldStage {
  int tile = -1, owe = 1;
  template <typename R>
  __device__ __forceinline__ void settle(const R& ring) {
    if (tile >= 0) {
      tma::bulk_wait_read<0>();
      __syncwarp();
      if ((threadIdx.x & 31) == 0 && owe > 0) arrive_both(ring.empty_of(tile), owe);
    }
    tile = -1;  // (unconditionally: no value of it stays live through the next tile loop)
  }
};

// The mbarriers of the K/V ring (full[s]: the producer's expect_tx arrival; empty[s]: one
// arrival per consumer warp, of both CTAs when paired) and of the Q tile (q_full like full[s];
// q_empty one arrival per consumer thread, see QRelease), initialized by thread 0
// and published by the CTA's last __syncthreads -- and, when paired, by a cluster barrier each
// role passes first (fa3_prefill.cuh), since the peer's copies and arrivals reach them too:
// from there the roles only meet on mbarriers and named barriers.
// kSplit: also the split ring's full_v[s] and empty_k[s] at split_bar (Ring<true>).
// kReaders: the consumer warpgroups that read each stage (1 in the batch kernel's pair form).
template <int STAGES, bool kSplit = false, int kReaders = kConsumers>
__device__ __forceinline__ void init_barriers(u32 full_bar, u32 empty_bar,
                                              u32 q_full, u32 q_empty, u32 split_bar = 0) {
  if (threadIdx.x == 0) {
    constexpr unsigned ctas = paired_ctas() ? 2 : 1;
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      tma::mbar_init(full_bar + 8 * s, 1);
      tma::mbar_init(empty_bar + 8 * s, 4 * kReaders * ctas);
      if constexpr (kSplit) {
        tma::mbar_init(split_bar + 8 * s, 1);
        tma::mbar_init(split_bar + 8 * (STAGES + s), 4 * kConsumers * ctas);
      }
    }
    tma::mbar_init(q_full, 1);
    tma::mbar_init(q_empty, 128 * kConsumers);
    tma::fence_barrier_init();
  }
  __syncthreads();
}

// When a consumer warp hands its Q tile back to the producer (q_empty) for the next work item:
// once its last S GEMM of the item completed -- or, when the output transform stages O in the Q
// tile, once that store is done, fenced because the next Q's TMA (async proxy) writes over the
// warp's generic-proxy accesses. kNext false: the CTA runs one item, there is no next Q.
// Every consumer thread arrives (not one per warp): each thread's own reads of the dense
// kernel's item slot are then ordered before the producer rewrites it by that thread's arrival,
// which is what compute-sanitizer's racecheck can see (with one arrival per warp it reported
// the slot's rewrite as a WAR hazard against the other lanes' reads).
template <typename Variant, bool kNext>
struct QRelease {
  u32 q_empty;
  __device__ __forceinline__ void release() const {
    if constexpr (kNext) tma::mbar_arrive(q_empty);
  }
  __device__ __forceinline__ void last_s_done() const {
    if constexpr (!Variant::has_output_transform) release();
  }
  __device__ __forceinline__ void stored() const {
    if constexpr (Variant::has_output_transform) {
      wg::fence_proxy_async();
      __syncwarp();
      release();
    }
  }
};

// One consumer warpgroup's pass over n >= 1 K/V tiles (ring tiles t0 .. t0 + n - 1) for its 64
// query rows, accumulating O and the row statistics:
//   prologue   S(0), its softmax, P(0)
//   i = 1..n-1 issue S(i); rescale O by tile i-1's factors; issue P(i-1) V(i-1); wait for S(i)
//              only; logits(i) while the P V runs; wait for it, release tile i-1, softmax(i), P(i)
//   tail       rescale O, P(n-1) V(n-1), release tile n-1
// (O is zero until the first P V, so its first rescale -- by 0 or 1 -- changes nothing.)
// Callbacks: logits_softmax(s, i, corr) turns S(i) into P(i) (hooks, mask, online softmax) and
// returns O's rescale factors; landed(i, t) runs once tile i is in shared memory, before any
// GEMM reads it; last_s_done() runs once the last S completed (Q is free from then on).
// With a HeldStage (the dense kernel's bulk-store epilogue): the stage a previous item's O was
// staged in is released once this pass issued its first GEMM, and with hold_last the last
// tile's stage is not released here but held for this item's O.
// consume_tiles' iteration tag: which part of P(i-1) V(i-1) it issues (issue_pv's HALF)
template <int H>
struct Half {
  static constexpr int value = H;
};
template <typename DType, int D, int TKV, int kTrims = 0, bool kSplitRing = false,
          typename LogitsSoftmax, typename Landed, typename LastS>
__device__ __forceinline__ void consume_tiles(int n, int t0, u32 sq_w,
                                              const Ring<kSplitRing>& ring,
                                              const Turns& turns, float (&o)[D / 64][32],
                                              LogitsSoftmax&& logits_softmax, Landed&& landed,
                                              LastS&& last_s_done, HeldStage* held = nullptr,
                                              bool hold_last = false, int half0 = 0) {
  static_assert(kTrims == 0 || TKV == 128, "tile 0 is trimmed to a half of a 128-key tile");
  float s[TKV / 2];
  u32 pa[TKV / 16][4];
  float corr[2];
#pragma unroll
  for (int i = 0; i < TKV / 2; ++i) s[i] = 0.f;  // the first k-step overwrites; defined anyway
  // sq_w is the same in every lane of the warp but derived from threadIdx.x, so ptxas would keep
  // it (and Q's descriptors) in vector registers and move them into uniform ones (R2UR) at every
  // wgmma; read from lane 0 it is provably warp-uniform. (The ring's addresses already are.)
  const wg::DescWords q = wg::desc_words(__shfl_sync(0xffffffffu, sq_w, 0), 16, 1024);
  // consumer 0 issues first at every issue point (Turns: consumer 1's first pass of the CTA)
  if (turns.me == 1 && t0 == 0) turns.pass();
  // the trimmed halves this kernel has code for (kTrims bit 0: half 1, bit 1: half 2), and only
  // where P(0) V(0) is issued in the loop (n >= 2). Each form's GEMMs complete inside its own
  // branch: a wgmma in flight across the join would make ptxas serialize every wgmma (C7515).
  half0 = (n >= 2 && half0 > 0 && ((kTrims >> (half0 - 1)) & 1)) ? half0 : 0;

  ring.wait_full(t0);
  landed(0, t0);
  turns.wait_mine();
  auto s0_done = [&] {
    turns.pass();
    if (held != nullptr) held->settle(ring);  // (while S(0) runs)
    wg::wait<0>();
    wg::fence_operands(s);
    ring.release_k(t0);
  };
  if constexpr ((kTrims & 1) != 0) {
    if (half0 == 1) {
      wg::fence();  // (in each branch: ptxas wants it in the wgmma's block)
      issue_qk<DType, D, TKV, 1>(s, q, ring.k_of(t0));
      s0_done();
    }
  }
  if constexpr ((kTrims & 2) != 0) {
    if (half0 == 2) {
      wg::fence();  // (in each branch: ptxas wants it in the wgmma's block)
      issue_qk<DType, D, TKV, 2>(s, q, ring.k_of(t0));
      s0_done();
    }
  }
  if (half0 == 0) {
    wg::fence();  // (in each branch: ptxas wants it in the wgmma's block)
    if constexpr (kTrims != 0) {
      // as the two halves: one m64n128 chain here, next to the trimmed form's m64n64 one on
      // the same registers, made ptxas serialize every wgmma of causal D 64 (C7511)
      issue_qk<DType, D, TKV, 1>(s, q, ring.k_of(t0));
      issue_qk<DType, D, TKV, 2>(s, q, ring.k_of(t0));
    } else {
      issue_qk<DType, D, TKV>(s, q, ring.k_of(t0));
    }
    s0_done();
  }
  if (n == 1) last_s_done();
  logits_softmax(s, 0, corr);
  pack_p<DType, TKV>(pa, s);

  // iteration i; HALF (of P(i-1) V(i-1)): 0 the whole tile, 1 / 2 tile 0's kept half (i = 1)
  auto step = [&](int i, auto half) {
    constexpr int HALF = decltype(half)::value;
    const int t = t0 + i;
    ring.wait_full(t);
    landed(i, t);
    ring.wait_v(t - 1);  // (split ring: V(i-1) may land after K(i))
    wg::fence_operands(pa);
    wg::fence_operands(o);
    turns.wait_mine();
    wg::fence();  // pa and o were written by ordinary instructions
    issue_qk<DType, D, TKV>(s, q, ring.k_of(t));
    rescale<D>(o, corr);  // by tile i-1's factors, while S(i) runs; before P(i-1) V(i-1)
    wg::fence_operands(o);
    wg::fence();
    issue_pv<DType, D, TKV, HALF>(o, pa, ring.v_of(t - 1));
    turns.pass();
    wg::wait<1>();  // S(i) is done; P(i-1) V(i-1) may still run
    wg::fence_operands(s);
    ring.release_k(t);
    if (i == n - 1) last_s_done();
    logits_softmax(s, i, corr);
    wg::wait<0>();
    wg::fence_operands(o);
    ring.release(t - 1);
    pack_p<DType, TKV>(pa, s);
  };
  if constexpr ((kTrims & 1) != 0) {
    if (half0 == 1) step(1, Half<1>{});
  }
  if constexpr ((kTrims & 2) != 0) {
    if (half0 == 2) step(1, Half<2>{});
  }
  int i = half0 > 0 ? 2 : 1;
#pragma unroll 1
  for (; i < n; ++i) step(i, Half<0>{});

  rescale<D>(o, corr);
  ring.wait_v(t0 + n - 1);
  wg::fence_operands(pa);
  wg::fence_operands(o);
  turns.wait_mine();
  wg::fence();
  issue_pv<DType, D, TKV>(o, pa, ring.v_of(t0 + n - 1));
  // (consumer 1's pass: for the next item's S(0), or for Turns::finish)
  turns.pass();
  wg::wait<0>();
  wg::fence_operands(o);
  if (held != nullptr) held->tile = hold_last ? t0 + n - 1 : -1;
  if (held == nullptr || !hold_last) ring.release(t0 + n - 1);
}

// The batch kernel's pair form (fa3_batch.cuh): one warpgroup's pass over n >= 1 ring tiles t0,
// t0 + 2, ... -- the other consumer takes the tiles between -- each tile finished before the
// next: S, logits and softmax, P V, release. Not pipelined across tiles as consume_tiles is:
// there a stage stays held until the next tile's S is issued, which here would be two tiles
// later, and the two warpgroups' GEMMs overlap each other's softmax instead (docs/serving.md,
// "The FA3 pair form"). Callbacks as consume_tiles' (i counts this pass's tiles).
template <typename DType, int D, int TKV, typename LogitsSoftmax, typename Landed, typename LastS>
__device__ __forceinline__ void consume_alternate_tiles(int n, int t0, u32 sq_w, const Ring<>& ring,
                                                        float (&o)[D / 64][32],
                                                        LogitsSoftmax&& logits_softmax,
                                                        Landed&& landed, LastS&& last_s_done) {
  float s[TKV / 2];
  u32 pa[TKV / 16][4];
  float corr[2];
  const wg::DescWords q = wg::desc_words(__shfl_sync(0xffffffffu, sq_w, 0), 16, 1024);
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const int t = t0 + 2 * i;
    ring.wait_full(t);
    landed(i, t);
    wg::fence();
    issue_qk<DType, D, TKV>(s, q, ring.k_of(t));
    wg::wait<0>();
    wg::fence_operands(s);
    if (i == n - 1) last_s_done();
    logits_softmax(s, i, corr);
    rescale<D>(o, corr);
    pack_p<DType, TKV>(pa, s);
    wg::fence_operands(pa);
    wg::fence_operands(o);
    wg::fence();
    issue_pv<DType, D, TKV>(o, pa, ring.v_of(t));
    wg::wait<0>();
    wg::fence_operands(o);
    ring.release(t);
  }
}

}  // namespace fa3
}  // namespace attncc

#endif  // ATTNCC_FA3_CONSUMER_CUH
