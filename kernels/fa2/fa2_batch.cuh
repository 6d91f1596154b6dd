// attncc persistent batch attention (serving): ragged queries, paged or ragged KV caches, a
// load-balanced plan of work units, and the merge of KV ranges split across CTAs.
//
// Self-contained: no #include. Comes after attncc_types.cuh, batch_params.cuh, common.cuh and
// fa2_attend.cuh, and before the generated Variant_<name> functors' entry point
// (ATTNCC_FA2_BATCH_ENTRY at the bottom).
//
// The plan (attncc.runtime.serving.plan.scheduler.plan) is made on the host and copied to the
// workspace in one asynchronous copy (its sections sit back to back: batch_params.cuh). The
// attention kernel's grid is fixed (k x #SMs): CTA c runs the work units cta_units[cta_indptr[c]
// .. cta_indptr[c+1]) one after another. A unit is (request, KV heads kv_head .. kv_head +
// kv_heads - 1, a tile of up to TQ fused query rows, a KV range); its heads run one after another,
// each as a one-head unit would (only write-through units of one-tile requests cover several
// heads: decode rows). A unit that covers its rows' whole KV range writes the output directly; the
// units of a split range write fp32 partial states to the workspace, and the merge kernel combines
// them -- in the plan's fixed order, so the same lengths give bitwise the same output -- then
// applies the OutputTransform. Because every pointer and both grid sizes are fixed, the pair of
// launches can be captured once in a CUDA graph and replayed with new plans.
//
// Query positions: token t of a request with q_len queries and kv_len keys is query position
// kv_len - q_len + t (the queries are the last q_len tokens of the sequence), which is what the
// hooks see as q_idx -- so `q_idx >= kv_idx` is the causal mask of a prefill chunk or a decode
// step alike.
#ifndef ATTNCC_FA2_BATCH_CUH
#define ATTNCC_FA2_BATCH_CUH

namespace attncc {
namespace fa2 {

// One work unit, as attncc.runtime.serving.plan.format.WORK_UNIT_DTYPE lays it out (8 int32): KV
// heads kv_head .. kv_head + kv_heads - 1 (kv_heads is 1 for a split unit, slot >= 0). The
// request's first query token is qo_indptr[request] (unit_qo_offset).
struct WorkUnit {
  int request, kv_head, kv_heads, q_start, q_rows, kv_start, kv_end, slot;
};

__device__ __forceinline__ WorkUnit load_unit(const int* units, int u) {
  const int4 a = __ldg(reinterpret_cast<const int4*>(units) + 2 * u);
  const int4 c = __ldg(reinterpret_cast<const int4*>(units) + 2 * u + 1);
  return WorkUnit{a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
}

// The unit at position i of the CTA queues: units[cta_units[i]] (plan_section: no pointer kept).
__device__ __forceinline__ WorkUnit queued_unit(const attncc::BatchParams& p, int i) {
  return load_unit(plan_section(p, kPlanUnitsAt), __ldg(plan_section(p, kPlanCtaUnitsAt) + i));
}

__device__ __forceinline__ int unit_qo_offset(const attncc::BatchParams& p,
                                              const WorkUnit& u) {
  return __ldg(p.qo_indptr + u.request);
}

// Query positions the hooks see. By default the queries are the request's last tokens: token t
// is position kv_len - q_len + t = t + request_q_pos0(...). A caller may instead give every query
// token its position (cascade: one "request" gathers the queries of many).
__device__ __forceinline__ int request_q_pos0(const attncc::BatchParams& p, int request) {
  const int q_len = __ldg(p.qo_indptr + request + 1) - __ldg(p.qo_indptr + request);
  return __ldg(p.kv_lens + request) - q_len;
}
__device__ __forceinline__ int query_position(const attncc::BatchParams& p, int q_pos0,
                                              int qo_offset, int tok) {
  return p.q_positions != nullptr ? __ldg(p.q_positions + qo_offset + tok) : tok + q_pos0;
}

// Multi-token decode tree masks (docs/serving.md, "Multi-token decode and tree masks"), as both
// batch kernels read them: query t (< 16) of request b keeps its step's key j (< 16; position
// q_pos0 + j) only where bit j of word 16 b + t is set; every other key stays visible, and so
// does everything of a plan with q_positions (there t is no token index). tree_keys: whether
// keys [kv0, kv1) hold any of the step's; tree_word: query t's word.
__device__ __forceinline__ bool tree_keys(const attncc::BatchParams& p, int q_pos0, int kv0,
                                          int kv1) {
  return p.tree_mask != nullptr && p.q_positions == nullptr && kv1 > q_pos0 &&
         kv0 < q_pos0 + 16;
}
__device__ __forceinline__ unsigned tree_word(const attncc::BatchParams& p, int b, unsigned t) {
  return __ldg(p.tree_mask + 16 * b + t);
}

// ---------------------------------------------------------------------------------------------
// BatchWork: fa2_attend's view of one work unit.
// ---------------------------------------------------------------------------------------------
template <typename DType, int D, int TQ, int TKV, int NT, typename KvType = DType,
          int DQK = D, int DV = D>
struct BatchWork {
  static constexpr bool kMaySplit = true;
  using KvT = KvType;  // the cache's element type: DType, or an fp8 tag (fa2_kv8.cuh)
  static constexpr bool kKv8 = KvTraits<KvT>::kIs8;
  // a padded form: D is the padded width of the real head dims DQK, DV (as DenseWork's)
  enum : bool { kPadded = DQK != D || DV != D };  // (an enumerator: as DenseWork's)
  // DV != DQK: the host gives the cache's strides in head rows (a K row is DQK elements, a V
  // row DV), and the offsets scale by these; else they are elements (steps of 1)
  enum : int { kKStep = DQK != DV ? DQK : 1, kVStep = DQK != DV ? DV : 1 };
  static constexpr int CHUNKS = D / 8;
  static constexpr int ROWS_PER_PASS = NT / CHUNKS;  // loader layout as in DenseWork
  static_assert(NT % CHUNKS == 0 && TQ % ROWS_PER_PASS == 0 && TKV % ROWS_PER_PASS == 0,
                "loader layout");
  static_assert(!kPadded || !kKv8, "a padded head dim reads a 16-bit cache (the host checks)");

  const attncc::BatchParams& p;
  int b, gf, head0, h_kv, row0, rows, q_pos0, kv_len, count;
  int kv_start, qo_offset, slot, kv_pos0;
  const int* pages;  // this request's page ids

  // Head `kv_head` of unit u (one of its kv_heads), whose request's first query token is
  // `qo_off`.
  __device__ __forceinline__ BatchWork(const attncc::BatchParams& params, const WorkUnit& u,
                                       int kv_head, int qo_off)
      : p(params) {
    b = u.request;
    gf = p.num_q_heads / p.num_kv_heads;
    h_kv = kv_head;
    head0 = kv_head * gf;
    row0 = u.q_start;
    rows = u.q_start + u.q_rows;
    q_pos0 = request_q_pos0(p, b);
    kv_pos0 = p.kv_pos_offset != nullptr ? __ldg(p.kv_pos_offset + b) : 0;
    kv_start = u.kv_start;
    kv_len = u.kv_end;  // positions past the unit's range do not exist for it
    count = (u.kv_end - u.kv_start + TKV - 1) / TKV;
    qo_offset = qo_off;
    slot = u.slot;
    pages = p.kv_page_indices + __ldg(p.kv_page_indptr + b);
  }

  // an fp8 cache's value scale of this KV head, read in the epilogue (not held across the loop)
  __device__ __forceinline__ float value_scale() const {
    return kKv8 ? __ldg(p.v_scale + h_kv) : 1.f;
  }
  __device__ __forceinline__ int tile_start(int i, bool& is_full) const {
    is_full = false;  // no block lists here: the variant's own mask applies to every tile
    return kv_start + i * TKV;
  }
  __device__ __forceinline__ int q_position(int tok) const {
    return query_position(p, q_pos0, qo_offset, tok);
  }

  // Multi-token decode tree mask (tree_keys / tree_word above; plan() refuses masks with
  // q_positions). Unmasked requests' words are all ones. Read from the kernel parameters, not
  // kept in registers: only the one or two tiles tree_tile() names pay for it. An fp8 cache's
  // forms carry none (plan() refuses masks with one): their registers are spent on widening
  // the cache.
  static constexpr bool kTreeMask = !kKv8;
  __device__ __forceinline__ bool tree_tile(int kv0, int kv_end) const {
    return tree_keys(p, q_pos0, kv0, kv_end);
  }
  __device__ __forceinline__ bool tree_keeps(int qi, int kv) const {
    const unsigned j = kv - q_pos0, t = qi - q_pos0;
    return p.tree_mask == nullptr || p.q_positions != nullptr || j >= 16u || t >= 16u ||
           ((tree_word(p, b, t) >> j) & 1) != 0;
  }

  __device__ __forceinline__ void load_q(u32 sq, int tid) const {
    const DType* gQ = reinterpret_cast<const DType*>(p.q);
    const int ld_row = tid / CHUNKS, ld_ch = tid % CHUNKS;
    const FastDiv gdiv(gf);
#pragma unroll
    for (int j = 0; j < TQ / ROWS_PER_PASS; ++j) {
      const int r = ld_row + j * ROWS_PER_PASS;
      const int fr = row0 + r;
      const int tok = gdiv.div(fr);
      const int hq = head0 + (fr - tok * gf);
      const bool ok = fr < rows && col_in(ld_ch, DQK);
      const DType* src = ok ? gQ + (qo_offset + tok) * p.q_stride_tok + hq * p.q_stride_h +
                                  ld_ch * 8
                            : gQ;
      cp_async_16(sq + 2 * swz<D>(r, ld_ch * 8), src, ok);
    }
  }

  // Element offset of KV position `kv` of this request: its page, then the slot in the page.
  __device__ __forceinline__ attncc::i64 kv_offset(int kv) const {
    int page_i;
    if (p.page_shift >= 0) {
      page_i = kv >> p.page_shift;
    } else {
      page_i = kv / p.page_size;
    }
    const int slot_in_page = kv - page_i * p.page_size;
    return (attncc::i64)__ldg(pages + page_i) * p.kv_stride_page +
           (attncc::i64)slot_in_page * p.kv_stride_slot;
  }

  // K and V rows of a tile: the page lookup of each row is shared by its K and V copies. Rows
  // are gathered one 16-byte chunk per thread, so any page size (down to 1) works; a page never
  // has to hold a whole tile.
  __device__ __forceinline__ void load_kv(u32 sk, u32 sv, int kv0, int tid) const {
    if constexpr (kKv8) {
      load_kv8(sk, sv, kv0, tid);
      return;
    }
    const int ld_row = tid / CHUNKS, ld_ch = tid % CHUNKS;
    const DType* kb =
        reinterpret_cast<const DType*>(p.k) + h_kv * p.kv_stride_h * kKStep + ld_ch * 8;
    const DType* vb =
        reinterpret_cast<const DType*>(p.v) + h_kv * p.kv_stride_h * kVStep + ld_ch * 8;
    const bool k_col = col_in(ld_ch, DQK), v_col = col_in(ld_ch, DV);
#pragma unroll
    for (int j = 0; j < TKV / ROWS_PER_PASS; ++j) {
      const int r = ld_row + j * ROWS_PER_PASS;
      const int kv = kv0 + r;
      const bool ok = (unsigned)kv < (unsigned)kv_len;
      const attncc::i64 off = ok ? kv_offset(kv) : 0;
      cp_async_16(sk + 2 * swz<D>(r, ld_ch * 8), kb + off * kKStep, ok && k_col);
      cp_async_16(sv + 2 * swz<D>(r, ld_ch * 8), vb + off * kVStep, ok && v_col);
    }
  }

  // An fp8 cache's K and V rows: 16 bytes (16 values) per copy, rows D bytes apart, chunks
  // swizzled by kv8_chunk (fa2_kv8.cuh); kv_offset's strides are in elements, here bytes.
  __device__ __forceinline__ void load_kv8(u32 sk, u32 sv, int kv0, int tid) const {
    constexpr int CH = D / 16, PASS = NT / CH;  // 16-byte chunks per row; rows per pass
    const int ld_row = tid / CH, ld_ch = tid % CH;
    const unsigned char* kb = reinterpret_cast<const unsigned char*>(p.k) +
                              h_kv * p.kv_stride_h + ld_ch * 16;
    const unsigned char* vb = reinterpret_cast<const unsigned char*>(p.v) +
                              h_kv * p.kv_stride_h + ld_ch * 16;
#pragma unroll
    for (int j = 0; j < (TKV + PASS - 1) / PASS; ++j) {
      const int r = ld_row + j * PASS;
      if (PASS > TKV && r >= TKV) break;  // more threads than chunks: the rest idle
      const int kv = kv0 + r;
      const bool ok = (unsigned)kv < (unsigned)kv_len;
      const attncc::i64 off = ok ? kv_offset(kv) : 0;
      const int at = r * D + 16 * kv8_chunk<D>(r, ld_ch);  // (swizzled: fa2_kv8.cuh)
      cp_async_16(sk + at, kb + off, ok);
      cp_async_16(sv + at, vb + off, ok);
    }
  }

  // Whether 16-byte chunk `ch` lies inside a real head dim `width` (always, unpadded).
  __device__ __forceinline__ static bool col_in(int ch, int width) {
    return !kPadded || ch * 8 < width;
  }
  __device__ __forceinline__ bool o_chunk(int ch) const { return col_in(ch, DV); }
  __device__ __forceinline__ DType* o_row(int tok, int hq) const {
    return reinterpret_cast<DType*>(p.o) + (qo_offset + tok) * p.o_stride_tok + hq * p.o_stride_h;
  }
  __device__ __forceinline__ bool has_lse() const { return p.lse != nullptr; }
  __device__ __forceinline__ float* lse_at(int tok, int hq) const {
    return p.lse + (attncc::i64)(qo_offset + tok) * p.lse_stride_tok + hq;
  }
  __device__ __forceinline__ float* partial_o() const {
    return slot < 0 ? nullptr : p.partial_o + (attncc::i64)slot * TQ * D;
  }
  __device__ __forceinline__ float* partial_lse() const {
    return p.partial_lse + (attncc::i64)slot * TQ;
  }
  __device__ __forceinline__ const float* sinks() const { return p.sinks; }
};

// ---------------------------------------------------------------------------------------------
// Merge of a split work item's partial states, combined with the attention composition operator
// -- LSE = log sum exp(LSE_s), O = sum exp(LSE_s - LSE) O_s -- summing the slots in the plan's
// order (ascending KV start), so the result does not depend on which CTA finished first or which
// CTA merges. No-softmax variants just add the parts.
//
// The merge kernel (fa2_merge) merges every split item, of the FA2 and the FA3 batch kernels
// alike, as a programmatic dependent launch that starts under the attention kernel's tail. (The
// FA2 kernel once merged small items in place -- the CTA writing an item's last part, found by a
// per-item arrival counter. With the dependent launch that lost time on skewed decode batches,
// whose CTAs holding short requests' parts also carried merges the plan's costs do not count,
// and gained nothing elsewhere: docs/serving.md, "Merge kernel and programmatic dependent
// launch".)
//
// The partials were just written and sit in L2, so a row's merge is bound by load latency, not
// bandwidth: a long request split into many chunks must not walk its slots one dependent load at
// a time. The lanes first read up to 32 slots' LSEs at once (max and sum by shuffles) and stage
// the slots' weights in shared memory; then every lane owns D/32 columns and sums the slots'
// rows MergeKernel::kUnroll at a time, so that many independent loads are in flight per lane.
// Partials are read with ld.global.cg (L2): another SM wrote them during this launch, and L1 is
// not coherent across SMs.
// ---------------------------------------------------------------------------------------------
struct MergeKernel {
  static constexpr int kThreads = 512;  // 16 warps, one row each at a time
  static constexpr int kChunk = 128;    // slots whose weights a warp stages at once
  static constexpr int kUnroll = 8;     // slot rows summed per step (independent loads)
};

struct FloatRow {  // a staged output row, as the OutputTransform's `Vec`
  const float* row;
  __device__ __forceinline__ float operator[](int d) const { return row[d]; }
};

// One split work item: where its merged rows go, and its partials (slots s0 .. s1).
struct MergeItem {
  int request, kv_head, qo_offset, q_start, q_rows, s0, s1;
};

// Shared-memory scratch of one merging warp: a staged output row and a chunk of slot weights.
template <int D>
struct MergeScratch {
  float row[D];
  float wts[MergeKernel::kChunk];
};

// The larger of two partial LSEs, NaN if either is: a partial state with a NaN logit makes the
// merged row NaN, as one softmax over the row's whole KV range would.
__device__ __forceinline__ float lse_max(float a, float b) { return fmax_nan(a, b); }

// Merge fused row r of `it` with one warp and write it (OutputTransform applied) and its LSE.
// NaN and inf propagate as in one softmax: a NaN partial LSE gives NaN, a +inf one (a +inf
// logit) an LSE of +inf and NaN output; a slot of weight 0 is still read (0 * NaN is NaN), and
// an empty slot (-inf) holds a zero row (fa2_attend.cuh's epilogue).
template <typename Variant, typename DType, int D, int TQ, int DV>
__device__ __forceinline__ void merge_row(const attncc::BatchParams& p,
                                          const typename Variant::Params& vp, const MergeItem& it,
                                          int r, int lane, MergeScratch<D>& scratch) {
  constexpr int COLS = D / 32;  // consecutive columns per lane: 2, 4 or 8 floats
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kSoftmax = Variant::use_softmax;
  auto lse_of = [&](int s) -> float {
    return __ldcg(p.partial_lse + (attncc::i64)s * TQ + r);
  };
  // the row's LSE over all slots: max, then the sum of 2^((l - max) log2 e), 32 slots per step.
  // Lane l keeps slot s0 + l's LSE in a register (`mine`): a row of at most 32 parts -- nearly
  // every split row -- then loads each LSE once, not once for the max, once for the sum and once
  // for the weights (three dependent L2 round trips where one does).
  float mx = neg_inf(), wsum = 0.f, mine = neg_inf();
  if constexpr (kSoftmax) {
    if (it.s0 + lane < it.s1) mine = lse_of(it.s0 + lane);
    mx = mine;
    for (int s = it.s0 + 32 + lane; s < it.s1; s += 32) mx = lse_max(mx, lse_of(s));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = lse_max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (it.s0 + lane < it.s1 && mx != neg_inf()) wsum = fast_exp2((mine - mx) * kLog2e);
    for (int s = it.s0 + 32 + lane; s < it.s1; s += 32)
      wsum += mx == neg_inf() ? 0.f : fast_exp2((lse_of(s) - mx) * kLog2e);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
  }
  const float inv = wsum == 0.f ? 0.f : 1.f / wsum;
  float acc[COLS];
#pragma unroll
  for (int c = 0; c < COLS; ++c) acc[c] = 0.f;
#pragma unroll 1
  for (int c0 = it.s0; c0 < it.s1; c0 += MergeKernel::kChunk) {
    const int n = min(MergeKernel::kChunk, it.s1 - c0);
    __syncwarp();  // the previous chunk's weights are consumed
    for (int i = lane; i < n; i += 32) {
      float w = 1.f;
      if constexpr (kSoftmax) {
        const float l = c0 == it.s0 && i < 32 ? mine : lse_of(c0 + i);  // i < 32: i == lane
        w = mx == neg_inf() ? 0.f : fast_exp2((l - mx) * kLog2e) * inv;
      }
      scratch.wts[i] = w;
    }
    __syncwarp();
    // slots in plan order, one accumulator per column: the sum is the same on every run
#pragma unroll MergeKernel::kUnroll
    for (int i = 0; i < n; ++i) {
      const float* src = p.partial_o + ((attncc::i64)(c0 + i) * TQ + r) * D + lane * COLS;
      const float w = scratch.wts[i];
#pragma unroll
      for (int c = 0; c < COLS; c += 2) {
        const float2 v = __ldcg(reinterpret_cast<const float2*>(src + c));
        acc[c] += w * v.x;
        acc[c + 1] += w * v.y;
      }
    }
  }
  float lse = 0.f;
  if constexpr (kSoftmax)
    lse = wsum == 0.f ? neg_inf() : (mx == attncc::pos_inf() ? mx : mx + __logf(wsum));
  const int gf = p.num_q_heads / p.num_kv_heads;
  const int fr = it.q_start + r;
  const int tok = fr / gf;
  const int hq = it.kv_head * gf + (fr - tok * gf);
  if constexpr (kSoftmax) {
    if (p.sinks != nullptr) {  // the merged row is whole: its sink joins here, once
      float f = 1.f;
      join_sink(__ldg(p.sinks + hq), f, lse);
#pragma unroll
      for (int c = 0; c < COLS; ++c) acc[c] *= f;
    }
  }
#pragma unroll
  for (int c = 0; c < COLS; ++c) scratch.row[lane * COLS + c] = acc[c];
  __syncwarp();
  const int q_pos = query_position(p, request_q_pos0(p, it.request), it.qo_offset, tok);
  DType* out = reinterpret_cast<DType*>(p.o) + (it.qo_offset + tok) * p.o_stride_tok +
               hq * p.o_stride_h;
  float vals[D / 32];
#pragma unroll
  for (int j = 0; j < D / 32; ++j) {
    const int d = lane + 32 * j;
    if constexpr (Variant::has_output_transform) {
      vals[j] = Variant::OutputTransform(vp, FloatRow{scratch.row}, it.request, hq, q_pos, d);
    } else {
      vals[j] = scratch.row[d];
    }
  }
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
    if (DV == D || lane + 32 * j < DV)  // a padded head dim: the real columns only
      reinterpret_cast<u16*>(out)[lane + 32 * j] = float_to_elem<DType>(vals[j]);
  if constexpr (kSoftmax) {
    if (p.lse != nullptr && lane == 0)
      p.lse[(attncc::i64)(it.qo_offset + tok) * p.lse_stride_tok + hq] = lse;
  }
  __syncwarp();  // the scratch is reused for the warp's next row
}

// The merge kernel: a fixed grid (at most one CTA per SM) walks the split items m = blockIdx.x,
// + gridDim.x, ..., up to the plan's num_merges. Thread t reads item base + t * gridDim.x -- one
// round of loads per kThreads items, not a dependent walk item by item -- and stages it in shared
// memory; a block-wide prefix sum of the items' rows then numbers all their rows, and warp w
// merges rows w, w + WARPS, ... of that numbering. Spreading rows, not items, over the warps
// matters for decode: a GQA-8 item has 8 rows, so one item at a time kept half of the 16 warps
// idle and the CTA's items ran one after another (docs/serving.md, "Merge kernel and
// programmatic dependent launch").
template <typename Variant, typename DType, int HEAD_DIM, int TQ, int DV = HEAD_DIM>
__device__ __forceinline__ void fa2_merge(const attncc::BatchParams& p,
                                          const typename Variant::Params& vp) {
  constexpr int NTH = MergeKernel::kThreads, WARPS = NTH / 32;
  __shared__ MergeScratch<HEAD_DIM> scratch[WARPS];
  __shared__ MergeItem items[NTH];  // thread t's item (when it has rows to merge)
  __shared__ int row_end[NTH];      // rows of items[0 .. t], inclusive prefix sum
  __shared__ int warp_rows[WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_merges = __ldg(p.plan + kPlanNumMerges);
#pragma unroll 1
  for (int base = blockIdx.x; base < num_merges; base += gridDim.x * NTH) {
    const int m = base + threadIdx.x * gridDim.x;
    int rows = 0;
    if (m < num_merges) {
      const int* merge_indptr = plan_section(p, kPlanMergeIndptrAt);
      const int s0 = __ldg(merge_indptr + m), s1 = __ldg(merge_indptr + m + 1);
      const int* t = plan_section(p, kPlanMergeOutAt) + 5 * m;
      rows = __ldg(t + 4);
      items[threadIdx.x] = MergeItem{__ldg(t), __ldg(t + 1), __ldg(t + 2), __ldg(t + 3), rows, s0,
                                     s1};
    }
    // inclusive prefix sum of `rows` over the block: within each warp, then the warps' totals
    int sum = rows;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, sum, o);
      if (lane >= o) sum += x;
    }
    if (lane == 31) warp_rows[warp] = sum;
    __syncthreads();
    if (warp == 0) {
      int w = lane < WARPS ? warp_rows[lane] : 0;
#pragma unroll
      for (int o = 1; o < WARPS; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += x;
      }
      if (lane < WARPS) warp_rows[lane] = w;
    }
    __syncthreads();
    row_end[threadIdx.x] = sum + (warp > 0 ? warp_rows[warp - 1] : 0);
    __syncthreads();
    const int total = warp_rows[WARPS - 1];
    wait_for_primary();  // everything above read the plan only; the partials come next
#pragma unroll 1
    for (int f = warp; f < total; f += WARPS) {
      // the item of row f: the first t with row_end[t] > f (it has rows, so items[t] is set)
      int lo = 0, hi = NTH - 1;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (row_end[mid] > f) hi = mid; else lo = mid + 1;
      }
      const MergeItem it = items[lo];
      merge_row<Variant, DType, HEAD_DIM, TQ, DV>(p, vp, it, f - (row_end[lo] - it.q_rows), lane,
                                              scratch[warp]);
    }
    __syncthreads();  // items and row_end are rewritten for the next items
  }
  // A CTA with no items waits too: this grid's completion then implies the attention kernel's,
  // which is what the stream's next operation (a plan upload, the next step) relies on.
  wait_for_primary();
}

// The persistent attention kernel: this CTA's queue of work units, in order, and each unit's
// KV heads in order.
// KvT: the cache's element type, DType or an fp8 tag (fa2_kv8.cuh), whose k_scale joins the
// logits' scale here. HALF: the decode form for tiles of 8 fused rows (fa2_attend's kHalf).
template <typename Variant, typename DType, int HEAD_DIM, int TQ, int TKV, int STAGES,
          int M_FRAGS, int KV_WARPS, typename KvT = DType, int DQK = HEAD_DIM,
          int DV = HEAD_DIM, bool HALF = false>
__device__ __forceinline__ void fa2_batch(const attncc::BatchParams& p,
                                          const typename Variant::Params& vp) {
  using Cfg = Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>;
  allow_dependents();  // the merge kernel may launch now (batch_params.cuh)
  const int first = __ldg(plan_cta_indptr(p) + blockIdx.x);
  // The queue's end is read again after every unit (an L1 hit), through asm so that it is not
  // hoisted into a register held through fa2_attend: at head dim 64 the decode kernel sits at
  // its 128-register cap, and ptxas spilled exactly that value (4 bytes) to local memory.
  auto queue_end = [&] {
    int last;
    asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(last)
                 : "l"(plan_cta_indptr(p) + blockIdx.x + 1));
    return last;
  };
#pragma unroll 1
  for (int i = first; i < queue_end(); ++i) {
    const WorkUnit u = queued_unit(p, i);
    const int qo_offset = unit_qo_offset(p, u);
#pragma unroll 1
    for (int h = u.kv_head; h < u.kv_head + u.kv_heads; ++h) {
      __syncthreads();  // the previous head's (unit's) epilogue is done with shared memory
      const BatchWork<DType, HEAD_DIM, TQ, TKV, Cfg::kThreads, KvT, DQK, DV> w(p, u, h, qo_offset);
      const float sm_scale = KvTraits<KvT>::kIs8 ? p.sm_scale * __ldg(p.k_scale + h) : p.sm_scale;
      fa2_attend<Variant, DType, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS, HALF>(w, vp,
                                                                                sm_scale);
    }
  }
}

}  // namespace fa2
}  // namespace attncc

// The line codegen emits per batch kernel: the persistent attention kernel NAME (grid: the plan's
// num_ctas; block: Config::kThreads; dynamic shared memory: Config::kSmemBytes) and the merge
// kernel NAME_merge of its split items (grid: at most one CTA per SM; block:
// MergeKernel::kThreads; static shared memory). KV_DTYPE: the cache's element type (DTYPE, or
// attncc::fa2::kv_e4m3 / kv_e5m2 for an fp8 cache). DQK, DV: the real head dims (HEAD_DIM both,
// or a padded form: BatchWork). HALF: the decode form for 8-row tiles (KernelTiles.half_rows).
#define ATTNCC_FA2_BATCH_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS, \
                               KV_DTYPE, DQK, DV, HALF)                                            \
  extern "C" __global__ void ATTNCC_FA2_LAUNCH_BOUNDS(HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS)\
      NAME(attncc::BatchParams p, VARIANT::Params vp) {                                            \
    attncc::fa2::fa2_batch<VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS, KV_DTYPE, \
                           DQK, DV, HALF>(p, vp);                                                  \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(attncc::fa2::MergeKernel::kThreads, 1)              \
      NAME##_merge(attncc::BatchParams p, VARIANT::Params vp) {                                    \
    attncc::fa2::fa2_merge<VARIANT, DTYPE, HEAD_DIM, TQ, DV>(p, vp);                               \
  }

#endif  // ATTNCC_FA2_BATCH_CUH
