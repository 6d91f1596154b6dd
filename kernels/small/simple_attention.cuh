// simple_attention.cuh: a simple, correct attention kernel for any attncc Variant.
//
// It is the reference GPU kernel: readable and exact in its semantics rather than fast.
//   * One warp computes one query row; a CTA has 4 warps = 4 consecutive query rows of one
//     (batch, head). Grid: (ceil(q_len / 4), num_q_heads, batch), 128 threads, no dynamic
//     shared memory (all shared memory is static and below 48 KB, so no attribute is needed).
//   * K and V are staged tile by tile in shared memory as float, after KeyTransform /
//     ValueTransform; the query row is staged (and QueryTransform-ed) in shared memory too.
//   * Every hook is called from exactly one, not unrolled, place: hooks can be large (RoPE
//     inlines sinf/cosf/powf), and unrolled copies made NVRTC compile times explode.
//   * For the scores, lane j owns kv row j of the tile: it does the full dot product over the
//     head dim, so the softmax max/sum need one warp reduction per tile, not one per key. For
//     P @ V, lane owns output elements d = lane + 32 * i, so V rows are read conflict-free.
//   * Softmax is online (running max m, running sum l) in fp32; the log-sum-exp (natural log)
//     is written when p.lse is non-null. normalize="none" accumulates score * v directly.
//   * With a block mask (p.kv_num_blocks != null) only the listed kv blocks are visited; full
//     blocks skip LogitsMask. Without one, every kv position is visited and masked.
// Requires attncc_types.cuh and attention_params.cuh (inlined before this text by codegen).
#ifndef ATTNCC_SIMPLE_ATTENTION_CUH
#define ATTNCC_SIMPLE_ATTENTION_CUH

namespace attncc {

template <int HEAD_DIM>
struct SimpleAttentionConfig {
    static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM >= 32 && HEAD_DIM <= 256,
                  "simple_attention supports head dims that are multiples of 32, up to 256");
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kRowsPerCta = kWarps;  // one warp per query row
    static constexpr int kDPerLane = HEAD_DIM / 32;
    // KV rows per tile: one per lane (32) while K+V tiles fit in ~32 KB of float; fewer for big
    // head dims (16 at 256) so the static shared memory stays below the 48 KB default limit.
    static constexpr int kBlockN = (4096 / HEAD_DIM < 32) ? 4096 / HEAD_DIM : 32;
    // K rows are padded by one float: lane j reads k_tile[j][d] in the same step as lane j+1
    // reads k_tile[j+1][d]; with the pad those addresses fall in different banks.
    static constexpr int kKStride = HEAD_DIM + 1;
    static constexpr int kTileElems = kBlockN * HEAD_DIM;
    static constexpr int kElemsPerThread = (kTileElems + kThreads - 1) / kThreads;
    // k_tile + v_tile + one query row and one scratch row per warp
    static constexpr int kSmemBytes =
        (int)sizeof(float) * (kBlockN * kKStride + kBlockN * HEAD_DIM + 2 * kWarps * HEAD_DIM);
    static_assert(kSmemBytes <= 48 * 1024, "static shared memory must stay below 48 KB");
};

// A float row in shared memory: the `Vec` the transform hooks index (hooks may read any
// element of their row, e.g. RoPE reads its partner element).
struct SmemRow {
    const float* row;
    __device__ __forceinline__ float operator[](int i) const { return row[i]; }
};

// The larger of a and b, NaN if either is (fmaxf drops a NaN): a NaN score makes the running
// maximum, and so the LSE, NaN as in torch, also in a row that holds a +inf score.
__device__ __forceinline__ float max_nan(float a, float b) {
    return (a != a || b != b) ? a + b : fmaxf(a, b);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// Everything one thread knows while it walks the kv tiles: its CTA's shared buffers, its row,
// and (for the row's warp) the running softmax state. p / vp are passed to every method
// instead of being stored, so they stay in the kernel parameter space.
template <typename Variant, typename DType, int HEAD_DIM>
struct SimpleAttentionCta {
    using Cfg = SimpleAttentionConfig<HEAD_DIM>;
    using VParams = typename Variant::Params;

    float* k_tile;         // [kBlockN][kKStride]
    float* v_tile;         // [kBlockN][HEAD_DIM]
    float* row;            // this warp's (transformed) query row
    float* scratch;        // this warp's raw row, read by transform hooks (see load_tile)
    const DType* k_head;   // &k[b, h_kv, 0, 0]
    const DType* v_head;   // &v[b, h_kv, 0, 0]
    int b, h, h_kv, q_idx, warp, lane;
    float m;  // running max of kept scores; -inf until the row keeps something
    float l;  // running sum of exp(score - m)
    float acc[Cfg::kDPerLane];  // output elements d = lane + 32 * i (unnormalized)

    // Stage the query row as float and apply QueryTransform. Called by a whole warp.
    __device__ __forceinline__ void load_query(const AttentionParams& p, const VParams& vp) {
        const DType* q = (const DType*)p.q + b * p.q_stride_b + h * p.q_stride_h +
                         (i64)q_idx * p.q_stride_s;
        if constexpr (Variant::has_query_transform) {
            // The hook may read any element of the raw row: stage all of it first.
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i)
                scratch[lane + 32 * i] = to_float(q[lane + 32 * i]);
            __syncwarp();
#pragma unroll 1
            for (int d = lane; d < HEAD_DIM; d += 32)
                row[d] = Variant::QueryTransform(vp, SmemRow{scratch}, b, h, q_idx, d);
        } else {
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i)
                row[lane + 32 * i] = to_float(q[lane + 32 * i]);
        }
        __syncwarp();
    }

    // Stage kv rows [kv0, kv0 + count) of K and V as float, transformed. Called by the whole CTA
    // (it contains barriers), including warps whose row is out of range.
    __device__ __forceinline__ void load_tile(const AttentionParams& p, const VParams& vp,
                                              int kv0, int count) {
        // Every warp must be done with the previous tile before it is overwritten.
        __syncthreads();
        if constexpr (!Variant::has_key_transform || !Variant::has_value_transform) {
            // Plain copy of K and/or V: consecutive threads read consecutive elements.
#pragma unroll
            for (int i = 0; i < Cfg::kElemsPerThread; ++i) {
                const int e = threadIdx.x + i * Cfg::kThreads;
                if (e < Cfg::kTileElems) {
                    const int n = e / HEAD_DIM, d = e % HEAD_DIM;
                    const bool in = n < count;  // rows past kv_len are zero, never read by hooks
                    const i64 s = (i64)(kv0 + n);
                    if constexpr (!Variant::has_key_transform)
                        k_tile[n * Cfg::kKStride + d] =
                            in ? to_float(k_head[s * p.k_stride_s + d]) : 0.0f;
                    if constexpr (!Variant::has_value_transform)
                        v_tile[n * HEAD_DIM + d] =
                            in ? to_float(v_head[s * p.v_stride_s + d]) : 0.0f;
                }
            }
        }
        if constexpr (Variant::has_key_transform || Variant::has_value_transform) {
            // A hook may read any element of its raw row (RoPE reads a partner element), so a
            // row is first staged raw in the warp's scratch row, then transformed into the tile.
            // Each warp owns whole rows, so warp-level syncs suffice.
#pragma unroll 1
            for (int n = warp; n < count; n += Cfg::kWarps) {
                const i64 s = (i64)(kv0 + n);
                if constexpr (Variant::has_key_transform) {
#pragma unroll
                    for (int i = 0; i < Cfg::kDPerLane; ++i)
                        scratch[lane + 32 * i] = to_float(k_head[s * p.k_stride_s + lane + 32 * i]);
                    __syncwarp();
#pragma unroll 1
                    for (int d = lane; d < HEAD_DIM; d += 32)
                        k_tile[n * Cfg::kKStride + d] =
                            Variant::KeyTransform(vp, SmemRow{scratch}, b, h_kv, kv0 + n, d);
                    __syncwarp();  // scratch is refilled next
                }
                if constexpr (Variant::has_value_transform) {
#pragma unroll
                    for (int i = 0; i < Cfg::kDPerLane; ++i)
                        scratch[lane + 32 * i] = to_float(v_head[s * p.v_stride_s + lane + 32 * i]);
                    __syncwarp();
#pragma unroll 1
                    for (int d = lane; d < HEAD_DIM; d += 32)
                        v_tile[n * HEAD_DIM + d] =
                            Variant::ValueTransform(vp, SmemRow{scratch}, b, h_kv, kv0 + n, d);
                    __syncwarp();
                }
            }
        }
        // The tile is complete and visible to every warp.
        __syncthreads();
    }

    // acc[d] += sum_j w_j * v[j][d] over kept keys j, where lane j holds w_j. A masked key's
    // value row is never read: a NaN there must not become 0 * NaN = NaN.
    __device__ __forceinline__ void accumulate(float w, bool keep, int count) {
        const unsigned kept = __ballot_sync(0xffffffffu, keep);
        for (int j = 0; j < count; ++j) {
            const float wj = __shfl_sync(0xffffffffu, w, j);
            if (!((kept >> j) & 1u)) continue;  // warp-uniform
            const float* vr = v_tile + j * HEAD_DIM + lane;
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i) acc[i] += wj * vr[32 * i];
        }
    }

    // Fold the staged tile into this warp's row. `apply_mask` is false for full blocks.
    __device__ __forceinline__ void attend(const AttentionParams& p, const VParams& vp, int kv0,
                                           int count, bool apply_mask) {
        float s = 0.0f;
        bool keep = false;
        if (lane < count) {
            const int kv_idx = kv0 + lane;
            keep = true;
            // The mask is evaluated before the score: a masked score is discarded anyway, and
            // skipping LogitsTransform there saves work (and its loads) for masked positions.
            if constexpr (Variant::has_logits_mask) {
                if (apply_mask) keep = Variant::LogitsMask(vp, b, h, q_idx, kv_idx);
            }
            if (keep) {
                const float* kr = k_tile + lane * Cfg::kKStride;
                float dot = 0.0f;
#pragma unroll 16
                for (int d = 0; d < HEAD_DIM; ++d) dot += row[d] * kr[d];
                s = dot * p.sm_scale;
                if constexpr (Variant::has_logits_transform)
                    s = Variant::LogitsTransform(vp, s, b, h, q_idx, kv_idx);
            }
        }
        if constexpr (Variant::use_softmax) {
            const float m_new = max_nan(m, warp_max(keep ? s : neg_inf()));
            // Every score so far masked or -inf (m_new is warp-uniform): shift by 0, as
            // exp(-inf - -inf) would be NaN; a NaN score of this tile must still reach l.
            const float m_use = m_new == neg_inf() ? 0.0f : m_new;
            const float alpha = expf(m - m_use);  // rescales the old sum; 0 when m was -inf
            const float w = keep ? expf(s - m_use) : 0.0f;
            l = l * alpha + warp_sum(w);
            m = m_new;
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i) acc[i] *= alpha;
            accumulate(w, keep, count);
        } else {
            // normalize="none": the weight is the transformed score itself; masked -> 0.
            accumulate(keep ? s : 0.0f, keep, count);
        }
    }

    // Visit kv positions [kv_begin, kv_end) tile by tile. Called by the whole CTA.
    __device__ __forceinline__ void visit(const AttentionParams& p, const VParams& vp,
                                          int kv_begin, int kv_end, bool active,
                                          bool apply_mask) {
        for (int kv0 = kv_begin; kv0 < kv_end; kv0 += Cfg::kBlockN) {
            const int count = mini(Cfg::kBlockN, kv_end - kv0);
            load_tile(p, vp, kv0, count);
            if (active) attend(p, vp, kv0, count, apply_mask);
        }
    }

    // Normalize, apply OutputTransform, write o (and lse). Called by a whole warp.
    __device__ __forceinline__ void finish(const AttentionParams& p, const VParams& vp) {
        float out[Cfg::kDPerLane];
        float lse = neg_inf();
        if constexpr (Variant::use_softmax) {
            // l == 0: every kv position was masked (or scored -inf): output 0, lse -inf. A NaN
            // score left l NaN (output and lse NaN); a +inf score made m +inf: lse +inf.
            const bool any = l != 0.0f;
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i) out[i] = any ? acc[i] / l : 0.0f;
            if (any) lse = m == pos_inf() ? m : m + logf(l);
        } else {
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i) out[i] = acc[i];
        }
        DType* o = (DType*)p.o + b * p.o_stride_b + h * p.o_stride_h + (i64)q_idx * p.o_stride_s;
        if constexpr (Variant::has_output_transform) {
            // The hook sees the whole output row: stage it in the warp's scratch row.
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i) scratch[lane + 32 * i] = out[i];
            __syncwarp();
#pragma unroll 1
            for (int d = lane; d < HEAD_DIM; d += 32)
                o[d] = from_float<DType>(
                    Variant::OutputTransform(vp, SmemRow{scratch}, b, h, q_idx, d));
        } else {
#pragma unroll
            for (int i = 0; i < Cfg::kDPerLane; ++i) o[lane + 32 * i] = from_float<DType>(out[i]);
        }
        if constexpr (Variant::use_softmax) {
            if (p.lse != nullptr && lane == 0)
                p.lse[b * p.lse_stride_b + h * p.lse_stride_h + q_idx] = lse;
        }
    }
};

template <typename Variant, typename DType, int HEAD_DIM>
__device__ void simple_attention(const AttentionParams& p, const typename Variant::Params& vp) {
    using Cfg = SimpleAttentionConfig<HEAD_DIM>;
    __shared__ float k_tile[Cfg::kBlockN * Cfg::kKStride];
    __shared__ float v_tile[Cfg::kBlockN * HEAD_DIM];
    __shared__ float rows[Cfg::kWarps * HEAD_DIM];
    __shared__ float scratch[Cfg::kWarps * HEAD_DIM];

    const int q_first = blockIdx.x * Cfg::kRowsPerCta;
    // Uniform over the CTA and before any barrier, so returning early is safe.
    if (q_first >= p.q_len || p.num_kv_heads <= 0) return;
    const int warp = threadIdx.x / 32;

    SimpleAttentionCta<Variant, DType, HEAD_DIM> cta;
    cta.k_tile = k_tile;
    cta.v_tile = v_tile;
    cta.row = rows + warp * HEAD_DIM;
    cta.scratch = scratch + warp * HEAD_DIM;
    cta.warp = warp;
    cta.lane = threadIdx.x % 32;
    cta.b = blockIdx.z;
    cta.h = blockIdx.y;
    cta.h_kv = cta.h / (p.num_q_heads / p.num_kv_heads);  // GQA: consecutive q heads share kv
    cta.q_idx = q_first + warp;
    cta.k_head = (const DType*)p.k + cta.b * p.k_stride_b + cta.h_kv * p.k_stride_h;
    cta.v_head = (const DType*)p.v + cta.b * p.v_stride_b + cta.h_kv * p.v_stride_h;
    cta.m = neg_inf();
    cta.l = 0.0f;
#pragma unroll
    for (int i = 0; i < Cfg::kDPerLane; ++i) cta.acc[i] = 0.0f;

    // Rows past q_len still run the loops below (they take part in the tile barriers) but
    // never compute or write.
    const bool row_valid = cta.q_idx < p.q_len;
    if (row_valid) cta.load_query(p, vp);

    // Without a block mask the whole kv range is one "partial" block (LogitsMask applies).
    // With one, the mask lists kv blocks per q block of block_q rows. This CTA's rows may span
    // two (or, for block_q < 4, more) q blocks: visit each q block's kv blocks in turn, with only
    // the warps whose row lies in that q block attending. Pass 0 visits partial blocks
    // (LogitsMask applies), pass 1 full blocks (it does not); blocks in neither list are fully
    // masked and never loaded. All of this is written around ONE call of visit(), so each hook
    // is inlined once.
    const bool sparse = p.kv_num_blocks != nullptr;
    const int q_last = mini(q_first + Cfg::kRowsPerCta, p.q_len) - 1;
    const int qb_first = sparse ? q_first / p.block_q : 0;
    const int qb_last = sparse ? q_last / p.block_q : 0;
    for (int qb = qb_first; qb <= qb_last; ++qb) {
        const bool active = row_valid && (!sparse || cta.q_idx / p.block_q == qb);
        const i64 num_at = cta.b * p.bm_stride_b + cta.h * p.bm_stride_h + qb;
        const i64 idx_at = cta.b * p.bi_stride_b + cta.h * p.bi_stride_h + qb * p.bi_stride_q;
        for (int pass = 0; pass < 2; ++pass) {
            const int* num = pass == 0 ? p.kv_num_blocks : p.full_kv_num_blocks;
            const int* idx = pass == 0 ? p.kv_indices : p.full_kv_indices;
            int nblocks = 0;
            if (!sparse) nblocks = pass == 0 ? 1 : 0;
            else if (num != nullptr && idx != nullptr) nblocks = num[num_at];
            for (int i = 0; i < nblocks; ++i) {
                const int kv_begin = sparse ? idx[idx_at + i] * p.block_kv : 0;
                const int kv_end = sparse ? mini(kv_begin + p.block_kv, p.kv_len) : p.kv_len;
                cta.visit(p, vp, kv_begin, kv_end, active, pass == 0);
            }
        }
    }

    if (row_valid) cta.finish(p, vp);
}

}  // namespace attncc

#endif  // ATTNCC_SIMPLE_ATTENTION_CUH
