// kv_transform.cuh: a variant's KeyTransform / ValueTransform applied once to every K/V row, as a
// pre-pass before attention.
//
// Why a pre-pass: key_mod and value_mod see only the row and its position (b, KV head, kv_idx,
// d), never the query, yet an attention kernel re-applies them to every tile it loads -- once
// per query block and per query head sharing the KV head. For RoPE on keys at 8K tokens that
// is 64+ recomputations of each row and made attention 4x slower than rotating first
// (bench/NOTES.md). attncc.ir.hoist splits the hooks off; this kernel writes transformed copies
// of K and/or V once (an extra read and write of K/V), and attention then runs with identity
// key/value hooks on the copies. The transformed element is rounded to the storage type here, as
// the attention kernels round it into their shared-memory tiles, so both paths give the same
// values.
//
// Layout: one warp per row (b, h_kv, kv_idx); kRowsPerCta rows per CTA. The warp stages its row
// as float in shared memory (a transform may read any element: RoPE reads (d + D/2) % D), then
// computes and stores its D outputs. Loads and stores move two elements (one 32-bit word) per
// lane, so a warp touches 128 contiguous bytes per instruction.
//   grid (ceil(kv_len / kRowsPerCta), num_kv_heads, batch), block (32 * kRowsPerCta).
// Requires attncc_types.cuh.
#ifndef ATTNCC_KV_TRANSFORM_CUH
#define ATTNCC_KV_TRANSFORM_CUH

namespace attncc {

// Mirrored in Python: attncc.codegen.layout.KV_TRANSFORM_PARAMS (offsets static_asserted).
struct KvTransformParams {
    const void* k;  // [batch, num_kv_heads, kv_len, D], element strides, head dim contiguous
    const void* v;
    void* k_out;  // written only when the variant has a KeyTransform (else may be null)
    void* v_out;  // written only when it has a ValueTransform
    i64 k_stride_b, k_stride_h, k_stride_s;
    i64 v_stride_b, v_stride_h, v_stride_s;
    i64 k_out_stride_b, k_out_stride_h, k_out_stride_s;
    i64 v_out_stride_b, v_out_stride_h, v_out_stride_s;
    int batch, num_kv_heads, kv_len;
};

namespace kvt {

constexpr int kRowsPerCta = 8;

// A staged row as the `Vec` the transforms take.
struct StagedRow {
    const float* x;
    __device__ __forceinline__ float operator[](int d) const { return x[d]; }
};

// One warp: out_row[d] = f(StagedRow{in_row}, d) for every d < D. `stage` is this warp's D floats.
template <typename DType, int D, typename F>
__device__ __forceinline__ void transform_row(const DType* in_row, DType* out_row, float* stage,
                                              int lane, F&& f) {
    static_assert(sizeof(DType) == 2 && D % 64 == 0, "16-bit rows of a multiple of 64 elements");
    constexpr int kWords = D / 2 / 32;  // 32-bit words (element pairs) per lane
    const u32* in = reinterpret_cast<const u32*>(in_row);
    #pragma unroll
    for (int j = 0; j < kWords; ++j) {
        const int w = lane + 32 * j;
        const u32 pair = in[w];
        DType lo, hi;
        lo.bits = (u16)(pair & 0xffffu);
        hi.bits = (u16)(pair >> 16);
        stage[2 * w] = to_float(lo);
        stage[2 * w + 1] = to_float(hi);
    }
    __syncwarp();  // every element staged before any lane reads another lane's
    const StagedRow row{stage};
    u32 outw[kWords];
    #pragma unroll
    for (int j = 0; j < kWords; ++j) {
        const int w = lane + 32 * j;
        const DType lo = from_float<DType>(f(row, 2 * w));
        const DType hi = from_float<DType>(f(row, 2 * w + 1));
        outw[j] = (u32)lo.bits | ((u32)hi.bits << 16);
    }
    u32* out = reinterpret_cast<u32*>(out_row);
    #pragma unroll
    for (int j = 0; j < kWords; ++j) out[lane + 32 * j] = outw[j];
    __syncwarp();  // the stage is free for the next row only after every lane read it
}

// Row (b, h, s) of a [batch, heads, len, D] tensor with element strides (sb, sh, ss).
template <typename T>
__device__ __forceinline__ T* row_of(T* base, i64 sb, i64 sh, i64 ss, int b, int h, int s) {
    return base + b * sb + h * sh + s * ss;
}

template <typename Variant, typename DType, int HEAD_DIM>
__device__ void kv_transform(const KvTransformParams& p, const typename Variant::Params& vp) {
    __shared__ float stage[kRowsPerCta][HEAD_DIM];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kv = blockIdx.x * kRowsPerCta + warp, h_kv = blockIdx.y, b = blockIdx.z;
    if (kv >= p.kv_len) return;  // warps never meet at a CTA barrier, so leaving early is safe
    if constexpr (Variant::has_key_transform) {
        transform_row<DType, HEAD_DIM>(
            row_of(static_cast<const DType*>(p.k), p.k_stride_b, p.k_stride_h, p.k_stride_s,
                   b, h_kv, kv),
            row_of(static_cast<DType*>(p.k_out), p.k_out_stride_b, p.k_out_stride_h,
                   p.k_out_stride_s, b, h_kv, kv),
            stage[warp], lane, [&](const StagedRow& k, int d) {
                return Variant::KeyTransform(vp, k, b, h_kv, kv, d);
            });
    }
    if constexpr (Variant::has_value_transform) {
        transform_row<DType, HEAD_DIM>(
            row_of(static_cast<const DType*>(p.v), p.v_stride_b, p.v_stride_h, p.v_stride_s,
                   b, h_kv, kv),
            row_of(static_cast<DType*>(p.v_out), p.v_out_stride_b, p.v_out_stride_h,
                   p.v_out_stride_s, b, h_kv, kv),
            stage[warp], lane, [&](const StagedRow& v, int d) {
                return Variant::ValueTransform(vp, v, b, h_kv, kv, d);
            });
    }
}

}  // namespace kvt
}  // namespace attncc

#endif  // ATTNCC_KV_TRANSFORM_CUH
