// attncc FA3 for sm_90a: the dense kernel's last round split by keys (a stream-K tail).
//
// Why. The persistent dense kernel runs num_items equal items (full attention: every query block
// reads every key) on G CTAs. When G does not divide num_items, the last R = num_items % G items
// run as one more round on R CTAs while the other G - R sit idle: at B * S = 16384 with 16
// heads, 2048 items on 132 CTAs, 68 CTAs run a 16th item -- the launch takes 16 item-times for
// 15.5 of work (docs/fa3.md, "Split tail").
//
// What. The R tail items' R * T K/V tiles (T per item), counted item by item, are cut into P =
// min(G, 4 R, R * T) pieces of consecutive tiles: piece j is tail tiles [j R T / P, (j + 1) R T /
// P). The dynamic order hands out pieces where it would have handed out the tail items, so the G
// CTAs each take about R T / G tiles instead of R of them taking T. A piece is at most T tiles long
// (R < G), so it holds the end of one item and / or the start of the next: one or two units, run
// one after the other by the CTA that claimed the piece. A unit is an item over a range of its
// tiles; its consumers run the usual loop over that range, then each consumer warp parks its rows'
// partial state (O unnormalized, the row maxima and per-thread sums: exactly its registers) in a
// slot of AttentionParams::split_partials and counts itself in on the item's counter. The warp that
// arrives last for its 16 rows merges every unit's state, in piece order, and runs the usual
// epilogue; the others store nothing. Reading its own state back from the slot rather than from
// registers makes the merge the same float operations whichever unit arrives last, so the output
// does not depend on the order the CTAs ran in.
//
// No warp waits for another CTA (the last arrival merges; nobody spins), so a CTA that is not
// resident yet cannot deadlock the others.
//
// It recovers less than the idle time: the CTAs' 15th items do not end together (part of the
// last round's idle time is spread out already), parking and merging have a fixed cost (hence
// kMinSplitKeys), and at the power cap idle SMs were partly paid back in clock. Figures:
// docs/fa3.md, "Split tail".
//
// Self-contained: no #include. Comes after fa3_consumer.cuh, before fa3_prefill.cuh.
#ifndef ATTNCC_FA3_SPLIT_CUH
#define ATTNCC_FA3_SPLIT_CUH

namespace attncc {
namespace fa3 {

// A unit of an item: tiles [first, first + count) of it (count < 0: all of its own list,
// item_tiles -- which the dense producer resolves before it publishes the unit; a CTA pair's
// consumers count all of the keys), and part = 2 j + side for a unit of piece j (side 1: the
// piece's second item), -1 for an item run whole.
struct UnitRange {
  int first, count, part;
};

// The tail's geometry, a function of the launch only (num_items, the grid, the item's tiles), so
// the producer and the consumers' merge compute the same pieces without passing them around.
struct TailSplit {
  int first;   // list index of the first tail item; claims from here on are pieces
  int tiles;   // T, tiles per item
  int total;   // R * T, the tail's tiles
  int pieces;  // P; 0: no split

  // tail tile where piece j starts (j = pieces: the end); 32-bit (tail_split keeps total *
  // pieces below 2^31: a 64-bit division is a call)
  __device__ __forceinline__ int begin(int j) const { return j * total / pieces; }
  // the piece holding tail tile t: the largest j with begin(j) <= t
  __device__ __forceinline__ int piece_of(int t) const { return ((t + 1) * pieces - 1) / total; }
  // list entries the claims run over: the whole items, then the pieces
  __device__ __forceinline__ int entries(int num_items) const {
    return pieces > 0 ? first + pieces : num_items;
  }
  // The tail item (index from `first`) of unit `side` of piece j, and the part (2 j + side) of
  // tail item `item` in piece j: the piece's second unit when the piece began in the item before.
  __device__ __forceinline__ int item_of(int j, int side) const {
    return begin(j) / tiles + side;
  }
  __device__ __forceinline__ int part_of(int item, int j) const {
    return 2 * j + (begin(j) < item * tiles ? 1 : 0);
  }
  // Unit `side` of piece j: its tail item and tile range; false when the piece has no second
  // unit.
  __device__ __forceinline__ bool unit(int j, int side, int& item, UnitRange& u) const {
    const int b = begin(j), e = begin(j + 1);
    item = item_of(j, side);
    const int lo = max(b, item * tiles), hi = min(e, (item + 1) * tiles);
    u = UnitRange{lo - item * tiles, hi - lo, 2 * j + side};
    return hi > lo;
  }
};

// At most this many pieces per tail item (so at most 5 units, and 5 slots for the merge to
// read): when few items are left (R small) the grid would otherwise cut each into many one-tile
// units whose parking and merging cost more than the balance gains. One piece per CTA, not
// more: two and four pieces per CTA measured slower than one (docs/fa3.md, "Split tail").
constexpr int kMaxPiecesPerItem = 4;
// Split only items of at least this many keys. A split costs each unit its own pipeline fill,
// parking and (for the last) a merge, a fixed cost, while what it recovers is a share of an
// item's length: it lost at 2048 keys and won from 4096 up (docs/fa3.md, "Split tail").
constexpr int kMinSplitKeys = 4096;

// The split of this launch: pieces = 0 unless the runtime passed the partials' workspace (it does
// for full-length items: no block mask, softmax, no output transform; runtime/flex/gpu_flex.py
// sizes it the same way) and the grid leaves a partial last round of items at least 2 tiles long.
// The runtime's counter buffer holds the claim counter and then 8 arrival counters (one per
// consumer warp) for each of the R tail items, all zero at launch.
// kAllowed: the kernel's variant and head dim allow it (fa3_prefill's kSplit).
template <int TKV, bool kAllowed>
__device__ __forceinline__ TailSplit tail_split(const attncc::AttentionParams& p, int num_items) {
  const int grid = gridDim.x, rest = num_items % grid, tiles = (p.kv_len + TKV - 1) / TKV;
  const int pieces = min(min(grid, kMaxPiecesPerItem * rest), rest * tiles);
  if (!kAllowed || p.split_partials == nullptr || p.kv_num_blocks != nullptr ||
      num_items <= grid || rest == 0 || tiles < 2 || p.kv_len < kMinSplitKeys ||
      (long long)rest * tiles * pieces >= (1ll << 31))
    return TailSplit{num_items, tiles, 0, 0};
  return TailSplit{num_items - rest, tiles, rest * tiles, pieces};
}

// The split in shared memory: computed once per CTA (thread 0, before the barrier that publishes
// the mbarriers) and read where it is used -- held in registers across the producer's loop its
// four values spilled the producer's 24, and the consumers need it only after their loop.
__device__ __forceinline__ void put_tail(u32 at, const TailSplit& t) {
  asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(t.first),
               "r"(t.tiles), "r"(t.total), "r"(t.pieces) : "memory");
}
__device__ __forceinline__ TailSplit get_tail(u32 at) {
  TailSplit t;
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(t.first), "=r"(t.tiles), "=r"(t.total), "=r"(t.pieces) : "r"(at));
  return t;
}

// One consumer warp's state slot: per lane, D/8 float4 of O (its accumulator registers in
// order) and one of (m0, m1, l0, l1), stored lane-minor so each float4 of the warp is one
// coalesced 512-byte access. Slot (2 j + side, warp) belongs to unit side of piece j.
template <int D>
__device__ __forceinline__ float4* split_slot(const attncc::AttentionParams& p, int part, int w8) {
  constexpr int kQuads = D / 8 + 1;
  return reinterpret_cast<float4*>(p.split_partials) +
         ((long long)part * 8 + w8) * kQuads * 32 + (threadIdx.x & 31);
}

// A split unit's consumer warp after its loop: park this warp's partial state, count in, and if
// this was the item's last unit to arrive for these rows, merge every unit's state into o /
// row_m / row_l (then the caller runs the epilogue: true) -- else false (the caller stores
// nothing). w8: the warp among the 8 consumer warps. Warp-wide (every lane calls it).
template <int D>
__device__ __forceinline__ bool park_or_merge(const attncc::AttentionParams& p,
                                              const TailSplit& tail, int part, int w8,
                                              float (&o)[D / 64][32], float (&row_m)[2],
                                              float (&row_l)[2]) {
  constexpr int Q = D / 8;  // float4 of O per lane
  const int lane = threadIdx.x & 31;
  float4* const mine = split_slot<D>(p, part, w8);
#pragma unroll
  for (int q = 0; q < Q; ++q)
    mine[32 * q] = make_float4(o[q >> 3][4 * (q & 7)], o[q >> 3][4 * (q & 7) + 1],
                               o[q >> 3][4 * (q & 7) + 2], o[q >> 3][4 * (q & 7) + 3]);
  mine[32 * Q] = make_float4(row_m[0], row_m[1], row_l[0], row_l[1]);
  // every lane's stores are visible device-wide before lane 0 counts the warp in (the fence),
  // and every lane's fence precedes that atomic (__syncwarp orders the warp's lanes)
  __threadfence();
  __syncwarp();
  const int item = tail.item_of(part >> 1, part & 1);
  const int first_piece = tail.piece_of(item * tail.tiles);
  const int last_piece = tail.piece_of((item + 1) * tail.tiles - 1);
  int before = 0;
  if (lane == 0) {
    before = atomicAdd(p.item_counter + 1 + 8 * item + w8, 1);
    __threadfence();  // the other units' slots are read after their arrivals were seen
  }
  before = __shfl_sync(0xffffffffu, before, 0);
  if (before < last_piece - first_piece) return false;
  __threadfence();

  // The merge: every unit's state from its slot (this one's too), in piece order, one pass with
  // a running maximum (each slot's 17 loads in flight together; a first pass over the maxima
  // alone cost a second chain of L2 round trips on the grid's critical path)
  float mx[2] = {common::neg_inf(), common::neg_inf()};
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[blk][i] = 0.f;
  row_l[0] = row_l[1] = 0.f;
#pragma unroll 1
  for (int j = first_piece; j <= last_piece; ++j) {
    const float4* const src = split_slot<D>(p, tail.part_of(item, j), w8);
    const float4 st = __ldcg(src + 32 * Q);
    float4 v[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) v[q] = __ldcg(src + 32 * q);
    // rescale what is summed so far and this unit to the new maximum; a -inf maximum (rows
    // that saw only masked logits so far, or in this unit) contributes nothing
    float keep[2], add[2];
    const float m_unit[2] = {st.x, st.y};
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float m_new = common::fmax_nan(mx[hr], m_unit[hr]);
      keep[hr] = mx[hr] == common::neg_inf() ? 0.f : common::fast_exp2(mx[hr] - m_new);
      add[hr] = m_unit[hr] == common::neg_inf() ? 0.f : common::fast_exp2(m_unit[hr] - m_new);
      mx[hr] = m_new;
    }
    row_l[0] = fmaf(st.z, add[0], row_l[0] * keep[0]);
    row_l[1] = fmaf(st.w, add[1], row_l[1] * keep[1]);
#pragma unroll
    for (int q = 0; q < Q; ++q) {  // elements 4 (q & 7) .. + 3: two of row 0, two of row 1
      float* const a = &o[q >> 3][4 * (q & 7)];
      a[0] = fmaf(v[q].x, add[0], a[0] * keep[0]);
      a[1] = fmaf(v[q].y, add[0], a[1] * keep[0]);
      a[2] = fmaf(v[q].z, add[1], a[2] * keep[1]);
      a[3] = fmaf(v[q].w, add[1], a[3] * keep[1]);
    }
  }
  row_m[0] = mx[0];
  row_m[1] = mx[1];
  return true;
}

}  // namespace fa3
}  // namespace attncc

#endif  // ATTNCC_FA3_SPLIT_CUH
