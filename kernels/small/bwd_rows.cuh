// bwd_rows.cuh: the per-row inputs of the FA3-class backward in one launch. For each query row
// of a (batch, head): its LSE in base 2 (+inf for a row with no weight, so the backward's P is 0
// there, never NaN) and delta = rowsum(dO * O) - dLSE in fp32, stored per 64-row query tile as
// [2][64] floats (the LSE rows, then delta), rows past q_len padded with +inf and 0 -- the
// layout fa3_backward.cuh's producer reads with one bulk copy a tile (docs/backward.md, "Warp
// specialization"). In torch the same took two fp32 copies of dO and O, a product, a sum and the
// padding: eight launches and about 7 bytes of traffic per element of O.
//
// Work: a row per group of head_dim / 8 lanes (two rows a warp at head dim 128, four at 64):
// lane l of a group reads 16 bytes (8 elements) of the dO and O rows, products and sums in
// fp32, a butterfly of shuffles within the group, and the group's first lane writes the pair.
// Rows are 16-byte aligned with strides in multiples of 8 elements, and head_dim / 8 is a power
// of two up to 32 (the launcher's checks: runtime/flex/backward.py _fa3_rows).
//   grid (ceil(batch * heads * tiles * 64 / (kThreads / (head_dim / 8)))), block (kThreads).
// Requires attncc_types.cuh.
#ifndef ATTNCC_BWD_ROWS_CUH
#define ATTNCC_BWD_ROWS_CUH

namespace attncc {

// Mirrored in Python: attncc.codegen.layout.BWD_ROWS_PARAMS (offsets static_asserted). Strides
// in elements; dlse may be null (no LSE gradient).
struct BwdRowsParams {
    const void* dout;
    const void* out;
    const float* lse;
    const float* dlse;
    float* rows;  // [batch, heads, tiles, 2, 64]
    i64 do_stride_b, do_stride_h, do_stride_s;
    i64 o_stride_b, o_stride_h, o_stride_s;
    i64 lse_stride_b, lse_stride_h, lse_stride_s;
    i64 dlse_stride_b, dlse_stride_h, dlse_stride_s;
    int batch, heads, q_len, tiles, head_dim;
};

namespace bwdrows {

constexpr int kThreads = 256;

// The two 16-bit elements of a word as floats.
template <typename T>
__device__ __forceinline__ void unpack2(u32 w, float& lo, float& hi) {
    T a, b;
    a.bits = (u16)(w & 0xffffu);
    b.bits = (u16)(w >> 16);
    lo = to_float(a);
    hi = to_float(b);
}

// sum over the 8 elements of two 16-byte chunks of products, in fp32
template <typename T>
__device__ __forceinline__ float dot8(uint4 d, uint4 o) {
    const u32 dw[4] = {d.x, d.y, d.z, d.w}, ow[4] = {o.x, o.y, o.z, o.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float d0, d1, o0, o1;
        unpack2<T>(dw[i], d0, d1);
        unpack2<T>(ow[i], o0, o1);
        acc += d0 * o0 + d1 * o1;
    }
    return acc;
}

template <typename T>
__device__ __forceinline__ void bwd_rows(const BwdRowsParams& p) {
    constexpr float kLog2e = 1.4426950408889634f;
    const int lanes = p.head_dim / 8;  // a row's group of lanes, 16 bytes each
    const int lane = threadIdx.x & 31, g = lane % lanes;
    const i64 row = ((i64)blockIdx.x * kThreads + threadIdx.x) / lanes;
    const int per_head = p.tiles * 64;
    // whole warps (the row count is a multiple of 64): every lane of a warp reaches the shuffles
    if (row >= (i64)p.batch * p.heads * per_head) return;
    const int s = (int)(row % per_head);
    const i64 bh = row / per_head;
    const int b = (int)(bh / p.heads), h = (int)(bh % p.heads);
    float acc = 0.f;
    const bool live = s < p.q_len;
    if (live) {
        const uint4* dw = reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) +
                                                         b * p.do_stride_b + h * p.do_stride_h +
                                                         s * p.do_stride_s);
        const uint4* ow = reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) +
                                                         b * p.o_stride_b + h * p.o_stride_h +
                                                         s * p.o_stride_s);
        acc = dot8<T>(dw[g], ow[g]);
    }
    for (int o = lanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (g != 0) return;
    float lse2 = pos_inf(), delta = 0.f;
    if (live) {
        const float l = p.lse[b * p.lse_stride_b + h * p.lse_stride_h + s * p.lse_stride_s];
        lse2 = l == neg_inf() ? pos_inf() : l * kLog2e;
        delta = p.dlse == nullptr
                    ? acc
                    : acc - p.dlse[b * p.dlse_stride_b + h * p.dlse_stride_h + s * p.dlse_stride_s];
    }
    float* t = p.rows + bh * (i64)p.tiles * 128 + (s / 64) * 128 + s % 64;
    t[0] = lse2;
    t[64] = delta;
}

}  // namespace bwdrows
}  // namespace attncc

// One extern "C" entry per 16-bit storage type; the launcher looks them up by name.
#define ATTNCC_BWD_ROWS_ENTRY(NAME, T)                                                           \
    extern "C" __global__ void __launch_bounds__(attncc::bwdrows::kThreads)                      \
        NAME(const attncc::BwdRowsParams p) {                                                    \
        attncc::bwdrows::bwd_rows<T>(p);                                                         \
    }

#endif  // ATTNCC_BWD_ROWS_CUH
