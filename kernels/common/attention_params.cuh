// attention_params.cuh: the one argument struct every attncc kernel template takes.
//
// Passed by value as the first kernel argument. Its layout is mirrored in Python
// (attncc.codegen.layout.ATTENTION_PARAMS) and every generated translation unit static_asserts
// each offset and the size, so a Python/C mismatch fails at compile time, not as garbage reads.
// Requires attncc_types.cuh (attncc::i64).
#ifndef ATTNCC_ATTENTION_PARAMS_CUH
#define ATTNCC_ATTENTION_PARAMS_CUH

namespace attncc {

struct AttentionParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;  // may be null: then no log-sum-exp is written

    // Strides in elements; the head dim is contiguous (stride 1).
    i64 q_stride_b, q_stride_h, q_stride_s;
    i64 k_stride_b, k_stride_h, k_stride_s;
    i64 v_stride_b, v_stride_h, v_stride_s;
    i64 o_stride_b, o_stride_h, o_stride_s;
    i64 lse_stride_b, lse_stride_h;  // lse[b, h, q] (float32, natural log), q contiguous

    int batch, num_q_heads, num_kv_heads, q_len, kv_len;
    float sm_scale;  // score = dot(q, k) * sm_scale before LogitsTransform

    // FlexAttention BlockMask (BSR). All null when there is no block mask: then every block is
    // "partial" (LogitsMask applies everywhere).
    const int* kv_num_blocks;  // [Bm, Hm, nQb]
    const int* kv_indices;     // [Bm, Hm, nQb, maxKvb]
    const int* full_kv_num_blocks;  // may be null: no block is known to be fully unmasked
    const int* full_kv_indices;
    i64 bm_stride_b, bm_stride_h;                // strides of kv_num_blocks; 0 broadcasts b / h
    i64 bi_stride_b, bi_stride_h, bi_stride_q;   // strides of kv_indices (full_* share them)
    int block_q, block_kv;                       // BLOCK_SIZE of the block mask

    // FA3 template only: four TMA tensor maps (128 bytes each, 64-byte aligned) in global
    // memory: q, k, v as [rows, head_dim] matrices and o as [batch, heads, q_len, head_dim]
    // (its strides; the epilogue's stores). Null for other templates.
    const void* tma;
    // FA3 template only: the dynamic item order's counter (one int, zero at launch; the runtime
    // hands each launch a fresh one). Null for other templates and at head dim 256, where each
    // CTA runs one item and claims none.
    int* item_counter;
    // FA3 template only: the split tail's workspace (kernels/fa3/fa3_split.cuh; float4 slots of the
    // consumer warps' partial state, written before read), and then item_counter holds one
    // arrival counter per tail item and consumer warp after the claim counter. Null: no split.
    float* split_partials;
    // Attention sinks: one float32 logit per query head [num_q_heads], joined to every row's
    // softmax denominator once (common.cuh join_sink), or null for none.
    const float* sinks;
};

}  // namespace attncc

#endif  // ATTNCC_ATTENTION_PARAMS_CUH
