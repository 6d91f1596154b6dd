// attncc FA3 prefill for sm_90a: TMA loads completed on mbarriers, wgmma tensor-core math, and
// warp specialization (issue 5; see bench/NOTES.md). Opt-in: kernel_options={"KERNEL": "fa3"}.
// Self-contained: no #include. Comes after attncc_types.cuh, attention_params.cuh,
// fa2_common.cuh, wgmma.cuh and tma.cuh, and before the generated Variant_<name> functors' entry
// point (ATTNCC_FA3_ENTRY at the bottom).
//
// Roles. A CTA owns 128 query rows of one (batch, query head) and has three warpgroups:
//   producer (warpgroup 0): one thread issues TMA bulk copies -- the CTA's Q tile once, then each
//     K/V tile into a STAGES-deep ring. Stage s has a "full" mbarrier the copy engine completes
//     with the tile's bytes, and an "empty" mbarrier the consumers arrive on when they are done
//     reading it; the producer waits for "empty" before refilling. No CTA-wide barrier in the loop.
//   consumers (warpgroups 1 and 2): each owns 64 of the rows and runs FA2's loop on them with
//     wgmma: S = Q K^T (both operands in shared memory, K-major), logits hooks and online softmax
//     in registers (exp2 domain), O += P V (P from registers, V N-major in shared memory).
// The two consumer warpgroups share every K/V tile, and while one runs its softmax the other's
// wgmma keeps the tensor cores busy: the scheduler's natural ping-pong. Explicit ping-pong
// ordering, intra-warpgroup overlap of softmax with the next S, and setmaxnreg (more registers
// for the consumers) are the next steps.
//
// Supported: head dims 64 and 128, score_mod / mask_mod hooks (LogitsTransform / LogitsMask),
// FlexAttention BlockMask lists (128-row query blocks), GQA (one query head per CTA),
// bf16. The launcher keeps query/key/value/output transforms on the FA2 template.
//
// Layouts: every tile is stored 128B-swizzled in 64-column blocks (wgmma.cuh), which is exactly
// what a TMA box of [64 rows][64 elements] with the 128-byte swizzle writes. q/k/v are read
// through tensor maps over [batch * heads * seq, head_dim] (contiguous tensors): rows past a
// sequence's end belong to the next head (or are zero past the tensor), and the logits of such
// keys and rows are masked, so their P is 0 and their output is never stored.
#ifndef ATTNCC_FA3_PREFILL_CUH
#define ATTNCC_FA3_PREFILL_CUH

// The N-major V descriptor's byte offsets, as tests/gpu/test_wgmma.py's probe measured them on
// the H200: any LBO (unused at N = 64), SBO = 1024.
#ifndef ATTNCC_FA3_V_LBO
#define ATTNCC_FA3_V_LBO 8192
#endif
#ifndef ATTNCC_FA3_V_SBO
#define ATTNCC_FA3_V_SBO 1024
#endif

namespace attncc {
namespace fa3 {

using fa2::fa2_u16;
using fa2::fa2_u32;

constexpr int kConsumers = 2;          // consumer warpgroups, 64 query rows each
constexpr int kTQ = 64 * kConsumers;    // query rows per CTA
constexpr int kTKV = 64;                // keys per KV tile: one m64n64 wgmma per 16-wide k-step
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBlockBytes = 64 * 128;   // one [64 rows][64 bf16] swizzled column block

template <int D, int STAGES>
struct Smem {
  static constexpr int kTileBytes = 64 * 2 * D;  // 64 rows of D 16-bit elements
  static constexpr int kQ = 0;                   // kConsumers row blocks of 64 rows
  static constexpr int kK = kQ + kConsumers * kTileBytes;
  static constexpr int kV = kK + STAGES * kTileBytes;
  static constexpr int kBar = kV + STAGES * kTileBytes;  // full[STAGES], empty[STAGES], q
  static constexpr int kBytes = kBar + 8 * (2 * STAGES + 1) + 1024;  // + alignment slack
};

template <typename Variant, typename DType, int D, int STAGES>
__device__ __forceinline__ void fa3_prefill(const attncc::AttentionParams& p,
                                            const typename Variant::Params& vp) {
  static_assert(D == 64 || D == 128, "the FA3 kernel supports head dims 64 and 128");
  static_assert(fa2::ElemTraits<DType>::kIsBf16, "the FA3 kernel's wgmma wrappers are bf16");
  using S = Smem<D, STAGES>;
  constexpr int BLOCKS = D / 64;     // 64-column blocks per tile
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr bool kSoftmax = Variant::use_softmax;

  extern __shared__ __attribute__((aligned(1024))) unsigned char attncc_fa3_smem_raw[];
  // the 128-byte swizzle works on absolute address bits: align the tiles to 1024 bytes
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<unsigned long long>(attncc_fa3_smem_raw) + 1023) & ~1023ull);
  const fa2_u32 base = fa2::smem_addr(smem);
  const fa2_u32 sq = base + S::kQ, sk = base + S::kK, sv = base + S::kV;
  const fa2_u32 full_bar = base + S::kBar;               // + 8*s: stage s landed
  const fa2_u32 empty_bar = full_bar + 8 * STAGES;       // + 8*s: stage s read by every consumer
  const fa2_u32 q_bar = full_bar + 16 * STAGES;
  const void* tm_q = p.tma;
  const void* tm_k = reinterpret_cast<const unsigned char*>(p.tma) + 128;
  const void* tm_v = reinterpret_cast<const unsigned char*>(p.tma) + 256;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7;               // 0: producer, 1..kConsumers: consumers
  const int warp = (tid >> 5) & 3;       // warp within its warpgroup
  const int b = blockIdx.z, hq = blockIdx.y;
  const int h_kv = hq / (p.num_q_heads / p.num_kv_heads);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kTQ;  // longest (causal) tiles first
  const int q_len = p.q_len, kv_len = p.kv_len;
  const int q_row0 = (b * p.num_q_heads + hq) * q_len + q0;   // tensor-map row of query q0
  const int kv_row0 = (b * p.num_kv_heads + h_kv) * kv_len;   // tensor-map row of key 0

  fa2::TileList tiles;
  if (p.kv_num_blocks == nullptr) {
    tiles = fa2::TileList{nullptr, nullptr, (kv_len + kTKV - 1) / kTKV, 0, 1, kTKV, kTKV, 0};
    tiles.count = tiles.n_partial;
  } else {
    const int qb = q0 / p.block_q;
    const attncc::i64 nb = b * p.bm_stride_b + hq * p.bm_stride_h + qb;
    const attncc::i64 ix = b * p.bi_stride_b + hq * p.bi_stride_h + qb * p.bi_stride_q;
    tiles.partial = p.kv_indices + ix;
    tiles.n_partial = __ldg(p.kv_num_blocks + nb);
    tiles.full = p.full_kv_num_blocks != nullptr ? p.full_kv_indices + ix : nullptr;
    tiles.n_full = p.full_kv_num_blocks != nullptr ? __ldg(p.full_kv_num_blocks + nb) : 0;
    tiles.sub = p.block_kv / kTKV;
    tiles.block_kv = p.block_kv;
    tiles.tile = kTKV;
    tiles.count = (tiles.n_partial + tiles.n_full) * tiles.sub;
  }

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      tma::mbar_init(full_bar + 8 * s, 1);                  // the producer's expect_tx arrival
      tma::mbar_init(empty_bar + 8 * s, 4 * kConsumers);    // one arrival per consumer warp
    }
    tma::mbar_init(q_bar, 1);
    tma::fence_barrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: from here the roles only meet on mbarriers

  // ---- producer: one thread; the other producer threads have nothing to do ------------------
  if (wg == 0) {
    if (tid == 0) {
      tma::mbar_arrive_expect_tx(q_bar, kConsumers * BLOCKS * kBlockBytes);
#pragma unroll
      for (int w = 0; w < kConsumers; ++w)
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
          tma::load_2d(sq + (w * BLOCKS + blk) * kBlockBytes, tm_q, q_bar, 64 * blk,
                       q_row0 + 64 * w);
#pragma unroll 1
      for (int i = 0; i < tiles.count; ++i) {
        const int st = i % STAGES;
        // refill stage st once every consumer warp released its previous tile (i - STAGES):
        // that was phase (i / STAGES - 1) of the stage's empty barrier
        if (i >= STAGES) tma::mbar_wait(empty_bar + 8 * st, ((i / STAGES) - 1) & 1);
        bool f;
        const int kv0 = tiles.start(i, f);
        const fa2_u32 full = full_bar + 8 * st;
        tma::mbar_arrive_expect_tx(full, 2 * BLOCKS * kBlockBytes);
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk) {
          tma::load_2d(sk + st * S::kTileBytes + blk * kBlockBytes, tm_k, full, 64 * blk,
                       kv_row0 + kv0);
          tma::load_2d(sv + st * S::kTileBytes + blk * kBlockBytes, tm_v, full, 64 * blk,
                       kv_row0 + kv0);
        }
      }
    }
    return;
  }

  // ---- consumers: warpgroup wg owns query rows [q0 + 64 (wg - 1), +64) -------------------------
  // Accumulator layout (wgmma m64nN): warp w holds rows 16w + lane/4 and 16w + lane/4 + 8; for
  // each 8-column block j, elements [4j, 4j+1] on the first row and [4j+2, 4j+3] on the second.
  const fa2_u32 sq_w = sq + (wg - 1) * BLOCKS * kBlockBytes;
  float o[BLOCKS][32];
#pragma unroll
  for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[blk][i] = 0.f;
  float row_m[2] = {fa2::neg_inf(), fa2::neg_inf()}, row_l[2] = {0.f, 0.f};
  const float qk_scale = (kSoftmax && !Variant::has_logits_transform) ? p.sm_scale * kLog2e
                                                                      : p.sm_scale;
  // query position of this thread's first row
  const int r_lo = q0 + 64 * (wg - 1) + 16 * warp + (lane >> 2);
  tma::mbar_wait(q_bar, 0);

#pragma unroll 1
  for (int it = 0; it < tiles.count; ++it) {
    const int st = it % STAGES;
    bool is_full;
    const int kv0 = tiles.start(it, is_full);
    tma::mbar_wait(full_bar + 8 * st, (it / STAGES) & 1);

    // S = Q K^T: D/16 k-steps, each a 32-byte step inside a 64-column block
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const fa2_u32 off = (ks >> 2) * kBlockBytes + (ks & 3) * 32;
      wg::mma_ss_m64n64k16_bf16<0>(s, wg::make_desc(sq_w + off, 16, 1024),
                                   wg::make_desc(sk + st * S::kTileBytes + off, 16, 1024), ks > 0);
    }
    wg::commit();
    wg::wait<0>();

    // logits: scale, hooks, mask; rows past q_len and keys past kv_len are masked
    const float masked = kSoftmax ? fa2::neg_inf() : 0.f;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int qi = r_lo + 8 * hr;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kv = kv0 + 8 * j + 2 * (lane & 3) + e;
          float sc = s[4 * j + 2 * hr + e] * qk_scale;
          if (qi >= q_len || (unsigned)kv >= (unsigned)kv_len) {
            sc = masked;
          } else {
            if constexpr (Variant::has_logits_transform) {
              sc = Variant::LogitsTransform(vp, sc, b, hq, qi, kv);
              if constexpr (kSoftmax) sc *= kLog2e;
            }
            if constexpr (Variant::has_logits_mask) {
              if (!is_full && !Variant::LogitsMask(vp, b, hq, qi, kv)) sc = masked;
            }
          }
          s[4 * j + 2 * hr + e] = sc;
        }
    }

    if constexpr (kSoftmax) {  // online softmax in base 2, as in fa2_attend.cuh
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float mx = row_m[hr];
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = (mx == fa2::neg_inf()) ? 0.f : mx;
        const float corr = fa2::fast_exp2(row_m[hr] - m_use);
        row_m[hr] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = fa2::fast_exp2(s[4 * j + 2 * hr + e] - m_use);
            s[4 * j + 2 * hr + e] = pe;
            sum += pe;
          }
        row_l[hr] = row_l[hr] * corr + sum;
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            o[blk][4 * j + 2 * hr] *= corr;
            o[blk][4 * j + 2 * hr + 1] *= corr;
          }
      }
    }

    // O += P V: P's A fragments for k-step kk are the S accumulators of columns 16kk..16kk+15
    fa2_u32 pa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      pa[kk][0] = fa2::pack2<DType>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = fa2::pack2<DType>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = fa2::pack2<DType>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = fa2::pack2<DType>(s[8 * kk + 6], s[8 * kk + 7]);
    }
    wg::fence();  // o was rescaled and pa written by ordinary instructions
#pragma unroll
    for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        // V rows 16kk.. of column block blk: N-major, 8-row groups 1024 bytes apart (SBO; at
        // N = 64 the tile is one swizzle atom wide and LBO is unused: tests/gpu/test_wgmma.py)
        const fa2_u32 vaddr = sv + st * S::kTileBytes + blk * kBlockBytes + kk * 16 * 128;
        wg::mma_rs_m64n64k16_bf16<1>(o[blk], pa[kk], wg::make_desc(vaddr, ATTNCC_FA3_V_LBO,
                                                                   ATTNCC_FA3_V_SBO), 1);
      }
    wg::commit();
    wg::wait<0>();
    // this warp's reads of stage st are complete: release it to the producer
    if (lane == 0) tma::mbar_arrive(empty_bar + 8 * st);
  }

  // ---- epilogue: normalize, store bf16 pairs and the LSE ---------------------------------------
  DType* out = reinterpret_cast<DType*>(p.o);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int qi = r_lo + 8 * hr;
    float inv = 1.f, lse = 0.f;
    if constexpr (kSoftmax) {
      float l = row_l[hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv = l > 0.f ? 1.f / l : 0.f;
      lse = l > 0.f ? (row_m[hr] + __log2f(l)) * kLn2 : fa2::neg_inf();
    }
    if (qi < q_len) {
      DType* row = out + b * p.o_stride_b + hq * p.o_stride_h + (attncc::i64)qi * p.o_stride_s;
#pragma unroll
      for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = 64 * blk + 8 * j + 2 * (lane & 3);
          *reinterpret_cast<fa2_u32*>(row + col) = fa2::pack2<DType>(
              o[blk][4 * j + 2 * hr] * inv, o[blk][4 * j + 2 * hr + 1] * inv);
        }
      if constexpr (kSoftmax) {
        if (p.lse != nullptr && (lane & 3) == 0)
          p.lse[b * p.lse_stride_b + hq * p.lse_stride_h + qi] = lse;
      }
    }
  }
}

}  // namespace fa3
}  // namespace attncc

// Grid (ceil(q_len / 128), num_q_heads, batch), block kThreads (384), dynamic shared memory
// attncc::fa3::Smem<HEAD_DIM, STAGES>::kBytes; AttentionParams::tma points at the q/k/v maps.
#define ATTNCC_FA3_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS)       \
  extern "C" __global__ void __launch_bounds__(attncc::fa3::kThreads, 1)                           \
      NAME(attncc::AttentionParams p, VARIANT::Params vp) {                                        \
    static_assert(KV_WARPS == 1, "the FA3 kernel has no KV-slice warps");                       \
    attncc::fa3::fa3_prefill<VARIANT, DTYPE, HEAD_DIM, STAGES>(p, vp);                             \
  }

#endif  // ATTNCC_FA3_PREFILL_CUH
