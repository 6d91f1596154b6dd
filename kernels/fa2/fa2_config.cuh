// attncc FA2 tile configuration: the compile-time Config of an FA2 instantiation, shared by the
// dense/BSR prefill kernel (fa2_prefill.cuh), the persistent batch kernel (fa2_batch.cuh) and
// (mirrored) the Python launcher. Self-contained: no #include; comes after common.cuh.
#ifndef ATTNCC_FA2_CONFIG_CUH
#define ATTNCC_FA2_CONFIG_CUH
namespace attncc {
namespace fa2 {

// The FA2 kernels call common.cuh's building blocks unqualified. Using-declarations, not a
// using-directive: attncc:: has its own neg_inf / fast_exp2 for the hooks, and these must win.
using common::ElemTraits;
using common::elem_to_float;
using common::float_to_elem;
using common::pack2;
using common::fast_exp2;
using common::neg_inf;
using common::fmax_nan;
using common::join_sink;
using common::BoolTag;
using common::smem_addr;
using common::cp_async_16;
using common::cp_async_commit;
using common::cp_async_wait;
using common::ldmatrix_x4;
using common::ldmatrix_x4_trans;
using common::mma_16816;
using common::swz;
using common::chunk_addr;
using common::opaque;
using common::FastDiv;
using common::SmemRow;
using common::transform_row;
using common::TileList;
using common::u32x4;

// ---------------------------------------------------------------------------------------------
// Compile-time configuration shared by the kernel, the entry-point macro and (mirrored) the Python
// launcher (attncc.runtime.jit.tiles.fa2_config).
// ---------------------------------------------------------------------------------------------
template <int HEAD_DIM, int TQ, int TKV, int STAGES, int M_FRAGS, int KV_WARPS = 1>
struct Config {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head dim 64/128/256");
  static_assert(TQ == 16 || TQ == 32 || TQ == 64 || TQ == 128, "TQ in {16,32,64,128}");
  static_assert(TKV == 32 || TKV == 64 || TKV == 128, "TKV in {32,64,128}");
  static_assert(STAGES >= 1 && STAGES <= 4, "1..4 pipeline stages");
  // M_FRAGS 16-row MMA fragments per warp. Two (FA2's 4 warps x 32 rows) let every K/V ldmatrix
  // feed two MMAs, halving shared-memory traffic per MMA -- at one fragment per warp ldmatrix
  // bandwidth, not the tensor cores, bounds the loop. The price is registers: the O and S
  // accumulators take M_FRAGS*(D/8 + TKV/8)*4 of them, so the launcher uses 2 only where ptxas
  // reports no spills (docs/fa2.md, "Two fragments per warp").
  static_assert(M_FRAGS == 1 || M_FRAGS == 2, "1 or 2 fragments per warp");
  static_assert(TQ % (16 * M_FRAGS) == 0, "TQ must be a multiple of 16 * M_FRAGS");
  // KV_WARPS > 1 (decode): the warps share one 16-row Q fragment and split every KV tile into
  // KV_WARPS column slices, each with its own online-softmax state, merged once at the end. A
  // decode tile has 16 rows -- one warp's worth -- so without this a CTA is one warp and the
  // SM runs few of the loads a bandwidth-bound kernel needs in flight.
  static_assert(KV_WARPS == 1 || (TQ == 16 && M_FRAGS == 1 && TKV / KV_WARPS >= 16 &&
                                  TKV % (16 * KV_WARPS) == 0),
                "KV_WARPS > 1 needs TQ = 16, one fragment and KV slices of 16 rows or more");
  static constexpr int kMFrags = M_FRAGS;
  static constexpr int kKvWarps = KV_WARPS;
  static constexpr int kRowWarps = TQ / (16 * kMFrags);
  static constexpr int kWarps = kRowWarps * KV_WARPS;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileElems = TKV * HEAD_DIM;
  static constexpr int kSmemBytes = 2 * HEAD_DIM * (TQ + 2 * STAGES * TKV);
  // CTAs per SM asked of ptxas (__launch_bounds__): one (up to 255 registers) for the compute
  // bound tiles; decode CTAs (KV_WARPS > 1) as many as 227 KB of shared memory and 128 registers
  // per thread allow, so several CTAs' loads are in flight per SM and ptxas gets every register
  // that residency leaves. Mirrored by attncc.runtime.serving.batch.choose_batch_tiles.
  static constexpr int kFitByRegs = 65536 / (kThreads * 128);
  static constexpr int kFitBySmem = (227 * 1024) / kSmemBytes;
  static constexpr int kMinBlocks =
      KV_WARPS == 1 ? 1
                    : (kFitByRegs < kFitBySmem ? kFitByRegs : (kFitBySmem > 0 ? kFitBySmem : 1));
};

// __launch_bounds__ of an FA2 entry point (fa2_prefill.cuh, fa2_batch.cuh): Config's threads and
// CTAs per SM, so both kernels follow one residency rule.
#define ATTNCC_FA2_LAUNCH_BOUNDS(HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS)                     \
  __launch_bounds__(attncc::fa2::Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>::kThreads,  \
                    attncc::fa2::Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>::kMinBlocks)

template <int HEAD_DIM, int TQ, int TKV, int STAGES, int M_FRAGS, int KV_WARPS = 1>
__host__ __device__ constexpr int fa2_smem_bytes() {
  return Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>::kSmemBytes;
}
template <int HEAD_DIM, int TQ, int TKV, int STAGES, int M_FRAGS, int KV_WARPS = 1>
__host__ __device__ constexpr int fa2_num_threads() {
  return Config<HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS>::kThreads;
}

}  // namespace fa2
}  // namespace attncc

#endif  // ATTNCC_FA2_CONFIG_CUH
