// attncc FA3 prefill for sm_90a: TMA loads completed on mbarriers, wgmma tensor-core math, and
// warp specialization (issue 5; see bench/NOTES.md). The default on sm_90 where it applies.
// Self-contained: no #include. Comes after attncc_types.cuh, attention_params.cuh,
// fa2_common.cuh, wgmma.cuh and tma.cuh, and before the generated Variant_<name> functors' entry
// point (ATTNCC_FA3_ENTRY at the bottom).
//
// Roles. A work item is 128 query rows of one (batch, query head); a CTA runs items one after
// another (persistent, below) with three warpgroups:
//   producer (warpgroup 0): one thread issues TMA bulk copies -- each item's Q tile, then its
//     K/V tiles into a STAGES-deep ring. Stage s has a "full" mbarrier the copy engine completes
//     with the tile's bytes, and an "empty" mbarrier the consumers arrive on when they are done
//     reading it; the producer waits for "empty" before refilling. No CTA-wide barrier in the loop.
//     It keeps 24 registers (setmaxnreg) and hands the rest to the consumers (240; see below).
//   consumers (warpgroups 1 and 2): each owns 64 of the rows and runs the online-softmax loop
//     with wgmma: S = Q K^T (both operands in shared memory, K-major), logits hooks and softmax
//     in registers (exp2 domain), O += P V (P from registers, V N-major in shared memory).
//
// Overlap. Within a warpgroup the loop is software-pipelined: iteration i issues S(i) = Q K(i)^T,
// rescales O by tile i-1's factors while S(i) runs, issues O += P(i-1) V(i-1), and waits for
// S(i) only (wgmma groups retire in order) to run tile i's logits hooks while the tensor cores
// still work on P(i-1) V(i-1); then it waits for the P V and runs the softmax and packs P(i).
// (ptxas puts that P V wait ahead of the softmax whatever the source order, as long as the two
// share a basic block; a loop that kept the softmax above it measured 2-5 % slower on the
// H200, bench/NOTES.md stop 17 -- the softmax overlaps the other warpgroup's GEMMs instead.)
// The softmax is lazy (softmax_step), so O's 64 multiplies are skipped on most tiles. Across
// warpgroups (ping-pong, when ATTNCC_FA3_PINGPONG is 1), the two consumers take turns issuing
// their GEMMs through two named barriers, so one's softmax runs while the other's GEMMs own the
// tensor cores instead of both computing softmax at once. A stage is released once the P V that
// reads its V completed, one iteration after its K was read.
//
// Tiles: 128 query rows x TKV keys, TKV = 64 or 128 (S is one m64nTKVk16 wgmma per 16-wide
// k-step; 128 halves the waits and fences per FLOP but needs twice the shared memory per stage).
// Persistent grid: at most one CTA per SM. The items form a list in sections of heads whose K/V
// fit in L2 (so the tiles running at once share their loads there), longest first within a
// section (query blocks from the last one, then (batch, head)); CTA c runs item c, then claims
// the next unclaimed one from a global counter, so the CTA that is free first takes the longest
// item left and the CTAs end together (LPT). The next item's Q and first K/V tiles load while the
// consumers finish the current one's last GEMM and store it.
//
// Supported: head dims 64, 128 and 256, every variant hook: score_mod / mask_mod (LogitsTransform
// / LogitsMask) in registers; query, key and value transforms in place on the landed shared-memory
// tiles (Q once per item by its warpgroup; each K/V tile split between the two consumers, which
// then meet on a named barrier -- so ping-pong loses some overlap on such variants); the output
// transform on O staged through the consumer's Q tile. FlexAttention BlockMask lists (128-row
// query blocks, block_kv a multiple of TKV), GQA (one query head per item), bf16 and fp16.
//
// Layouts: every tile is stored 128B-swizzled in 64-column blocks (wgmma.cuh), which is exactly
// what a TMA box of [64 rows][64 elements] with the 128-byte swizzle writes; a column block of a
// 128-key tile is two boxes back to back (the swizzle repeats every 8 rows). q/k/v are read
// through tensor maps over [batch * heads * seq, head_dim] (contiguous tensors): rows past a
// sequence's end belong to the next head (or are zero past the tensor), and the logits of such
// keys and rows are masked, so their P is 0 and their output is never stored.
#ifndef ATTNCC_FA3_PREFILL_CUH
#define ATTNCC_FA3_PREFILL_CUH

// The N-major V descriptor's byte offsets, as tests/gpu/test_wgmma.py's probe measured them on
// the H200: any LBO (unused at N = 64), SBO = 1024.
#ifndef ATTNCC_FA3_V_LBO
#define ATTNCC_FA3_V_LBO 8192
#endif
#ifndef ATTNCC_FA3_V_SBO
#define ATTNCC_FA3_V_SBO 1024
#endif

#ifndef ATTNCC_FA3_PINGPONG
#define ATTNCC_FA3_PINGPONG 1
#endif
// Whether consumer 1 hands the turn back right after its last GEMM of an item (1) or only when
// it starts the next item (0, the A/B's old form): see Turns.
#ifndef ATTNCC_FA3_TAIL_PASS
#define ATTNCC_FA3_TAIL_PASS 1
#endif

namespace attncc {
namespace fa3 {

using fa2::fa2_u16;
using fa2::fa2_u32;

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
  // full[STAGES], empty[STAGES], q_full, q_empty
  static constexpr int kBar = kV + STAGES * kKvTileBytes;
  // the dense kernel's current work item, as the producer publishes it with its Q (int4)
  static constexpr int kItem = kBar + 8 * (2 * STAGES + 2);
  static constexpr int kBytes = kItem + 16 + 1024;  // + alignment slack
};

// Ping-pong turns of the two consumer warpgroups: consumer c waits on named barrier 1 + c (0 is
// __syncthreads) before it issues a group of GEMMs and then arrives on the other's barrier. A
// barrier completes when all 256 consumer threads reached it: 128 waiting + 128 arriving.
// Consumer 0 issues first at every issue point. Consumer 1 passes the turn once before its
// first GEMM of the CTA and then after each of its issue points, the item's last (the tail's
// P V) included: so consumer 0 issues the next item's S(0) as soon as its own epilogue is done,
// while consumer 1 still stores its rows (with ATTNCC_FA3_TAIL_PASS 0 consumer 1 passed at the
// start of each item instead, and consumer 0's S(0) waited for consumer 1's whole epilogue).
// An arrival is always consumed before the next one: between two passes consumer 1 waits for
// consumer 0's, which follows consumer 0's wait. The last item's tail pass is consumed by
// finish() (a barrier is not left half-arrived when the CTA exits).
struct Turns {
  int me;  // 0 or 1: which consumer warpgroup this thread belongs to
  __device__ __forceinline__ void wait_mine() const {
    if (ATTNCC_FA3_PINGPONG) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + me) : "memory");
  }
  __device__ __forceinline__ void pass() const {
    if (ATTNCC_FA3_PINGPONG) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - me) : "memory");
  }
  // After a consumer's last item, when it consumed ring tiles (issued GEMMs) at all.
  __device__ __forceinline__ void finish(int tiles_consumed) const {
    if (ATTNCC_FA3_TAIL_PASS && me == 0 && tiles_consumed > 0) wait_mine();
  }
};

// ---- consumer building blocks (one warpgroup, 64 rows; every function is warpgroup-wide) ------
// Accumulator layout (wgmma m64nN): warp w holds rows 16w + lane/4 and 16w + lane/4 + 8; for
// each 8-column block j, elements [4j, 4j+1] on the first row and [4j+2, 4j+3] on the second.

// Issue S = Q K^T for one K tile (D/16 k-steps, each a 32-byte step inside a 64-column block;
// the K operand's TKV rows are 8-row swizzle atoms 1024 bytes apart) and commit it as a group.
// kRebuildQ: make sq_w opaque to the optimizer, so that Q's D/16 64-bit descriptors are rebuilt
// at each tile (a few integer ops) rather than hoisted out of the tile loop, where they pin D/8
// registers across it and were what ptxas spilled first. With 64-bit descriptors built in vector
// registers it cost variants with a score_mod 1-7 % on the H200 (bench/NOTES.md, 2026-12-01), and
// rebuild_q() kept it to mask-only variants; with the uniform descriptor words below a rebuild is
// one add per k-step, and it is on for every variant (rebuild_q).
// Descriptors are 32-bit word pairs (wg::DescWords) from warp-uniform addresses, so they live in
// the uniform registers wgmma reads: a k-step is one UIADD3 per operand (before: an R2UR pair,
// IMAD.MOV and UMOVs, ~7 instructions per S k-step). Q comes as its descriptor words
// (consume_tiles builds them once); rebuilding is one add per k-step on the opaque low word. The
// rebuilt high word also takes K's address bits above 2^18 -- zero, but a per-tile value ptxas
// cannot prove zero: the word is then computed at each tile straight into the register the
// wgmmas read it from, rather than kept in a register of its own through the loop and copied
// there before every wgmma (UMOV; at D = 256 ptxas does that with a loop-invariant high word, 16
// a tile).
template <typename DType, int D, int TKV, bool kRebuildQ>
__device__ __forceinline__ void issue_qk(float (&s)[TKV / 2], wg::DescWords q, fa2_u32 sk_tile) {
  constexpr bool F16 = !fa2::ElemTraits<DType>::kIsBf16;
  if constexpr (kRebuildQ) {
    asm volatile("" : "+r"(q.lo), "+r"(q.hi));
    q.hi += sk_tile >> 18;
  }
  const wg::DescWords k0 = wg::desc_words(sk_tile, 16, 1024);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const fa2_u32 inner = (ks & 3) * 32;
    const wg::u64 a = wg::desc_u64(wg::desc_plus(q, (ks >> 2) * kBoxBytes + inner));
    const wg::u64 k = wg::desc_u64(wg::desc_plus(k0, (ks >> 2) * TKV * 128 + inner));
    if constexpr (TKV == 128) {
      wg::mma_ss_m64n128k16<F16>(s, a, k, ks > 0);
    } else {
      wg::mma_ss_m64n64k16<0, F16>(s, a, k, ks > 0);
    }
  }
  wg::commit();
}

// Issue O += P V for one V tile (P's A fragment for k-step kk is S's columns 16kk..16kk+15; V
// rows 16kk.. of column block blk are N-major, 8-row groups SBO = 1024 bytes apart) and commit.
template <typename DType, int D, int TKV>
__device__ __forceinline__ void issue_pv(float (&o)[D / 64][32], const fa2_u32 (&pa)[TKV / 16][4],
                                         fa2_u32 sv_tile) {
  constexpr bool F16 = !fa2::ElemTraits<DType>::kIsBf16;
  const wg::DescWords v0 = wg::desc_words(sv_tile, ATTNCC_FA3_V_LBO, ATTNCC_FA3_V_SBO);
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int kk = 0; kk < TKV / 16; ++kk) {
      wg::mma_rs_m64n64k16<1, F16>(
          o[blk], pa[kk], wg::desc_u64(wg::desc_plus(v0, blk * TKV * 128 + kk * 16 * 128)), 1);
    }
  wg::commit();
}

// ATTNCC_FA3_LOW_PRESSURE: the runtime compiles each FA3 kernel as it is first and, only if ptxas
// spills, again with this defined to 1 (runtime/gpu_flex.py compile_fa3). The low-pressure form
// (Q descriptors rebuilt per tile, the mask evaluated unconditionally, a score_mod's logits
// key-outer) takes document_causal and relative_bias to 0 spills, but as the only form it cost
// softcap/alibi + causal 2-7 % at S = 2048 (H200 A/B, bench/NOTES.md 2026-12-01).
#ifndef ATTNCC_FA3_LOW_PRESSURE
#define ATTNCC_FA3_LOW_PRESSURE 0
#endif

// issue_qk's kRebuildQ for a variant: every variant since the descriptors became uniform words
// (H200, same process, two A/Bs: alibi + causal 0-8 % faster, softcap + causal within +-2 %);
// before, only variants without a score_mod and the low-pressure form, which
// ATTNCC_FA3_REBUILD_Q_ALL 0 restores for an A/B.
#ifndef ATTNCC_FA3_REBUILD_Q_ALL
#define ATTNCC_FA3_REBUILD_Q_ALL 1
#endif
template <typename Variant>
__device__ __forceinline__ constexpr bool rebuild_q() {
  return ATTNCC_FA3_REBUILD_Q_ALL || !Variant::has_logits_transform || ATTNCC_FA3_LOW_PRESSURE;
}

// Whether softmax_step applies the logits scale itself (softmax variants without a score_mod,
// whose logits are just S * scale): apply_logits then leaves S unscaled and each element's
// scale and max subtraction are one FFMA in front of its exp2 -- 64 multiplies a tile fewer.
// Not in the low-pressure form (document_mask D 64 spilled 24 bytes there with it).
template <typename Variant>
__device__ __forceinline__ constexpr bool folds_scale() {
  return Variant::use_softmax && !Variant::has_logits_transform && !ATTNCC_FA3_LOW_PRESSURE;
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
  const float masked = kSoftmax ? fa2::neg_inf() : 0.f;
  const int lane = threadIdx.x & 31;
  // kOneHead (the dense kernel): both rows are head hq[0], at positions qi[0] and qi[0] + 8.
  // Spelled so in the score_mod loop, a per-head load (ALiBi's slope) has one address and
  // kv - q folds to a constant offset per element: on the H200 alibi + causal +6 % / +8 % at
  // S = 2048 / 8192 against the per-row spelling, softcap +-2 % (same process, bitwise-equal
  // outputs; bench/NOTES.md, stop 15). The lambda loop keeps the per-row spelling.
  auto head = [&](int hr) { return kOneHead ? hq[0] : hq[hr]; };
  auto qpos = [&](int hr) { return kOneHead ? qi[0] + 8 * hr : qi[hr]; };
  // Two ways to write the same loop, each where the H200 measured it faster (bench/NOTES.md,
  // 2026-12-01; ptxas schedules and allocates them differently): a variant with a score_mod
  // runs the plain nested loop below (the lambda cost softcap / alibi + causal up to 7 % at
  // S = 2048); mask-only variants, and every variant's low-pressure form, run the lambda (the
  // sliding window +10 %).
  if constexpr (Variant::has_logits_transform && !ATTNCC_FA3_LOW_PRESSURE) {
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
          if constexpr (ATTNCC_FA3_LOW_PRESSURE) {
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
    for (int i = 0; i < TKV / 2; ++i) s[i] = s[i] == fa2::neg_inf() ? s[i] : s[i] * scale;
    scale = 1.f;
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    // the tile's row maximum as a tree (depth log2(TKV / 4)) rather than one dependent chain
    float v[TKV / 8];
#pragma unroll
    for (int j = 0; j < TKV / 8; ++j) v[j] = fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]);
#pragma unroll
    for (int step = 1; step < TKV / 8; step *= 2)
#pragma unroll
      for (int j = 0; j + step < TKV / 8; j += 2 * step) v[j] = fmaxf(v[j], v[j + step]);
    float mx = fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(mx * scale, row_m[hr]);  // (-inf * scale = -inf)
    const float m_new = mx > row_m[hr] + kLazy ? mx : row_m[hr];
    const float m_use = (m_new == fa2::neg_inf()) ? 0.f : m_new;  // a fully masked row so far
    corr[hr] = fa2::fast_exp2(row_m[hr] - m_use);  // 1 while the maximum stays
    row_m[hr] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = fa2::fast_exp2(fmaf(s[4 * j + 2 * hr + e], scale, -m_use));
        s[4 * j + 2 * hr + e] = pe;
        sum += pe;
      }
    row_l[hr] = row_l[hr] * corr[hr] + sum;
  }
}

// apply_logits (CHECKED unless the tile is interior) then softmax_step: S(i) -> P(i) in place,
// with O's rescale factors (1 for variants without softmax).
template <typename Variant, int TKV, bool kOneHead>
__device__ __forceinline__ void logits_softmax_step(
    float (&s)[TKV / 2], const typename Variant::Params& vp, float qk_scale, int b,
    const int (&hq)[2], const int (&qi)[2], const bool (&row_ok)[2], int kv0, int kv_len,
    int kv_pos0, bool is_full, bool interior, float (&row_m)[2], float (&row_l)[2],
    float (&corr)[2]) {
  if (interior) {
    apply_logits<Variant, TKV, false, kOneHead>(s, vp, qk_scale, b, hq, qi, row_ok, kv0, kv_len,
                                                kv_pos0, is_full);
  } else {
    apply_logits<Variant, TKV, true, kOneHead>(s, vp, qk_scale, b, hq, qi, row_ok, kv0, kv_len,
                                               kv_pos0, is_full);
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
__device__ __forceinline__ void pack_p(fa2_u32 (&pa)[TKV / 16][4], const float (&s)[TKV / 2]) {
#pragma unroll
  for (int kk = 0; kk < TKV / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = fa2::pack2<DType>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
}

// ---- row transforms (query/key/value/output hooks) on 128B-swizzled tiles ----------------------
// The hooks see a whole head vector (RoPE reads element (d + D/2) % D), so a tile row is
// transformed in place by one warp: every lane reads its D/32 results first, then writes. The
// tiles are the TMA/wgmma layout (wgmma.cuh's sw128_offset, ROWS rows per column block); the
// writes are generic-proxy stores, so whoever wrote must fence.proxy.async before a barrier that
// precedes the wgmma (async proxy) reading the tile.
__device__ __forceinline__ fa2_u16 lds_u16(fa2_u32 addr) {
  fa2_u16 v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void sts_u16(fa2_u32 addr, fa2_u16 v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}

// Row `row` of a swizzled tile at shared address `tile`, as the transforms' `Vec`.
template <typename DType, int ROWS>
struct SwRow {
  fa2_u32 tile;
  int row;
  __device__ __forceinline__ float operator[](int d) const {
    return fa2::elem_to_float<DType>(lds_u16(tile + wg::sw128_offset(row, d, ROWS)));
  }
};

// f(row_view, d) -> float applied to every element of the row, by one warp.
template <typename DType, int D, int ROWS, typename F>
__device__ __forceinline__ void transform_sw_row(fa2_u32 tile, int row, F&& f) {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  const int lane = threadIdx.x & 31;
  const SwRow<DType, ROWS> view{tile, row};
  float vals[D / 32];
#pragma unroll
  for (int j = 0; j < D / 32; ++j) vals[j] = f(view, lane + 32 * j);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
    sts_u16(tile + wg::sw128_offset(row, lane + 32 * j, ROWS), fa2::float_to_elem<DType>(vals[j]));
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
__device__ __forceinline__ void transform_warp_rows(fa2_u32 tile, RowAt&& row_at, Hook&& hook) {
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
__device__ __forceinline__ void transform_q(const typename Variant::Params& vp, fa2_u32 sq_w,
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
__device__ __forceinline__ void transform_kv(const typename Variant::Params& vp, fa2_u32 k_tile,
                                             fa2_u32 v_tile, int me, int b, int h_kv, int kv0,
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
__device__ __forceinline__ void for_each_acc(fa2_u32 tile, F&& f) {
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
                                                  fa2_u32 stage, int b, RowAt&& row_at) {
  for_each_acc<D>(stage, [&](int hr, int blk, int i, fa2_u32 addr) {
    sts_u16(addr, fa2::float_to_elem<DType>(o[blk][i] * inv[hr]));
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
__device__ __forceinline__ void store_staged_rows(fa2_u32 stage, RowPtr&& row_ptr) {
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
                                            const typename Variant::Params& vp, fa2_u32 stage,
                                            int b, RowAt&& row_at) {
  stage_transform_o<Variant, DType, D>(o, inv, vp, stage, b, row_at);
  for_each_acc<D>(stage, [&](int, int blk, int i, fa2_u32 addr) {
    o[blk][i] = fa2::elem_to_float<DType>(lds_u16(addr));
  });
  inv[0] = inv[1] = 1.f;
}

// Where a consumer's K/V ring lives and how it is synchronized: the K and V tiles of stage st
// at k + st * kKvTileBytes / v + ...; "full" barriers the copies complete, "empty" barriers each
// consumer warp arrives on when it has read a stage. Tile t (counted across everything this
// CTA ran) sits in stage t % STAGES, phase (t / STAGES) & 1.
struct Ring {
  fa2_u32 k, v, full, empty;
  int tile_bytes, stages;
  __device__ __forceinline__ void wait_full(int t) const {
    tma::mbar_wait(full + 8 * (t % stages), (t / stages) & 1);
  }
  __device__ __forceinline__ fa2_u32 empty_of(int t) const { return empty + 8 * (t % stages); }
  __device__ __forceinline__ void release(int t) const {  // this warp is done with tile t
    if ((threadIdx.x & 31) == 0) tma::mbar_arrive(empty_of(t));
  }
  __device__ __forceinline__ fa2_u32 k_of(int t) const { return k + (t % stages) * tile_bytes; }
  __device__ __forceinline__ fa2_u32 v_of(int t) const { return v + (t % stages) * tile_bytes; }
};

// A ring stage this warp keeps after its last GEMM on it because the K half holds rows of an
// item's O until the bulk copies writing them out have read them (the dense kernel's bulk-store
// epilogue, fa3_prefill). settle() waits for those reads -- only the lanes that issued copies
// have a group to wait for -- and then makes `owe` of the stage's empty arrivals: 1 when the warp
// copied its own rows, 4 for a warpgroup whose one copy this warp issued, 0 for the warpgroup's
// other warps. tile < 0: none held.
struct HeldStage {
  int tile = -1, owe = 1;
  __device__ __forceinline__ void settle(const Ring& ring) {
    if (tile >= 0) {
      tma::bulk_wait_read<0>();
      __syncwarp();
      if ((threadIdx.x & 31) == 0 && owe > 0)
        tma::mbar_arrive_n(ring.empty_of(tile), owe);
    }
    tile = -1;  // (unconditionally: no value of it stays live through the next tile loop)
  }
};

// The mbarriers of the K/V ring (full[s]: the producer's expect_tx arrival; empty[s]: one
// arrival per consumer warp) and of the Q tile (q_full like full[s]; q_empty one arrival per
// consumer thread, see QRelease), initialized by thread 0
// and published by the CTA's last __syncthreads: from there the roles only meet on mbarriers and
// named barriers.
template <int STAGES>
__device__ __forceinline__ void init_barriers(fa2_u32 full_bar, fa2_u32 empty_bar,
                                              fa2_u32 q_full, fa2_u32 q_empty) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      tma::mbar_init(full_bar + 8 * s, 1);
      tma::mbar_init(empty_bar + 8 * s, 4 * kConsumers);
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
  fa2_u32 q_empty;
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
template <typename DType, int D, int TKV, bool kRebuildQ, typename LogitsSoftmax,
          typename Landed, typename LastS>
__device__ __forceinline__ void consume_tiles(int n, int t0, fa2_u32 sq_w, const Ring& ring,
                                              const Turns& turns, float (&o)[D / 64][32],
                                              LogitsSoftmax&& logits_softmax, Landed&& landed,
                                              LastS&& last_s_done, HeldStage* held = nullptr,
                                              bool hold_last = false) {
  float s[TKV / 2];
  fa2_u32 pa[TKV / 16][4];
  float corr[2];
#pragma unroll
  for (int i = 0; i < TKV / 2; ++i) s[i] = 0.f;  // the first k-step overwrites; defined anyway
  // sq_w is the same in every lane of the warp but derived from threadIdx.x, so ptxas would keep
  // it (and Q's descriptors) in vector registers and move them into uniform ones (R2UR) at every
  // wgmma; read from lane 0 it is provably warp-uniform. (The ring's addresses already are.)
  const wg::DescWords q = wg::desc_words(__shfl_sync(0xffffffffu, sq_w, 0), 16, 1024);
  // consumer 0 issues first at every issue point (Turns: consumer 1's first pass of the CTA)
  if (turns.me == 1 && (t0 == 0 || !ATTNCC_FA3_TAIL_PASS)) turns.pass();

  ring.wait_full(t0);
  landed(0, t0);
  turns.wait_mine();
  wg::fence();
  issue_qk<DType, D, TKV, kRebuildQ>(s, q, ring.k_of(t0));
  turns.pass();
  if (held != nullptr) held->settle(ring);  // (while S(0) runs)
  wg::wait<0>();
  wg::fence_operands(s);
  if (n == 1) last_s_done();
  logits_softmax(s, 0, corr);
  pack_p<DType, TKV>(pa, s);

#pragma unroll 1
  for (int i = 1; i < n; ++i) {
    const int t = t0 + i;
    ring.wait_full(t);
    landed(i, t);
    wg::fence_operands(pa);
    wg::fence_operands(o);
    turns.wait_mine();
    wg::fence();  // pa and o were written by ordinary instructions
    issue_qk<DType, D, TKV, kRebuildQ>(s, q, ring.k_of(t));
    rescale<D>(o, corr);  // by tile i-1's factors, while S(i) runs; before P(i-1) V(i-1)
    wg::fence_operands(o);
    wg::fence();
    issue_pv<DType, D, TKV>(o, pa, ring.v_of(t - 1));
    turns.pass();
    wg::wait<1>();  // S(i) is done; P(i-1) V(i-1) may still run
    wg::fence_operands(s);
    if (i == n - 1) last_s_done();
    logits_softmax(s, i, corr);
    wg::wait<0>();
    wg::fence_operands(o);
    ring.release(t - 1);
    pack_p<DType, TKV>(pa, s);
  }

  rescale<D>(o, corr);
  wg::fence_operands(pa);
  wg::fence_operands(o);
  turns.wait_mine();
  wg::fence();
  issue_pv<DType, D, TKV>(o, pa, ring.v_of(t0 + n - 1));
  // (consumer 1's pass: for the next item's S(0), or for Turns::finish)
  if (turns.me == 0 || ATTNCC_FA3_TAIL_PASS) turns.pass();
  wg::wait<0>();
  wg::fence_operands(o);
  if (held != nullptr) held->tile = hold_last ? t0 + n - 1 : -1;
  if (held == nullptr || !hold_last) ring.release(t0 + n - 1);
}

// Store this thread's half-row hr of O (its 2 x D/8 columns), times inv, as 16-bit pairs.
template <typename DType, int D>
__device__ __forceinline__ void store_row(DType* row, const float (&o)[D / 64][32], int hr,
                                          float inv) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = 64 * blk + 8 * j + 2 * (lane & 3);
      *reinterpret_cast<fa2_u32*>(row + col) =
          fa2::pack2<DType>(o[blk][4 * j + 2 * hr] * inv, o[blk][4 * j + 2 * hr + 1] * inv);
    }
}

// Four 16-bit pairs transposed across a quad: on entry lane t holds v[i], its pair of chunk i of
// a group of four 8-column chunks (columns 8i + 2t, +1); on return it holds chunk t whole, lane
// l's pair in word l. Two shfl.xor rounds; every lane of the warp must call it.
__device__ __forceinline__ uint4 quad_transpose(const fa2_u32 (&v)[4]) {
  const int t = threadIdx.x & 3;
  const bool hi2 = t & 2, hi1 = t & 1;
  // round 1 (lanes t, t^2): keep the chunks with bit 1 equal to t's, trade the others
  const fa2_u32 a0 = hi2 ? v[2] : v[0], a1 = hi2 ? v[3] : v[1];
  const fa2_u32 b0 = __shfl_xor_sync(0xffffffffu, hi2 ? v[0] : v[2], 2);
  const fa2_u32 b1 = __shfl_xor_sync(0xffffffffu, hi2 ? v[1] : v[3], 2);
  // round 2 (lanes t, t^1): chunk t from lanes t, t^2 is in hand, from t^1, t^3 traded
  const fa2_u32 own = hi1 ? a1 : a0, far = hi1 ? b1 : b0;  // pairs of lanes t, t^2
  const fa2_u32 n1 = __shfl_xor_sync(0xffffffffu, hi1 ? a0 : a1, 1);  // of lane t^1
  const fa2_u32 n3 = __shfl_xor_sync(0xffffffffu, hi1 ? b0 : b1, 1);  // of lane t^3
  // w[l] = lane l's pair of chunk t
  const fa2_u32 w_t = own, w_t1 = n1, w_t2 = far, w_t3 = n3;
  const fa2_u32 w0 = t == 0 ? w_t : t == 1 ? w_t1 : t == 2 ? w_t2 : w_t3;
  const fa2_u32 w1 = t == 0 ? w_t1 : t == 1 ? w_t : t == 2 ? w_t3 : w_t2;
  const fa2_u32 w2 = t == 0 ? w_t2 : t == 1 ? w_t3 : t == 2 ? w_t : w_t1;
  const fa2_u32 w3 = t == 0 ? w_t3 : t == 1 ? w_t2 : t == 2 ? w_t1 : w_t;
  return make_uint4(w0, w1, w2, w3);
}

// This lane's 16-byte chunk of half-row hr, column block blk, chunk group g of O times inv
// (columns 64 blk + 8 (4 g + t) .. + 7, t = lane & 3; quad_transpose, so every lane calls it).
template <typename DType, int D>
__device__ __forceinline__ uint4 o_chunk(const float (&o)[D / 64][32], float inv, int hr, int blk,
                                         int g) {
  fa2_u32 v[4];  // v[i]: this lane's pair of chunk 4g + i
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int j = 4 * g + i;
    v[i] = fa2::pack2<DType>(o[blk][4 * j + 2 * hr] * inv, o[blk][4 * j + 2 * hr + 1] * inv);
  }
  return quad_transpose(v);
}

// Store this thread's rows of O (half-row hr at row_ptr(hr), null: not a real query), times
// inv, as 16-byte chunks: the four lanes of a quad hold 8 columns of a row in 4-byte pairs, so
// four chunks at a time are transposed across the quad (two shfl.xor rounds) and lane t stores
// chunk t -- a quarter of store_row's store instructions, each writing whole 32-byte sectors.
// Every lane of the warp must call it (shuffles); row pointers must be 16-byte aligned
// (v4_aligned). On the H200 (same process, bitwise-equal outputs) it took 2-5 % off S = 2048
// (causal, sliding window, alibi, full) and 0-2 % at 8192 and 16384: with no O stores at all a
// diagnostic build ran causal and the sliding window at S = 2048 ~10 % faster, so the epilogue's
// 4-byte stores were a real share of a short item (bench/NOTES.md, 2026-12-01).
// ATTNCC_FA3_STORE_V4 0 keeps store_row.
#ifndef ATTNCC_FA3_STORE_V4
#define ATTNCC_FA3_STORE_V4 1
#endif
// ATTNCC_FA3_BULK_STORE 1: the dense kernel stages O in shared memory and writes it with bulk
// copies where it can (fa3_prefill's kBulkO); 0: store_rows_v4 from registers.
#ifndef ATTNCC_FA3_BULK_STORE
#define ATTNCC_FA3_BULK_STORE 1
#endif
// ATTNCC_FA3_TMA_STORE_O 1: kBulkO stages O swizzled with stmatrix (stage_rows_sw) and writes it
// with TMA tensor stores through O's map; 0: unswizzled rows (stage_rows_v4) and plain bulk
// copies, one per warpgroup when O's rows are contiguous, else one per row.
#ifndef ATTNCC_FA3_TMA_STORE_O
#define ATTNCC_FA3_TMA_STORE_O 1
#endif
template <typename DType, int D, typename RowPtr>
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
        if (row != nullptr) *reinterpret_cast<uint4*>(row + 64 * blk + 8 * (4 * g + t)) = c;
      }
  }
}

// This warp's 16 rows of O times inv, as 16-bit values into shared memory at `rows` (a
// warpgroup's 64 rows of 2 D bytes each, unswizzled: row r at rows + 2 D r, so that the rows
// are O's bytes as global memory holds them and a bulk copy -- of all 64 rows, or of one --
// writes them out as they are). A 16-byte store is served 8 lanes at a time, i.e. two quads,
// two rows; rows 2 D bytes apart would meet in the same banks, so odd rows store their chunk
// groups in the other order: row a writes bytes 0-63 of a 128-byte block while row a + 1 writes
// 64-127 -- all 32 banks, no conflict.
template <typename DType, int D>
__device__ __forceinline__ void stage_rows_v4(const float (&o)[D / 64][32], const float (&inv)[2],
                                              fa2_u32 rows) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  const int odd = (lane >> 2) & 1;
  const int warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const fa2_u32 row = rows + (16 * warp + (lane >> 2) + 8 * hr) * (2 * D);
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk) {
      const uint4 c0 = o_chunk<DType, D>(o, inv[hr], hr, blk, 0);
      const uint4 c1 = o_chunk<DType, D>(o, inv[hr], hr, blk, 1);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int g = k ^ odd;
        const uint4 c = g ? c1 : c0;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         row + 2 * (64 * blk + 8 * (4 * g + t))),
                     "r"(c.x), "r"(c.y), "r"(c.z), "r"(c.w)
                     : "memory");
      }
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
// conflict-free -- against stage_rows_v4's unswizzled rows, which need the quad transposes
// (shuffles) to write whole 16-byte chunks: D/16 stores here instead of 2 D/32 shuffle rounds.
template <typename DType, int D>
__device__ __forceinline__ void stage_rows_sw(const float (&o)[D / 64][32], const float (&inv)[2],
                                              fa2_u32 tile) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  const int i = lane >> 3;                                   // the matrix this lane addresses
  const int row = 16 * warp + 8 * (i & 1) + (lane & 7);      // its row of the warpgroup's 64
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    const int blk = k >> 2, j = (2 * k) & 7;  // 8-column blocks j and j + 1 of column block blk
    const fa2_u32 r0 = fa2::pack2<DType>(o[blk][4 * j] * inv[0], o[blk][4 * j + 1] * inv[0]);
    const fa2_u32 r1 = fa2::pack2<DType>(o[blk][4 * j + 2] * inv[1], o[blk][4 * j + 3] * inv[1]);
    const fa2_u32 r2 = fa2::pack2<DType>(o[blk][4 * j + 4] * inv[0], o[blk][4 * j + 5] * inv[0]);
    const fa2_u32 r3 = fa2::pack2<DType>(o[blk][4 * j + 6] * inv[1], o[blk][4 * j + 7] * inv[1]);
    const fa2_u32 addr = tile + wg::sw128_offset(row, 16 * k + 8 * (i >> 1), 64);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  }
}

// Whether O at `o` with element strides whose OR is `strides` takes store_rows_v4.
__device__ __forceinline__ bool v4_aligned(const void* o, long long strides) {
  return ATTNCC_FA3_STORE_V4 && (strides & 7) == 0 &&
         (reinterpret_cast<unsigned long long>(o) & 15) == 0;
}

// The row's final softmax statistics: 1 / l (0 for a fully masked row) and the natural-log LSE
// (-inf for a fully masked row). Per-thread partial sums are reduced across the quad here.
template <bool kSoftmax>
__device__ __forceinline__ void finish_row(float m, float l, float& inv, float& lse) {
  inv = 1.f;
  lse = 0.f;
  if constexpr (kSoftmax) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv = l > 0.f ? 1.f / l : 0.f;
    lse = l > 0.f ? (m + __log2f(l)) * kLn2 : fa2::neg_inf();
  }
}

// One work item of the dense kernel: a 128-row query tile of one (batch, head).
struct DenseItem {
  int b, hq, h_kv, q0;
};

// Items are numbered in sections of heads whose K and V together fit in this much of the L2
// (50 MB on the H100 / H200): within a section, query blocks from the last one, then head. The
// CTAs then run many query blocks of a few heads at a time, which read the same K/V tiles at
// about the same time, so most tile loads hit in L2. Numbered over all heads at once, a round at
// S = 2048 (8 x 16 heads) read 128 heads' K/V once each -- about 128 MB a round from HBM, which
// made the kernel memory-bound there (bench/NOTES.md, 2026-12-01). The sections need the dynamic
// order below when item lengths differ (a block mask): with snake rounds they broke the rounds'
// balance (causal -4 % at S = 16384), so then there is one section. 0: no sections.
#ifndef ATTNCC_FA3_L2_SECTION_BYTES
#define ATTNCC_FA3_L2_SECTION_BYTES (24 << 20)
#endif

// ATTNCC_FA3_DYNAMIC (the default): instead of snake rounds, a CTA's first item is blockIdx.x
// and every later one the next unclaimed item of the list, from a counter in global memory (a
// fresh zero for each launch: AttentionParams::item_counter), so the CTA that finishes first
// takes the next longest item whatever the lengths, and the L2 sections apply with a block mask
// too. Same process on the H200, against snake rounds over all heads: full +11 % at S = 2048
// and 4096, causal +10 % and sliding window +9 % at 2048, +0-2 % at 16384.
#ifndef ATTNCC_FA3_DYNAMIC
#define ATTNCC_FA3_DYNAMIC 1
#endif

// Item w of B * Hq * nqb: sections of sec head slots each (a slot is b * Hq + hq; whole GQA
// groups), the first taking the remainder; within the section [s0, s0 + n), item r is query block
// nqb - 1 - r / n of slot s0 + r % n -- longest first within the section, so the list ends with
// the shortest items of a full section.
// The remainder goes first because the dynamic order is longest-processing-time first only if
// the list's tail is short items: a remainder section at the end (8 heads of 24 at S = 2048, one
// of 3 at 16384, B * S = 16384 x 16 heads) restarted the list with its longest query blocks
// while the grid was finishing, and an H200 trace of causal S = 2048 showed the CTAs' last items
// at 13-16 tiles and their spans spread over 447-491 K cycles (max / mean ~1.045). A simulation
// of the claims (bench/NOTES.md, stop 19) gives makespan / mean 1.04-1.05 at every S with the
// remainder last and 1.00-1.01 with it first. ATTNCC_FA3_REMAINDER_FIRST 0: last (the A/B).
#ifndef ATTNCC_FA3_REMAINDER_FIRST
#define ATTNCC_FA3_REMAINDER_FIRST 1
#endif
template <int D>
__device__ __forceinline__ DenseItem dense_item(const attncc::AttentionParams& p, int w, int nqb) {
  const int heads = p.batch * p.num_q_heads;
  const int group = p.num_q_heads / p.num_kv_heads;
  int sec = heads;
  if (ATTNCC_FA3_L2_SECTION_BYTES > 0 && (p.kv_num_blocks == nullptr || ATTNCC_FA3_DYNAMIC)) {
    // in KiB and 32 bits (a 64-bit division is a call): K and V of one KV head, 16-bit
    const unsigned kv_head_kib = max(1u, ((unsigned)p.kv_len >> 2) * (D / 64));
    const unsigned kv_heads = max(1u, (unsigned)(ATTNCC_FA3_L2_SECTION_BYTES >> 10) / kv_head_kib);
    sec = (int)min((unsigned)heads, kv_heads * group);
  }
  int s0, n;
  const int first = heads - (heads - 1) / sec * sec;  // the remainder section: 1 .. sec slots
  if (!ATTNCC_FA3_REMAINDER_FIRST) {
    s0 = w / (sec * nqb) * sec;
    n = min(sec, heads - s0);
  } else if (w < first * nqb) {
    s0 = 0;
    n = first;
  } else {
    s0 = first + (w - first * nqb) / (sec * nqb) * sec;
    n = sec;
  }
  const int r = w - s0 * nqb;
  const int slot = s0 + r % n, qb = nqb - 1 - r / n;
  const int hq = slot % p.num_q_heads;
  return {slot / p.num_q_heads, hq, hq / group, qb * kTQ};
}

// The item's K/V tiles: every tile of [0, kv_len), or the block mask's lists for its query block.
template <int TKV>
__device__ __forceinline__ fa2::TileList item_tiles(const attncc::AttentionParams& p,
                                                    const DenseItem& it) {
  fa2::TileList tiles;
  if (p.kv_num_blocks == nullptr) {
    tiles = fa2::TileList{nullptr, nullptr, (p.kv_len + TKV - 1) / TKV, 0, 1, TKV, TKV, 0};
    tiles.count = tiles.n_partial;
    return tiles;
  }
  const int qb = it.q0 / p.block_q;
  const attncc::i64 nb = it.b * p.bm_stride_b + it.hq * p.bm_stride_h + qb;
  const attncc::i64 ix = it.b * p.bi_stride_b + it.hq * p.bi_stride_h + qb * p.bi_stride_q;
  tiles.partial = p.kv_indices + ix;
  tiles.n_partial = __ldg(p.kv_num_blocks + nb);
  tiles.full = p.full_kv_num_blocks != nullptr ? p.full_kv_indices + ix : nullptr;
  tiles.n_full = p.full_kv_num_blocks != nullptr ? __ldg(p.full_kv_num_blocks + nb) : 0;
  tiles.sub = p.block_kv / TKV;
  tiles.block_kv = p.block_kv;
  tiles.tile = TKV;
  tiles.count = (tiles.n_partial + tiles.n_full) * tiles.sub;
  return tiles;
}

// Whether the dense kernel is persistent at head dim D: at D = 256 the consumers' 240 registers
// hold 128 O accumulators and have none left for the item loop's state (sliding-window and
// prefix-LM masks spilled 8 bytes), so there each CTA runs one item (grid = the items).
// runtime/gpu_flex.py mirrors this (FA3_PERSISTENT_HEAD_DIMS).
template <int D>
constexpr bool kPersistentHeadDim = D <= 128;

// The k-th item of this CTA in a persistent grid, or -1 when there is none: round k of the grid
// hands out items k * grid .. (k + 1) * grid - 1 (the longest first), going left to right in even
// rounds and right to left in odd ones, so the CTA that got a round's longest item gets the next
// round's shortest and causal totals stay level (a plain stride made CTA 0 the last to finish:
// causal lost 5-10% at S = 8192, bench/NOTES.md).
__device__ __forceinline__ int snake_item(int k, int num_items) {
  const int c = (k & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int w = k * gridDim.x + c;
  return w < num_items ? w : -1;
}

// The k-th item of this CTA (the producer asks once per item), or -1 when there is none;
// `counter` (AttentionParams::item_counter) is zero at launch.
__device__ __forceinline__ int next_item(int k, int num_items, int* counter) {
  if constexpr (!ATTNCC_FA3_DYNAMIC) {
    return snake_item(k, num_items);
  } else {
    const int w = k == 0 ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(counter, 1);
    return w < num_items ? w : -1;
  }
}

// The item slot in shared memory: the producer writes it before the q_full arrival that
// releases it (mbarrier arrive has release semantics, the consumers' wait acquire), and only
// after q_empty says both consumers have read the previous one.
__device__ __forceinline__ void publish_item(fa2_u32 slot, const DenseItem& it) {
  asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot), "r"(it.b), "r"(it.hq),
               "r"(it.h_kv), "r"(it.q0) : "memory");
}

// Persistent (D <= 128): the grid is at most one CTA per SM (the ring takes the shared memory)
// and CTA c runs item c and then those next_item claims. The producer loads the next item's Q as
// soon as both consumers issued their last S GEMM of the current one (q_empty), and its K/V
// tiles flow into the ring
// (stage phases run on across items) while the consumers finish the last P V and store O -- the
// cold start and the epilogue of a tile no longer leave the tensor cores idle.
template <typename Variant, typename DType, int D, int TKV, int STAGES>
__device__ __forceinline__ void fa3_prefill(const attncc::AttentionParams& p,
                                            const typename Variant::Params& vp) {
  static_assert(D == 64 || D == 128 || D == 256, "the FA3 kernel supports head dims 64, 128, 256");
  static_assert(TKV == 64 || TKV == 128, "the FA3 kernel's KV tiles are 64 or 128 keys");
  using S = Smem<D, TKV, STAGES>;
  constexpr int BLOCKS = D / 64;     // 64-column blocks per tile
  constexpr bool kSoftmax = Variant::use_softmax;
  // The bulk-store epilogue: O staged in the K half of the item's last stage (both consumers'
  // 128 rows fit in a 128-key K tile) and written out by bulk copies, so the consumers go on to
  // the next item while the copy engine writes. Persistent head dims only (a one-item CTA has
  // nothing to overlap), not with an output transform (O is staged in the Q tile then), and
  // not in the low-pressure form (its variants spilled 8 bytes with it: document_causal D 128).
  constexpr bool kBulkO = ATTNCC_FA3_BULK_STORE && kPersistentHeadDim<D> && TKV == 128 &&
                          !Variant::has_output_transform && !ATTNCC_FA3_LOW_PRESSURE;
  static_assert(!kBulkO || S::kKvTileBytes >= kTQ * 2 * D, "O does not fit in a K tile");

  extern __shared__ __attribute__((aligned(1024))) unsigned char attncc_fa3_smem_raw[];
  // the 128-byte swizzle works on absolute address bits: align the tiles to 1024 bytes
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<unsigned long long>(attncc_fa3_smem_raw) + 1023) & ~1023ull);
  const fa2_u32 base = fa2::smem_addr(smem);
  const fa2_u32 sq = base + S::kQ, sk = base + S::kK, sv = base + S::kV;
  const fa2_u32 full_bar = base + S::kBar;               // + 8*s: stage s landed
  const fa2_u32 empty_bar = full_bar + 8 * STAGES;       // + 8*s: stage s read by every consumer
  const fa2_u32 q_full = full_bar + 16 * STAGES, q_empty = q_full + 8;
  const fa2_u32 item_slot = base + S::kItem;
  const void* tm_q = p.tma;
  const void* tm_k = reinterpret_cast<const unsigned char*>(p.tma) + 128;
  const void* tm_v = reinterpret_cast<const unsigned char*>(p.tma) + 256;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7;               // 0: producer, 1..kConsumers: consumers
  const int warp = (tid >> 5) & 3;       // warp within its warpgroup
  const int q_len = p.q_len, kv_len = p.kv_len;
  const int nqb = (q_len + kTQ - 1) / kTQ;
  const int num_items = p.batch * p.num_q_heads * nqb;

  init_barriers<STAGES>(full_bar, empty_bar, q_full, q_empty);

  // ---- producer: one thread; the other producer threads have nothing to do ------------------
  if (wg == 0) {
    wg::setmaxnreg_dec<kProducerRegs>();
    if (tid != 0) return;
    int tile = 0;  // tiles issued by this CTA so far: stage tile % STAGES, phase tile / STAGES
#pragma unroll 1
    for (int k = 0;; ++k) {  // k: items run by this CTA so far
      // one item per CTA at D = 256: its consumers never hand Q back, and stop by themselves
      if (!kPersistentHeadDim<D> && k > 0) break;
      const int w = next_item(k, num_items, p.item_counter);
      // Q of this item (and the item in item_slot) once both consumers are done with the last
      // one's: they read the slot before they release Q
      if (k > 0) tma::mbar_wait(q_empty, (k - 1) & 1);
      if (w < 0) {  // no more items: an arrival without bytes wakes the consumers to stop
        publish_item(item_slot, DenseItem{-1, 0, 0, 0});
        tma::mbar_arrive(q_full);
        break;
      }
      const DenseItem it = dense_item<D>(p, w, nqb);
      const fa2::TileList tiles = item_tiles<TKV>(p, it);
      const int q_row0 = (it.b * p.num_q_heads + it.hq) * q_len + it.q0;  // map row of q0
      const int kv_row0 = (it.b * p.num_kv_heads + it.h_kv) * kv_len;   // map row of key 0
      publish_item(item_slot, it);  // released to the consumers by the q_full arrival
      tma::mbar_arrive_expect_tx(q_full, kConsumers * BLOCKS * kBoxBytes);
#pragma unroll
      for (int c = 0; c < kConsumers; ++c)
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
          tma::load_2d(sq + (c * BLOCKS + blk) * kBoxBytes, tm_q, q_full, 64 * blk,
                       q_row0 + 64 * c);
#pragma unroll 1
      for (int i = 0; i < tiles.count; ++i, ++tile) {
        const int st = tile % STAGES;
        // refill stage st once every consumer warp released its previous tile (tile - STAGES):
        // that was phase (tile / STAGES - 1) of the stage's empty barrier
        if (tile >= STAGES) tma::mbar_wait(empty_bar + 8 * st, ((tile / STAGES) - 1) & 1);
        bool f;
        const int kv0 = tiles.start(i, f);
        const fa2_u32 full = full_bar + 8 * st;
        tma::mbar_arrive_expect_tx(full, 2 * S::kKvTileBytes);
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
          for (int h = 0; h < TKV / 64; ++h) {
            const fa2_u32 off = st * S::kKvTileBytes + blk * S::kKvBlockBytes + h * kBoxBytes;
            tma::load_2d(sk + off, tm_k, full, 64 * blk, kv_row0 + kv0 + 64 * h);
            tma::load_2d(sv + off, tm_v, full, 64 * blk, kv_row0 + kv0 + 64 * h);
          }
      }
    }
    return;
  }

  // ---- consumers: warpgroup wg owns query rows [q0 + 64 (wg - 1), +64) of each item ----------
  wg::setmaxnreg_inc<kConsumerRegs>();
  const fa2_u32 sq_w = sq + (wg - 1) * BLOCKS * kBoxBytes;
  const float qk_scale = (kSoftmax && !Variant::has_logits_transform) ? p.sm_scale * kLog2e
                                                                      : p.sm_scale;
  const Ring ring{sk, sv, full_bar, empty_bar, S::kKvTileBytes, STAGES};
  // Both consumers visit the same tiles, so they meet at the same issue points.
  const Turns turns{wg - 1};
  DType* out = reinterpret_cast<DType*>(p.o);
  int tile = 0;
  // O rows 16-byte aligned: stored 16 bytes a lane, or through shared memory (kBulkO); a
  // function of the parameters, so nothing holds it in a register through the tile loop
  auto o_v4 = [&] {
    return !Variant::has_output_transform &&
           v4_aligned(p.o, p.o_stride_s | p.o_stride_h | p.o_stride_b);
  };
  HeldStage held;  // kBulkO: the stage holding this warp's rows of the last item's O
  // the CTA's k-th item `it` (its Q has landed), its K/V tiles from ring tile `tile` on
  auto run_item = [&](const DenseItem& it, int k) {
    const fa2::TileList tiles = item_tiles<TKV>(p, it);
    const int b = it.b, hq = it.hq, q0 = it.q0;
    float o[BLOCKS][32];
#pragma unroll
    for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[blk][i] = 0.f;
    float row_m[2] = {fa2::neg_inf(), fa2::neg_inf()}, row_l[2] = {0.f, 0.f};
    // query position of this thread's first row
    const int r_lo = q0 + 64 * (wg - 1) + 16 * warp + (lane >> 2);
    // every row of the tile is a real query: tiles inside kv_len need no bounds checks
    const bool rows_inside = q0 + kTQ <= q_len;
    // row r of this warpgroup's 64: its query head and position, and whether it is a real query
    auto row_at = [&](int r, int& h, int& qi) {
      h = hq;
      qi = q0 + 64 * (wg - 1) + r;
      return qi < q_len;
    };
    if constexpr (Variant::has_query_transform)
      transform_q<Variant, DType, D>(vp, sq_w, b, wg - 1, row_at);

    const int row_hq[2] = {hq, hq}, row_qi[2] = {r_lo, r_lo + 8};
    const bool row_ok[2] = {r_lo < q_len, r_lo + 8 < q_len};
    auto logits_softmax = [&](float (&s)[TKV / 2], int i, float (&corr)[2]) {
      bool is_full;
      const int kv0 = tiles.start(i, is_full);
      const bool interior = rows_inside && kv0 + TKV <= kv_len &&
                            (is_full || !Variant::has_logits_mask);
      logits_softmax_step<Variant, TKV, true>(s, vp, qk_scale, b, row_hq, row_qi, row_ok, kv0,
                                              kv_len, 0, is_full, interior, row_m, row_l, corr);
    };
    // A key/value transform rewrites each landed tile in place before any GEMM reads it, the two
    // consumers taking half of its rows each (both read the whole tile).
    auto landed = [&](int i, int t) {
      if constexpr (Variant::has_key_transform || Variant::has_value_transform) {
        bool is_full;
        const int kv0 = tiles.start(i, is_full);
        transform_kv<Variant, DType, D, TKV>(vp, ring.k_of(t), ring.v_of(t), wg - 1, b, it.h_kv,
                                             kv0, kv_len, 0);
        wg::fence_proxy_async();  // the wgmmas (async proxy) must see these stores
        consumers_sync();
      }
    };
    const QRelease<Variant, kPersistentHeadDim<D>> q_release{q_empty};
    auto last_s_done = [&] { q_release.last_s_done(); };
    if (tiles.count > 0) {
      consume_tiles<DType, D, TKV, rebuild_q<Variant>()>(tiles.count, tile, sq_w, ring, turns, o,
                                                        logits_softmax, landed, last_s_done,
                                                        kBulkO ? &held : nullptr,
                                                        kBulkO && o_v4());
    } else {
      last_s_done();  // nothing reads it (the block mask left this query block no keys)
      if constexpr (kBulkO) held.settle(ring);
    }
    tile += tiles.count;

    // ---- epilogue: normalize (output transform through the Q tile), store O and the LSE ------
    float inv[2], lse[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) finish_row<kSoftmax>(row_m[hr], row_l[hr], inv[hr], lse[hr]);
    DType* const out_bh = out + b * p.o_stride_b + hq * p.o_stride_h;
    auto out_row = [&](int qi) { return out_bh + (attncc::i64)qi * p.o_stride_s; };
    if constexpr (Variant::has_output_transform) {
      stage_transform_o<Variant, DType, D>(o, inv, vp, sq_w, b, row_at);
      store_staged_rows<DType, D>(sq_w, [&](int r) -> DType* {
        int h, qi;
        return row_at(r, h, qi) ? out_row(qi) : nullptr;
      });
    }
    const bool v4 = o_v4();
    if (kBulkO && v4 && tiles.count > 0) {
      // The last tile's K half takes this warpgroup's 64 rows once both consumers' last S
      // GEMMs completed (q_empty's phase of item k; the other warpgroup's last P V reads V
      // only). Each warp writes its 16 rows and fences them for the async proxy, then bulk
      // copies write them out; the stage stays held until those copies have read it
      // (HeldStage::settle, during the next item's first S GEMM).
      tma::mbar_wait(q_empty, k & 1);
      const fa2_u32 rows = ring.k_of(tile - 1) + (wg - 1) * 64 * 2 * D;
      const int row0 = q0 + 64 * (wg - 1);  // the warpgroup's first query
      if constexpr (ATTNCC_FA3_TMA_STORE_O) {
        // swizzled boxes through O's tensor map (p.tma + 384), one thread storing the
        // warpgroup's D/64 boxes once all four warps staged theirs; rows past q_len lie outside
        // the map's [B, H, q_len, D] tensor and are not written
        stage_rows_sw<DType, D>(o, inv, rows);
        wg::fence_proxy_async();
        warpgroup_sync(wg - 1);
        if (warp == 0 && lane == 0 && row0 < q_len) {
          const void* tm_o = reinterpret_cast<const unsigned char*>(p.tma) + 384;
#pragma unroll
          for (int blk = 0; blk < BLOCKS; ++blk)
            tma::store_4d(tm_o, rows + blk * kBoxBytes, 64 * blk, row0, hq, b);
          tma::bulk_commit();
        }
        held.owe = warp == 0 ? 4 : 0;
      } else {
        stage_rows_v4<DType, D>(o, inv, rows);
        wg::fence_proxy_async();
        if (p.o_stride_s == D) {
          // the warpgroup's rows are one contiguous range of O: one copy (a bulk request per
          // row ran 1-2 % slower than storing from registers), once all four warps wrote theirs
          warpgroup_sync(wg - 1);
          const int n_rows = min(64, q_len - row0);
          if (warp == 0 && lane == 0 && n_rows > 0) {
            tma::bulk_store(out_row(row0), rows, n_rows * 2 * D);
            tma::bulk_commit();
          }
          held.owe = warp == 0 ? 4 : 0;
        } else {
          __syncwarp();
          if (lane < 16) {
            const int r = 16 * warp + lane;
            if (row0 + r < q_len) tma::bulk_store(out_row(row0 + r), rows + r * 2 * D, 2 * D);
            tma::bulk_commit();
          }
          held.owe = 1;
        }
      }
    } else if (v4) {
      store_rows_v4<DType, D>(o, inv, [&](int hr) -> DType* {
        const int qi = r_lo + 8 * hr;
        return qi < q_len ? out_row(qi) : nullptr;
      });
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int qi = r_lo + 8 * hr;
      if (qi < q_len) {
        if (!Variant::has_output_transform && !v4)
          store_row<DType, D>(out_row(qi), o, hr, inv[hr]);
        if constexpr (kSoftmax) {
          if (p.lse != nullptr && (lane & 3) == 0)
            p.lse[b * p.lse_stride_b + hq * p.lse_stride_h + qi] = lse[hr];
        }
      }
    }
    q_release.stored();
  };
  // The producer picks the items (the consumers keep no scheduling state in their registers)
  // and publishes each in item_slot with its Q; b < 0 means there are no more.
#pragma unroll 1
  for (int k = 0;; ++k) {
    tma::mbar_wait(q_full, k & 1);
    // a plain load, not asm volatile, so the optimizer may place it (which kept document_causal
    // D = 128's low-pressure form spill-free); it stays below the wait, whose asm clobbers memory
    const DenseItem it = *reinterpret_cast<const DenseItem*>(smem + S::kItem);
    if (it.b < 0) break;
    run_item(it, k);
    if (!kPersistentHeadDim<D>) break;  // one item per CTA: the grid has num_items CTAs
  }
  turns.finish(tile);
  if constexpr (kBulkO) {  // the last item's copies: read (the stage) and written (the CTA ends)
    held.settle(ring);
    tma::bulk_wait_all<0>();
  }
}

}  // namespace fa3
}  // namespace attncc

// Grid (min(#SMs, items): persistent; items = batch * num_q_heads * ceil(q_len / 128), and
// grid = items at head dim 256, see kPersistentHeadDim), block kThreads (384),
// dynamic shared memory attncc::fa3::Smem<HEAD_DIM, TKV, STAGES>::kBytes; AttentionParams::tma
// points at the q/k/v maps.
#define ATTNCC_FA3_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS)       \
  extern "C" __global__ void __launch_bounds__(attncc::fa3::kThreads, 1)                           \
      NAME(attncc::AttentionParams p, VARIANT::Params vp) {                                        \
    static_assert(TQ == attncc::fa3::kTQ && M_FRAGS == 1 && KV_WARPS == 1,                         \
                  "the FA3 kernel has 128-row CTAs of two 64-row consumer warpgroups");            \
    attncc::fa3::fa3_prefill<VARIANT, DTYPE, HEAD_DIM, TKV, STAGES>(p, vp);                        \
  }

#endif  // ATTNCC_FA3_PREFILL_CUH
