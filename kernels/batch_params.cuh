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
//   merge_count               workspace: one arrival counter per split item (zeroed once).
//   plan      the packed plan (attncc.runtime.scheduler): units, per-CTA queues, merge map.
#ifndef ATTNCC_BATCH_PARAMS_CUH
#define ATTNCC_BATCH_PARAMS_CUH

namespace attncc {

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
    const int* units;            // [num_units][8]: WORK_UNIT_DTYPE of attncc.runtime.scheduler
    const int* cta_indptr;       // [num_ctas + 1]: CTA c runs cta_units[cta_indptr[c] ..]
    const int* cta_units;
    const int* merge_indptr;     // [num_merges + 1]: split item m's parts are partial slots
                                 // merge_indptr[m] .. merge_indptr[m + 1] (ascending kv start)
    const int* slot_merge;       // [num_partial_slots]: each slot's split item
    const int* merge_out;        // [num_merges][5]: MERGE_TARGET_DTYPE
    const int* num_merges;       // device-side count (the plan header), so a captured graph
                                 // replays with any plan
    const int* q_positions;      // [total_q_tokens] query positions the hooks see, or null:
                                 // then token t of request i is kv_lens[i] - q_len_i + t
    const int* kv_pos_offset;    // [batch] added to kv positions for the hooks, or null
    int* merge_count;            // [max_merges] workspace: parts of each split item written so
                                 // far (0 between launches; the FA2 batch kernel's last part
                                 // merges and puts it back to 0)
    const void* tma;             // the FA3 batch kernel's q / k / v tensor maps (3 x 128 bytes,
                                 // fa3_batch.cuh), or null for the FA2 batch kernel
    i64 q_stride_tok, q_stride_h;
    i64 o_stride_tok, o_stride_h;
    i64 kv_stride_page, kv_stride_slot, kv_stride_h;
    int lse_stride_tok;
    int num_q_heads, num_kv_heads;
    int page_size;               // tokens per page
    int page_shift;              // log2(page_size) when it is a power of two, else -1
    float sm_scale;
};

}  // namespace attncc

#endif  // ATTNCC_BATCH_PARAMS_CUH
