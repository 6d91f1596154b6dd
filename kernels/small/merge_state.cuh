// merge_state.cuh: two attention states of the same rows, over disjoint KV ranges, merged into
// one -- the composition operator of the FlashInfer paper (arXiv 2501.01005, §2.2):
//
//     lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b
//
// (natural logs, as runtime/serving/merge.py's reference). Used by CascadeAttention to join the
// shared prefix's pass with the suffixes' pass, and by attncc.merge_state on CUDA tensors. One
// launch instead of the dozen elementwise torch ops the same formula costs -- at decode sizes each
// of those is a launch of a few microseconds doing nanoseconds of work.
//
// Work: one thread per 8 consecutive elements of a row (one 16-byte load of a 16-bit type, two
// of float), so a warp reads 512 contiguous bytes of a bf16 row pair. Each thread recomputes its
// row's weights from the two lse values (two loads that hit L1 after the first thread of the
// row); no shared memory, no synchronisation. A state with lse = -inf is empty: its o is never
// read, so garbage (or NaN) there cannot leak; two empty states give o = 0, lse = -inf.
// Variants without softmax (normalize='none') have no lse: o = o_a + o_b.
//   grid (ceil(rows * head_dim / 8 / kThreads)), block (kThreads). Requires attncc_types.cuh.
#ifndef ATTNCC_MERGE_STATE_CUH
#define ATTNCC_MERGE_STATE_CUH

namespace attncc {

// Mirrored in Python: attncc.codegen.layout.MERGE_STATE_PARAMS (offsets static_asserted). The o
// arrays are [rows, head_dim], contiguous, 16-byte aligned; head_dim % 8 == 0. lse_out may be
// null (not wanted); lse_a / lse_b / lse_out are unused when softmax == 0.
struct MergeStateParams {
    const void* o_a;
    const float* lse_a;
    const void* o_b;
    const float* lse_b;
    void* o_out;
    float* lse_out;
    i64 rows;
    int head_dim;
    int softmax;
};

namespace merge {

constexpr int kThreads = 256;

// 8 elements starting at p (16-byte aligned) as floats.
__device__ __forceinline__ void load8(const bf16* p, float (&x)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void load8(const f16* p, float (&x)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f16 lo, hi;
        lo.bits = (u16)(w[i] & 0xffffu);
        hi.bits = (u16)(w[i] >> 16);
        x[2 * i] = to_float(lo);
        x[2 * i + 1] = to_float(hi);
    }
}
__device__ __forceinline__ void load8(const float* p, float (&x)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// 8 floats rounded to T, stored at p (16-byte aligned).
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&x)[8]) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = (u32)from_float<T>(x[2 * i]).bits | ((u32)from_float<T>(x[2 * i + 1]).bits << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
template <>
__device__ __forceinline__ void store8<float>(float* p, const float (&x)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}

// The weights of the two states in their merge, and the merged lse. An empty state (-inf) gets
// weight 0 and is never read (the caller tests its lse). NaN and +inf propagate as in one
// softmax over both ranges: a NaN lse makes the weights and lse NaN (fmaxf alone would drop it),
// a +inf lse (a +inf logit) makes them NaN and the lse +inf.
__device__ __forceinline__ void weights(float la, float lb, float& wa, float& wb, float& lse) {
    const float m = (la != la || lb != lb) ? la + lb : fmaxf(la, lb);
    if (m == neg_inf()) {
        wa = wb = 0.f;
        lse = neg_inf();
        return;
    }
    const float ea = expf(la - m), eb = expf(lb - m);  // 0 for an empty state, 1 for the larger
    const float inv = 1.f / (ea + eb);
    wa = ea * inv;
    wb = eb * inv;
    lse = m == pos_inf() ? m : m + logf(ea + eb);
}

template <typename T>
__device__ __forceinline__ void merge_state(const MergeStateParams& p) {
    const int chunks = p.head_dim / 8;
    const i64 idx = (i64)blockIdx.x * kThreads + threadIdx.x;
    if (idx >= p.rows * chunks) return;
    const i64 row = idx / chunks;
    float wa = 1.f, wb = 1.f, lse = 0.f;
    bool read_a = true, read_b = true;  // a weight that underflowed to 0 still reads (0 * NaN)
    if (p.softmax) {
        const float la = p.lse_a[row], lb = p.lse_b[row];
        weights(la, lb, wa, wb, lse);
        read_a = la != neg_inf();
        read_b = lb != neg_inf();
    }
    float out[8], x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = 0.f;
    if (read_a) {
        load8(static_cast<const T*>(p.o_a) + idx * 8, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = wa * x[i];
    }
    if (read_b) {
        load8(static_cast<const T*>(p.o_b) + idx * 8, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] += wb * x[i];
    }
    store8<T>(static_cast<T*>(p.o_out) + idx * 8, out);
    if (p.softmax && p.lse_out != nullptr && idx % chunks == 0) p.lse_out[row] = lse;
}

}  // namespace merge
}  // namespace attncc

// One extern "C" entry per storage type; the launcher looks them up by name.
#define ATTNCC_MERGE_STATE_ENTRY(NAME, T)                                                        \
    extern "C" __global__ void __launch_bounds__(attncc::merge::kThreads)                        \
        NAME(const attncc::MergeStateParams p) {                                                 \
        attncc::merge::merge_state<T>(p);                                                        \
    }

#endif  // ATTNCC_MERGE_STATE_CUH
