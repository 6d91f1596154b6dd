// attncc FA3-class attention backward for sm_90a (wgmma): dQ, dK, dV and the gradients of
// captured tensors of one variant, recomputing the probabilities from Q, K and the saved LSE.
// Written for attncc; docs/backward.md, "The FA3-class kernel", is the design note.
//
// Self-contained: no #include. Comes after attncc_types.cuh, backward_params.cuh, common.cuh,
// fa2_config.cuh, fa2_backward.cuh (the per-element hooks, the tile lists), codegen's form
// block and wgmma.cuh, and before the generated Variant_<name> (ATTNCC_FA3_BWD_ENTRY below).
//
// Grid: fa2::bwd_cta's (ceil(kv_len / 128) C, num_kv_heads / C, batch), KV heads in chunks of C.
// Two warpgroups, warpgroup w owns KV rows [64 w, 64 w + 64) of the CTA's 128-row KV tile. As in
// the FA2-class kernel, a CTA keeps its K and V tile in shared memory and dK, dV in registers,
// visits the 64-row query tiles of every query head of its GQA group that touch it, and writes
// dK, dV once. Per query tile and each of its two 32-column query sub-tiles, each warpgroup (its
// 64 KV rows are every wgmma's M):
//   S^T = K Q^T, dP^T = V dO^T                 SS m64n32, both issued at once
//   P^T, dS^T in registers                     fa2_backward.cuh's probs_tile / dscores_tile: the
//                                              wgmma accumulator is mma.sync's C layout per warp
//   dV += P^T dO, dK += dS^T Q                 RS: P^T / dS^T as A fragments, dO / Q N-major
//   dQ += dS K                                 after both sub-tiles: SS m64n64 over dS in shared
//                                              memory (query-major), fp32 reductions into dq_accum
// dQ's columns are split over the warpgroups at head dim 128 (one m64n64 each, all 128 keys);
// at head dim 64 warpgroup 0 computes it alone, so every dQ element takes one atomic add per
// CTA and query tile -- what the deterministic mode's per-tile launches rely on.
// Shared tiles use the 128-byte swizzle of wgmma.cuh (sw128_offset), filled by cp.async.
#ifndef ATTNCC_FA3_BACKWARD_CUH
#define ATTNCC_FA3_BACKWARD_CUH

namespace attncc {
namespace fa3bwd {

using common::cp_async_16;
using common::cp_async_commit;
using common::cp_async_wait;
using common::ElemTraits;
using common::smem_addr;
using common::TileList;
typedef unsigned int u32;
typedef unsigned short u16;

// The N-major descriptor's byte offsets as the forward's V operand uses them (fa3_consumer.cuh;
// tests/gpu/test_wgmma.py measured them): LBO unused at N = 64, SBO = 1024.
constexpr unsigned kNMajorLbo = 8192;
constexpr unsigned kNMajorSbo = 1024;

template <int D, int TQ, int TKV, int STAGES, int DSPLIT>
struct BwdConfig {
  static_assert(D == 64 || D == 128, "the FA3-class backward runs head dims 64 and 128");
  static_assert(TQ == 64 && TKV == 128 && STAGES == 2 && DSPLIT == 1,
                "one form: 64-row query tiles, 128-row KV tiles, two stages");
  static constexpr int kThreads = 256;  // two warpgroups of 64 KV rows
  // byte offsets from a 1024-aligned base (128-byte swizzle atoms); tiles are stored as
  // 64-column blocks of [rows][128 B] one after another (wgmma.cuh)
  static constexpr int kK = 0;
  static constexpr int kV = kK + TKV * D * 2;
  static constexpr int kQ = kV + TKV * D * 2;            // [STAGES]
  static constexpr int kDo = kQ + STAGES * TQ * D * 2;   // [STAGES]
  static constexpr int kDs = kDo + STAGES * TQ * D * 2;  // dS [TQ][TKV], query-major
  static constexpr int kLse = kDs + TQ * TKV * 2;        // fp32 LSE (base 2) [STAGES][TQ]
  static constexpr int kDelta = kLse + STAGES * TQ * 4;  // fp32 delta [STAGES][TQ]
  static constexpr int kSmemBytes = kDelta + STAGES * TQ * 4 + 1024;  // + alignment slack
};

// Copy rows [row0, row0 + ROWS) of a [len][D] 16-bit tensor into a 128B-swizzled tile at
// shared address dst; rows outside [0, len) are zero-filled.
template <typename DType, int D, int ROWS, int NT>
__device__ __forceinline__ void load_rows(const DType* g, i64 stride_s, u32 dst, int row0, int len,
                                          int tid) {
  constexpr int CHUNKS = D / 8;
  constexpr int PER_PASS = NT / CHUNKS;
  static_assert(NT % CHUNKS == 0 && ROWS % PER_PASS == 0, "loader layout");
  const int r0 = tid / CHUNKS, col = (tid % CHUNKS) * 8;
#pragma unroll
  for (int j = 0; j < ROWS / PER_PASS; ++j) {
    const int r = r0 + j * PER_PASS;
    const bool ok = (unsigned)(row0 + r) < (unsigned)len;
    const DType* src = ok ? g + (i64)(row0 + r) * stride_s + col : g;
    cp_async_16(dst + wg::sw128_offset(r, col, ROWS), src, ok);
  }
}

// Where a CTA's shared tiles are: shared-space addresses for wgmma / cp.async, and generic
// pointers for the fp32 rows and the dS stores.
template <int D, int TQ, int TKV>
struct BwdSmem {
  using Cfg = BwdConfig<D, TQ, TKV, 2, 1>;
  u32 base;
  unsigned char* ptr;
  __device__ __forceinline__ explicit BwdSmem(unsigned char* raw) {
    const u32 a = smem_addr(raw);
    base = (a + 1023u) & ~1023u;
    ptr = raw + (base - a);
  }
  __device__ __forceinline__ u32 k() const { return base + Cfg::kK; }
  __device__ __forceinline__ u32 v() const { return base + Cfg::kV; }
  __device__ __forceinline__ u32 q(int st) const { return base + Cfg::kQ + st * TQ * D * 2; }
  __device__ __forceinline__ u32 dout(int st) const { return base + Cfg::kDo + st * TQ * D * 2; }
  __device__ __forceinline__ u32 ds() const { return base + Cfg::kDs; }
  __device__ __forceinline__ float* lse2(int st) const {
    return reinterpret_cast<float*>(ptr + Cfg::kLse) + st * TQ;
  }
  __device__ __forceinline__ float* delta(int st) const {
    return reinterpret_cast<float*>(ptr + Cfg::kDelta) + st * TQ;
  }
};

// cp.async query tile i of head hq (Q, dO rows) into its stage; LSE (base 2) and delta by plain
// stores. Commits one group even past the list (the ring's wait counts groups).
template <typename DType, int D, int TQ, int TKV, int NT>
__device__ __forceinline__ void load_q_tile(const attncc::BackwardParams& p,
                                            const BwdSmem<D, TQ, TKV>& sm, const TileList& tl,
                                            int i, int b, int hq, int tid) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (i < tl.count) {
    bool is_full;
    const int q0 = tl.start(i, is_full);
    const int st = i & 1;
    load_rows<DType, D, TQ, NT>(
        reinterpret_cast<const DType*>(p.q) + b * p.q_stride_b + hq * p.q_stride_h, p.q_stride_s,
        sm.q(st), q0, p.q_len, tid);
    load_rows<DType, D, TQ, NT>(
        reinterpret_cast<const DType*>(p.dout) + b * p.do_stride_b + hq * p.do_stride_h,
        p.do_stride_s, sm.dout(st), q0, p.q_len, tid);
    if (p.lse != nullptr && tid < TQ) {
      const int qi = q0 + tid;
      const bool in = (unsigned)qi < (unsigned)p.q_len;
      const i64 off = b * p.lse_stride_b + hq * p.lse_stride_h + qi;
      const float l = in ? p.lse[off] : 0.f;
      // a row with no weight (LSE -inf) has P = 0 everywhere: exp2(s - +inf) = 0, never NaN
      sm.lse2(st)[tid] = l == attncc::neg_inf() ? attncc::pos_inf() : l * kLog2e;
      sm.delta(st)[tid] = in ? p.delta[off] : 0.f;
    }
  }
  cp_async_commit();
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
    else
      wg::mma_ss_m64n32k16<0, F16>(acc, a, b, ks > 0);
  }
}

// acc[blk] += A B for each 64-column block blk of B: A the K-step fragments in registers (P^T or
// dS^T packed), B an N-major [16 KS rows][D] tile of TQ rows (dO or Q of the stage).
template <bool F16, int KS, int NB, int ROWS>
__device__ __forceinline__ void issue_rs(float (&acc)[NB][32], const u32 (&a)[KS][4], u32 b_tile) {
  const wg::DescWords b0 = local_desc(b_tile, kNMajorLbo, kNMajorSbo);
#pragma unroll
  for (int blk = 0; blk < NB; ++blk)
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
      wg::mma_rs_m64n64k16<1, F16>(
          acc[blk], a[kk], wg::desc_u64(wg::desc_plus(b0, blk * ROWS * 128 + kk * 16 * 128)), 1);
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

// Two adjacent fp32 adds into global memory (8-byte aligned), one vector reduction (sm_90):
// half the atomic instructions of dQ's element-wise atomicAdd.
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}

// dQ[TQ x 64] += dS K over the 64 columns [n0, n0 + 64) and key steps [kk0, kk0 + KS), then
// fp32 vector reductions (times sm_scale) into dq_accum. Warp wi holds query rows
// 16 wi + lane/4 (+8).
template <bool F16, int D, int TQ, int TKV, int KS>
__device__ __forceinline__ void dq_part(const attncc::BackwardParams& p, u32 sds, u32 sk, int b,
                                        int hq, int q0, int n0, int kk0, int wi, int lane) {
  float acc[32];
  const wg::DescWords a0 = local_desc(sds, 16, 1024);
  const wg::DescWords b0 = local_desc(sk + (n0 / 64) * TKV * 128, kNMajorLbo, kNMajorSbo);
  wg::fence();
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    const int kk = kk0 + k;
    wg::mma_ss_m64n64k16<1, F16>(acc,
                                 wg::desc_u64(wg::desc_plus(a0, (kk >> 2) * TQ * 128 +
                                                                    (kk & 3) * 32)),
                                 wg::desc_u64(wg::desc_plus(b0, kk * 16 * 128)), k > 0);
  }
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(acc);
  float* dq = p.dq_accum + b * p.dq_stride_b + hq * p.dq_stride_h;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int qi = q0 + 16 * wi + (lane >> 2) + 8 * hr;
    if (qi >= p.q_len) continue;
    float* row = dq + (i64)qi * p.dq_stride_s + n0 + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      red_add2(row + 8 * j, acc[4 * j + 2 * hr] * p.sm_scale,
               acc[4 * j + 2 * hr + 1] * p.sm_scale);
  }
}

// Query columns [qs0, qs0 + QS) of a tile against the warpgroup's 64 KV rows: S^T, dP^T, P^T,
// dS^T in registers, dV and dK updated, dS^T stored for dQ. Ends with its wgmmas complete.
// t.q0 is the sub-tile's first query position.
template <typename Variant, typename DType, int D, int TQ, int TKV, int QS, bool kMask>
__device__ __forceinline__ void bwd_sub(const attncc::BackwardParams& p,
                                        const typename Variant::Params& vp,
                                        const typename Variant::Grads& vg,
                                        const BwdSmem<D, TQ, TKV>& sm, const fa2::BwdTileView& t,
                                        int st, int qs0, int wgi, int wi, bool mask_here,
                                        float (&dk)[D / 64][32], float (&dv)[D / 64][32]) {
  constexpr bool F16 = !ElemTraits<DType>::kIsBf16;
  constexpr int NF = QS / 8;
  const u32 kv_rows = wgi * 64 * 128;  // the warpgroup's first K / V row in each column block
  const u32 q_rows = qs0 * 128;        // the sub-tile's first Q / dO row in each column block
  float s[QS / 2], dp[QS / 2];
  wg::fence();
  issue_abt<F16, D / 16, QS>(s, sm.k() + kv_rows, TKV * 128, sm.q(st) + q_rows, TQ * 128);
  wg::commit();
  issue_abt<F16, D / 16, QS>(dp, sm.v() + kv_rows, TKV * 128, sm.dout(st) + q_rows, TQ * 128);
  wg::commit();
  wg::wait<1>();
  wg::fence_operands(s);
  float(&pt)[NF][4] = *reinterpret_cast<float(*)[NF][4]>(s);
  float sc[NF][4];
  u32 live;
  fa2::probs_tile<Variant, kMask, NF>(t, vp, pt, sc, live, sm.lse2(st) + qs0, p.sm_scale,
                                      mask_here);

  u32 pa[NF / 2][4];
  fa2::pack_a<DType, NF>(pa, pt);
  wg::fence_operands(pa);
  wg::fence();
  issue_rs<F16, NF / 2, D / 64, TQ>(dv, pa, sm.dout(st) + q_rows);  // dV += P^T dO
  wg::commit();
  wg::wait<1>();  // dP^T (the dV group may still run)
  wg::fence_operands(dp);
  float(&dpt)[NF][4] = *reinterpret_cast<float(*)[NF][4]>(dp);
  fa2::dscores_tile<Variant, NF>(t, vp, vg, pt, sc, dpt, live, sm.delta(st) + qs0, true);
  wg::wait<0>();  // dV done: pa's registers are free from here
  wg::fence_operands(pa);
  wg::fence_operands(dv);

  u32 da[NF / 2][4];
  fa2::pack_a<DType, NF>(da, dpt);
  // an opaque lane: the stores' swizzled offsets are the same every tile, and ptxas otherwise
  // hoists all of them out of the query loop into registers of their own (then spills)
  store_ds<TQ, NF / 2>(sm.ds(), da, qs0, 64 * wgi + 16 * wi, (int)common::opaque((u32)t.lane));
  wg::fence_operands(da);
  wg::fence();
  issue_rs<F16, NF / 2, D / 64, TQ>(dk, da, sm.q(st) + q_rows);  // dK += dS^T Q
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(da);  // the dK wgmma read da until the wait
  wg::fence_operands(dk);
}

// One query tile against the CTA's KV tile (the header's per-tile steps): its two query sub-tiles
// of 32 columns (a whole 64-column S^T and dP^T spilled beside dK and dV at head dim 128, and
// serialized the wgmmas of several variants at 64), then dQ. Ends with every wgmma of the tile
// complete, so the caller may refill the stage.
template <typename Variant, typename DType, int D, int TQ, int TKV, bool kMask>
__device__ __forceinline__ void bwd_tile(const attncc::BackwardParams& p,
                                         const typename Variant::Params& vp,
                                         const typename Variant::Grads& vg,
                                         const BwdSmem<D, TQ, TKV>& sm, const fa2::BwdTileView& t,
                                         int st, int wgi, int wi, bool mask_here,
                                         float (&dk)[D / 64][32], float (&dv)[D / 64][32]) {
  constexpr bool F16 = !ElemTraits<DType>::kIsBf16;
  constexpr int QS = 32;
  // not unrolled: two inlined sub-tiles let ptxas hoist the second's loads and offsets into
  // the first, and hook-carrying variants spilled at head dim 128
#pragma unroll 1
  for (int qs0 = 0; qs0 < TQ; qs0 += QS) {
    fa2::BwdTileView ts = t;
    ts.q0 = t.q0 + qs0;
    bwd_sub<Variant, DType, D, TQ, TKV, QS, kMask>(p, vp, vg, sm, ts, st, qs0, wgi, wi, mask_here,
                                                   dk, dv);
  }
  wg::fence_proxy_async();  // the dS stores, before wgmma reads them
  __syncthreads();          // dS complete (both warpgroups)
  if (D == 128 || wgi == 0)
    dq_part<F16, D, TQ, TKV, TKV / 16>(p, sm.ds(), sm.k(), t.b, t.hq, t.q0, D == 128 ? 64 * wgi : 0,
                                       0, wi, t.lane);
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

// The kernel body: K/V tile in, then for each query head of the group and each listed query
// tile bwd_tile (two-stage cp.async ring: tile it + 1 loads while tile it computes), dK/dV out.
template <typename Variant, typename DType, int D, int TQ, int TKV>
__device__ __forceinline__ void fa3_backward(const attncc::BackwardParams& p,
                                             const typename Variant::Params& vp,
                                             const typename Variant::Grads& vg) {
  using Cfg = BwdConfig<D, TQ, TKV, 2, 1>;
  static_assert(!Variant::has_query_transform && !Variant::has_key_transform &&
                    !Variant::has_value_transform && !Variant::has_output_transform,
                "the backward kernel runs on materialized q/k/v (docs/backward.md, Kernels)");
  extern __shared__ __attribute__((aligned(128))) unsigned char attncc_fa3_bwd_smem[];
  const BwdSmem<D, TQ, TKV> sm(attncc_fa3_bwd_smem);
  const int tid = threadIdx.x, lane = tid & 31, wgi = tid >> 7, wi = (tid >> 5) & 3;
  const fa2::BwdCta cta = fa2::bwd_cta<TKV>(p);
  const int b = cta.b, h_kv = cta.h_kv, kv0 = cta.kv0;
  const int gsize = p.num_q_heads / p.num_kv_heads;
  const int kv_row0 = kv0 + 64 * wgi + 16 * wi;

  load_rows<DType, D, TKV, Cfg::kThreads>(
      reinterpret_cast<const DType*>(p.k) + b * p.k_stride_b + h_kv * p.k_stride_h, p.k_stride_s,
      sm.k(), kv0, p.kv_len, tid);
  load_rows<DType, D, TKV, Cfg::kThreads>(
      reinterpret_cast<const DType*>(p.v) + b * p.v_stride_b + h_kv * p.v_stride_h, p.v_stride_s,
      sm.v(), kv0, p.kv_len, tid);
  cp_async_commit();

  float dk[D / 64][32], dv[D / 64][32];
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int e = 0; e < 32; ++e) dk[blk][e] = dv[blk][e] = 0.f;

#pragma unroll 1
  for (int j = 0; j < gsize; ++j) {
    const int hq = fa2::bwd_cta<TKV>(p).h_kv * gsize + j;  // re-derived, not live (bwd_cta)
    const TileList tl = fa2::query_tiles<TQ>(p, b, hq, kv0);
    load_q_tile<DType, D, TQ, TKV, Cfg::kThreads>(p, sm, tl, 0, b, hq, tid);
#pragma unroll 1
    for (int it = 0; it < tl.count; ++it) {
      cp_async_wait<0>();        // tile it (and K/V) landed for this thread ...
      wg::fence_proxy_async();   // ... is visible to wgmma ...
      __syncthreads();           // ... for all; stage (it + 1) % 2 and dS are free
      load_q_tile<DType, D, TQ, TKV, Cfg::kThreads>(p, sm, tl, it + 1, b, hq, tid);
      bool is_full;
      const int q0 = tl.start(it, is_full);
      const fa2::BwdTileView t{b, hq, q0, kv_row0, p.q_len, p.kv_len, lane};
      // one instantiation, the mask decided per tile: two inlined copies of the tile body (one
      // masked, one not) spilled at head dim 128 (docs/backward.md, "The FA3-class kernel")
      bwd_tile<Variant, DType, D, TQ, TKV, Variant::has_logits_mask>(p, vp, vg, sm, t, it & 1,
                                                                     wgi, wi, !is_full, dk, dv);
    }
    cp_async_wait<0>();
    __syncthreads();  // the last tile's stages are read before the next head refills them
  }
  store_dkdv<DType, D>(p, b, fa2::bwd_cta<TKV>(p).h_kv, kv_row0, lane, dk, dv);  // likewise
}

}  // namespace fa3bwd
}  // namespace attncc

// The entry point codegen emits for an FA3-class backward unit: the FA2-class macro's arguments
// (BackwardTiles), grid (ceil(kv_len / TKV) C, num_kv_heads / C, batch) (fa2::bwd_cta), block
// BwdConfig::kThreads, dynamic shared memory BwdConfig::kSmemBytes; dq_accum zeroed first.
#define ATTNCC_FA3_BWD_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, DSPLIT)              \
  extern "C" __global__ void __launch_bounds__(                                                    \
      attncc::fa3bwd::BwdConfig<HEAD_DIM, TQ, TKV, STAGES, DSPLIT>::kThreads, 1)                   \
      NAME(attncc::BackwardParams p, VARIANT::Params vp, VARIANT::Grads vg) {                      \
    attncc::fa3bwd::fa3_backward<VARIANT, DTYPE, HEAD_DIM, TQ, TKV>(p, vp, vg);                    \
  }

#endif  // ATTNCC_FA3_BACKWARD_CUH
