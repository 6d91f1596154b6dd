// attncc FA3 batch attention for sm_90a (serving prefill): the plan/run work units of
// fa2_batch.cuh, run by the dense FA3 kernel's warp-specialized TMA + wgmma pipeline.
//
// Self-contained: no #include. Comes after batch_params.cuh, common.cuh, fa2_attend.cuh,
// fa2_batch.cuh (WorkUnit, query positions, the merge kernel), wgmma.cuh, tma.cuh,
// fa3_consumer.cuh (the consumer building blocks) and fa3_store.cuh, and before the generated
// Variant_<name> functors' entry point (ATTNCC_FA3_BATCH_ENTRY at the bottom).
//
// Persistent: the grid is the plan's CTA count (one CTA per SM: 227 KB of shared memory) and CTA
// c runs the units cta_units[cta_indptr[c] ..] one after another. A unit is (request, KV head, a
// tile of 128 fused query rows, a KV range) -- one KV head: BatchAttention plans FA3 batches
// with scheduler.plan(head_span=False), so u.kv_heads is 1 and is not read here. Its rows are a
// GQA group's heads of consecutive tokens (fused row r = token r / g, head r % g of the group),
// exactly what one 3-D TMA box [64 / g tokens][g heads][64 columns] lands as in shared memory,
// so Q needs no gather.
//
// Roles, as in fa3_prefill.cuh but with a producer warp: two consumer warpgroups of 64 rows.
//   The producer walks the CTA's units and, per unit, loads Q (after the consumers released the
//   previous unit's Q: the q_empty barrier) and then each K/V tile into the ring. A tile of TKV
//   keys of a paged cache is TKV / R boxes of R = min(page_size, TKV) rows, one per page (page
//   sizes are powers of two >= 16, so a box never crosses a page), lane j issuing box j; a ragged
//   cache is one box.
//   Stage and barrier phases run on across units (one tile counter), so the ring never drains
//   between units: the next unit's first tiles load while the consumers finish the last one.
//   The consumers run fa3_consumer.cuh's pipelined loop per unit, then store: straight to
//   the output when the unit covers its rows' whole KV range, else fp32 partial O and LSE to the
//   workspace slot for the merge kernel.
// The pair form (TQ = 64, multi-token decode): units of 64 rows, Q loaded once for both
// consumers, each K/V tile read by one of them (alternate tiles), and consumer 1's state handed
// to consumer 0 at the end of the unit (PairMerge; docs/serving.md, "The FA3 pair form").
//
// Keys past the unit's range: K rows are masked in the logits, but P = 0 does not make P V finite
// if V holds NaN or Inf -- and the unwritten slots of a request's last page may hold anything. So
// the rows of a partial last tile past the range are zeroed in shared memory before a P V reads
// them, with a proxy fence so the tensor cores see the generic-proxy stores.
//
// Variant hooks: all of fa3_prefill.cuh's, applied the same way (Q per unit once it landed, K/V
// per tile split between the consumers, O staged in the Q tile -- which then is released to the
// producer only after the store). A split unit's partial O is stored untransformed: the merge
// kernel applies the output transform to the merged rows.
//
// TMA maps (BatchParams::tma, 128 bytes each): q as [tokens][num_q_heads][D] (box 64 x g x 64/g),
// k and v as 2-D [rows][row_stride] views of the cache with row_stride = kv_stride_slot (box
// R x 64). Cache element (page, slot, head, col) is view row page * rows_per_page + head_row +
// slot, column head_col + col, where rows_per_page = kv_stride_page / kv_stride_slot and
// (head_row, head_col) = divmod(head * kv_stride_h, kv_stride_slot): NHD, HND and ragged alike.
#ifndef ATTNCC_FA3_BATCH_CUH
#define ATTNCC_FA3_BATCH_CUH

namespace attncc {
namespace fa3 {

// Where KV position `pos` of a request lives in the cache's 2-D view (row; the column is fixed per
// KV head). Positions past the request's pages read its first page: those keys are masked and
// their V rows zeroed, and the page id is always a valid one.
struct PagedRows {
  const int* pages;  // the request's page ids
  int num_pages;     // how many it has
  int page_shift;    // log2(page_size)
  int page_mask;     // page_size - 1
  long long rows_per_page;
  long long head_row;

  __device__ __forceinline__ int row(int pos) const {
    int pi = pos >> page_shift;
    pi = pi < num_pages ? pi : 0;
    return (int)(__ldg(pages + pi) * rows_per_page + head_row) + (pos & page_mask);
  }
};

// The pair form's hand-over at the end of a unit: consumer 1 gives its rows' state -- running
// maxima, per-thread sums, unnormalized O, over its half of the tiles -- to consumer 0, which
// folds it into its own as the online softmax folds a tile (docs/serving.md, "The FA3 pair
// form"). It goes through consumer 1's Q slot (the pair form loads Q once, into slot 0), in
// rounds of the slot's size; thread t of consumer 1 holds exactly the rows and columns that
// thread t of consumer 0 does, so each thread's values are one strided vector of float4s:
// element k = (m[0], m[1], l[0], l[1], o[0][0..31], o[1][0..31]) [k]. Two mbarriers order the
// rounds, every thread arriving on its own (full: consumer 1 wrote a round; empty: consumer 0
// read it), as QRelease does for Q -- with named barriers instead, racecheck reported the next
// round's writes against the last round's reads.
template <int D, bool kSoftmax>
struct PairMerge {
  u32 buf;          // consumer 1's Q slot: D / 64 TMA boxes
  u32 full, empty;  // the two mbarriers (128 arrivals each)
  static constexpr int kN = 4 + 32 * (D / 64);                 // floats a thread hands over
  static constexpr int kChunk = (D / 64) * kBoxBytes / 128 / 4;  // of them per round
  static constexpr int kRounds = (kN + kChunk - 1) / kChunk;
  static_assert(kChunk % 4 == 0, "rounds of whole float4s");

  template <int K>
  __device__ __forceinline__ static float& at(float (&m)[2], float (&l)[2],
                                              float (&o)[D / 64][32]) {
    if constexpr (K < 2) return m[K];
    else if constexpr (K < 4) return l[K - 2];
    else return o[(K - 4) / 32][(K - 4) % 32];
  }
  __device__ __forceinline__ u32 slot(int q) const {  // float4 q of this thread's round
    return buf + (q * 128 + (threadIdx.x & 127)) * 16;
  }

  // Consumer 1 (`giver`) hands its state over; consumer 0's m, l, o become the state over both
  // halves (a NaN maximum stays NaN, as torch's softmax). `round`: the rounds this consumer
  // ran in the CTA so far (the barriers' phases).
  __device__ __forceinline__ void hand_over(bool giver, float (&m)[2], float (&l)[2],
                                            float (&o)[D / 64][32], int& round) const {
    float a0[2] = {1.f, 1.f}, a1[2] = {1.f, 1.f};  // the weights of the two states
    auto give = [&](auto k, u32 addr) {
      constexpr int K = decltype(k)::value;
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                   "f"(at<K>(m, l, o)), "f"(at<K + 1>(m, l, o)), "f"(at<K + 2>(m, l, o)),
                   "f"(at<K + 3>(m, l, o))
                   : "memory");
    };
    auto take = [&](auto k, u32 addr) {
      constexpr int K = decltype(k)::value;
      float v[4];
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
                   : "r"(addr)
                   : "memory");
      if constexpr (K == 0) {
        if constexpr (kSoftmax) {
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const float mx = common::fmax_nan(m[hr], v[hr]);
            const float mu = mx == common::neg_inf() ? 0.f : mx;  // both rows empty so far
            a0[hr] = common::fast_exp2(m[hr] - mu);
            a1[hr] = common::fast_exp2(v[hr] - mu);
            l[hr] = l[hr] * a0[hr] + v[2 + hr] * a1[hr];
            m[hr] = mx;
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hr = ((K - 4 + e) >> 1) & 1;  // o[blk][i]'s row: (i >> 1) & 1
          float& x = e == 0 ? at<K>(m, l, o) : e == 1 ? at<K + 1>(m, l, o)
                   : e == 2 ? at<K + 2>(m, l, o) : at<K + 3>(m, l, o);
          x = x * a0[hr] + v[e] * a1[hr];
        }
      }
    };
    rounds<0>(giver, give, take, round);
  }

 private:
  // round R: once the slot is free (the taker read the last round), the giver stores its
  // float4s R * kChunk .. of the vector; once they landed the taker loads and folds them
  template <int R, typename G, typename T>
  __device__ __forceinline__ void rounds(bool giver, G& give, T& take, int& round) const {
    if constexpr (R < kRounds) {
      constexpr int kEnd = (R + 1) * kChunk < kN ? (R + 1) * kChunk : kN;
      if (giver) {
        if (round > 0) tma::mbar_wait(empty, (round - 1) & 1);
        each<R * kChunk, kEnd>(give);
        tma::mbar_arrive(full);
      } else {
        tma::mbar_wait(full, round & 1);
        each<R * kChunk, kEnd>(take);
        tma::mbar_arrive(empty);
      }
      ++round;
      rounds<R + 1>(giver, give, take, round);
    }
  }
  template <int K, int END, typename F>
  __device__ __forceinline__ void each(F& f) const {
    if constexpr (K < END) {
      f(common::IntTag<K>{}, slot((K % kChunk) / 4));
      each<K + 4, END>(f);
    }
  }
};

template <typename Variant, typename DType, int D, int TQ, int TKV, int STAGES>
__device__ __forceinline__ void fa3_batch(const attncc::BatchParams& p,
                                          const typename Variant::Params& vp) {
  static_assert(D == 64 || D == 128, "the FA3 batch kernel supports head dims 64 and 128");
  using S = Smem<D, TKV, STAGES>;
  constexpr int BLOCKS = D / 64;
  constexpr bool kSoftmax = Variant::use_softmax;
  // the pair form: 64-row units whose K/V tiles the two consumers split (PairMerge below)
  constexpr bool kPair = TQ == 64;
  static_assert(TQ == kTQ || kPair, "units of 128 rows, or of 64 (the pair form)");
  static_assert(TKV == 128 || (kPair && TKV == 64), "KV tiles of 128 keys (the pair form: 64)");
  // A consumer waits on a stage's full barrier by parity, which cannot tell the tile it wants
  // from the tile STAGES earlier. Each consumer has waited for that one itself only when
  // STAGES is even (the pair form hands out tiles by parity); with an odd ring, consumer 1
  // could pass the barrier of a stage still holding consumer 0's older, unlanded tile.
  static_assert(!kPair || STAGES % 2 == 0, "the pair form needs an even number of stages");
  static_assert(!kPair || !(Variant::has_query_transform || Variant::has_key_transform ||
                            Variant::has_value_transform),
                "the pair form's consumers share Q and see half the K/V tiles each: variants "
                "with query/key/value transforms run 128-row units");

  extern __shared__ __attribute__((aligned(1024))) unsigned char attncc_fa3_smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<unsigned long long>(attncc_fa3_smem_raw) + 1023) & ~1023ull);
  const u32 base = common::smem_addr(smem);
  const u32 sq = base + S::kQ, sk = base + S::kK, sv = base + S::kV;
  const u32 full_bar = base + S::kBar;
  const u32 empty_bar = full_bar + 8 * STAGES;
  const u32 q_full = full_bar + 16 * STAGES, q_empty = q_full + 8;
  const void* tm_q = p.tma;
  const void* tm_k = reinterpret_cast<const unsigned char*>(p.tma) + 128;
  const void* tm_v = reinterpret_cast<const unsigned char*>(p.tma) + 256;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7, warp = (tid >> 5) & 3;
  attncc::allow_dependents();  // the merge kernel may launch now (batch_params.cuh)
  const int first = __ldg(plan_cta_indptr(p) + blockIdx.x);
  const int last = __ldg(plan_cta_indptr(p) + blockIdx.x + 1);
  const int gf = p.num_q_heads / p.num_kv_heads;

  // (the pair form's hand-over barriers take the split ring's slots, which this kernel's ring
  // does not use; init_barriers' fence and __syncthreads publish them)
  const u32 hand_bar = base + S::kSplitBar;
  if (kPair && threadIdx.x == 0) {
    tma::mbar_init(hand_bar, 128);
    tma::mbar_init(hand_bar + 8, 128);
  }
  init_barriers<STAGES, false, kPair ? 1 : kConsumers>(full_bar, empty_bar, q_full, q_empty);

  // ---- producer: one warp; the other producer warps have nothing to do ----------------------
  // Lane 0 issues Q and arms the barriers; at a paged cache lane j < TKV / R loads the page id of
  // the tile's box j and issues that box, so the tile's page-id loads overlap: one thread issuing
  // the boxes behind one dependent page-id load each serialized TKV / R L2 round trips per tile
  // (8 at page size 16). A warp rather than one thread with the ids in an array: the producer
  // has kProducerRegs registers, and an 8-entry array spilled.
  if (wg == 0) {
    wg::setmaxnreg_dec<kProducerRegs>();
    if (warp != 0) return;
    const long long row_stride = p.kv_stride_slot;
    const int box_rows = min(p.page_size, TKV);  // the K/V maps' box height
    const bool my_box = lane * box_rows < TKV;   // lane issues box `lane` of each tile
    int tile = 0;  // tiles issued by this CTA so far: stage tile % STAGES, phase tile / STAGES
#pragma unroll 1
    for (int ui = first; ui < last; ++ui) {
      const fa2::WorkUnit u = fa2::queued_unit(p, ui);
      const int qo_offset = fa2::unit_qo_offset(p, u);
      // Q: the 128 fused rows, as two boxes of 64 rows (one per consumer) per column block;
      // the pair form's 64 rows once, in consumer 0's slot (both read it)
      constexpr int kQSlots = kPair ? 1 : kConsumers;
      if (ui > first) tma::mbar_wait(q_empty, (ui - first - 1) & 1);
      if (lane == 0) {
        tma::mbar_arrive_expect_tx(q_full, kQSlots * BLOCKS * kBoxBytes);
#pragma unroll
        for (int c = 0; c < kQSlots; ++c)
#pragma unroll
          for (int blk = 0; blk < BLOCKS; ++blk) {
            const u32 dst = sq + (c * BLOCKS + blk) * kBoxBytes;
            const int row = qo_offset + (u.q_start + 64 * c) / gf;
            // Q is read once: marked L2 evict_first (tma.cuh)
            tma::load_3d_hint(dst, tm_q, q_full, 64 * blk, u.kv_head * gf, row,
                              tma::l2_evict_first());
          }
      }
      // K/V tiles of [kv_start, kv_end)
      const int kv_len = __ldg(p.kv_lens + u.request);
      const long long head_off = (long long)u.kv_head * p.kv_stride_h;
      PagedRows rows{p.kv_page_indices + __ldg(p.kv_page_indptr + u.request),
                     (kv_len + p.page_size - 1) >> p.page_shift, p.page_shift,
                     p.page_size - 1, p.kv_stride_page / row_stride, head_off / row_stride};
      const int head_col = (int)(head_off % row_stride);
      const int n = (u.kv_end - u.kv_start + TKV - 1) / TKV;
#pragma unroll 1
      for (int i = 0; i < n; ++i, ++tile) {
        const int st = tile % STAGES;
        // this lane's box row, loaded before the wait: where a producer that runs ahead of the
        // consumers idles anyway
        const int row = my_box ? rows.row(u.kv_start + i * TKV + lane * box_rows) : 0;
        if (tile >= STAGES) tma::mbar_wait(empty_bar + 8 * st, ((tile / STAGES) - 1) & 1);
        const u32 full = full_bar + 8 * st;
        if (lane == 0) tma::mbar_arrive_expect_tx(full, 2 * S::kKvTileBytes);
        __syncwarp();  // the stage's bytes are expected before any box can complete
        if (my_box) {
#pragma unroll
          for (int blk = 0; blk < BLOCKS; ++blk) {
            // rows lane * R.. of column block blk: R rows of 128 bytes, where the swizzle
            // (which repeats every 8 rows) puts them
            const u32 off =
                st * S::kKvTileBytes + blk * S::kKvBlockBytes + lane * box_rows * 128;
            tma::load_2d(sk + off, tm_k, full, head_col + 64 * blk, row);
            tma::load_2d(sv + off, tm_v, full, head_col + 64 * blk, row);
          }
        }
      }
    }
    return;
  }

  // ---- consumers -------------------------------------------------------------------------------
  wg::setmaxnreg_inc<kConsumerRegs>();
  const u32 sq_w = sq + (kPair ? 0 : (wg - 1) * BLOCKS * kBoxBytes);
  // this warpgroup's first row of a unit, computed where used (held in a variable, it moved
  // ptxas's register allocation of the 128-row form)
  auto row0 = [&] { return kPair ? 0 : 64 * (wg - 1); };
  const Ring<> ring{sk, sv, full_bar, empty_bar, S::kKvTileBytes, STAGES};
  const Turns turns{wg - 1};
  const float qk_scale = (kSoftmax && !Variant::has_logits_transform) ? p.sm_scale * kLog2e
                                                                      : p.sm_scale;
  const common::FastDiv gdiv(gf);
  int tile = 0, hand_rounds = 0;
#pragma unroll 1
  for (int ui = first; ui < last; ++ui) {
    const fa2::WorkUnit u = fa2::queued_unit(p, ui);
    const int qo_offset = fa2::unit_qo_offset(p, u);
    const int q_pos0 = fa2::request_q_pos0(p, u.request);
    const int kv_pos0 = p.kv_pos_offset != nullptr ? __ldg(p.kv_pos_offset + u.request) : 0;
    const int kv_end = u.kv_end;
    const int n = (kv_end - u.kv_start + TKV - 1) / TKV;
    // this thread's two rows: fused row -> (token, query head, query position)
    int row_hq[2], row_qi[2], row_tok[2];
    bool row_ok[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = row0() + 16 * warp + (lane >> 2) + 8 * hr;  // row within the unit
      const int fr = u.q_start + r;
      row_ok[hr] = r < u.q_rows;
      row_tok[hr] = gdiv.div(fr);
      row_hq[hr] = u.kv_head * gf + (fr - row_tok[hr] * gf);
      row_qi[hr] = row_ok[hr] ? fa2::query_position(p, q_pos0, qo_offset, row_tok[hr]) : 0;
    }
    const bool rows_full = u.q_rows >= TQ;

    float o[BLOCKS][32];
#pragma unroll
    for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[blk][i] = 0.f;
    float row_m[2] = {common::neg_inf(), common::neg_inf()}, row_l[2] = {0.f, 0.f};
    tma::mbar_wait(q_full, (ui - first) & 1);
    // row r of this warpgroup's 64: its query head and position, and whether it is a real row
    auto row_at = [&](int r, int& h, int& qi) {
      const int ru = row0() + r;
      if (ru >= u.q_rows) return false;
      const int fr = u.q_start + ru, tok = gdiv.div(fr);
      h = u.kv_head * gf + (fr - tok * gf);
      qi = fa2::query_position(p, q_pos0, qo_offset, tok);
      return true;
    };
    if constexpr (Variant::has_query_transform)
      transform_q<Variant, DType, D>(vp, sq_w, u.request, turns.me, row_at);
    // (low-pressure form) A mask-only variant whose mask reads a captured tensor at the
    // positions (document_mask: a document id per key, 32 loads a tile) evaluates it as soon as
    // the tile landed, into one bit per logit (keep[hr] bit 2j + e: s[4j + 2hr + e]), and the
    // logits only apply the bits. Where the logits run, S, P and O hold 160 registers at D = 128
    // (P V in flight), and the loads, their 64-bit addresses and the clamped key positions did
    // not fit next to them: in the tile loop, document_causal spilled 84 B at D = 128 and
    // document_mask 16 B (NVRTC 12.9), document_causal 32 B at D = 64 (NVRTC 13); this form
    // has none of those spills. When the tile lands S is not live yet (its GEMM comes next). The
    // same loads and compares as apply_logits' checked path (clamped positions; invalid rows,
    // keys past the range and the mask), just earlier in the same iteration, and the same
    // logits (tests/gpu/test_batch.py checks them against the fp64 reference).
    constexpr bool kMaskBits = form::low_pressure() && Variant::has_logits_mask &&
                               !Variant::has_logits_transform && Variant::loads_at_positions;
    unsigned keep[2] = {~0u, ~0u};
    auto mask_bits = [&](int it) {
      const int kv0 = u.kv_start + it * TKV;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        unsigned bits = 0;
#pragma unroll
        for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kv = kv0 + 8 * j + 2 * (lane & 3) + e;
            // (an invalid row's row_qi is 0: a real position, as apply_logits gives it)
            const bool mask = Variant::LogitsMask(vp, u.request, row_hq[hr], row_qi[hr],
                                                  min(kv, kv_end - 1) + kv_pos0);
            const bool ok = row_ok[hr] && (unsigned)kv < (unsigned)kv_end && mask;
            bits |= (unsigned)ok << (2 * j + e);
          }
        keep[hr] = bits;
      }
      // the bits as two words: else the compiler folds each test in the logits back into its
      // compare here, and 64 predicates stay live instead (document_mask D = 128: 208 B spilled)
      asm volatile("" : "+r"(keep[0]), "+r"(keep[1]));
    };
    // (the pair form) a multi-token decode tree mask (fa2_batch.cuh's tree_keys / tree_word):
    // only the one or two tiles holding the step's keys test it, on the checked path
    auto tree_tile = [&](int kv0) { return kPair && fa2::tree_keys(p, q_pos0, kv0, kv0 + TKV); };
    auto hide_tree = [&](float (&s)[TKV / 2], int kv0) {
      const float masked = kSoftmax ? common::neg_inf() : 0.f;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const unsigned t = row_qi[hr] - q_pos0;
        const unsigned w = row_ok[hr] && t < 16u ? fa2::tree_word(p, u.request, t) : ~0u;
#pragma unroll
        for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const unsigned key = kv0 + 8 * j + 2 * (lane & 3) + e - q_pos0;
            if (key < 16u && !((w >> key) & 1u)) s[4 * j + 2 * hr + e] = masked;
          }
      }
    };
    auto logits_softmax = [&](float (&s)[TKV / 2], int it, float (&corr)[2]) {
      const int kv0 = u.kv_start + it * TKV;
      if constexpr (kMaskBits) {  // logits_softmax_step with the mask from keep
        apply_logits<Variant, TKV, false, false>(s, vp, qk_scale, u.request, row_hq, row_qi,
                                                 row_ok, kv0, kv_end, kv_pos0, true);
        const float masked = kSoftmax ? common::neg_inf() : 0.f;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
          for (int j = 0; j < TKV / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!((keep[hr] >> (2 * j + e)) & 1u)) s[4 * j + 2 * hr + e] = masked;
        if (tree_tile(kv0)) hide_tree(s, kv0);
        if constexpr (kSoftmax) {
          softmax_step<TKV, folds_scale<Variant>()>(s, row_m, row_l, corr, qk_scale);
        } else {
          corr[0] = corr[1] = 1.f;
        }
        return;
      }
      // A mask that is exactly a band lo <= kv - q <= hi (Variant::has_kv_window: causal) keeps
      // every key of a tile whose pairs all lie inside it, for every row of this warp (a vote:
      // apply_logits works per warp); the mask is then skipped, as the dense kernel skips it on
      // a block mask's full tiles -- without it every tile of a causal unit ran the checked path.
      // Mask-only variants: with a score_mod too, the second (unchecked) copy of the logits loop
      // cost alibi + causal D = 128 16 B of spills (168 B when only the mask was skipped).
      bool in_band = false;
      if constexpr (Variant::has_kv_window && !Variant::has_logits_transform) {
        const long long k_lo = (long long)kv_pos0 + kv0, k_hi = k_lo + TKV - 1;
        bool mine = true;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          mine = mine && (!row_ok[hr] || (k_hi - row_qi[hr] <= Variant::kv_window_hi &&
                                          k_lo - row_qi[hr] >= Variant::kv_window_lo));
        in_band = __all_sync(0xffffffffu, mine);
      }
      const bool interior =
          rows_full && kv0 + TKV <= kv_end && (!Variant::has_logits_mask || in_band);
      if constexpr (kPair) {  // a tree tile is never interior: the tree rides the checked path
        const bool tree = tree_tile(kv0);
        logits_softmax_step<Variant, TKV, false>(
            s, vp, qk_scale, u.request, row_hq, row_qi, row_ok, kv0, kv_end, kv_pos0, in_band,
            interior && !tree, row_m, row_l, corr, false, [&](float (&s2)[TKV / 2]) {
              if (tree) hide_tree(s2, kv0);
            });
      } else {
        logits_softmax_step<Variant, TKV, false>(s, vp, qk_scale, u.request, row_hq, row_qi,
                                                 row_ok, kv0, kv_end, kv_pos0, in_band, interior,
                                                 row_m, row_l, corr);
      }
    };
    // V rows of the last tile past kv_end, zeroed after the tile landed and before this
    // warpgroup's P V reads them. Both consumers zero them (the same zeros: a write of 0 over 0
    // cannot change what the other reads), so neither waits for the other; each then fences its
    // stores into the async proxy and meets its own four warps at named barrier 3 + me, because
    // one warpgroup-wide wgmma reads every warp's stores.
    // A key/value transform first rewrites the tile's rows inside the range, split between the
    // consumers, who then both need the other's rows: they meet on consumers_sync instead.
    constexpr bool kKvTransform = Variant::has_key_transform || Variant::has_value_transform;
    const int tail_valid = kv_end - (u.kv_start + (n - 1) * TKV);
    auto landed = [&](int it, int t) {
      if constexpr (kMaskBits) mask_bits(it);
      const bool tail = it == n - 1 && tail_valid < TKV;
      if constexpr (kKvTransform)
        transform_kv<Variant, DType, D, TKV>(vp, ring.k_of(t), ring.v_of(t), turns.me, u.request,
                                             u.kv_head, u.kv_start + it * TKV, kv_end, kv_pos0);
      if (tail) {
        const int per_blk = (TKV - tail_valid) * 8;  // 16-byte chunks per column block
        for (int idx = tid & 127; idx < BLOCKS * per_blk; idx += 128) {
          const int blk = idx / per_blk, rem = idx - blk * per_blk;
          const u32 addr = ring.v_of(t) + blk * S::kKvBlockBytes +
                               (tail_valid + rem / 8) * 128 + (rem % 8) * 16;
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0)
                       : "memory");
        }
      }
      if (kKvTransform || tail) wg::fence_proxy_async();  // the tensor cores must see the stores
      if constexpr (kKvTransform) {
        consumers_sync();
      } else if (tail) {
        warpgroup_sync(turns.me);
      }
    };
    const QRelease<Variant, true> q_release{q_empty};
    auto last_s_done = [&] { q_release.last_s_done(); };
    if constexpr (kPair) {  // this consumer's tiles: those of its parity in the CTA's count
      const int off = (turns.me - tile) & 1, mine = n > off ? (n - off + 1) >> 1 : 0;
      if (mine > 0) {
        consume_alternate_tiles<DType, D, TKV>(
            mine, tile + off, sq_w, ring, o,
            [&](float (&s)[TKV / 2], int i, float (&corr)[2]) {
              logits_softmax(s, off + 2 * i, corr);
            },
            [&](int i, int t) { landed(off + 2 * i, t); }, last_s_done);
      } else {
        last_s_done();
      }
    } else if (n > 0) {
      consume_tiles<DType, D, TKV>(n, tile, sq_w, ring, turns, o, logits_softmax, landed,
                                   last_s_done);
    } else {
      last_s_done();  // nothing reads it (an empty KV range)
    }
    tile += n;
    if constexpr (kPair) {  // consumer 1 hands its state to consumer 0, which stores the rows
      PairMerge<D, kSoftmax>{sq + BLOCKS * kBoxBytes, hand_bar, hand_bar + 8}.hand_over(
          turns.me == 1, row_m, row_l, o, hand_rounds);
      if (turns.me == 1) {
        q_release.stored();
        continue;
      }
    }

    // ---- store: the output rows, or this unit's partial state -----------------------------
    // (a split unit's partial state stays untransformed: the merge kernel applies the output
    // transform to the combined rows)
    float* part_o = u.slot >= 0 ? p.partial_o + (attncc::i64)u.slot * TQ * D : nullptr;
    float inv_r[2], lse_r[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) finish_row<kSoftmax>(row_m[hr], row_l[hr], inv_r[hr], lse_r[hr]);
    if constexpr (kSoftmax) {
      if (part_o == nullptr && p.sinks != nullptr) {  // whole rows; the merge joins a split's
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {  // the row's query head from its fused row, as below
          const int fr = u.q_start + row0() + 16 * warp + (lane >> 2) + 8 * hr;
          const int hq = u.kv_head * gf + (fr - gdiv.div(fr) * gf);
          common::join_sink(__ldg(p.sinks + hq), inv_r[hr], lse_r[hr]);
        }
      }
    }
    if constexpr (kSoftmax) clear_empty_rows<D>(o, inv_r);
    if constexpr (Variant::has_output_transform) {
      if (part_o == nullptr) transform_o<Variant, DType, D>(o, inv_r, vp, sq_w, u.request, row_at);
    }
    // (low-pressure form) the rows' tokens and query heads again, for the stores below: kept
    // from the unit's start they were live through the whole tile loop for these few stores, and
    // were among what ptxas spilled (relative_bias D = 64 and 128: 8 B and 108 B in this form
    // before). A few integer ops a unit; q_start goes through an empty asm, or the compiler
    // would reuse the values of the unit's start (and keep them live again).
    if constexpr (form::low_pressure()) {
      int q_start = u.q_start;
      asm volatile("" : "+r"(q_start));
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int fr = q_start + row0() + 16 * warp + (lane >> 2) + 8 * hr;
        row_tok[hr] = gdiv.div(fr);
        row_hq[hr] = u.kv_head * gf + (fr - row_tok[hr] * gf);
      }
    }
    // this thread's output row hr (a write-through unit's)
    auto out_row = [&](int hr) -> DType* {
      return reinterpret_cast<DType*>(p.o) + (qo_offset + row_tok[hr]) * p.o_stride_tok +
             row_hq[hr] * p.o_stride_h;
    };
    // write-through units store O 16 bytes a lane (store_rows_v4: every lane calls it)
    const bool v4 = part_o == nullptr && v4_aligned(p.o, p.o_stride_tok | p.o_stride_h);
    if (v4)
      store_rows_v4<DType, D>(o, inv_r,
                              [&](int hr) -> DType* { return row_ok[hr] ? out_row(hr) : nullptr; });
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float inv = inv_r[hr], lse = lse_r[hr];
      if (!row_ok[hr]) continue;
      const int r = row0() + 16 * warp + (lane >> 2) + 8 * hr;
      if (part_o != nullptr) {
        float* dst = part_o + (attncc::i64)r * D;
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int col = 64 * blk + 8 * j + 2 * (lane & 3);
            *reinterpret_cast<float2*>(dst + col) =
                make_float2(o[blk][4 * j + 2 * hr] * inv, o[blk][4 * j + 2 * hr + 1] * inv);
          }
        if ((lane & 3) == 0) p.partial_lse[(attncc::i64)u.slot * TQ + r] = kSoftmax ? lse : 0.f;
      } else {
        if (!v4) store_row<DType, D>(out_row(hr), o, hr, inv);
        if constexpr (kSoftmax) {
          if (p.lse != nullptr && (lane & 3) == 0)
            p.lse[(attncc::i64)(qo_offset + row_tok[hr]) * p.lse_stride_tok + row_hq[hr]] = lse;
        }
      }
    }
    q_release.stored();
  }
  if constexpr (!kPair) turns.finish(tile);  // (the pair form's consumers take no turns)
}

}  // namespace fa3
}  // namespace attncc

// The line codegen emits per FA3 batch kernel: the persistent attention kernel NAME (grid: the
// plan's num_ctas; block: kThreads = 384; dynamic shared memory Smem::kBytes) and the merge
// kernel NAME_merge of fa2_batch.cuh (grid: at most one CTA per SM; block: MergeKernel::kThreads).
#define ATTNCC_FA3_BATCH_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS) \
  extern "C" __global__ void __launch_bounds__(attncc::fa3::kThreads, 1)                           \
      NAME(attncc::BatchParams p, VARIANT::Params vp) {                                            \
    static_assert(M_FRAGS == 1 && KV_WARPS == 1,                                                   \
                  "the FA3 kernel's CTAs are two 64-row consumer warpgroups");                     \
    attncc::fa3::fa3_batch<VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES>(p, vp);                      \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(attncc::fa2::MergeKernel::kThreads, 1)              \
      NAME##_merge(attncc::BatchParams p, VARIANT::Params vp) {                                    \
    attncc::fa2::fa2_merge<VARIANT, DTYPE, HEAD_DIM, TQ>(p, vp);                                   \
  }

#endif  // ATTNCC_FA3_BATCH_CUH
