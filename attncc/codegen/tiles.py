"""Compile-time tiles of the tiled kernel templates (FA2 and FA3), mirrored in Python.

`KernelTiles(tq, tkv, stages, m_frags, kv_warps)` is what `generate_source(kernel="fa2" |
"fa2batch" | "fa3" | "fa3batch", tiles=...)` instantiates (`fa3_tiles` gives FA3's): T_q fused query rows per CTA, T_kv KV rows per tile, the
cp.async pipeline depth, 16-row MMA fragments per warp, and (decode, T_q = 16) how many warps
split each KV tile between them (warps = T_q / (16 * m_frags) * kv_warps). Its threads
and dynamic shared memory are the C++ `attncc::fa2::Config`'s (the launcher also checks the
threads against the loaded function).

Example:
    >>> t = KernelTiles(128, 64, 2, 2)
    >>> t.warps, t.threads, t.smem_bytes(128), t.suffix
    (4, 128, 98304, '_q128_k64_s2_m2')
    >>> default_tiles(256)
    KernelTiles(tq=64, tkv=32, stages=2, m_frags=1, kv_warps=1, half_rows=False)
    >>> KernelTiles(16, 64, 2, 1, kv_warps=4).threads
    128
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import CodegenError

__all__ = ["KernelTiles", "default_tiles", "fa3_tiles", "fa3_smem_bytes", "FA2_HEAD_DIMS",
           "TQ_CHOICES", "HEAD_DIM_STEP", "HEAD_DIM_MIN", "HEAD_DIM_MAX", "padded_head_dim",
           "TKV_CHOICES", "FA3_TKV_CHOICES", "BackwardTiles", "backward_tiles",
           "backward_fallbacks", "FA3_BACKWARD_TILES", "fa3_backward_geometry",
           "FA3_PADDED_MIN_DIM"]

FA2_HEAD_DIMS = (64, 128, 256)
# Head dims the GPU paths take: multiples of 8 (one 16-byte chunk of 16-bit elements) from 32 to
# 256; those not in FA2_HEAD_DIMS run the FA2 kernels' padded form (padded_head_dim).
HEAD_DIM_STEP, HEAD_DIM_MIN, HEAD_DIM_MAX = 8, 32, 256
TQ_CHOICES = (16, 32, 64, 128)
TKV_CHOICES = (32, 64, 128)
FA3_TKV_CHOICES = (64, 128)


@dataclass(frozen=True)
class KernelTiles:
    """One tiled kernel instantiation's tiles; invalid combinations raise CodegenError."""

    tq: int = 128
    tkv: int = 64
    stages: int = 2
    m_frags: int = 2
    kv_warps: int = 1
    # decode (kv_warps > 1): tiles of exactly 8 fused rows skip their padding row (one token of
    # a GQA group of 8, or q_len x group = 8; fa2_attend's kHalf, docs/serving.md "GQA-8 tiles")
    half_rows: bool = False

    def __post_init__(self) -> None:
        if self.tq not in TQ_CHOICES or self.tkv not in TKV_CHOICES or \
                not 1 <= self.stages <= 4:
            raise CodegenError(f"tiles (T_q={self.tq}, T_kv={self.tkv}, stages={self.stages}): "
                               f"T_q in {TQ_CHOICES}, T_kv in {TKV_CHOICES}, 1..4 stages")
        if self.m_frags not in (1, 2) or self.tq % (16 * self.m_frags):
            raise CodegenError(f"m_frags={self.m_frags} with T_q={self.tq}: 1 or 2 16-row "
                               f"fragments per warp, T_q a multiple of 16 * m_frags")
        if self.kv_warps not in (1, 2, 4) or (self.kv_warps > 1 and (
                self.tq != 16 or self.m_frags != 1 or self.tkv % (16 * self.kv_warps))):
            raise CodegenError(f"kv_warps={self.kv_warps} with T_q={self.tq}, T_kv={self.tkv}: "
                               f"1, 2 or 4; more than 1 needs T_q=16, m_frags=1 and KV slices "
                               f"(T_kv / kv_warps) that are multiples of 16 rows")
        if self.half_rows and self.kv_warps == 1:
            raise CodegenError("half_rows is a decode form: it needs kv_warps > 1")

    @property
    def warps(self) -> int:
        return self.tq // (16 * self.m_frags) * self.kv_warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory: the Q tile plus `stages` K and V tiles of 16-bit elements."""
        return 2 * head_dim * (self.tq + 2 * self.stages * self.tkv)

    @property
    def suffix(self) -> str:
        """What the kernel name appends for these tiles."""
        return (f"_q{self.tq}_k{self.tkv}_s{self.stages}"
                + (f"_m{self.m_frags}" if self.m_frags > 1 else "")
                + (f"_w{self.kv_warps}" if self.kv_warps > 1 else "")
                + ("_h8" if self.half_rows else ""))


# The FA3 kernel's padded form reads q/k/v through TMA maps of the real widths in boxes of 64
# columns: every real head dim is at least one box wide (fa3_prefill.cuh's static_assert).
FA3_PADDED_MIN_DIM = 64


def padded_head_dim(head_dim_qk: int, head_dim_vo: int | None = None,
                    names: tuple[str, str] = ("query head_dim", "value head_dim")
                    ) -> tuple[int, bool]:
    """(kernel head dim, padded) for a query/key head dim and a value head dim (None: the same):
    the smallest of FA2_HEAD_DIMS holding both, and whether a real dim is below it (then the
    kernel runs its padded form: zero-filled columns past the real dims, which it does not
    store; docs/flex-api.md, "Head dims"). ValueError, naming `names`, for a dim that is not a
    multiple of 8 from 32 to 256.

    Example:
        >>> padded_head_dim(128), padded_head_dim(80), padded_head_dim(192, 128)
        ((128, False), (128, True), (256, True))
        >>> padded_head_dim(100)
        Traceback (most recent call last):
        ...
        ValueError: query head_dim 100: the GPU kernels take head dims that are multiples of 8 from 32 to 256 (pad the head dim to a multiple of 8)
    """
    head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
    for name, d in zip(names, (head_dim_qk, head_dim_vo)):
        if (isinstance(d, bool) or not isinstance(d, int) or d % HEAD_DIM_STEP
                or not HEAD_DIM_MIN <= d <= HEAD_DIM_MAX):
            raise ValueError(f"{name} {d!r}: the GPU kernels take head dims that are multiples "
                             f"of {HEAD_DIM_STEP} from {HEAD_DIM_MIN} to {HEAD_DIM_MAX} (pad the "
                             f"head dim to a multiple of {HEAD_DIM_STEP})")
    width = next(w for w in FA2_HEAD_DIMS if w >= max(head_dim_qk, head_dim_vo))
    return width, (head_dim_qk, head_dim_vo) != (width, width)


def default_tiles(head_dim: int) -> KernelTiles:
    """The tiles `export` / `compile` use when none are given: the prefill heuristic's choice
    for a long sequence (attncc.runtime.flex.gpu_flex.choose_tiles has the shape-dependent one)."""
    if head_dim <= 128:
        return KernelTiles(128, 64, 2, 2)
    return KernelTiles(64, 32, 2, 1)


def fa3_tiles(stages: int = 2, tkv: int = 128, tq: int = 128) -> KernelTiles:
    """The FA3 kernel's tiles (kernels/fa3/fa3_prefill.cuh: 128 query rows = two consumer
    warpgroups of 64; KV tiles of 64 or 128 keys); the KV tile width and the pipeline depth vary.
    `tq` 64 is the batch kernel's pair form (kernels/fa3/fa3_batch.cuh: 64-row units whose K/V
    tiles the two consumer warpgroups split).

    Example:
        >>> fa3_tiles(3)
        KernelTiles(tq=128, tkv=128, stages=3, m_frags=1, kv_warps=1, half_rows=False)
        >>> fa3_tiles(2, tkv=64).suffix, fa3_tiles(4, tkv=64, tq=64).suffix
        ('_q128_k64_s2', '_q64_k64_s4')
    """
    if tkv not in FA3_TKV_CHOICES:
        raise CodegenError(f"the FA3 kernel's KV tiles are {FA3_TKV_CHOICES} keys, not {tkv}")
    if tq not in (64, 128):
        raise CodegenError(f"the FA3 kernel's units are 128 query rows (or 64: the batch "
                           f"kernel's pair form), not {tq}")
    if tq == 64 and stages not in (2, 4):
        # each consumer waits only for its own tiles' full barriers, by parity: it could pass
        # a stage still holding the other consumer's older tile unless the ring is even
        raise CodegenError(f"the FA3 pair form's K/V ring needs 2 or 4 stages, not {stages}: "
                           f"its consumers take alternate tiles")
    if tq == 128 and not 2 <= stages <= 4:
        # a consumer releases K/V tile i only after the P V of tile i, which it issues together
        # with S(i+1): with one stage tile i+1 could never land (the kernel would hang)
        raise CodegenError(f"the FA3 kernel's K/V ring needs 2 to 4 stages, not {stages}: a "
                           f"stage is released one iteration after it is read")
    return KernelTiles(tq, tkv, stages, 1)


def fa3_smem_bytes(head_dim: int, tiles: KernelTiles) -> int:
    """Dynamic shared memory of an FA3 kernel, dense or batch (kernels/fa3/fa3_prefill.cuh Smem):
    the Q tile and the K/V ring, 2 * stages mbarriers plus Q's two (full and empty: both kernels
    are persistent), 2 * stages more for the split ring's V-full and K-empty barriers (reserved
    in every form; docs/fa3.md, "The split K/V ring and D = 256"), the dense kernel's 32-byte
    work-item slot, 16-byte split-tail record and 8-byte record of each stage's tile, and 1 KB
    of slack that aligns the tiles to 1024 bytes.

    Example:
        >>> fa3_smem_bytes(128, fa3_tiles(3)), fa3_smem_bytes(64, fa3_tiles(4))
        (230584, 148704)
    """
    # (the Q region holds 128 rows in every form: the pair form hands O over in the second slot)
    ring = dataclasses.replace(tiles, tq=128).smem_bytes(head_dim)
    return ring + 8 * (4 * tiles.stages + 2) + 32 + 16 + 8 * tiles.stages + 1024


@dataclass(frozen=True)
class BackwardTiles:
    """The FA2-class backward kernel's tiles (kernels/fa2/fa2_backward.cuh BwdConfig): a CTA owns
    `tkv` KV rows and visits `tq`-row query tiles through a `stages`-deep ring; `dsplit` warps
    share each 16-row KV group, splitting dK/dV's columns (2 at head dim 256).

    Example:
        >>> t = backward_tiles(256)
        >>> t.threads(256), t.smem_bytes(256), t.suffix
        (256, 100608, '_bq16_bk64_s2_ds2')
    """

    tq: int = 16
    tkv: int = 64
    stages: int = 2
    dsplit: int = 1

    def __post_init__(self) -> None:
        if (self.tq not in (16, 32, 64) or self.tkv not in (64, 128) or self.stages != 2
                or self.dsplit not in (1, 2)):
            raise CodegenError(f"backward tiles (T_q={self.tq}, T_kv={self.tkv}, "
                               f"stages={self.stages}, dsplit={self.dsplit}): T_q in "
                               f"(16, 32, 64), T_kv in (64, 128), 2 stages, dsplit 1 or 2")

    def check(self, head_dim: int) -> None:
        """CodegenError unless these tiles fit `head_dim` (dK/dV of 256 columns need dsplit 2;
        at most 256 threads)."""
        if (head_dim == 256 and self.dsplit != 2) or self.threads(head_dim) > 256:
            raise CodegenError(f"backward tiles {self} at head dim {head_dim}: head dim 256 "
                               f"needs dsplit=2, and a CTA has at most 8 warps")

    def warps(self, head_dim: int) -> int:
        """KV row groups of 16, times dsplit."""
        return self.tkv // 16 * self.dsplit

    def threads(self, head_dim: int) -> int:
        return 32 * self.warps(head_dim)

    def smem_bytes(self, head_dim: int) -> int:
        """K and V; Q and dO per stage; dS; fp32 LSE and delta per stage."""
        return (2 * (2 * self.tkv * head_dim + 2 * self.stages * self.tq * head_dim
                     + self.tq * self.tkv) + 8 * self.stages * self.tq)

    @property
    def suffix(self) -> str:
        return (f"_bq{self.tq}_bk{self.tkv}_s{self.stages}"
                + (f"_ds{self.dsplit}" if self.dsplit > 1 else ""))


def backward_fallbacks(head_dim: int, block_kv: int | None = None) -> tuple[BackwardTiles, ...]:
    """The backward forms the kernel cache tries in order until ptxas reports neither spills nor
    a stack frame (runtime/jit/kernels.py): every one of them is within 255 registers only by a
    few, and which one fits depends on the hooks (docs/backward.md, "Kernels"). A block mask's
    `block_kv` keeps the KV tiles that divide it.

    Example:
        >>> [t.suffix for t in backward_fallbacks(128)]
        ['_bq16_bk128_s2', '_bq16_bk64_s2_ds2', '_bq16_bk64_s2']
        >>> [t.suffix for t in backward_fallbacks(128, block_kv=64)]
        ['_bq16_bk64_s2_ds2', '_bq16_bk64_s2']
    """
    forms = {64: ((64, 64, 1), (32, 64, 1), (16, 64, 1)),
             128: ((16, 128, 1), (16, 64, 2), (16, 64, 1)),
             256: ((16, 64, 2),)}[head_dim]
    return tuple(BackwardTiles(q, k, 2, ds) for q, k, ds in forms
                 if block_kv is None or block_kv % k == 0)


# The FA3-class backward's one form (kernels/fa3/fa3_backward.cuh): 64-row query tiles, 128-row
# KV tiles, two stages; its geometry is fa3_backward_geometry's.
FA3_BACKWARD_TILES = BackwardTiles(64, 128, 2, 1)


def fa3_backward_geometry(head_dim: int) -> tuple[int, int]:
    """Threads and dynamic shared memory of the FA3-class backward (fa3_backward.cuh BwdConfig):
    a producer warpgroup and two consumers; K, V, the Q and dO stages, two dS buffers, one fp32
    dQ staging tile per 64 columns, the LSE and delta rows and a tile's 8-byte description per
    stage, 128 bytes of mbarriers and 1 KB of alignment slack.

    Example:
        >>> fa3_backward_geometry(128), fa3_backward_geometry(64)
        ((384, 198800), (384, 116880))
    """
    t = FA3_BACKWARD_TILES
    tiles = 2 * (2 * t.tkv * head_dim + 2 * t.stages * t.tq * head_dim + 2 * t.tq * t.tkv)
    dq = head_dim // 64 * t.tq * 64 * 4
    return 384, tiles + dq + 8 * t.stages * t.tq + 8 * t.stages + 128 + 1024


def backward_tiles(head_dim: int, block_kv: int | None = None) -> BackwardTiles:
    """The first backward form for `head_dim` (backward_fallbacks).

    Example:
        >>> backward_tiles(128).tkv, backward_tiles(64).tq, backward_tiles(256).dsplit
        (128, 64, 2)
    """
    return backward_fallbacks(head_dim, block_kv)[0]
