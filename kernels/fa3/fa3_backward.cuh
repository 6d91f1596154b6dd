// attncc FA3-class attention backward for sm_90a (wgmma): dQ, dK, dV and the gradients of
// captured tensors of one variant, recomputing the probabilities from Q, K and the saved LSE.
// Written for attncc; docs/backward.md, "The FA3-class kernel", is the design note.
//
// Self-contained: no #include. Comes after attncc_types.cuh, backward_params.cuh, common.cuh,
// fa2_config.cuh, fa2_backward.cuh (the per-element hooks, the tile lists), codegen's form
// block, wgmma.cuh and tma.cuh, and before the generated Variant_<name> (ATTNCC_FA3_BWD_ENTRY
// below).
//
// Grid: fa2::bwd_cta's (ceil(kv_len / 128) C, num_kv_heads / C, batch), KV heads in chunks of C.
// As in the FA2-class kernel, a CTA keeps its 128-row K and V tile in shared memory and dK, dV in
// registers, visits the 64-row query tiles of every query head of its GQA group that touch it,
// and writes dK, dV once. Three warpgroups with roles (docs/backward.md, "Warp specialization"):
//   producer (one thread of warpgroup 0): TMA loads -- K and V once, then each query tile's Q,
//     dO (4-D boxes: rows past the sequence land as zeros), LSE and delta rows into a two-stage
//     ring (mbarriers) -- and, a tile behind, each tile's staged fp32 dQ added into dq_accum by
//     bulk reductions, off the consumers' path;
//   consumer w (warpgroup w + 1, w = 0, 1): KV rows [64 w, 64 w + 64) (every wgmma's M). Per
//     query tile and each of its sub-tiles of QS = 64, 32 or 16 columns (the form's):
//   S^T = K Q^T, dP^T = V dO^T                 SS m64nQS
//   P^T, dS^T in registers                     fa2_backward.cuh's probs_tile / dscores_tile: the
//                                              wgmma accumulator is mma.sync's C layout per warp
//   dV += P^T dO, dK += dS^T Q                 RS: P^T / dS^T as A fragments, dO / Q N-major
//   dQ = dS K                                  after the sub-tiles and both consumers' dS halves:
//                                              SS m64n64 over dS in shared memory (query-major,
//                                              two buffers), staged for the producer
// dQ's columns are split over the consumers at head dim 128 (one m64n64 each, all 128 keys); at
// head dim 64 consumer 0 computes it alone, so every dQ element takes one add per CTA and query
// tile -- what the deterministic mode's per-tile launches rely on.
// Shared tiles use the 128-byte swizzle of wgmma.cuh (sw128_offset), which TMA writes.
#ifndef ATTNCC_FA3_BACKWARD_CUH
#define ATTNCC_FA3_BACKWARD_CUH

namespace attncc {
namespace fa3bwd {

using common::ElemTraits;
using common::smem_addr;
using common::TileList;
typedef unsigned int u32;

// The N-major descriptor's byte offsets as the forward's V operand uses them (fa3_consumer.cuh;
// tests/gpu/test_wgmma.py measured them): LBO unused at N = 64 (at N = 128 it is the distance
// between the two 64-column blocks: issue_rs), SBO = 1024.
constexpr unsigned kNMajorLbo = 8192;
constexpr unsigned kNMajorSbo = 1024;

// setmaxnreg: the producer warpgroup keeps 24 registers and the consumers take 240 each: 128 x
// 24 + 256 x 240 = 384 x 168, what the launch holds (ptxas's 168 a thread under
// __launch_bounds__(384, 1)); more for the consumers and their setmaxnreg.inc waits forever
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;

template <int D, int TQ, int TKV, int STAGES, int DSPLIT>
struct BwdConfig {
  static_assert(D == 64 || D == 128, "the FA3-class backward runs head dims 64 and 128");
  static_assert(TQ == 64 && TKV == 128 && STAGES == 2 && DSPLIT == 1,
                "one form: 64-row query tiles, 128-row KV tiles, two stages");
  // a producer warpgroup (one thread loads and adds dQ) and two consumers of 64 KV rows
  static constexpr int kThreads = 384;
  static constexpr int kDqGroups = D / 64;  // consumers that compute dQ (64 columns each)
  static constexpr int kDqBytes = TQ * 64 * 4;  // one consumer's fp32 dQ tile
  // byte offsets from a 1024-aligned base (128-byte swizzle atoms); tiles are stored as
  // 64-column blocks of [rows][128 B] one after another (wgmma.cuh), as TMA boxes of
  // [64 rows][64] land
  static constexpr int kK = 0;
  static constexpr int kV = kK + TKV * D * 2;
  static constexpr int kQ = kV + TKV * D * 2;             // [STAGES]
  static constexpr int kDo = kQ + STAGES * TQ * D * 2;    // [STAGES]
  static constexpr int kDs = kDo + STAGES * TQ * D * 2;   // dS [2][TQ][TKV], query-major
  static constexpr int kDq = kDs + 2 * TQ * TKV * 2;      // fp32 dQ [kDqGroups][kDqBytes]
  // fp32 rows [STAGES][2][TQ]: a tile's LSE (base 2), then its delta
  static constexpr int kRows = kDq + kDqGroups * kDqBytes;
  // per stage the tile's query head and first row (with bit 0: a full block), or head -1: the
  // sequence ended (TileMeta)
  static constexpr int kMeta = kRows + STAGES * 2 * TQ * 4;
  static constexpr int kBar = kMeta + STAGES * 8;  // mbarriers (BwdSmem)
  static constexpr int kSmemBytes = kBar + 128 + 1024;     // + alignment slack
};

// Where a CTA's shared tiles and barriers are (shared-space addresses). The barriers: K/V landed;
// per stage Q/dO/LSE/delta landed (full) and read by both consumers (empty); per dS buffer both
// consumers' halves stored; per dQ tile staged (dq_full) and read by the copy engine (dq_empty).
template <int D, int TQ, int TKV>
struct BwdSmem {
  using Cfg = BwdConfig<D, TQ, TKV, 2, 1>;
  u32 base;
  __device__ __forceinline__ explicit BwdSmem(unsigned char* raw) {
    base = (smem_addr(raw) + 1023u) & ~1023u;
  }
  __device__ __forceinline__ u32 k() const { return base + Cfg::kK; }
  __device__ __forceinline__ u32 v() const { return base + Cfg::kV; }
  __device__ __forceinline__ u32 q(int st) const { return base + Cfg::kQ + st * TQ * D * 2; }
  __device__ __forceinline__ u32 dout(int st) const { return base + Cfg::kDo + st * TQ * D * 2; }
  __device__ __forceinline__ u32 ds(int buf) const { return base + Cfg::kDs + buf * TQ * TKV * 2; }
  __device__ __forceinline__ u32 dq(int g) const { return base + Cfg::kDq + g * Cfg::kDqBytes; }
  __device__ __forceinline__ u32 rows(int st) const { return base + Cfg::kRows + st * 2 * TQ * 4; }
  // generic pointers for the hooks' code, made at the use from the shared address (no 64-bit
  // pointer held through the tile loop)
  __device__ __forceinline__ const float* lse2_rows(int st) const {
    return static_cast<const float*>(__cvta_shared_to_generic(rows(st)));
  }
  __device__ __forceinline__ const float* delta_rows(int st) const {
    return static_cast<const float*>(__cvta_shared_to_generic(rows(st) + TQ * 4));
  }
  __device__ __forceinline__ u32 meta(int st) const { return base + Cfg::kMeta + 8 * st; }
  __device__ __forceinline__ u32 kv_full() const { return base + Cfg::kBar; }
  __device__ __forceinline__ u32 full(int st) const { return base + Cfg::kBar + 8 + 8 * st; }
  __device__ __forceinline__ u32 empty(int st) const { return base + Cfg::kBar + 24 + 8 * st; }
  __device__ __forceinline__ u32 ds_done(int buf) const { return base + Cfg::kBar + 40 + 8 * buf; }
  __device__ __forceinline__ u32 dq_full(int g) const { return base + Cfg::kBar + 56 + 8 * g; }
  __device__ __forceinline__ u32 dq_empty(int g) const { return base + Cfg::kBar + 72 + 8 * g; }
};

// The tensor maps BackwardParams::tma points at: q, k, v, dO, each over [batch, heads, seq,
// head_dim] in [64 rows][64] boxes with the 128-byte swizzle (runtime/flex/backward.py).
__device__ __forceinline__ const void* tmap(const attncc::BackwardParams& p, int i) {
  return reinterpret_cast<const unsigned char*>(p.tma) + 128 * i;
}

// A [ROWS][D] tile of (b, h) from row0 into its swizzled column blocks: ROWS / 64 boxes a block.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const void* tm, u32 bar, int row0, int h,
                                          int b) {
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int r = 0; r < ROWS / 64; ++r)
      tma::load_4d(dst + blk * ROWS * 128 + r * 64 * 128, tm, bar, 64 * blk, row0 + 64 * r, h, b);
}

// The query tiles the CTA visits, in order: every listed tile of every query head of the GQA
// group. The producer and both consumers walk the same sequence (visit(n, hq, q0,
// is_full) per tile, n counting from 0), so their barrier phases agree.
template <int TQ, int TKV, typename F>
__device__ __forceinline__ void for_each_tile(const attncc::BackwardParams& p, int b, int h_kv,
                                              int kv0, F&& visit) {
  const int gsize = p.num_q_heads / p.num_kv_heads;
  int n = 0;
#pragma unroll 1
  for (int j = 0; j < gsize; ++j) {
    const int hq = h_kv * gsize + j;
    const TileList tl = fa2::query_tiles<TQ>(p, b, hq, kv0);
#pragma unroll 1
    for (int it = 0; it < tl.count; ++it, ++n) {
      bool is_full;
      const int q0 = tl.start(it, is_full);
      visit(n, hq, q0, is_full);
    }
  }
}

// What the producer tells the consumers about the tile in a stage: its query head (-1: the
// sequence ended) and first row, bit 0 set for a full block. The consumers then keep no tile
// list of their own (registers beside dK and dV).
struct TileMeta {
  int hq, q0f;
};
__device__ __forceinline__ void put_meta(u32 at, TileMeta m) {
  asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(at), "r"(m.hq), "r"(m.q0f) : "memory");
}
__device__ __forceinline__ TileMeta get_meta(u32 at) {
  TileMeta m;
  asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(m.hq), "=r"(m.q0f) : "r"(at) : "memory");
  return m;
}

// One query tile's loads into stage n % 2, once both consumers released it (tile n - 2 read):
// Q, dO, and its LSE (base 2) and delta rows (one copy: they are interleaved by tile).
template <int D, int TQ, int TKV>
__device__ __forceinline__ void load_q_tile(const attncc::BackwardParams& p,
                                            const BwdSmem<D, TQ, TKV>& sm, int n, int b, int hq,
                                            int q0, bool is_full) {
  const int st = n & 1;
  const bool rows = p.lse != nullptr;  // softmax: the LSE and delta rows too
  if (n >= 2) tma::mbar_wait(sm.empty(st), ((n >> 1) - 1) & 1);
  // the consumers read it after their wait on `full`, which this thread's arrival releases
  put_meta(sm.meta(st), TileMeta{hq, q0 | (int)is_full});
  tma::mbar_arrive_expect_tx(sm.full(st), 2 * TQ * D * 2 + (rows ? 2 * TQ * 4 : 0));
  load_tile<D, TQ>(sm.q(st), tmap(p, 0), sm.full(st), q0, hq, b);
  load_tile<D, TQ>(sm.dout(st), tmap(p, 3), sm.full(st), q0, hq, b);
  if (rows)
    tma::load_1d(sm.rows(st), p.lse + b * p.lse_stride_b + hq * p.lse_stride_h + 2 * q0,
                 2 * TQ * 4, sm.full(st));
}

// Tile n's staged fp32 dQ added into dq_accum by the copy engine (one bulk reduction a staging
// tile), then the staging tiles handed back. dq_accum holds each (b, hq, query tile) as
// kDqGroups contiguous tiles in the staging order (stage_dq).
template <int D, int TQ, int TKV>
__device__ __forceinline__ void add_dq(const attncc::BackwardParams& p,
                                       const BwdSmem<D, TQ, TKV>& sm, int n, int b, int hq,
                                       int q0) {
  using Cfg = BwdConfig<D, TQ, TKV, 2, 1>;
  float* dst = p.dq_accum + b * p.dq_stride_b + hq * p.dq_stride_h + (i64)q0 * D;
#pragma unroll
  for (int g = 0; g < Cfg::kDqGroups; ++g) {
    tma::mbar_wait(sm.dq_full(g), n & 1);
    tma::reduce_add_f32(dst + g * (Cfg::kDqBytes / 4), sm.dq(g), Cfg::kDqBytes);
  }
  tma::bulk_commit();
  tma::bulk_wait_read<0>();
#pragma unroll
  for (int g = 0; g < Cfg::kDqGroups; ++g) tma::mbar_arrive(sm.dq_empty(g));
}

// The producer (one thread): K and V once, then per tile n of the sequence its loads, and
// tile n - 1's dQ once the consumers staged it. The loads run a tile ahead of the consumers;
// tile n - 1's dQ is staged after its stage was released, so the reductions never hold up a load.
template <int D, int TQ, int TKV>
__device__ __forceinline__ void produce(const attncc::BackwardParams& p,
                                        const BwdSmem<D, TQ, TKV>& sm) {
  const fa2::BwdCta cta = fa2::bwd_cta<TKV>(p);
  const int b = cta.b;
  tma::mbar_arrive_expect_tx(sm.kv_full(), 2 * TKV * D * 2);
  load_tile<D, TKV>(sm.k(), tmap(p, 1), sm.kv_full(), cta.kv0, cta.h_kv, b);
  load_tile<D, TKV>(sm.v(), tmap(p, 2), sm.kv_full(), cta.kv0, cta.h_kv, b);
  int last_hq = 0, last_q0 = -1, count = 0;
  for_each_tile<TQ, TKV>(p, b, cta.h_kv, cta.kv0, [&](int n, int hq, int q0, bool is_full) {
    load_q_tile(p, sm, n, b, hq, q0, is_full);
    if (n > 0) add_dq(p, sm, n - 1, b, last_hq, last_q0);
    last_hq = hq;
    last_q0 = q0;
    count = n + 1;
  });
  // the end: a stage with head -1 and no bytes, once its last tile was read
  const int st = count & 1;
  if (count >= 2) tma::mbar_wait(sm.empty(st), ((count >> 1) - 1) & 1);
  put_meta(sm.meta(st), TileMeta{-1, 0});
  tma::mbar_arrive(sm.full(st));
  if (count > 0) add_dq(p, sm, count - 1, b, last_hq, last_q0);
  tma::bulk_wait_all<0>();  // the reductions landed before the CTA ends
}

// A descriptor rebuilt where it is used: opaque words keep ptxas from hoisting a tile's per-k-step
// descriptors out of the query loop, two registers each (docs/backward.md, "The FA3-class kernel").
__device__ __forceinline__ wg::DescWords local_desc(u32 addr, unsigned lbo, unsigned sbo) {
  wg::DescWords d = wg::desc_words(addr, lbo, sbo);
  asm volatile("" : "+r"(d.lo), "+r"(d.hi));
  return d;
}

// acc[64 x QS] (=)+= A[64 x 16 KS] B^T, A the warpgroup's 64 rows of a K-major tile (a_tile:
// its first row's address in column block 0, blocks a_block bytes apart), B QS rows of a
// K-major tile (b_block bytes between column blocks): S^T = K Q^T, dP^T = V dO^T.
template <bool F16, int KS, int QS>
__device__ __forceinline__ void issue_abt(float (&acc)[QS / 2], u32 a_tile, u32 a_block,
                                          u32 b_tile, u32 b_block) {
  const wg::DescWords a0 = local_desc(a_tile, 16, 1024);
  const wg::DescWords b0 = local_desc(b_tile, 16, 1024);
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const u32 inner = (ks & 3) * 32;
    const wg::u64 a = wg::desc_u64(wg::desc_plus(a0, (ks >> 2) * a_block + inner));
    const wg::u64 b = wg::desc_u64(wg::desc_plus(b0, (ks >> 2) * b_block + inner));
    if constexpr (QS == 64)
      wg::mma_ss_m64n64k16<0, F16>(acc, a, b, ks > 0);
    else if constexpr (QS == 32)
      wg::mma_ss_m64n32k16<0, F16>(acc, a, b, ks > 0);
    else
      wg::mma_ss_m64n16k16<0, F16>(acc, a, b, ks > 0);
  }
}

// acc += A B over B's NB 64-column blocks: A the K-step fragments in registers (P^T or dS^T
// packed), B an N-major [16 KS rows][D] tile of TQ rows (dO or Q of the stage). At head dim 128
// one m64n128 per k-step covers both blocks, the descriptor's LBO stepping from one to the
// other (docs/backward.md, "The FA3-class kernel").
template <bool F16, int KS, int NB, int ROWS>
__device__ __forceinline__ void issue_rs(float (&acc)[NB][32], const u32 (&a)[KS][4], u32 b_tile) {
  static_assert(NB == 1 || NB == 2, "head dims 64 and 128");
  const wg::DescWords b0 = local_desc(b_tile, NB == 2 ? ROWS * 128 : kNMajorLbo, kNMajorSbo);
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const wg::u64 b = wg::desc_u64(wg::desc_plus(b0, kk * 16 * 128));
    if constexpr (NB == 2)
      wg::mma_rs_m64n128k16<1, F16>(*reinterpret_cast<float(*)[64]>(&acc[0][0]), a[kk], b, 1);
    else
      wg::mma_rs_m64n64k16<1, F16>(acc[0], a[kk], b, 1);
  }
}

// dS^T of the warp's 16 KV rows to shared memory as dS [TQ][TKV] (query-major, swizzled): the
// K-major A operand of dQ = dS K. da[kk] (pack_a's A fragment of query columns [16 kk, 16 kk +
// 16)) is four 8 x 8 blocks in mma.sync's C layout, block j at query columns + 8 (j / 2) and KV
// rows + 8 (j % 2); one stmatrix.trans stores them as rows of dS, lane L giving the address of
// row L % 8 (a query column) of block L / 8. Rows are 16 bytes of one swizzle chunk.
template <int TQ, int KS>
__device__ __forceinline__ void store_ds(u32 sds, const u32 (&da)[KS][4], int qs0, int kv_local0,
                                         int lane) {
  const int j = lane >> 3;
  const int qc = qs0 + 8 * (j >> 1) + (lane & 7), kr = kv_local0 + 8 * (j & 1);
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     sds + wg::sw128_offset(qc + 16 * kk, kr, TQ)),
                 "r"(da[kk][0]), "r"(da[kk][1]), "r"(da[kk][2]), "r"(da[kk][3])
                 : "memory");
}

// dQ[TQ x 64] = dS K over the 64 columns [n0, n0 + 64), all TKV keys: dS (query-major) and K
// (N-major) both in shared memory. Issued and committed; the caller waits.
template <bool F16, int TQ, int TKV>
__device__ __forceinline__ void dq_mma(float (&acc)[32], u32 sds, u32 sk, int n0) {
  const wg::DescWords a0 = local_desc(sds, 16, 1024);
  const wg::DescWords b0 = local_desc(sk + (n0 / 64) * TKV * 128, kNMajorLbo, kNMajorSbo);
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < TKV / 16; ++kk)
    wg::mma_ss_m64n64k16<1, F16>(
        acc, wg::desc_u64(wg::desc_plus(a0, (kk >> 2) * TQ * 128 + (kk & 3) * 32)),
        wg::desc_u64(wg::desc_plus(b0, kk * 16 * 128)), kk > 0);
  wg::commit();
}

// A consumer's dQ tile into its staging tile at `dst`, in the order the bulk reduction adds it
// to dq_accum: [acc / 4][thread][4] floats, so a warp's 16-byte stores are consecutive (no bank
// conflicts). runtime/flex/backward.py (fa3_dq) puts rows and columns back and applies sm_scale
// once (not here: 32 multiplies a tile): acc[4 j + 2 hr + i] of thread 32 wi + 4 r + a is row
// 16 wi + 8 hr + r, column 8 j + 2 a + i.
__device__ __forceinline__ void stage_dq(u32 dst, const float (&acc)[32], int t) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + (j * 128 + t) * 16),
                 "f"(acc[4 * j]), "f"(acc[4 * j + 1]), "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3])
                 : "memory");
}

// Query columns [qs0, qs0 + QS) of a tile against the warpgroup's 64 KV rows: S^T, dP^T, P^T,
// dS^T in registers, dV and dK updated, dS^T stored (buffer sds) for dQ and packed in `da`. Ends
// with its wgmmas complete, but for a whole tile's (QS == TQ) dK wgmma: the caller waits for it
// and keeps `da` alive until then. t.q0 is the sub-tile's first query position. A whole tile's
// S^T is issued alone and dP^T beside dV: S^T and dP^T at once do not fit beside dK and dV;
// it was issued into `s` a tile ahead (bwd_tile), a narrower sub-tile's is issued here.
template <typename Variant, typename DType, int D, int TQ, int TKV, int QS, bool kMask>
__device__ __forceinline__ void bwd_sub(const attncc::BackwardParams& p,
                                        const typename Variant::Params& vp,
                                        const typename Variant::Grads& vg,
                                        const BwdSmem<D, TQ, TKV>& sm, const fa2::BwdTileView& t,
                                        int st, u32 sds, int qs0, int wgi, int wi, bool mask_here,
                                        float (&dk)[D / 64][32], float (&dv)[D / 64][32],
                                        u32 (&da)[QS / 16][4], float (&s)[QS / 2]) {
  constexpr bool F16 = !ElemTraits<DType>::kIsBf16;
  constexpr int NF = QS / 8;
  constexpr bool kWhole = QS == TQ;
  const u32 kv_rows = wgi * 64 * 128;  // the warpgroup's first K / V row in each column block
  const u32 q_rows = qs0 * 128;        // the sub-tile's first Q / dO row in each column block
  float dp[QS / 2];
  if constexpr (!kWhole) {
    wg::fence();
    issue_abt<F16, D / 16, QS>(s, sm.k() + kv_rows, TKV * 128, sm.q(st) + q_rows, TQ * 128);
    wg::commit();
  }
  if constexpr (!kWhole) {
    issue_abt<F16, D / 16, QS>(dp, sm.v() + kv_rows, TKV * 128, sm.dout(st) + q_rows, TQ * 128);
    wg::commit();
    wg::wait<1>();
  } else {
    wg::wait<0>();
  }
  wg::fence_operands(s);
  float(&pt)[NF][4] = *reinterpret_cast<float(*)[NF][4]>(s);
  float sc[NF][4];
  u32 live;
  fa2::probs_tile<Variant, kMask, NF>(t, vp, pt, sc, live, sm.lse2_rows(st) + qs0, p.sm_scale,
                                      p.sm_scale_log2, mask_here);

  u32 pa[NF / 2][4];
  fa2::pack_a<DType, NF>(pa, pt);
  wg::fence_operands(pa);
  wg::fence();
  if constexpr (kWhole) {
    issue_abt<F16, D / 16, QS>(dp, sm.v() + kv_rows, TKV * 128, sm.dout(st) + q_rows, TQ * 128);
    wg::commit();
  }
  issue_rs<F16, NF / 2, D / 64, TQ>(dv, pa, sm.dout(st) + q_rows);  // dV += P^T dO
  wg::commit();
  wg::wait<1>();  // dP^T (the dV group may still run)
  wg::fence_operands(dp);
  float(&dpt)[NF][4] = *reinterpret_cast<float(*)[NF][4]>(dp);
  fa2::dscores_tile<Variant, NF>(t, vp, vg, pt, sc, dpt, live, sm.delta_rows(st) + qs0, true);
  wg::wait<0>();  // dV done: pa's registers are free from here
  wg::fence_operands(pa);
  wg::fence_operands(dv);

  fa2::pack_a<DType, NF>(da, dpt);
  // an opaque lane: the stores' swizzled offsets are the same every tile, and ptxas otherwise
  // hoists all of them out of the query loop into registers of their own (then spills)
  store_ds<TQ, NF / 2>(sds, da, qs0, 64 * wgi + 16 * wi, (int)common::opaque((u32)t.lane));
  wg::fence_operands(da);
  wg::fence();
  issue_rs<F16, NF / 2, D / 64, TQ>(dk, da, sm.q(st) + q_rows);  // dK += dS^T Q
  wg::commit();
  if constexpr (!kWhole) {
    wg::wait<0>();
    wg::fence_operands(da);  // the dK wgmma read da until the wait
    wg::fence_operands(dk);
  }
}

// One query tile against the CTA's KV tile (the header's per-tile steps), tile n of the CTA's
// sequence in stage n % 2 and dS buffer n % 2: its query sub-tiles, the stage released, then
// once both consumers stored their dS halves, dQ staged for the producer's bulk reduction.
// Returns the next tile's TileMeta (head -1: the end). At 64 columns tile n's `Sᵀ` was issued
// into `s` before (by the caller, or by tile n - 1 here), and this tile issues the next one's
// right behind dQ's wgmmas, before waiting for them, so it runs through dQ's wait, the staging
// and the loop's turn.
template <typename Variant, typename DType, int D, int TQ, int TKV, bool kMask>
__device__ __forceinline__ TileMeta bwd_tile(const attncc::BackwardParams& p,
                                             const typename Variant::Params& vp,
                                             const typename Variant::Grads& vg,
                                             const BwdSmem<D, TQ, TKV>& sm,
                                             const fa2::BwdTileView& t, int n, int wgi, int wi,
                                             bool mask_here, float (&dk)[D / 64][32],
                                             float (&dv)[D / 64][32],
                                             float (&s)[(64 >> form::pressure_level()) / 2]) {
  constexpr bool F16 = !ElemTraits<DType>::kIsBf16;
  // sub-tiles of 64, 32 or 16 query columns by the form's pressure level (the kernel cache
  // tries them in that order until one compiles without spills; docs/backward.md)
  constexpr int QS = 64 >> form::pressure_level();
  // at 64 columns (one sub-tile) its dK wgmma runs on through the dS exchange and dQ's wgmmas,
  // and the next tile's S^T is issued ahead of dQ; the narrower forms wait for dK (`da` live
  // past the sub-tile cost them their form)
  constexpr bool kOverlapDk = QS == TQ;
  const int st = n & 1;
  const u32 sds = sm.ds(n & 1);
  u32 da[QS / 16][4];
  if constexpr (kOverlapDk) {
    bwd_sub<Variant, DType, D, TQ, TKV, QS, kMask>(p, vp, vg, sm, t, st, sds, 0, wgi, wi,
                                                   mask_here, dk, dv, da, s);
  } else {
    // not unrolled: inlined sub-tiles let ptxas hoist the next one's loads and offsets into
    // the one before, and hook-carrying variants spilled at head dim 128
#pragma unroll 1
    for (int qs0 = 0; qs0 < TQ; qs0 += QS) {
      fa2::BwdTileView ts = t;
      ts.q0 = t.q0 + qs0;
      bwd_sub<Variant, DType, D, TQ, TKV, QS, kMask>(p, vp, vg, sm, ts, st, sds, qs0, wgi, wi,
                                                     mask_here, dk, dv, da, s);
    }
  }
  // Q, dO, LSE and delta read (the dK wgmma done): the producer may refill the stage
  if constexpr (!kOverlapDk) tma::mbar_arrive(sm.empty(st));
  wg::fence_proxy_async();  // the dS stores, before wgmma reads them
  tma::mbar_arrive(sm.ds_done(n & 1));
  tma::mbar_wait(sm.ds_done(n & 1), (n >> 1) & 1);  // dS complete (both warpgroups)
  float acc[32];
  const bool dq_here = !(D == 64 && wgi != 0);  // at head dim 64 consumer 0 computes all of dQ
  if (dq_here) dq_mma<F16, TQ, TKV>(acc, sds, sm.k(), 64 * wgi);
  // the next tile (its stage was filled while this one ran) and, at 64 columns, its S^T: in
  // flight through dQ's staging and the loop's turn, waited on in its bwd_sub
  tma::mbar_wait(sm.full((n + 1) & 1), ((n + 1) >> 1) & 1);
  const TileMeta next = get_meta(sm.meta((n + 1) & 1));
  if constexpr (kOverlapDk) {  // (after the last tile too: a divergent issue serializes every
                               // wgmma, ptxas's C7518; the end's stage holds stale tiles)
    wg::fence();
    issue_abt<F16, D / 16, QS>(s, sm.k() + wgi * 64 * 128, TKV * 128, sm.q((n + 1) & 1),
                               TQ * 128);
    wg::commit();
    wg::wait<1>();  // dQ's (and the dK) wgmmas; S^T runs on
  } else {
    wg::wait<0>();
  }
  wg::fence_operands(acc);
  if constexpr (kOverlapDk) {
    wg::fence_operands(da);
    wg::fence_operands(dk);
    tma::mbar_arrive(sm.empty(st));
  }
  if (dq_here) {
    if (n > 0) tma::mbar_wait(sm.dq_empty(wgi), (n - 1) & 1);  // the last tile's dQ was read
    stage_dq(sm.dq(wgi), acc, 32 * wi + t.lane);
    wg::fence_proxy_async();  // the staging stores, before the copy engine reads them
    tma::mbar_arrive(sm.dq_full(wgi));
  }
  return next;
}

// dK (times sm_scale) and dV rows of this warp: element pairs, 32-bit stores.
template <typename DType, int D>
__device__ __forceinline__ void store_dkdv(const attncc::BackwardParams& p, int b, int h_kv,
                                           int kv_row0, int lane, const float (&dk)[D / 64][32],
                                           const float (&dv)[D / 64][32]) {
  DType* gk = reinterpret_cast<DType*>(p.dk) + b * p.dk_stride_b + h_kv * p.dk_stride_h;
  DType* gv = reinterpret_cast<DType*>(p.dv) + b * p.dv_stride_b + h_kv * p.dv_stride_h;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int kv = kv_row0 + (lane >> 2) + 8 * hr;
    if (kv >= p.kv_len) continue;
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 64 * blk + 8 * j + 2 * (lane & 3);
        const int e = 4 * j + 2 * hr;
        *reinterpret_cast<u32*>(gk + (i64)kv * p.dk_stride_s + col) = common::pack2<DType>(
            dk[blk][e] * p.sm_scale, dk[blk][e + 1] * p.sm_scale);
        *reinterpret_cast<u32*>(gv + (i64)kv * p.dv_stride_s + col) =
            common::pack2<DType>(dv[blk][e], dv[blk][e + 1]);
      }
  }
}

// One-time setup by thread 0: every barrier's arrival count (docs/backward.md, "Warp
// specialization"), made visible to the copy engine.
template <int D, int TQ, int TKV>
__device__ __forceinline__ void init_barriers(const BwdSmem<D, TQ, TKV>& sm) {
  tma::mbar_init(sm.kv_full(), 1);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    tma::mbar_init(sm.full(i), 1);
    tma::mbar_init(sm.empty(i), 256);  // every consumer thread, after its last read
    tma::mbar_init(sm.ds_done(i), 256);
    tma::mbar_init(sm.dq_full(i), 128);  // the staging warpgroup's threads
    tma::mbar_init(sm.dq_empty(i), 1);   // the producer
  }
  tma::fence_barrier_init();
}

// A consumer warpgroup (wgi 0 or 1: KV rows [64 wgi, 64 wgi + 64) of the tile): every tile of
// the CTA's sequence once its stage landed (bwd_tile), then dK and dV out.
template <typename Variant, typename DType, int D, int TQ, int TKV>
__device__ __forceinline__ void consume(const attncc::BackwardParams& p,
                                        const typename Variant::Params& vp,
                                        const typename Variant::Grads& vg,
                                        const BwdSmem<D, TQ, TKV>& sm, int wgi, int wi, int lane) {
  const fa2::BwdCta cta = fa2::bwd_cta<TKV>(p);
  const int b = cta.b, kv_row0 = cta.kv0 + 64 * wgi + 16 * wi;
  float dk[D / 64][32], dv[D / 64][32];
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int e = 0; e < 32; ++e) dk[blk][e] = dv[blk][e] = 0.f;
  tma::mbar_wait(sm.kv_full(), 0);
  constexpr int QS = 64 >> form::pressure_level();
  float s[QS / 2];  // S^T of a sub-tile; at 64 columns issued a tile ahead (bwd_tile)
  tma::mbar_wait(sm.full(0), 0);
  TileMeta m = get_meta(sm.meta(0));
  if constexpr (QS == TQ) {
    wg::fence();
    issue_abt<!ElemTraits<DType>::kIsBf16, D / 16, QS>(s, sm.k() + wgi * 64 * 128, TKV * 128,
                                                       sm.q(0), TQ * 128);
    wg::commit();
  }
#pragma unroll 1
  for (int n = 0; m.hq >= 0; ++n) {
    const fa2::BwdTileView t{b, m.hq, m.q0f & ~1, kv_row0, p.q_len, p.kv_len, lane};
    // one instantiation, the mask decided per tile: two inlined copies of the tile body (one
    // masked, one not) spilled at head dim 128 (docs/backward.md, "The FA3-class kernel")
    m = bwd_tile<Variant, DType, D, TQ, TKV, Variant::has_logits_mask>(
        p, vp, vg, sm, t, n, wgi, wi, !(m.q0f & 1), dk, dv, s);
  }
  wg::wait<0>();  // the S^T issued past the last tile
  wg::fence_operands(s);
  // re-derived, not live through the loop (bwd_cta)
  store_dkdv<DType, D>(p, b, fa2::bwd_cta<TKV>(p).h_kv, kv_row0, lane, dk, dv);
}

// The kernel body: barriers, then the roles (the header's): one thread of the producer
// warpgroup loads and adds dQ, warpgroups 1 and 2 consume.
template <typename Variant, typename DType, int D, int TQ, int TKV>
__device__ __forceinline__ void fa3_backward(const attncc::BackwardParams& p,
                                             const typename Variant::Params& vp,
                                             const typename Variant::Grads& vg) {
  static_assert(!Variant::has_query_transform && !Variant::has_key_transform &&
                    !Variant::has_value_transform && !Variant::has_output_transform,
                "the backward kernel runs on materialized q/k/v (docs/backward.md, Kernels)");
  extern __shared__ __attribute__((aligned(128))) unsigned char attncc_fa3_bwd_smem[];
  const BwdSmem<D, TQ, TKV> sm(attncc_fa3_bwd_smem);
  // the warpgroup index broadcast from lane 0, so ptxas knows it warp-uniform: the consumers'
  // K / V addresses and their wgmma descriptors then stay in uniform registers (no R2UR a wgmma)
  const int tid = threadIdx.x, wg_id = __shfl_sync(0xffffffffu, tid >> 7, 0);
  if (tid == 0) init_barriers(sm);
  __syncthreads();
  if (wg_id == 0) {
    wg::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0) produce<D, TQ, TKV>(p, sm);
    return;
  }
  wg::setmaxnreg_inc<kConsumerRegs>();
  consume<Variant, DType, D, TQ, TKV>(p, vp, vg, sm, wg_id - 1, (tid >> 5) & 3, tid & 31);
}

}  // namespace fa3bwd
}  // namespace attncc

// The entry point codegen emits for an FA3-class backward unit: the FA2-class macro's arguments
// (BackwardTiles), grid (ceil(kv_len / TKV) C, num_kv_heads / C, batch) (fa2::bwd_cta), block
// BwdConfig::kThreads, dynamic shared memory BwdConfig::kSmemBytes; BackwardParams::tma the
// q, k, v, dO maps, the LSE base 2 and with delta padded to whole query tiles, dq_accum zeroed
// in the staging order (runtime/flex/backward.py).
#define ATTNCC_FA3_BWD_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, DSPLIT)              \
  extern "C" __global__ void __launch_bounds__(                                                    \
      attncc::fa3bwd::BwdConfig<HEAD_DIM, TQ, TKV, STAGES, DSPLIT>::kThreads, 1)                   \
      NAME(attncc::BackwardParams p, VARIANT::Params vp, VARIANT::Grads vg) {                      \
    attncc::fa3bwd::fa3_backward<VARIANT, DTYPE, HEAD_DIM, TQ, TKV>(p, vp, vg);                    \
  }

#endif  // ATTNCC_FA3_BACKWARD_CUH
