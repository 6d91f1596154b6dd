// prepass.cuh: a variant's QueryTransform / KeyTransform / ValueTransform applied once to every
// row of q / k / v, as a pre-pass before attention.
//
// Why a pre-pass: key_mod and value_mod see only the row and its position (b, KV head, kv_idx, d),
// never the query, yet an attention kernel re-applies them to every tile it loads -- once per
// query block and per query head sharing the KV head. For RoPE on keys at 8K tokens that is 64+
// recomputations of each row and made attention several times slower than rotating first
// (docs/fa2.md, "Transform pre-pass"). A query transform
// runs once per row inside attention too, but there it sits on the CTA's critical path at one CTA
// per SM, before the first GEMM; here it runs at full occupancy. attncc.ir.hoist splits the hooks
// off; this kernel writes transformed copies, and attention then runs with identity hooks on them.
// The transformed element is rounded to the storage type here, as the attention kernels round it
// into their shared-memory tiles, so both paths give the same values.
//
// Work: one task = kRowsPerWarp consecutive rows of one tensor (flat row (b * heads + h) * len +
// s), one warp per task, kWarps tasks per CTA; the q tasks come first, then k, then v. A warp
// walks its rows in order, so the parts of a hook that depend only on d (RoPE's frequency
// exp(-2i log(base) / D), the partner index, the sign) are loop-invariant and computed once per
// warp rather than once per row. Each row is staged as float in shared memory (a transform may
// read any element: RoPE reads (d + D/2) % D); loads and stores move one 32-bit word (two
// elements) per lane, 128 contiguous bytes per warp instruction.
//   grid (ceil((warps_q + warps_k + warps_v) / kWarps)), block (32 * kWarps).
// Requires attncc_types.cuh.
#ifndef ATTNCC_PREPASS_CUH
#define ATTNCC_PREPASS_CUH

namespace attncc {

// Mirrored in Python: attncc.codegen.layout.PREPASS_PARAMS (offsets static_asserted). Tensors are
// [batch, heads, len, D] with element strides and a contiguous head dim; an output is written
// only when the variant has that hook (else it may be null and its task count is 0).
struct PrepassParams {
    const void* q;
    const void* k;
    const void* v;
    void* q_out;
    void* k_out;
    void* v_out;
    i64 q_stride_b, q_stride_h, q_stride_s;
    i64 k_stride_b, k_stride_h, k_stride_s;
    i64 v_stride_b, v_stride_h, v_stride_s;
    i64 q_out_stride_b, q_out_stride_h, q_out_stride_s;
    i64 k_out_stride_b, k_out_stride_h, k_out_stride_s;
    i64 v_out_stride_b, v_out_stride_h, v_out_stride_s;
    int batch, num_q_heads, num_kv_heads, q_len, kv_len;
    int warps_q, warps_k, warps_v;  // tasks per tensor: ceil(rows / kRowsPerWarp), or 0
};

namespace prepass {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 16;

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

// One tensor of the pre-pass: where it is, where its copy goes, its shape.
struct Rows {
    const void* in;
    void* out;
    i64 sb, sh, ss, osb, osh, oss;
    int heads, len;
};

// Task `task` of tensor `t`: rows task * kRowsPerWarp .. + kRowsPerWarp - 1 (clipped), each
// out = hook(row, b, h, s, d). The position (b, h, s) is divided out once and then stepped.
template <typename DType, int D, typename Hook>
__device__ __forceinline__ void transform_task(const Rows& t, int batch, int task, float* stage,
                                               int lane, Hook&& hook) {
    const i64 total = (i64)batch * t.heads * t.len;
    const i64 first = (i64)task * kRowsPerWarp;
    const int n = (int)min((i64)kRowsPerWarp, total - first);
    int s = (int)(first % t.len);
    const i64 bh = first / t.len;
    int h = (int)(bh % t.heads), b = (int)(bh / t.heads);
    for (int r = 0; r < n; ++r) {
        const DType* in = static_cast<const DType*>(t.in) + b * t.sb + h * t.sh + s * t.ss;
        DType* out = static_cast<DType*>(t.out) + b * t.osb + h * t.osh + s * t.oss;
        transform_row<DType, D>(in, out, stage, lane, [&](const StagedRow& x, int d) {
            return hook(x, b, h, s, d);
        });
        if (++s == t.len) {
            s = 0;
            if (++h == t.heads) h = 0, ++b;
        }
    }
}

enum Tensor { kQ, kK, kV };

// Where tensor T's rows are, where its copy goes, and its shape.
template <Tensor T>
__device__ __forceinline__ Rows rows_of(const PrepassParams& p) {
    if constexpr (T == kQ)
        return {p.q, p.q_out, p.q_stride_b, p.q_stride_h, p.q_stride_s, p.q_out_stride_b,
                p.q_out_stride_h, p.q_out_stride_s, p.num_q_heads, p.q_len};
    else if constexpr (T == kK)
        return {p.k, p.k_out, p.k_stride_b, p.k_stride_h, p.k_stride_s, p.k_out_stride_b,
                p.k_out_stride_h, p.k_out_stride_s, p.num_kv_heads, p.kv_len};
    else
        return {p.v, p.v_out, p.v_stride_b, p.v_stride_h, p.v_stride_s, p.v_out_stride_b,
                p.v_out_stride_h, p.v_out_stride_s, p.num_kv_heads, p.kv_len};
}

// The variant's transform of tensor T.
template <typename Variant, Tensor T>
__device__ __forceinline__ float hook(const typename Variant::Params& vp, const StagedRow& x,
                                      int b, int h, int s, int d) {
    if constexpr (T == kQ) return Variant::QueryTransform(vp, x, b, h, s, d);
    else if constexpr (T == kK) return Variant::KeyTransform(vp, x, b, h, s, d);
    else return Variant::ValueTransform(vp, x, b, h, s, d);
}

// Run `task` if it is one of tensor T's `count` tasks (true), else make it relative to the next
// tensor's tasks (false).
template <typename Variant, typename DType, int D, Tensor T>
__device__ __forceinline__ bool run_task(const PrepassParams& p,
                                         const typename Variant::Params& vp, int& task,
                                         int count, float* stage, int lane) {
    if (task >= count) {
        task -= count;
        return false;
    }
    transform_task<DType, D>(rows_of<T>(p), p.batch, task, stage, lane,
                             [&](const StagedRow& x, int b, int h, int s, int d) {
        return hook<Variant, T>(vp, x, b, h, s, d);
    });
    return true;
}

template <typename Variant, typename DType, int HEAD_DIM>
__device__ void prepass(const PrepassParams& p, const typename Variant::Params& vp) {
    __shared__ float stage[kWarps][HEAD_DIM];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int task = blockIdx.x * kWarps + warp;  // q tasks first, then k, then v
    float* st = stage[warp];
    if constexpr (Variant::has_query_transform)
        if (run_task<Variant, DType, HEAD_DIM, kQ>(p, vp, task, p.warps_q, st, lane)) return;
    if constexpr (Variant::has_key_transform)
        if (run_task<Variant, DType, HEAD_DIM, kK>(p, vp, task, p.warps_k, st, lane)) return;
    if constexpr (Variant::has_value_transform)
        run_task<Variant, DType, HEAD_DIM, kV>(p, vp, task, p.warps_v, st, lane);
}

}  // namespace prepass
}  // namespace attncc

#endif  // ATTNCC_PREPASS_CUH
