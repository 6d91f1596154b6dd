// bwd_dq.cuh: the FA3-class backward's dQ out of its fp32 accumulator, in one launch. The
// kernel's producer adds each consumer's staged dQ tile into dq_accum with a bulk reduction, so
// dq_accum holds every 64 x 64 block of dQ in the consumers' staging order (fa3_backward.cuh
// `stage_dq`): 1024 groups of four floats, group 128 j + t holding thread t's accumulator
// elements 4 j .. 4 j + 3, where element 4 j + 2 hr + i of thread t = 32 wi + 4 r + a is row
// 16 wi + 8 hr + r, column 8 j + 2 a + i. This kernel converts to the storage type and puts
// rows and columns back, times sm_scale (docs/backward.md, "Warp specialization").
//
// Work: one CTA per block. Its 256 threads read the block's 16 KB as consecutive 16-byte
// groups, write each as two converted pairs into shared memory at their rows (a row stride of
// 36 words: a warp's pairs land in 32 different banks), then write the rows back out as
// 16-byte chunks (a row's 128 bytes by eight consecutive threads). Rows past q_len are not
// written. dq's rows are 16-byte aligned with strides in multiples of 8 elements (the
// launcher's check: runtime/flex/backward.py fa3_dq).
//   grid (batch * heads * tiles * head_dim / 64), block (kThreads).
// Requires attncc_types.cuh.
#ifndef ATTNCC_BWD_DQ_CUH
#define ATTNCC_BWD_DQ_CUH

namespace attncc {

// Mirrored in Python: attncc.codegen.layout.BWD_DQ_PARAMS (offsets static_asserted). Strides in
// elements.
struct BwdDqParams {
    const float* acc;  // [batch, heads, tiles, head_dim / 64, 4096] in the staging order
    void* dq;          // [batch, heads, q_len, head_dim]
    i64 dq_stride_b, dq_stride_h, dq_stride_s;
    int heads, q_len, tiles, groups;  // groups: head_dim / 64
    float scale;  // sm_scale: the backward kernel stages dS K, dQ is scale times its sum
};

namespace bwddq {

constexpr int kThreads = 256;
constexpr int kRowWords = 36;  // 32 words of a row's pairs + 4: conflict-free stores and loads

template <typename T>
__device__ __forceinline__ u32 pair(float lo, float hi) {
    return (u32)from_float<T>(lo).bits | ((u32)from_float<T>(hi).bits << 16);
}

template <typename T>
__device__ __forceinline__ void bwd_dq(const BwdDqParams& p) {
    __shared__ __align__(16) u32 sm[64 * kRowWords];
    const i64 blk = blockIdx.x;  // ((b * heads + h) * tiles + tile) * groups + g
    const int g = (int)(blk % p.groups);
    const i64 bt = blk / p.groups;
    const int tile = (int)(bt % p.tiles);
    const i64 bh = bt / p.tiles;
    const int b = (int)(bh / p.heads), h = (int)(bh % p.heads);
    const float4* src = reinterpret_cast<const float4*>(p.acc) + blk * 1024;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int f = threadIdx.x + kThreads * m;  // group 128 j + t
        const float4 v = src[f];
        const int j = f >> 7, t = f & 127;
        const int row = 16 * (t >> 5) + ((t >> 2) & 7), w = 4 * j + (t & 3);
        sm[row * kRowWords + w] = pair<T>(v.x * p.scale, v.y * p.scale);
        sm[(row + 8) * kRowWords + w] = pair<T>(v.z * p.scale, v.w * p.scale);
    }
    __syncthreads();
    T* out = static_cast<T*>(p.dq) + b * p.dq_stride_b + h * p.dq_stride_h + 64 * g;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int u = threadIdx.x + kThreads * m, row = u >> 3, c = u & 7;
        const int s = tile * 64 + row;
        if (s < p.q_len)
            *reinterpret_cast<uint4*>(out + s * p.dq_stride_s + 8 * c) =
                *reinterpret_cast<const uint4*>(sm + row * kRowWords + 4 * c);
    }
}

}  // namespace bwddq
}  // namespace attncc

// One extern "C" entry per 16-bit storage type; the launcher looks them up by name.
#define ATTNCC_BWD_DQ_ENTRY(NAME, T)                                                             \
    extern "C" __global__ void __launch_bounds__(attncc::bwddq::kThreads)                        \
        NAME(const attncc::BwdDqParams p) {                                                      \
        attncc::bwddq::bwd_dq<T>(p);                                                             \
    }

#endif  // ATTNCC_BWD_DQ_CUH
