// attncc fp8 KV caches in the FA2 batch kernel (e4m3 / e5m2): the tile is copied into shared
// memory as bytes -- half the global traffic of a bf16 tile, the point of an fp8 cache -- and
// widened to a 16-bit type right before the tile's MMAs: q's (bf16 or fp16), or fp16 where
// the decode forms' register path rescales bf16 queries (q_bf16_to_f16). Both fp8 formats
// widen exactly into bf16 and fp16, so the tile the MMAs read is the cache's values
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

// The 16-bit type the MMAs of a tile read: fp16 where the kernel takes it instead of q's bf16
// (q_bf16_to_f16 below), else q's DType.
template <bool kF16, typename DType>
struct MmaType {
  using T = DType;
};
template <typename DType>
struct MmaType<true, DType> {
  using T = f16;
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

// Four fp8 values (little-endian bytes of `x`) -> two DType pairs: (x0, x1), (x2, x3).
template <typename DType, typename KvT>
__device__ __forceinline__ void widen4(u32 x, u32& lo, u32& hi) {
  constexpr bool kE4m3 = KvTraits<KvT>::kE4m3;
  lo = fp8x2_to_f16x2<kE4m3, false>(x);
  hi = fp8x2_to_f16x2<kE4m3, true>(x);
  if constexpr (ElemTraits<DType>::kIsBf16) {
    lo = f16x2_to_bf16x2(lo);
    hi = f16x2_to_bf16x2(hi);
  }
}

// Eight fp8 values (little-endian bytes of `b`) -> eight DType values, in order.
template <typename DType, typename KvT>
__device__ __forceinline__ u32x4 widen8(uint2 b) {
  u32x4 r;
  widen4<DType, KvT>(b.x, r.x, r.y);
  widen4<DType, KvT>(b.y, r.z, r.w);
  return r;
}

// The fp8 ring's rows are D bytes in 16-byte chunks; chunk c of row r is stored at chunk
// kv8_chunk<D>(r, c), so that ldmatrix's 8 lanes (8 consecutive rows, one logical chunk) hit 8
// distinct 16-byte slots of the banks (common.cuh's swizzle, for rows of 64-256 bytes: at
// D = 64 two rows share a 128-byte line, so rows pair up before the XOR).
template <int D>
__device__ __forceinline__ int kv8_chunk(int r, int c) {
  static_assert(D == 64 || D == 128 || D == 256, "fp8 rows of 64, 128 or 256 bytes");
  return c ^ (D >= 128 ? (r & 7) : ((r >> 1) & 3));
}
// kv8_chunk's XOR key for ldmatrix lane `lane` (its row is 8k + (lane & 7)).
template <int D>
__device__ __forceinline__ u32 kv8_lane_key(int lane) {
  return D >= 128 ? (u32)(lane & 7) : (u32)((lane & 7) >> 1);
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
    const uint2 b = *reinterpret_cast<const uint2*>(src + r * D + 16 * kv8_chunk<D>(r, ch >> 1) +
                                                    8 * (ch & 1));
    *reinterpret_cast<u32x4*>(dst + swz<D>(r, ch * 8)) = widen8<DType, KvT>(b);
  }
}

// Widen the landed fp8 K and V tile (`ring`: K's TKV*D bytes, then V's) into the one 16-bit
// K and V tiles the MMAs read (the forms that do not widen in registers, Kv8Frags below).
// KV_WARPS > 1 (decode at D = 64): each warp widens only its own KV slice, which only it
// reads, so a __syncwarp publishes it; otherwise all threads widen every row and the block
// barrier publishes them. The caller's barrier at the top of the tile guarantees every warp is
// done with the previous tile's 16-bit rows.
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

// ---------------------------------------------------------------------------------------------
// Decode forms at D >= 128 (KV_WARPS > 1) widen in registers: each warp ldmatrix-es its slice of the fp8
// tile as 16-bit pairs, so a lane gets 4 consecutive bytes of one row, and converts them right
// before the MMAs -- no 16-bit tile in shared memory, no store/reload between the landing and
// the MMAs (docs/serving.md, "fp8 KV cache").
//   S = Q K^T sums over the head dim, so its order is free: a lane's 4 bytes d = 4c..4c+3 of a
//   16-wide block (c = lane % 4) become the B fragment's k = 2c, 2c+1 and 2c+8, 2c+9, and Q's
//   columns are permuted the same way once per unit (permute_q_cols).
//   O = P V needs V's pairs along the keys: the widened 8x8 16-bit blocks (rows = keys) are
//   transposed in registers (movmatrix), which leaves O with a lane's 4 consecutive head-dim
//   columns per block instead of FA2's two pairs; unpermute_o restores FA2's layout once.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

__device__ __forceinline__ u32 movmatrix_t(u32 x) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// Q's columns in the order the register-widened K fragments use: in every 16-column block
// the 32-bit words (column pairs) w0..w7 become w0 w2 w4 w6 w1 w3 w5 w7, so that the A
// fragment's k = 2c, 2c+1 / 2c+8, 2c+9 hold columns 4c, 4c+1 / 4c+2, 4c+3. All NT threads
// share the TQ x D/16 blocks; the caller's barrier publishes them.
template <int D, int TQ, int NT>
__device__ __forceinline__ void permute_q_cols(u16* sQ, int tid) {
  constexpr int BLOCKS = TQ * (D / 16);
  static_assert(BLOCKS % NT == 0, "every thread permutes the same number of blocks");
#pragma unroll
  for (int j = 0; j < BLOCKS / NT; ++j) {
    const int blk = tid + j * NT, r = blk / (D / 16), c0 = (blk % (D / 16)) * 16;
    u32x4* a = reinterpret_cast<u32x4*>(sQ + swz<D>(r, c0));
    u32x4* b = reinterpret_cast<u32x4*>(sQ + swz<D>(r, c0 + 8));
    const u32x4 x = *a, y = *b;
    *a = u32x4{x.x, x.z, y.x, y.z};
    *b = u32x4{x.y, x.w, y.y, y.w};
  }
}

// 2^e as a float for e in the normal range [-126, 127]: the exponent field alone, exact.
__device__ __forceinline__ float pow2i(int e) { return __uint_as_float((u32)(127 + e) << 23); }

// bf16 queries over an fp8 cache run the register path's MMAs in fp16 (the fp8 -> fp16 widening
// is one instruction; fp16 -> bf16 cost ~15 % of the step): each row of Q, already in shared
// memory, is multiplied by its own 2^-e so that its largest finite |value| lands in
// [2^14, 2^15), and rewritten as fp16 -- exact wherever the result is a normal fp16, as fp16
// holds bf16's 8 significant bits. The caller multiplies the row's dot products by 2^e, which
// makes S the bf16 path's S bit for bit. Rows of one tile (GQA heads) scale apart: one scale
// for the tile would flush a small row's values to zero (docs/serving.md, "fp8 KV cache").
// inf and NaN stay inf and NaN; e >= -100 keeps 2^e a normal float. NT / TQ threads share a
// row; `row_exp` (TQ ints of scratch) receives each row's e, for after the caller's barrier.
template <int D, int TQ, int NT>
__device__ __forceinline__ void q_bf16_to_f16(u16* sQ, int* row_exp, int tid) {
  constexpr int TPR = NT / TQ, VECS = D / 8 / TPR;  // threads per row; 16-byte vectors each
  static_assert(NT % TQ == 0 && TPR <= 32 && (TPR & (TPR - 1)) == 0 && (D / 8) % TPR == 0,
                "a power-of-two number of threads of one warp share each row");
  const int r = tid / TPR, c = tid % TPR;
  u32x4* row = reinterpret_cast<u32x4*>(sQ + r * D);  // (the swizzle keeps chunks in their row)
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < VECS; ++j) {
    const u32x4 x = row[c + j * TPR];
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a = fabsf(__uint_as_float(w[i] << 16));
      const float b = fabsf(__uint_as_float(w[i] & 0xffff0000u));
      amax = fmaxf(amax, a <= 3.402823466e38f ? a : 0.f);  // (inf and NaN fail the test)
      amax = fmaxf(amax, b <= 3.402823466e38f ? b : 0.f);
    }
  }
#pragma unroll
  for (int o = TPR / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  // floor(log2(amax)) from the exponent field (a subnormal amax reads -127; clamped below)
  const int e = amax > 0.f ? max((int)((__float_as_uint(amax) >> 23) & 0xff) - 127 - 14, -100) : 0;
  const float f = pow2i(-e);
#pragma unroll
  for (int j = 0; j < VECS; ++j) {
    const u32x4 x = row[c + j * TPR];
    const u32 w[4] = {x.x, x.y, x.z, x.w};
    u32 h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      h[i] = pack2<f16>(__uint_as_float(w[i] << 16) * f, __uint_as_float(w[i] & 0xffff0000u) * f);
    row[c + j * TPR] = u32x4{h[0], h[1], h[2], h[3]};
  }
  if (c == 0) row_exp[r] = e;
}

// The fp8 fragments of one warp's slice of a landed tile (`k`: the shared address of the slice's
// first K row; its V rows are TKV * D bytes further), for lane `lane`. Lane l addresses row
// 8 * ((l >> 3) & 1) + (l & 7) of a 16-row group at chunk 2j + (l >> 4): matrices
// (rows 0-7 | 8-15) x (chunks 2j | 2j + 1).
template <typename DType, typename KvT, int D, int TKV>
struct Kv8Frags {
  u32 k_lane, key;  // the lane's K row address in the slice; its XOR key (with chunk 2j+1)

  __device__ __forceinline__ Kv8Frags(u32 k, int lane) {
    k_lane = k + (8 * ((lane >> 3) & 1) + (lane & 7)) * D;
    key = opaque(kv8_lane_key<D>(lane) ^ (u32)((lane >> 4) & 1));  // (re-derived per tile)
  }
  // K of rows 16g..16g+15 at head-dim blocks 2j, 2j+1: b[n][ks][0..1], the B fragments of
  // n-fragment n (rows 8n..8n+7) at k-step 2j + ks (permuted head dims, see above).
  __device__ __forceinline__ void k_frags(int g, int j, u32 (&b)[2][2][2]) const {
    u32 r[4];
    ldmatrix_x4(r, chunk_addr(k_lane + g * 16 * D, 2 * j, key));
#pragma unroll
    for (int m = 0; m < 4; ++m) widen4<DType, KvT>(r[m], b[m & 1][m >> 1][0], b[m & 1][m >> 1][1]);
  }
  // V of rows 16g..16g+15 at head-dim block q: b[h][0..1], the B fragments of the n-fragment
  // holding the block's columns 4c + 2h, 4c + 2h + 1 (keys 2c, 2c+1 | 2c+8, 2c+9). One block
  // per call (an x2 load), keeping few widened registers live.
  __device__ __forceinline__ void v_frags(int g, int q, u32 (&b)[2][2]) const {
    u32 r[2];  // rows 0-7 and 8-15 (lanes 16-31's addresses are ignored by .x2)
    ldmatrix_x2(r, chunk_addr(k_lane + TKV * D + g * 16 * D, q, key));
    u32 lo0, hi0, lo1, hi1;
    widen4<DType, KvT>(r[0], lo0, hi0);
    widen4<DType, KvT>(r[1], lo1, hi1);
    b[0][0] = movmatrix_t(lo0);
    b[0][1] = movmatrix_t(lo1);
    b[1][0] = movmatrix_t(hi0);
    b[1][1] = movmatrix_t(hi1);
  }
};

// O from Kv8Frags' layout -- n-fragments 2q, 2q+1 hold block q's columns 4c, 4c+1 and
// 4c+2, 4c+3 -- to FA2's (columns 2c, 2c+1 and 8+2c, 8+2c+1): within each quad, lane c takes
// its columns from lanes c/2 and 2 + c/2, one shuffle per value and source.
template <int N_FRAGS_O>
__device__ __forceinline__ void unpermute_o(float (&o)[N_FRAGS_O][4], int lane) {
  const int c = lane & 3, src_lo = (lane & ~3) + (c >> 1), src_hi = src_lo + 2;
  __syncwarp();  // (converged: ptxas then issues the shuffles without per-shuffle reconvergence)
#pragma unroll
  for (int q = 0; q < N_FRAGS_O / 2; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float a0 = __shfl_sync(0xffffffffu, o[2 * q][e], src_lo);
      const float a1 = __shfl_sync(0xffffffffu, o[2 * q + 1][e], src_lo);
      const float b0 = __shfl_sync(0xffffffffu, o[2 * q][e], src_hi);
      const float b1 = __shfl_sync(0xffffffffu, o[2 * q + 1][e], src_hi);
      o[2 * q][e] = (c & 1) ? a1 : a0;
      o[2 * q + 1][e] = (c & 1) ? b1 : b0;
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
