// batch_params.cuh: the argument struct of the persistent batch kernels (fa2_batch.cuh).
//
// Passed by value as the first kernel argument; mirrored in Python (attncc.codegen.layout.
// BATCH_PARAMS) and static_asserted in every generated translation unit, like AttentionParams.
// Requires attncc_types.cuh (attncc::i64).
//
// Tensors (FlashInfer's serving layouts, no padding):
//   q, o      [total_q_tokens, num_q_heads, D]        request i owns tokens qo_indptr[i] ..
//   lse       [total_q_tokens, num_q_heads] float32   (may be null)
//   k, v      a paged cache: page p, slot s, KV head h at  p*kv_stride_page + s*kv_stride_slot +
//             h*kv_stride_h  (NHD: [pages, page_size, H, D]; HND: [pages, H, page_size, D]);
//             request i's pages are kv_page_indices[kv_page_indptr[i] ..], its length kv_lens[i].
//             A ragged (contiguous) cache is the same with one "page" per request: page id = the
//             request's first token, page_size = 2^30, kv_stride_page = kv_stride_slot.
//   partial_o / partial_lse   workspace: slot s holds TQ rows of fp32 O [TQ, D] and LSE [TQ].
//   plan      the packed plan (attncc.runtime.serving.plan.format, PLAN_VERSION 6): its int32
//             header, cta_indptr right after it, then the sections whose sizes vary from plan
//             to plan (units, per-CTA queues, merge map) back to back at word offsets the header
//             holds -- so a plan is one contiguous range, one host-to-device copy.
//             plan_section() finds a section.
#ifndef ATTNCC_BATCH_PARAMS_CUH
#define ATTNCC_BATCH_PARAMS_CUH

namespace attncc {

// Words of the plan header (attncc.codegen.layout.PLAN_HEADER_FIELDS) the kernels read; every
// generated batch translation unit static_asserts them against Python (PLAN_HEADER_CONSTANTS).
constexpr int kPlanHeaderWords = 24;    // the header's size: cta_indptr follows it
constexpr int kPlanNumMerges = 5;       // split items: the merge kernel's bound
// The word offsets (from the plan's start) of the sections whose sizes vary:
constexpr int kPlanUnitsAt = 14;        // units [num_units][8]: WORK_UNIT_DTYPE
constexpr int kPlanCtaUnitsAt = 15;     // cta_units [num_units]: the CTAs' queues of units
constexpr int kPlanMergeIndptrAt = 16;  // merge_indptr [num_merges + 1]: split item m's parts
                                        // are partial slots merge_indptr[m] .. [m + 1]
                                        // (ascending kv start)
constexpr int kPlanMergeOutAt = 17;     // merge_out [num_merges][5]: MERGE_TARGET_DTYPE

struct BatchParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    float* partial_o;
    float* partial_lse;
    const int* qo_indptr;        // [batch + 1]
    const int* kv_page_indptr;   // [batch + 1]
    const int* kv_page_indices;  // page ids
    const int* kv_lens;          // [batch]
    const int* plan;             // the packed plan in the workspace: read on the device (its
                                 // counts and section offsets too), so a captured graph
                                 // replays with any plan
    const int* q_positions;      // [total_q_tokens] query positions the hooks see, or null:
                                 // then token t of request i is kv_lens[i] - q_len_i + t
    const int* kv_pos_offset;    // [batch] added to kv positions for the hooks, or null
    const void* tma;             // the FA3 batch kernel's q / k / v tensor maps (3 x 128 bytes,
                                 // fa3_batch.cuh), or null for the FA2 batch kernel
    const int* tree_mask;        // [batch][16] multi-token decode tree rows, or null: bit j of
                                 // word 16*i + t keeps request i's key kv_lens[i] - q_len_i + j
                                 // for its query t (the FA2 batch kernel; docs/serving.md,
                                 // "Multi-token decode and tree masks")
    i64 q_stride_tok, q_stride_h;
    i64 o_stride_tok, o_stride_h;
    i64 kv_stride_page, kv_stride_slot, kv_stride_h;
    int lse_stride_tok;
    int num_q_heads, num_kv_heads;
    int page_size;               // tokens per page
    int page_shift;              // log2(page_size) when it is a power of two, else -1
    float sm_scale;
    const float* sinks;          // [num_q_heads] float32 sink logits (common.cuh join_sink), or
                                 // null: joined once per row, in the epilogue or the merge
    const float* k_scale;        // [num_kv_heads] an fp8 cache's key / value scales (the
    const float* v_scale;        // cache holds k / k_scale), or null for a 16-bit cache
};

// Section `at` (one of the kPlan*At words) of the packed plan. Its offset is loaded at each use
// (one L1-cached load) rather than kept in a pointer: the FA3 batch kernel's producer warp runs
// on 24 registers, and BatchParams' members, kernel parameters, cost it none.
__device__ __forceinline__ const int* plan_section(const BatchParams& p, int at) {
  return p.plan + __ldg(p.plan + at);
}

// Programmatic dependent launch (sm_90+). The merge kernel is launched with the programmatic
// stream-serialization attribute (runtime/jit/launcher.py, `pdl=True`), so its CTAs may start while
// the attention kernel's last units still run: the attention kernel calls allow_dependents() as
// it starts (its grid is persistent, so every CTA is resident by then, and a merge CTA only takes
// an SM's room that attention CTAs left), and the merge kernel reads the plan -- written before
// either launch -- then calls wait_for_primary() before the first partial state it reads:
// griddepcontrol.wait returns once the attention grid has finished and its stores are visible.
// The merge's launch and its plan prologue then overlap the attention kernel's tail instead of
// following it. Both are no-ops before sm_90 and when the launch carried no attribute.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// cta_indptr [max_ctas + 1] (past num_ctas padded with num_units): CTA c runs the units
// cta_units[cta_indptr[c] .. cta_indptr[c + 1]). At a fixed offset: no load.
__device__ __forceinline__ const int* plan_cta_indptr(const BatchParams& p) {
  return p.plan + kPlanHeaderWords;
}

}  // namespace attncc

#endif  // ATTNCC_BATCH_PARAMS_CUH
