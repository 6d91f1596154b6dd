// attncc fp8 KV caches in the FA2 batch kernel (e4m3 / e5m2): the tile is copied into shared
// memory as bytes -- half the global traffic of a bf16 tile, the point of an fp8 cache -- and
// widened to the compute dtype (q's: bf16 or fp16) right before the tile's MMAs. Both fp8
// formats widen exactly into bf16 and fp16, so the tile the MMAs read is the cache's values
// exactly; the per-head scales are applied in fp32 outside the tile: k_scale folded into the
// logits' scale, v_scale into the normalized output (docs/serving.md, "fp8 KV cache").
//
// Self-contained: no #include; comes after common.cuh and fa2_config.cuh, before fa2_attend.cuh.
#ifndef ATTNCC_FA2_KV8_CUH
#define ATTNCC_FA2_KV8_CUH

namespace attncc {
namespace fa2 {

// The KV cache's element type when it is not the compute dtype: torch.float8_e4m3fn and
// torch.float8_e5m2. A Work whose KvT is one of these sets kKv8.
struct kv_e4m3 {};
struct kv_e5m2 {};

template <typename KvT>
struct KvTraits {
  static constexpr bool kIs8 = false;
};
template <>
struct KvTraits<kv_e4m3> {
  static constexpr bool kIs8 = true;
  static constexpr bool kE4m3 = true;
};
template <>
struct KvTraits<kv_e5m2> {
  static constexpr bool kIs8 = true;
  static constexpr bool kE4m3 = false;
};

// Two fp8 values (bytes 0, 1 of `x` if !kHigh, else bytes 2, 3) -> f16x2, first value in the low
// half. e5m2 is the top byte of an fp16 (same exponent, 2 of its 10 mantissa bits), so a byte
// permute is exact, inf and NaN included; e4m3 needs sm_89's cvt (the host refuses fp8 caches
// on older GPUs: runtime/serving/operands.py).
template <bool kE4m3, bool kHigh>
__device__ __forceinline__ u32 fp8x2_to_f16x2(u32 x) {
  u32 r;
  if constexpr (!kE4m3) {
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(x), "n"(kHigh ? 0x3424 : 0x1404));
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (kHigh) {
      asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }"
          : "=r"(r) : "r"(x));
    } else {
      asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }"
          : "=r"(r) : "r"(x));
    }
#else
    asm volatile("trap;");
    r = 0;
#endif
  }
  return r;
}

// f16x2 -> bf16x2 through fp32: exact for every value an fp8 format holds.
__device__ __forceinline__ u32 f16x2_to_bf16x2(u32 h) {
  u32 r;
  asm("{ .reg .f16 lo, hi; .reg .f32 a, b; mov.b32 {lo, hi}, %1; cvt.f32.f16 a, lo;"
      " cvt.f32.f16 b, hi; cvt.rn.bf16x2.f32 %0, b, a; }"
      : "=r"(r) : "r"(h));
  return r;
}

// Eight fp8 values (little-endian bytes of `b`) -> eight DType values, in order.
template <typename DType, typename KvT>
__device__ __forceinline__ u32x4 widen8(uint2 b) {
  constexpr bool kE4m3 = KvTraits<KvT>::kE4m3;
  u32 h[4] = {fp8x2_to_f16x2<kE4m3, false>(b.x), fp8x2_to_f16x2<kE4m3, true>(b.x),
              fp8x2_to_f16x2<kE4m3, false>(b.y), fp8x2_to_f16x2<kE4m3, true>(b.y)};
  if constexpr (ElemTraits<DType>::kIsBf16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = f16x2_to_bf16x2(h[i]);
  }
  return u32x4{h[0], h[1], h[2], h[3]};
}

// load_kv_tile (fa2_attend.cuh) for an fp8 cache: tile i's fp8 K and V into ring stage
// i % STAGES at shared address `ring` (STAGE_BYTES per stage: K's TKV*D bytes, then V's), one
// commit group. The caller converts `ring` to a shared address once, before its loop: per
// tile, ptxas spilled 16 bytes of the decode form at D = 128.
template <int STAGES, int STAGE_BYTES, typename Work>
__device__ __forceinline__ void load_kv8_tile(const Work& w, int i, u32 ring, int tid) {
  if (i < w.count) {
    bool f;
    const int kv0 = w.tile_start(i, f);
    const u32 k = ring + (i % STAGES) * STAGE_BYTES;
    w.load_kv(k, k + STAGE_BYTES / 2, kv0, tid);
  }
  cp_async_commit();
}

// Widen rows [r0, r0 + ROWS) of one fp8 tile `src` ([TKV][D] bytes, rows D bytes apart, no
// swizzle) into the 16-bit tile `dst` (common.cuh's swizzled layout), N threads sharing them
// (`idx` < N), 8 elements each: 8-byte shared loads, 16-byte conflict-free stores. UNROLL
// chunks are in flight at once: four in decode, two where the O accumulators of a
// two-fragment prefill tile leave few registers (more spilled: 16 B in the fp16 decode form at
// D = 128 fully unrolled, 216 B in the bf16 two-fragment form).
template <typename DType, typename KvT, int D, int ROWS, int N, int UNROLL>
__device__ __forceinline__ void widen_rows(const unsigned char* src, u16* dst, int r0, int idx) {
  constexpr int CH = D / 8;
  static_assert((ROWS * CH) % N == 0, "every thread widens the same number of chunks");
#pragma unroll UNROLL
  for (int j = 0; j < ROWS * CH / N; ++j) {
    const int c = idx + j * N;
    const int r = r0 + c / CH, ch = c % CH;
    const uint2 b = *reinterpret_cast<const uint2*>(src + r * D + ch * 8);
    *reinterpret_cast<u32x4*>(dst + swz<D>(r, ch * 8)) = widen8<DType, KvT>(b);
  }
}

// Widen the landed fp8 K and V tile (`ring`: K's TKV*D bytes, then V's) into the one 16-bit
// K and V tiles the MMAs read. Decode (KV_WARPS > 1): each warp widens only its own KV slice,
// which only it reads, so a __syncwarp publishes it; otherwise all threads widen every row and
// the block barrier publishes them. The caller's barrier at the top of the tile guarantees
// every warp is done with the previous tile's 16-bit rows.
template <typename DType, typename KvT, int D, int TKV, int KV_WARPS, int NT>
__device__ __forceinline__ void widen_kv_tile(const unsigned char* ring, u16* sK, u16* sV,
                                              int kvw, int tid) {
  if constexpr (KV_WARPS > 1) {
    constexpr int SLICE = TKV / KV_WARPS;
    constexpr int UNROLL = SLICE * D / 8 / 32 > 4 ? 4 : SLICE * D / 8 / 32;
    widen_rows<DType, KvT, D, SLICE, 32, UNROLL>(ring, sK, kvw * SLICE, tid & 31);
    widen_rows<DType, KvT, D, SLICE, 32, UNROLL>(ring + TKV * D, sV, kvw * SLICE, tid & 31);
    __syncwarp();
  } else {
    widen_rows<DType, KvT, D, TKV, NT, 2>(ring, sK, 0, tid);
    widen_rows<DType, KvT, D, TKV, NT, 2>(ring + TKV * D, sV, 0, tid);
    __syncthreads();
  }
}

// O *= v_scale: the value scale of an fp8 cache, applied once to the normalized output rows
// instead of to every V element (O = sum_j p_j (v_scale * v8_j) = v_scale * sum_j p_j v8_j).
template <int M_FRAGS, int N_FRAGS_O>
__device__ __forceinline__ void scale_o(float (&o_acc)[M_FRAGS][N_FRAGS_O][4], float v_scale) {
#pragma unroll
  for (int mf = 0; mf < M_FRAGS; ++mf)
#pragma unroll
    for (int nf = 0; nf < N_FRAGS_O; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) o_acc[mf][nf][i] *= v_scale;
}

}  // namespace fa2
}  // namespace attncc

#endif  // ATTNCC_FA2_KV8_CUH
