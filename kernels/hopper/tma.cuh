// attncc Hopper TMA and mbarrier building blocks, for the FA3 kernels (docs/fa3.md).
//
// Compiled with NVRTC for sm_90a; tests/gpu/test_tma.py checks them on the GPU.
// Self-contained: no #include.
//
// A producer thread arms an mbarrier with the bytes it expects (arrive.expect_tx), issues bulk
// tensor copies (TMA) that complete_tx on that barrier as they land, and consumers wait on the
// barrier's phase parity -- so a K/V tile arriving in shared memory is signalled by the copy
// engine itself, with no cp.async.wait_group or __syncthreads in the consumers' loop.
//
// Tensor maps are built on the host (attncc.runtime.jit.tma.tensor_map_2d) and passed as a pointer
// to 128 bytes in global memory (64-byte aligned). With the 128-byte swizzle a box row is at most
// 128 bytes (64 bf16), and the copy lands in exactly wgmma.cuh's sw128 layout: a [rows][128 B] box
// per TMA copy, so a D = 128 tile is two copies into two column blocks.
#ifndef ATTNCC_TMA_CUH
#define ATTNCC_TMA_CUH

namespace attncc {
namespace tma {

typedef unsigned int u32;

// One mbarrier (8 bytes of shared memory, 8-byte aligned) expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Make initialized barriers visible to the async proxy (TMA) before any copy uses them.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive once and announce `bytes` more transaction bytes for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrive `count` times at once (for warps whose arrival another thread makes after it waited).
__device__ __forceinline__ void mbar_arrive_n(u32 bar, u32 count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count)
               : "memory");
}
// Block until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// 2-D tiled bulk copy: the box at (col0, row0) of the tensor `tmap` describes (innermost
// coordinate first) into shared memory at `dst`, completing `bar`'s transaction bytes.
__device__ __forceinline__ void load_2d(u32 dst, const void* tmap, u32 bar, int col0, int row0) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(tmap), "r"(col0), "r"(row0), "r"(bar)
      : "memory");
}

// L2 eviction priorities for a bulk copy's .L2::cache_hint operand: createpolicy makes the
// opaque 64-bit policy (fraction 1.0: every line the copy touches gets the priority). Lines
// marked evict_first are replaced before normal ones, evict_last after them -- so a tile read
// once (Q) or written once (O) need not push out K/V tiles that other CTAs read again soon.
// The FA3 kernels mark their Q loads and the dense kernel's O stores evict_first: an item's
// 64 KB of them would otherwise push out K/V tiles that the L2 section's other query blocks
// read again. (K/V marked evict_last measured slower.)
__device__ __forceinline__ unsigned long long l2_evict_first() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// load_2d with an L2 eviction policy (l2_evict_first).
__device__ __forceinline__ void load_2d_hint(u32 dst, const void* tmap, u32 bar, int col0,
                                             int row0, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(tmap), "r"(col0), "r"(row0), "r"(bar), "l"(policy)
      : "memory");
}

// 3-D tiled bulk copy: the box at (c0, c1, c2), innermost coordinate first. The batch kernel
// reads a GQA group's query heads of consecutive tokens as one box of [tokens][heads][64].
__device__ __forceinline__ void load_3d(u32 dst, const void* tmap, u32 bar, int c0, int c1,
                                        int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// load_3d with an L2 eviction policy.
__device__ __forceinline__ void load_3d_hint(u32 dst, const void* tmap, u32 bar, int c0, int c1,
                                             int c2, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".L2::cache_hint [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}

// 4-D tiled bulk copy: the box at (c0, c1, c2, c3), innermost coordinate first. The FA3-class
// backward reads [64 rows][64] boxes of a [batch, heads, seq, head_dim] tensor of any strides;
// rows past seq are outside the tensor and land as zeros.
__device__ __forceinline__ void load_4d(u32 dst, const void* tmap, u32 bar, int c0, int c1,
                                        int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// 1-D bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory
// into shared memory at `dst`, completing `bar`'s transaction bytes.
__device__ __forceinline__ void load_1d(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// dst[i] += src[i] for `bytes` / 4 fp32 values (a multiple of 16 bytes, both 16-byte aligned),
// done by the copy engine in L2: it joins the thread's bulk async-group (commit, wait_read and
// wait_all below), and the writers of `src` must have run fence.proxy.async before.
__device__ __forceinline__ void reduce_add_f32(float* dst, u32 src, u32 bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      ::"l"(dst), "r"(src), "r"(bytes)
      : "memory");
}

// 4-D tiled bulk store: the box at (c0, c1, c2, c3), innermost coordinate first, written from
// shared memory at `src` (laid out as a load of the same box would leave it: swizzled as the map
// says) to the tensor `tmap` describes. Box rows outside the tensor are not written. It joins
// this thread's current bulk async-group: the copy engine reads the shared memory and writes
// global memory while the thread goes on. The writing threads must have run fence.proxy.async
// before (the engine is the async proxy) and be ordered before the issuing thread (a barrier).
// commit closes the group; wait_read<N> blocks until at most N of this thread's groups still
// read shared memory (the source may then be overwritten), wait_all<N> until at most N are
// still writing global memory.
__device__ __forceinline__ void store_4d(const void* tmap, u32 src, int c0, int c1, int c2,
                                         int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(tmap), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// store_4d with an L2 eviction policy.
__device__ __forceinline__ void store_4d_hint(const void* tmap, u32 src, int c0, int c1, int c2,
                                              int c3, unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group.L2::cache_hint"
      " [%0, {%2, %3, %4, %5}], [%1], %6;\n"
      ::"l"(tmap), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- CTA pairs (clusters of two, sm_90) ----------------------------------------------------
// CTAs of one cluster run at the same time on one GPC and can reach each other's shared memory.
// The dense FA3 kernel pairs two CTAs on the same K/V tiles, so each tile is read from L2 once
// and lands in both (a multicast copy), and each CTA frees a stage in both (remote arrivals).
// The CTA's rank in its cluster (0 in a grid launched without clusters).
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster meets here: arrivals before are visible after
// (release / acquire). All threads must reach it -- none may have exited.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// `count` arrivals on the mbarrier at the same shared-memory offset as `bar` in CTA `rank` of
// the cluster (mapa turns the offset into that CTA's address). Relaxed: it tells the peer that
// this CTA's wgmmas finished reading a ring stage (their wait already returned), which orders
// nothing else; with release semantics ptxas put MEMBAR.ALL.GPU before every such arrival in
// the tile loop.
__device__ __forceinline__ void mbar_arrive_remote(u32 bar, u32 rank, u32 count) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [remote], %2;\n}\n"
      ::"r"(bar), "r"(rank), "r"(count)
      : "memory");
}
// load_2d into the same shared-memory offset of every CTA in `cta_mask` (bit r: cluster rank
// r), completing the bytes each copy delivers on the mbarrier at `bar`'s offset in that CTA.
__device__ __forceinline__ void load_2d_multicast(u32 dst, const void* tmap, u32 bar, int col0,
                                                  int row0, unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(tmap), "r"(col0), "r"(row0), "r"(bar), "h"(cta_mask)
      : "memory");
}

}  // namespace tma
}  // namespace attncc

#endif  // ATTNCC_TMA_CUH
