// backward_params.cuh: the argument struct of the attention backward kernels (fa2_backward.cuh).
//
// Passed by value as the first kernel argument, before VariantParams_<name> and
// VariantGrads_<name>. Mirrored in Python (attncc.codegen.layout.BACKWARD_PARAMS); every generated
// backward unit static_asserts each offset and the size. Requires attncc_types.cuh (attncc::i64).
// docs/backward.md, "Kernels", says what each buffer holds.
#ifndef ATTNCC_BACKWARD_PARAMS_CUH
#define ATTNCC_BACKWARD_PARAMS_CUH

namespace attncc {

struct BackwardParams {
    const void* q;      // [B, Hq, Sq, D] the forward's (transformed) q, k, v
    const void* k;      // [B, Hkv, Skv, D]
    const void* v;
    const void* dout;   // [B, Hq, Sq, D] gradient of the output
    const float* lse;   // [B, Hq, Sq] the forward's log-sum-exp (natural log); null: normalize none
    const float* delta; // [B, Hq, Sq] rowsum(dO * O) - dLSE; null: normalize none
    float* dq_accum;    // [B, Hq, Sq, D] fp32, zeroed before launch; atomically accumulated
    void* dk;           // [B, Hkv, Skv, D] written once per row
    void* dv;

    // Strides in elements; the head dim is contiguous (stride 1).
    i64 q_stride_b, q_stride_h, q_stride_s;
    i64 k_stride_b, k_stride_h, k_stride_s;
    i64 v_stride_b, v_stride_h, v_stride_s;
    i64 do_stride_b, do_stride_h, do_stride_s;
    i64 dq_stride_b, dq_stride_h, dq_stride_s;
    i64 dk_stride_b, dk_stride_h, dk_stride_s;
    i64 dv_stride_b, dv_stride_h, dv_stride_s;
    i64 lse_stride_b, lse_stride_h;  // lse and delta share this layout, q contiguous

    int batch, num_q_heads, num_kv_heads, q_len, kv_len;
    float sm_scale;
    float sm_scale_log2;  // sm_scale * log2(e) rounded to float, as the forward's exp2 takes it

    // The block mask's KV-major (transposed) lists: for each (b, h, KV block) the query blocks
    // that touch it, partial ones (LogitsMask applies) and full ones. All null: no block mask.
    const int* q_num_blocks;       // [Bm, Hm, nKvb]
    const int* q_indices;          // [Bm, Hm, nKvb, maxQb]
    const int* full_q_num_blocks;  // may be null
    const int* full_q_indices;
    i64 qm_stride_b, qm_stride_h;                // strides of q_num_blocks; 0 broadcasts b / h
    i64 qi_stride_b, qi_stride_h, qi_stride_kv;  // strides of q_indices (full_* share them)
    int block_q, block_kv;
    // first KV tile of the launch (CTA x runs tile kv_tile0 + x / C, fa2_backward.cuh bwd_cta):
    // 0, or the tile of one launch of the deterministic sequence (docs/backward.md, "Kernels")
    int kv_tile0;
    // FA3-class kernel only: its q, k, v, dO tensor maps (fa3_backward.cuh). There `lse` holds
    // per 64-row query tile its LSE (base 2, +inf for a row with no weight) then its delta
    // ([B, Hq, tiles, 2, 64]; `delta` is null), and dq_accum each query tile in the kernel's
    // staging order (runtime/flex/backward.py _fa3_rows, fa3_dq). Null for the FA2-class kernel.
    const void* tma;
};

}  // namespace attncc

#endif  // ATTNCC_BACKWARD_PARAMS_CUH
