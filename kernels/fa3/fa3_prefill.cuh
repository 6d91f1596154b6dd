// attncc FA3 prefill for sm_90a: TMA loads completed on mbarriers, wgmma tensor-core math, and
// warp specialization (design by topic: docs/fa3.md). The default on sm_90 where it applies.
// Self-contained: no #include. Comes after attncc_types.cuh, attention_params.cuh,
// common.cuh, wgmma.cuh, tma.cuh, fa3_consumer.cuh (the consumer warpgroups' building
// blocks and their pass over the K/V ring), fa3_store.cuh (the epilogue's stores) and
// fa3_split.cuh (the split last round), and before
// the generated Variant_<name> functors' entry point (ATTNCC_FA3_ENTRY at the bottom).
//
// Roles. A work item is 128 query rows of one (batch, query head); a CTA runs items one after
// another (persistent, below) with three warpgroups:
//   producer (warpgroup 0): one thread issues TMA bulk copies -- each item's Q tile, then its
//     K/V tiles into a STAGES-deep ring. Stage s has a "full" mbarrier the copy engine completes
//     with the tile's bytes, and an "empty" mbarrier the consumers arrive on when they are done
//     reading it; the producer waits for "empty" before refilling. No CTA-wide barrier in the loop.
//     It keeps 24 registers (setmaxnreg) and hands the rest to the consumers (240; see below).
//   consumers (warpgroups 1 and 2): each owns 64 of the rows and runs the online-softmax loop
//     with wgmma: S = Q K^T (both operands in shared memory, K-major), logits hooks and softmax
//     in registers (exp2 domain), O += P V (P from registers, V N-major in shared memory).
//
// Overlap. Within a warpgroup the loop is software-pipelined: iteration i issues S(i) = Q K(i)^T,
// rescales O by tile i-1's factors while S(i) runs, issues O += P(i-1) V(i-1), and waits for
// S(i) only (wgmma groups retire in order) to run tile i's logits hooks while the tensor cores
// still work on P(i-1) V(i-1); then it waits for the P V and runs the softmax and packs P(i).
// (ptxas puts that P V wait ahead of the softmax whatever the source order, as long as the two
// share a basic block; a loop that kept the softmax above it measured slower, docs/fa3.md,
// "Warp specialization and the K/V ring" -- the softmax overlaps the other warpgroup's GEMMs.)
// The softmax is lazy (softmax_step), so O's 64 multiplies are skipped on most tiles. Across
// warpgroups (ping-pong), the two consumers take turns issuing their GEMMs through two named
// barriers, so one's softmax runs while the other's GEMMs own the tensor cores instead of both
// computing softmax at once. A stage is released once the P V that reads its V completed, one
// iteration after its K was read.
//
// Tiles: 128 query rows x TKV keys, TKV = 64 or 128 (S is one m64nTKVk16 wgmma per 16-wide
// k-step; 128 halves the waits and fences per FLOP but needs twice the shared memory per stage).
// Persistent grid: at most one CTA per SM. The items form a list in sections of heads whose K/V
// fit in L2 (so the tiles running at once share their loads there), longest first within a
// section (query blocks from the last one, then (batch, head)); CTA c runs item c, then claims
// the next unclaimed one from a global counter, so the CTA that is free first takes the longest
// item left and the CTAs end together (LPT). The next item's Q and first K/V tiles load while the
// consumers finish the current one's last GEMM and store it. When the items are all the same
// length (no block mask) and the grid does not divide them, the last partial round is split by
// keys across every CTA instead (fa3_split.cuh): a CTA then runs units, parts of an item, and
// the item's last unit merges the others' parked states. Full-length items with an even number of
// query blocks run on CTA pairs instead (by default up to 8192 keys): two CTAs of a cluster take
// two query blocks of one head and share every K/V tile, read from L2 once (produce_pairs).
//
// Supported: head dims 64, 128 and 256, every variant hook: score_mod / mask_mod (LogitsTransform
// / LogitsMask) in registers; query, key and value transforms in place on the landed shared-memory
// tiles (Q once per item by its warpgroup; each K/V tile split between the two consumers, which
// then meet on a named barrier -- so ping-pong loses some overlap on such variants); the output
// transform on O staged through the consumer's Q tile. FlexAttention BlockMask lists (128-row
// query blocks, block_kv a multiple of TKV), GQA (one query head per item), bf16 and fp16.
//
// Layouts: every tile is stored 128B-swizzled in 64-column blocks (wgmma.cuh), which is exactly
// what a TMA box of [64 rows][64 elements] with the 128-byte swizzle writes; a column block of a
// 128-key tile is two boxes back to back (the swizzle repeats every 8 rows). q/k/v are read
// through tensor maps over [batch * heads * seq, head_dim] (contiguous tensors): rows past a
// sequence's end belong to the next head (or are zero past the tensor), and the logits of such
// keys and rows are masked, so their P is 0 and their output is never stored.
#ifndef ATTNCC_FA3_PREFILL_CUH
#define ATTNCC_FA3_PREFILL_CUH

namespace attncc {
namespace fa3 {

// One work item of the dense kernel: a 128-row query tile of one (batch, head).
struct DenseItem {
  int b, hq, h_kv, q0;
};

// Items are numbered in sections of heads whose K and V together fit in this much of the L2
// (50 MB on the H100 / H200): within a section, query blocks from the last one, then head. The
// CTAs then run many query blocks of a few heads at a time, which read the same K/V tiles at
// about the same time, so most tile loads hit in L2. Numbered over all heads at once, a round at
// S = 2048 (8 x 16 heads) read 128 heads' K/V once each -- about 128 MB a round from HBM, which
// made the kernel memory-bound there. 12 MiB rather than the whole L2: an SM's loads are served
// by one of the L2's two 25 MB partitions, and bench/l2_order_model.py (an LRU of that size)
// has 24 MiB sections read full attention's K/V ~2.3 times from DRAM, 12 MiB ones once; used
// with Q and O marked evict_first (tma.cuh's l2_evict_first). docs/fa3.md, "Persistent
// scheduling, item order and L2 sections". The sections need the dynamic order below when item
// lengths differ (a block mask), which next_item gives. 0: no sections.
// The default is attncc.codegen.constants.L2_SECTION_BYTES (static_asserted in every unit). A
// macro, not a constexpr: a namespace-scope constexpr would add a symbol to every cubin.
#define ATTNCC_FA3_L2_SECTION_BYTES_DEFAULT (12 << 20)
#ifndef ATTNCC_FA3_L2_SECTION_BYTES
#define ATTNCC_FA3_L2_SECTION_BYTES ATTNCC_FA3_L2_SECTION_BYTES_DEFAULT
#endif

// Item w of B * Hq * nqb: sections of sec head slots each (a slot is b * Hq + hq; whole GQA
// groups), the first taking the remainder; within the section [s0, s0 + n), item r is query block
// nqb - 1 - r / n of slot s0 + r % n -- longest first within the section, so the list ends with
// the shortest items of a full section.
// The remainder goes first because the dynamic order is longest-processing-time first only if
// the list's tail is short items: a remainder section at the end (8 heads of 24 at S = 2048, one
// of 3 at 16384, B * S = 16384 x 16 heads) restarted the list with its longest query blocks
// while the grid was finishing, and an H200 trace of causal S = 2048 showed the CTAs' last items
// at 13-16 tiles and their spans spread over 447-491 K cycles (max / mean ~1.045); a simulation
// of the claims agrees (docs/fa3.md, "Persistent scheduling, item order and L2 sections").
template <int D>
__device__ __forceinline__ DenseItem dense_item(const attncc::AttentionParams& p, int w, int nqb) {
  const int heads = p.batch * p.num_q_heads;
  const int group = p.num_q_heads / p.num_kv_heads;
  int sec = heads;
  if (ATTNCC_FA3_L2_SECTION_BYTES > 0) {
    // in KiB and 32 bits (a 64-bit division is a call): K and V of one KV head, 16-bit
    const unsigned kv_head_kib = max(1u, ((unsigned)p.kv_len >> 2) * (D / 64));
    const unsigned kv_heads = max(1u, (unsigned)(ATTNCC_FA3_L2_SECTION_BYTES >> 10) / kv_head_kib);
    sec = (int)min((unsigned)heads, kv_heads * group);
  }
  int s0, n;
  const int first = heads - (heads - 1) / sec * sec;  // the remainder section: 1 .. sec slots
  if (w < first * nqb) {
    s0 = 0;
    n = first;
  } else {
    s0 = first + (w - first * nqb) / (sec * nqb) * sec;
    n = sec;
  }
  const int r = w - s0 * nqb;
  const int slot = s0 + r % n, qb = nqb - 1 - r / n;
  const int hq = slot % p.num_q_heads;
  return {slot / p.num_q_heads, hq, hq / group, qb * kTQ};
}

// The item's K/V tiles: every tile of [0, kv_len), or the block mask's lists for its query block.
template <int TKV>
__device__ __forceinline__ common::TileList item_tiles(const attncc::AttentionParams& p,
                                                    const DenseItem& it) {
  common::TileList tiles;
  if (p.kv_num_blocks == nullptr) {
    tiles = common::TileList{nullptr, nullptr, (p.kv_len + TKV - 1) / TKV, 0, 1, TKV, TKV, 0};
    tiles.count = tiles.n_partial;
    return tiles;
  }
  const int qb = it.q0 / p.block_q;
  const attncc::i64 nb = it.b * p.bm_stride_b + it.hq * p.bm_stride_h + qb;
  const attncc::i64 ix = it.b * p.bi_stride_b + it.hq * p.bi_stride_h + qb * p.bi_stride_q;
  tiles.partial = p.kv_indices + ix;
  tiles.n_partial = __ldg(p.kv_num_blocks + nb);
  tiles.full = p.full_kv_num_blocks != nullptr ? p.full_kv_indices + ix : nullptr;
  tiles.n_full = p.full_kv_num_blocks != nullptr ? __ldg(p.full_kv_num_blocks + nb) : 0;
  tiles.sub = p.block_kv / TKV;
  tiles.block_kv = p.block_kv;
  tiles.tile = TKV;
  tiles.count = (tiles.n_partial + tiles.n_full) * tiles.sub;
  return tiles;
}

// Whether the dense kernel is persistent at head dim D (every one it supports); at D = 256 the
// consumers' 240 registers hold 128 O accumulators, and the item loop's state fits beside them
// (0 spills for every AttentionGym variant as loaded, docs/fa3.md, "The split K/V ring and
// D = 256"). runtime/flex/gpu_flex.py mirrors this (FA3_PERSISTENT_HEAD_DIMS).
template <int D>
constexpr bool kPersistentHeadDim = D <= 256;
// Whether it also has the split tail (fa3_split.cuh) and the CTA-pair form: not at D = 256,
// where the split tail's park/merge spilled ~400 bytes beside O (FA3_SPLIT_HEAD_DIMS).
template <int D>
constexpr bool kSplitHeadDim = D <= 128;

// The k-th item of this CTA (the producer asks once per item), or -1 when there is none: a
// CTA's first item is blockIdx.x and every later one the next unclaimed item of the list, from a
// counter in global memory (AttentionParams::item_counter, zero at launch), so the CTA that
// finishes first takes the next longest item whatever the lengths.
__device__ __forceinline__ int next_item(int k, int num_items, int* counter) {
  const int w = k == 0 ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(counter, 1);
  return w < num_items ? w : -1;
}

// CTA pairs (the paired form, fa3_consumer.cuh; fa3_pairs in runtime/flex/gpu_flex.py
// launches it in clusters of two for full-length items -- no block mask -- with an even number
// of query blocks per head, by default up to 8192 keys, and no split tail; docs/fa3.md, "CTA
// pairs"):
// pair w is query blocks 2 q + 1 (rank 0) and 2 q (rank 1) of one (batch, head),
// q and the head as item w of a list with nqb / 2 blocks per head, so the pairs keep the L2
// sections' order. Both CTAs run the same K/V tiles; each issues half of every tile (K from rank
// 0, V from rank 1) into both rings. Pairs go in rounds, pair k * clusters + c being cluster c's
// k-th (the items are all the same length, which is where a static order loses nothing).
template <int D>
__device__ __forceinline__ DenseItem pair_item(const attncc::AttentionParams& p, int w, int nqb) {
  DenseItem it = dense_item<D>(p, w, nqb / 2);
  it.q0 = (2 * (it.q0 / kTQ) + 1 - (int)tma::cluster_rank()) * kTQ;
  return it;
}
__device__ __forceinline__ int next_pair(int k, int num_pairs) {
  const int w = k * (int)(gridDim.x / 2) + (int)(blockIdx.x / 2);
  return w < num_pairs ? w : -1;
}

// The item slot in shared memory: the producer writes it before the q_full arrival that
// releases it (mbarrier arrive has release semantics, the consumers' wait acquire), and only
// after q_empty says both consumers have read the previous one. The item, then which of its
// tiles to run (fa3_split.cuh's UnitRange), then the producer's own note: the piece whose second
// unit it runs next, or -1 (kept here rather than in a register across the tile loop, where it
// spilled the producer's 24).
struct ItemSlot {
  DenseItem item;
  UnitRange range;
  int pending;
};
__device__ __forceinline__ void publish_item(u32 slot, const DenseItem& it,
                                             const UnitRange& u, int pending) {
  asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot), "r"(it.b), "r"(it.hq),
               "r"(it.h_kv), "r"(it.q0) : "memory");
  asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + 16), "r"(u.first),
               "r"(u.count), "r"(u.part), "r"(pending) : "memory");
}
__device__ __forceinline__ ItemSlot read_slot(u32 slot) {
  ItemSlot v;
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.item.b), "=r"(v.item.hq), "=r"(v.item.h_kv), "=r"(v.item.q0)
               : "r"(slot));
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.range.first), "=r"(v.range.count), "=r"(v.range.part), "=r"(v.pending)
               : "r"(slot + 16));
  return v;
}
__device__ __forceinline__ int pending_piece(u32 slot) {
  int v;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(slot + 28));
  return v;
}

// A ring stage's tile as the producer loaded it (Smem::kMeta + 8 * stage): its first key
// (TileList::start; a split-tail unit's consumers add the unit's offset) and whether it is a
// block mask's full block. The producer writes it before the stage's full arrival (release)
// and the consumers read it after their wait (acquire), so they never read the block mask's
// lists themselves: that was, at every tile, an integer division (the mask block of tile i)
// and a dependent load from global memory between S's wait and the logits -- the tile loop's
// critical path -- and at an item's start two dependent L2 reads (the list's length, its
// first block) before S(0) could issue (docs/fa3.md, "TileMeta").
// One word, so a consumer holds one register from the step's start to its logits. 2 * kv0 fits
// an int: a key position is below 2^30 for any K and V that fit in a GPU's memory (gpu_flex
// bounds heads x positions by 2^31), and the signed form lets the compiler fold
// of(kv0, f).kv0() back to kv0 (with an unsigned one, document_causal spilled 32 B at D = 64).
struct TileMeta {
  int bits;  // kv0 * 2 + full
  __device__ __forceinline__ int kv0() const { return bits >> 1; }
  __device__ __forceinline__ bool full() const { return bits & 1; }
  __device__ __forceinline__ static TileMeta of(int kv0, bool full) {
    return {2 * kv0 + (int)full};
  }
};
__device__ __forceinline__ void put_meta(u32 at, TileMeta m) {
  asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(at), "r"(m.bits) : "memory");
}
__device__ __forceinline__ TileMeta get_meta(u32 at) {
  TileMeta m;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(m.bits) : "r"(at));
  return m;
}

// The item's Q tile (both consumers' 64 rows from map row q_row0 on) into shared memory at sq,
// completing q_full; read once, so marked L2 evict_first (tma.cuh).
template <int D>
__device__ __forceinline__ void load_q(u32 sq, const void* tm_q, u32 q_full,
                                       int q_row0) {
  constexpr int BLOCKS = D / 64;
  tma::mbar_arrive_expect_tx(q_full, kConsumers * BLOCKS * kBoxBytes);
#pragma unroll
  for (int c = 0; c < kConsumers; ++c)
#pragma unroll
    for (int blk = 0; blk < BLOCKS; ++blk) {
      const u32 dst = sq + (c * BLOCKS + blk) * kBoxBytes;
      tma::load_2d_hint(dst, tm_q, q_full, 64 * blk, q_row0 + 64 * c, tma::l2_evict_first());
    }
}

// The producer of a CTA pair (one thread): for each of the pair's items, the item slot and Q as
// below, then every K/V tile -- once both CTAs' consumers released its stage (the empty barrier
// counts both) -- with this CTA's half (K from rank 0, V from rank 1) copied into both rings;
// each CTA's full barrier expects the whole tile. Its own loop, apart from the split-tail one
// below: with the pieces' bookkeeping in the same loop the 24-register producer spilled.
template <int D, int TKV, int STAGES>
__device__ __forceinline__ void produce_pairs(const attncc::AttentionParams& p, u32 base) {
  using S = Smem<D, TKV, STAGES>;
  constexpr int BLOCKS = D / 64;
  const u32 full_bar = base + S::kBar, empty_bar = full_bar + 8 * STAGES;
  const u32 q_full = full_bar + 16 * STAGES, q_empty = q_full + 8;
  const bool v_half = tma::cluster_rank() & 1;
  const u32 ring = base + (v_half ? S::kV : S::kK);  // where this CTA's half lands
  const void* tm_kv = reinterpret_cast<const unsigned char*>(p.tma) + (v_half ? 256 : 128);
  // (computed here from p, not passed in: values shared with the other producer loop stayed
  // live through the kernel's prologue and spilled that loop's 24 registers)
  const int nqb = (p.q_len + kTQ - 1) / kTQ, num_pairs = p.batch * p.num_q_heads * nqb / 2;
  int tile = 0;
#pragma unroll 1
  for (int k = 0;; ++k) {
    const int w = next_pair(k, num_pairs);
    if (k > 0) tma::mbar_wait(q_empty, (k - 1) & 1);
    if (w < 0) {
      publish_item(base + S::kItem, DenseItem{-1, 0, 0, 0}, UnitRange{0, -1, -1}, -1);
      tma::mbar_arrive(q_full);
      return;
    }
    const DenseItem it = pair_item<D>(p, w, nqb);
    const int q_row0 = (it.b * p.num_q_heads + it.hq) * p.q_len + it.q0;
    const int kv_row0 = (it.b * p.num_kv_heads + it.h_kv) * p.kv_len;
    // (no count: the consumers know a pair's tiles are all of the keys; computed here, it
    // spilled the 24-register producer 8 B)
    publish_item(base + S::kItem, it, UnitRange{0, -1, -1}, -1);
    load_q<D>(base + S::kQ, p.tma, q_full, q_row0);
#pragma unroll 1
    for (int kv0 = 0; kv0 < p.kv_len; kv0 += TKV, ++tile) {  // (p.kv_len: no register)
      const int st = tile % STAGES;
      if (tile >= STAGES) tma::mbar_wait(empty_bar + 8 * st, ((tile / STAGES) - 1) & 1);
      const u32 full = full_bar + 8 * st;
      // (each CTA's consumers read their own; addressed from `full`: a register of its own for
      // the address spilled the 24-register producer 8 B)
      put_meta(full + (S::kMeta - S::kBar), TileMeta::of(kv0, false));
      tma::mbar_arrive_expect_tx(full, 2 * S::kKvTileBytes);
#pragma unroll
      for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
        for (int h = 0; h < TKV / 64; ++h)
          tma::load_2d_multicast(ring + st * S::kKvTileBytes + blk * S::kKvBlockBytes +
                                     h * kBoxBytes, tm_kv, full, 64 * blk,
                                 kv_row0 + kv0 + 64 * h, 3);
    }
  }
}

// What the producer of unpaired CTAs works with, computed once in the kernel's prologue (shared
// memory addresses, the q/k/v tensor maps, the problem's sizes).
struct ProducerView {
  u32 sq, sk, sv, full_bar, empty_bar, q_full, q_empty, item_slot, tail_at;
  const void* tm_q;
  const void* tm_k;
  const void* tm_v;
  int q_len, kv_len, nqb, num_items;
};

// One ring tile of the split ring (Ring<true>, docs/fa3.md "The split K/V ring and D = 256"):
// K into stage tile % STAGES once every consumer warp's S read its last K there (the stage's
// K-empty barrier), completing its full barrier; then V once the last P V read its V (empty),
// completing its V-full barrier. `full` and `empty` are the stage's joint-ring barriers; the
// split ones sit at fixed offsets from them (Smem::kSplitBar). kv_row: the tile's first map row.
template <int D, int TKV, int STAGES>
__device__ __forceinline__ void produce_split_tile(int tile, u32 full, u32 empty, u32 sk, u32 sv,
                                                   const void* tm_k, const void* tm_v,
                                                   int kv_row, TileMeta meta) {
  using S = Smem<D, TKV, STAGES>;
  const int st = tile % STAGES, phase = ((tile / STAGES) - 1) & 1;
  const u32 full_v = full + (S::kSplitBar - S::kBar), empty_k = full_v + 8 * STAGES;
  const u32 off0 = st * S::kKvTileBytes;
  if (tile >= STAGES) tma::mbar_wait(empty_k, phase);
  put_meta(full + (S::kMeta - S::kBar), meta);  // published by the arrival
  tma::mbar_arrive_expect_tx(full, S::kKvTileBytes);
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int h = 0; h < TKV / 64; ++h)
      tma::load_2d(sk + off0 + blk * S::kKvBlockBytes + h * kBoxBytes, tm_k, full, 64 * blk,
                   kv_row + 64 * h);
  if (tile >= STAGES) tma::mbar_wait(empty, phase);
  tma::mbar_arrive_expect_tx(full_v, S::kKvTileBytes);
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
#pragma unroll
    for (int h = 0; h < TKV / 64; ++h)
      tma::load_2d(sv + off0 + blk * S::kKvBlockBytes + h * kBoxBytes, tm_v, full_v, 64 * blk,
                   kv_row + 64 * h);
}

// The producer of unpaired CTAs (one thread): claims units -- whole items, then (with a split
// tail, fa3_split.cuh) pieces -- publishes each in the item slot, loads its Q once the consumers
// released the last one, and streams its K/V tiles into the ring as stages free up.
template <int D, int TKV, int STAGES, bool kSplitRing>
__device__ __forceinline__ void produce_items(const attncc::AttentionParams& p,
                                              const ProducerView& v) {
  using S = Smem<D, TKV, STAGES>;
  constexpr int BLOCKS = D / 64;
  const u32 sq = v.sq, sk = v.sk, sv = v.sv, full_bar = v.full_bar, empty_bar = v.empty_bar;
  const u32 q_full = v.q_full, q_empty = v.q_empty, item_slot = v.item_slot, tail_at = v.tail_at;
  const void* tm_q = v.tm_q;
  const void* tm_k = v.tm_k;
  const void* tm_v = v.tm_v;
  const int q_len = v.q_len, kv_len = v.kv_len, nqb = v.nqb, num_items = v.num_items;
  int tile = 0;  // tiles issued by this CTA so far: stage tile % STAGES, phase tile / STAGES
  // the list's entries: whole items, then (with a split tail, fa3_split.cuh) pieces; a piece
  // of two units runs its second (`pending`, noted in the item slot) before the next claim
#pragma unroll 1
  for (int k = 0;; ++k) {  // k: units (items, or parts of them) run by this CTA so far
    const TailSplit tail = get_tail(tail_at);
    // the last unit's note (the slot is unchanged until this iteration publishes)
    const int pending = k > 0 ? pending_piece(item_slot) : -1;
    const int side = pending >= 0 ? 1 : 0;
    // (the CTA's first unit is its first claim: next_item's k == 0)
    const int w = side ? pending : next_item(k, tail.entries(num_items), p.item_counter);
    // Q of this item (and the item in item_slot) once both consumers are done with the last
    // one's: they read the slot before they release Q
    if (k > 0) tma::mbar_wait(q_empty, (k - 1) & 1);
    if (w < 0) {  // no more items: an arrival without bytes wakes the consumers to stop
      publish_item(item_slot, DenseItem{-1, 0, 0, 0}, UnitRange{0, -1, -1}, -1);
      tma::mbar_arrive(q_full);
      break;
    }
    UnitRange u{0, -1, -1};  // the whole item
    int item = w, next_piece = -1;
    if (w >= tail.first) {  // a piece of the split tail: unit `side` of piece w - tail.first
      int t;
      tail.unit(w - tail.first, side, t, u);
      item = tail.first + t;
      UnitRange next;
      if (side == 0 && tail.unit(w - tail.first, 1, t, next)) next_piece = w;
    }
    const DenseItem it = dense_item<D>(p, item, nqb);
    common::TileList tiles = item_tiles<TKV>(p, it);
    if (u.count >= 0) tiles.count = u.count;
    const int q_row0 = (it.b * p.num_q_heads + it.hq) * q_len + it.q0;  // map row of q0
    // map row of the unit's key 0 (a tail piece's first tile: dense items only)
    const int kv_row0 = (it.b * p.num_kv_heads + it.h_kv) * kv_len + u.first * TKV;
    // released to the consumers by the q_full arrival, with the unit's resolved tile count
    publish_item(item_slot, it, UnitRange{u.first, tiles.count, u.part}, next_piece);
    load_q<D>(sq, tm_q, q_full, q_row0);
#pragma unroll 1
    for (int i = 0; i < tiles.count; ++i, ++tile) {
      const int st = tile % STAGES;
      if constexpr (kSplitRing) {
        bool f;
        const int kv0 = tiles.start(i, f);
        produce_split_tile<D, TKV, STAGES>(tile, full_bar + 8 * st, empty_bar + 8 * st, sk, sv,
                                           tm_k, tm_v, kv_row0 + kv0, TileMeta::of(kv0, f));
      } else {
        // refill stage st once every consumer warp released its previous tile (tile - STAGES):
        // that was phase (tile / STAGES - 1) of the stage's empty barrier
        if (tile >= STAGES) tma::mbar_wait(empty_bar + 8 * st, ((tile / STAGES) - 1) & 1);
        bool f;
        const int kv0 = tiles.start(i, f);
        const u32 full = full_bar + 8 * st;
        put_meta(full + (S::kMeta - S::kBar), TileMeta::of(kv0, f));  // published by the arrival
        tma::mbar_arrive_expect_tx(full, 2 * S::kKvTileBytes);
#pragma unroll
        for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
          for (int h = 0; h < TKV / 64; ++h) {
            const u32 off = st * S::kKvTileBytes + blk * S::kKvBlockBytes + h * kBoxBytes;
            tma::load_2d(sk + off, tm_k, full, 64 * blk, kv_row0 + kv0 + 64 * h);
            tma::load_2d(sv + off, tm_v, full, 64 * blk, kv_row0 + kv0 + 64 * h);
          }
      }
    }
  }
}

// Persistent (D <= 128): the grid is at most one CTA per SM (the ring takes the shared memory)
// and CTA c runs item c and then those next_item claims. The producer loads the next item's Q as
// soon as both consumers issued their last S GEMM of the current one (q_empty), and its K/V
// tiles flow into the ring
// (stage phases run on across items) while the consumers finish the last P V and store O -- the
// cold start and the epilogue of a tile no longer leave the tensor cores idle.
// The bulk-store epilogue (docs/fa3.md, "TMA, O through shared memory, L2 hints"): the K half
// of the item's last stage (at k_stage) takes this warpgroup's 64 rows once both consumers' last
// S GEMMs completed (q_empty's phase of the item; the other warpgroup's last P V reads V only).
// Each warp stages its 16 rows swizzled and fences them for the async proxy; once all four
// warps staged theirs, one thread writes the warpgroup's D/64 boxes by TMA tensor stores
// through O's map (p.tma + 384) -- rows past q_len lie outside the map's [B, H, q_len, D]
// tensor and are not written. The caller holds the stage until those stores have read it.
template <typename DType, int D>
__device__ __forceinline__ void store_o_bulk(const attncc::AttentionParams& p, u32 k_stage,
                                             u32 q_empty, int phase, int wg, int warp, int lane,
                                             int q0, int q_len, int hq, int b,
                                             const float (&o)[D / 64][32], const float (&inv)[2]) {
  tma::mbar_wait(q_empty, phase);
  const u32 rows = k_stage + (wg - 1) * 64 * 2 * D;
  const int row0 = q0 + 64 * (wg - 1);  // the warpgroup's first query
  stage_rows_sw<DType, D>(o, inv, rows);
  wg::fence_proxy_async();
  warpgroup_sync(wg - 1);
  if (warp == 0 && lane == 0 && row0 < q_len) {
    const void* tm_o = reinterpret_cast<const unsigned char*>(p.tma) + 384;
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk)
      tma::store_4d_hint(tm_o, rows + blk * kBoxBytes, 64 * blk, row0, hq, b,
                         tma::l2_evict_first());
    tma::bulk_commit();
  }
}

// The epilogue's per-thread stores: O rows r_lo and r_lo + 8 (unless an output transform or
// the 16-byte path already wrote them) and their LSE, by the quad's first lane.
template <typename Variant, typename DType, int D, int DV, typename OutRow>
__device__ __forceinline__ void store_rows_lse(const attncc::AttentionParams& p, OutRow&& out_row,
                                               const float (&o)[D / 64][32], const float (&inv)[2],
                                               const float (&lse)[2], int r_lo, int q_len, bool v4,
                                               int b, int hq, int lane) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int qi = r_lo + 8 * hr;
    if (qi < q_len) {
      if (!Variant::has_output_transform && !v4)
        store_row<DType, D, DV>(out_row(qi), o, hr, inv[hr]);
      if constexpr (Variant::use_softmax) {
        if (p.lse != nullptr && (lane & 3) == 0)
          p.lse[b * p.lse_stride_b + hq * p.lse_stride_h + qi] = lse[hr];
      }
    }
  }
}

// DQK, DV: the real head dims of q/k and v; a padded form (either below D) reads its rows
// through TMA maps of the real widths, which fill the columns past them with zeros, and
// stores the DV columns of O (docs/flex-api.md, "Head dims").
template <typename Variant, typename DType, int D, int TKV, int STAGES, int DQK = D, int DV = D>
__device__ __forceinline__ void fa3_prefill(const attncc::AttentionParams& p,
                                            const typename Variant::Params& vp) {
  static_assert(D == 64 || D == 128 || D == 256, "the FA3 kernel supports head dims 64, 128, 256");
  static_assert(DQK % 8 == 0 && DV % 8 == 0 && DQK <= D && DV <= D && DQK >= 64 && DV >= 64,
                "a padded form's real head dims are multiples of 8 from 64 (a TMA box's width)");
  static_assert((DQK == D && DV == D) ||
                    !(Variant::has_query_transform || Variant::has_key_transform ||
                      Variant::has_value_transform || Variant::has_output_transform),
                "a padded head dim has no q/k/v/output transform (the host refuses those)");
  static_assert(TKV == 64 || TKV == 128, "the FA3 kernel's KV tiles are 64 or 128 keys");
  static_assert(!paired_ctas() || kSplitHeadDim<D>, "CTA pairs run at D = 64 and 128");
  using S = Smem<D, TKV, STAGES>;
  constexpr int BLOCKS = D / 64;     // 64-column blocks per tile
  constexpr bool kSoftmax = Variant::use_softmax;
  // The bulk-store epilogue: O staged in the K half of the item's last stage (both consumers'
  // 128 rows fit in a 128-key K tile) and written out by TMA tensor stores, so the consumers go
  // on to the next item while the copy engine writes. Persistent head dims only (a one-item CTA has
  // nothing to overlap), not with an output transform (O is staged in the Q tile then), and
  // not in the low-pressure form (its variants spilled 8 bytes with it: document_causal D 128).
  constexpr bool kBulkO = kPersistentHeadDim<D> && TKV == 128 &&
                          !Variant::has_output_transform && !form::low_pressure();
  static_assert(!kBulkO || S::kKvTileBytes >= kTQ * 2 * D, "O does not fit in a K tile");
  // The split K/V ring (Ring<true>; docs/fa3.md, "The split K/V ring and D = 256"): with 2
  // stages a joint stage is refilled only after the P V that frees it, when the next S needs
  // it. Not with key/value transforms (a landed tile's transform rewrites K and V together),
  // not with the bulk-store epilogue (it holds the K half of a stage) nor CTA pairs (their own
  // producer).
  constexpr bool kSplitRing = STAGES == 2 && !kBulkO && !paired_ctas() &&
                              !Variant::has_key_transform && !Variant::has_value_transform;
  // The split tail (fa3_split.cuh): for persistent CTAs, where a unit's state is softmax
  // statistics and nothing is staged in Q after the loop.
  constexpr bool kSplit = kSplitHeadDim<D> && kSoftmax &&
                          !Variant::has_output_transform && !paired_ctas();

  extern __shared__ __attribute__((aligned(1024))) unsigned char attncc_fa3_smem_raw[];
  // the 128-byte swizzle works on absolute address bits: align the tiles to 1024 bytes
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<unsigned long long>(attncc_fa3_smem_raw) + 1023) & ~1023ull);
  const u32 base = common::smem_addr(smem);
  const u32 sq = base + S::kQ, sk = base + S::kK, sv = base + S::kV;
  const u32 full_bar = base + S::kBar;               // + 8*s: stage s landed
  const u32 empty_bar = full_bar + 8 * STAGES;       // + 8*s: stage s read by every consumer
  const u32 q_full = full_bar + 16 * STAGES, q_empty = q_full + 8;
  const u32 item_slot = base + S::kItem, tail_at = base + S::kTail;
  const void* tm_q = p.tma;
  const void* tm_k = reinterpret_cast<const unsigned char*>(p.tma) + 128;
  const void* tm_v = reinterpret_cast<const unsigned char*>(p.tma) + 256;

  const int tid = threadIdx.x, lane = tid & 31;
  const int wg = tid >> 7;               // 0: producer, 1..kConsumers: consumers
  const int warp = (tid >> 5) & 3;       // warp within its warpgroup
  const int q_len = p.q_len, kv_len = p.kv_len;
  const int nqb = (q_len + kTQ - 1) / kTQ;
  const int num_items = p.batch * p.num_q_heads * nqb;

  if (tid == 0) put_tail(tail_at, tail_split<TKV, kSplit>(p, num_items));
  init_barriers<STAGES, kSplitRing>(full_bar, empty_bar, q_full, q_empty,
                                    base + S::kSplitBar);  // (its __syncthreads publishes it)

  // ---- producer: one thread; the other producer threads have nothing to do ------------------
  if (wg == 0) {
    wg::setmaxnreg_dec<kProducerRegs>();
    if constexpr (paired_ctas()) {
      // the peer's barriers are initialized (here rather than in init_barriers: across that
      // barrier the prologue's generic shared-memory pointer spilled, document_mask D = 128);
      // and at the end, a CTA of a pair stays until the peer is done: its copies and arrivals
      // reach this one
      tma::cluster_sync();
      if (tid == 0) produce_pairs<D, TKV, STAGES>(p, base);
      tma::cluster_sync();
      return;
    }
    if (tid != 0) return;
    const ProducerView view{sq,      sk,   sv,   full_bar, empty_bar, q_full, q_empty, item_slot,
                            tail_at, tm_q, tm_k, tm_v,     q_len,     kv_len, nqb,     num_items};
    produce_items<D, TKV, STAGES, kSplitRing>(p, view);
    return;
  }

  // ---- consumers: warpgroup wg owns query rows [q0 + 64 (wg - 1), +64) of each item ----------
  wg::setmaxnreg_inc<kConsumerRegs>();
  if constexpr (paired_ctas()) tma::cluster_sync();  // (see the producer's)
  const u32 sq_w = sq + (wg - 1) * BLOCKS * kBoxBytes;
  const float qk_scale = (kSoftmax && !Variant::has_logits_transform) ? p.sm_scale * kLog2e
                                                                      : p.sm_scale;
  const Ring<kSplitRing> ring{sk,     sv,     full_bar, empty_bar, S::kKvTileBytes,
                              STAGES, base + S::kSplitBar, base + S::kSplitBar + 8 * STAGES};
  // Both consumers visit the same tiles, so they meet at the same issue points.
  const Turns turns{wg - 1};
  DType* out = reinterpret_cast<DType*>(p.o);
  int tile = 0;
  // O rows 16-byte aligned: stored 16 bytes a lane, or through shared memory (kBulkO); a
  // function of the parameters, so nothing holds it in a register through the tile loop
  auto o_v4 = [&] {
    return !Variant::has_output_transform &&
           v4_aligned(p.o, p.o_stride_s | p.o_stride_h | p.o_stride_b);
  };
  HeldStage held;  // kBulkO: the stage holding this warp's rows of the last item's O
  const u32 meta_at = base + S::kMeta;
  // the CTA's k-th unit: item `it` (its Q has landed) over tiles `u` (UnitRange; the producer
  // resolved its count, except a CTA pair's: all of the keys), its K/V tiles from ring tile
  // `tile` on, each described by its stage's TileMeta
  auto run_item = [&](const DenseItem& it, const UnitRange& u, int k) {
    const int n = paired_ctas() ? (kv_len + TKV - 1) / TKV : u.count;
    const int kv_skip = u.first * TKV, part = u.part;
    // the lists, for the forms that read them (kListTiles below; elsewhere its loads are dead)
    const common::TileList tiles = item_tiles<TKV>(p, it);
    const int b = it.b, hq = it.hq, q0 = it.q0;
    float o[BLOCKS][32];
#pragma unroll
    for (int blk = 0; blk < BLOCKS; ++blk)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[blk][i] = 0.f;
    float row_m[2] = {common::neg_inf(), common::neg_inf()}, row_l[2] = {0.f, 0.f};
    // query position of this thread's first row
    const int r_lo = q0 + 64 * (wg - 1) + 16 * warp + (lane >> 2);
    // every row of the tile is a real query: tiles inside kv_len need no bounds checks
    const bool rows_inside = q0 + kTQ <= q_len;
    // row r of this warpgroup's 64: its query head and position, and whether it is a real query
    auto row_at = [&](int r, int& h, int& qi) {
      h = hq;
      qi = q0 + 64 * (wg - 1) + r;
      return qi < q_len;
    };
    if constexpr (Variant::has_query_transform)
      transform_q<Variant, DType, D>(vp, sq_w, b, wg - 1, row_at);

    const int row_hq[2] = {hq, hq}, row_qi[2] = {r_lo, r_lo + 8};
    const bool row_ok[2] = {r_lo < q_len, r_lo + 8 < q_len};
    // The tile consume_tiles is on: read by `landed` as soon as the tile's stage is full, so the
    // load is done long before `logits_softmax` needs it in the same step. Masks that load at
    // the positions (document masks) read the lists instead, in their logits: with the stage's
    // word (read early or late, one word or two) ptxas spilled document_causal 32 B at D = 64
    // and 64 B at D = 128 (NVRTC 12.9), with the lists it spills nothing.
    constexpr bool kListTiles = Variant::loads_at_positions;
    TileMeta cur{0};
    auto logits_softmax = [&](float (&s)[TKV / 2], int i, float (&corr)[2]) {
      if constexpr (kListTiles) {
        bool f;
        const int kv0 = tiles.start(i, f);
        cur = TileMeta::of(kv0, f);
      }
      const bool is_full = cur.full();
      const int kv0 = cur.kv0() + kv_skip;
      // a block mask's partial tile of a band mask (causal) inside both sequences: mask_band
      const bool band = Variant::has_kv_window && !is_full;
      const bool interior = rows_inside && kv0 + TKV <= kv_len &&
                            (is_full || !Variant::has_logits_mask || band);
      logits_softmax_step<Variant, TKV, true>(s, vp, qk_scale, b, row_hq, row_qi, row_ok, kv0,
                                              kv_len, 0, is_full, interior, row_m, row_l, corr,
                                              band);
    };
    // A key/value transform rewrites each landed tile in place before any GEMM reads it, the two
    // consumers taking half of its rows each (both read the whole tile).
    auto landed = [&](int, int t) {
      if constexpr (!kListTiles) cur = get_meta(meta_at + 8 * (t % STAGES));
      if constexpr (Variant::has_key_transform || Variant::has_value_transform) {
        const int kv0 = (kListTiles ? get_meta(meta_at + 8 * (t % STAGES)) : cur).kv0() + kv_skip;
        transform_kv<Variant, DType, D, TKV>(vp, ring.k_of(t), ring.v_of(t), wg - 1, b, it.h_kv,
                                             kv0, kv_len, 0);
        wg::fence_proxy_async();  // the wgmmas (async proxy) must see these stores
        consumers_sync();
      }
    };
    const QRelease<Variant, kPersistentHeadDim<D>> q_release{q_empty};
    auto last_s_done = [&] { q_release.last_s_done(); };
    if (n > 0) {
      consume_tiles<DType, D, TKV>(n, tile, sq_w, ring, turns, o, logits_softmax, landed,
                                   last_s_done, kBulkO ? &held : nullptr,
                                   kBulkO && o_v4() && part < 0);
    } else {
      last_s_done();  // nothing reads it (the block mask left this query block no keys)
      if constexpr (kBulkO) held.settle(ring);
    }
    tile += n;
    // a unit of a split tail item: park this warp's state; the item's last warp to arrive
    // merges every unit's and stores (fa3_split.cuh), the others are done
    if constexpr (kSplit) {
      if (part >= 0 && !park_or_merge<D>(p, get_tail(tail_at), part, 4 * (wg - 1) + warp, o,
                                         row_m, row_l))
        return;
    }

    // ---- epilogue: normalize (output transform through the Q tile), store O and the LSE ------
    float inv[2], lse[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) finish_row<kSoftmax>(row_m[hr], row_l[hr], inv[hr], lse[hr]);
    if constexpr (kSoftmax) join_sinks(p.sinks, hq, inv, lse);  // whole rows (merged if split)
    if constexpr (kSoftmax) clear_empty_rows<D>(o, inv);
    DType* const out_bh = out + b * p.o_stride_b + hq * p.o_stride_h;
    auto out_row = [&](int qi) { return out_bh + (attncc::i64)qi * p.o_stride_s; };
    if constexpr (Variant::has_output_transform) {
      stage_transform_o<Variant, DType, D>(o, inv, vp, sq_w, b, row_at);
      store_staged_rows<DType, D>(sq_w, [&](int r) -> DType* {
        int h, qi;
        return row_at(r, h, qi) ? out_row(qi) : nullptr;
      });
    }
    const bool v4 = o_v4();
    if (kBulkO && v4 && n > 0 && part < 0) {
      store_o_bulk<DType, D>(p, ring.k_of(tile - 1), q_empty, k & 1, wg, warp, lane, q0, q_len,
                             hq, b, o, inv);
      held.owe = warp == 0 ? 4 : 0;
    } else if (v4) {
      store_rows_v4<DType, D, DV>(o, inv, [&](int hr) -> DType* {
        const int qi = r_lo + 8 * hr;
        return qi < q_len ? out_row(qi) : nullptr;
      });
    }
    store_rows_lse<Variant, DType, D, DV>(p, out_row, o, inv, lse, r_lo, q_len, v4, b, hq, lane);
    q_release.stored();
  };
  // The producer picks the items (the consumers keep no scheduling state in their registers)
  // and publishes each in item_slot with its Q; b < 0 means there are no more.
#pragma unroll 1
  for (int k = 0;; ++k) {
    tma::mbar_wait(q_full, k & 1);
    // a plain load, not asm volatile, so the optimizer may place it (which kept document_causal
    // D = 128's low-pressure form spill-free); it stays below the wait, whose asm clobbers memory
    // (indexed from the __shared__ array itself, so it is an LDS from a 32-bit offset: through
    // the aligned generic pointer it was a generic load whose 64-bit base spilled, softcap
    // D = 128)
    // The pair form reads it by its 32-bit address instead: there the generic pointer the
    // offset comes from, live across the roles' cluster barrier, spilled (document_mask D = 128).
    ItemSlot slot;
    if constexpr (paired_ctas())
      slot = read_slot(item_slot);
    else
      slot = *reinterpret_cast<const ItemSlot*>(attncc_fa3_smem_raw +
                                                (smem - attncc_fa3_smem_raw) + S::kItem);
    if (slot.item.b < 0) break;
    run_item(slot.item, slot.range, k);
    if (!kPersistentHeadDim<D>) break;  // one item per CTA: the grid has num_items CTAs
  }
  turns.finish(tile);
  if constexpr (kBulkO) {  // the last item's copies: read (the stage) and written (the CTA ends)
    held.settle(ring);
    tma::bulk_wait_all<0>();
  }
  if constexpr (paired_ctas()) tma::cluster_sync();  // the peer's last arrivals on this ring
}

}  // namespace fa3
}  // namespace attncc

// Grid (min(#SMs, items): persistent; items = batch * num_q_heads * ceil(q_len / 128), or
// items with kernel_options PERSISTENT False), block kThreads (384),
// dynamic shared memory attncc::fa3::Smem<HEAD_DIM, TKV, STAGES>::kBytes; AttentionParams::tma
// points at the q/k/v maps. DQK, DV: the real head dims (HEAD_DIM both, or a padded form).
#define ATTNCC_FA3_ENTRY(NAME, VARIANT, DTYPE, HEAD_DIM, TQ, TKV, STAGES, M_FRAGS, KV_WARPS, DQK,  \
                         DV)                                                                       \
  extern "C" __global__ void __launch_bounds__(attncc::fa3::kThreads, 1)                           \
      NAME(attncc::AttentionParams p, VARIANT::Params vp) {                                        \
    static_assert(TQ == attncc::fa3::kTQ && M_FRAGS == 1 && KV_WARPS == 1,                         \
                  "the FA3 kernel has 128-row CTAs of two 64-row consumer warpgroups");            \
    attncc::fa3::fa3_prefill<VARIANT, DTYPE, HEAD_DIM, TKV, STAGES, DQK, DV>(p, vp);               \
  }

#endif  // ATTNCC_FA3_PREFILL_CUH
