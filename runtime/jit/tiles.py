"""Kernel tile configurations both the FlexAttention path and serving compile: the FA2
instantiation's launch geometry (`fa2_config`), the FA3 K/V ring depth (`fa3_stages`) and the
head dims the kernels take.

Example:
    >>> fa2_config(128, 128, 64, 2)
    LaunchConfig(head_dim=128, tq=128, tkv=64, stages=2, m_frags=1, warps=8, threads=256, smem_bytes=98304, kv_warps=1)
"""
from __future__ import annotations

from dataclasses import dataclass

from attncc.codegen.tiles import FA2_HEAD_DIMS as HEAD_DIMS
from attncc.codegen.tiles import KernelTiles, fa3_smem_bytes, fa3_tiles, padded_head_dim

__all__ = ["LaunchConfig", "fa2_config", "fa3_stages", "HEAD_DIMS", "SMEM_PER_CTA",
           "padded_head_dim"]

# Dynamic shared memory one CTA may opt into on sm_90 (227 KB of the SM's 228).
SMEM_PER_CTA = 227 * 1024


@dataclass(frozen=True)
class LaunchConfig:
    """Launch geometry of one tiled kernel instantiation (`fa2_config` computes FA2's, mirroring
    attncc::fa2::Config in kernels/fa2/fa2_config.cuh; the FA3 paths fill it from their tiles)."""

    head_dim: int
    tq: int
    tkv: int
    stages: int
    m_frags: int
    warps: int
    threads: int
    smem_bytes: int
    kv_warps: int = 1


def fa2_config(head_dim: int, tq: int, tkv: int, stages: int = 2, m_frags: int = 1,
               kv_warps: int = 1) -> LaunchConfig:
    """Threads and dynamic shared memory of fa2_prefill<.., head_dim, tq, tkv, stages, m_frags>.

    `m_frags` is the number of 16-row MMA fragments per warp; `kv_warps` (decode, tq = 16) warps
    split each KV tile (warps = tq / (16 * m_frags) * kv_warps).

    Example:
        >>> c = fa2_config(256, 128, 32, 2)
        >>> c.warps, c.smem_bytes
        (8, 131072)
        >>> fa2_config(128, 128, 64, 2, m_frags=2).warps
        4
        >>> fa2_config(128, 16, 64, 2, kv_warps=4).threads
        128
    """
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim}: the FA2 kernel supports {HEAD_DIMS}")
    t = KernelTiles(tq, tkv, stages, m_frags, kv_warps)  # CodegenError (a ValueError) if bad
    return LaunchConfig(head_dim, tq, tkv, stages, m_frags, t.warps, t.threads,
                     t.smem_bytes(head_dim), kv_warps)


def fa3_stages(head_dim: int, tkv: int) -> int:
    """The deepest K/V ring (at most 4 stages) whose shared memory fits one CTA, for the dense
    and the batch FA3 kernel (the same layout): with 2 stages the producer falls behind the
    consumers (docs/fa3.md#warp-specialization-and-the-kv-ring).

    Example:
        >>> fa3_stages(64, 128), fa3_stages(128, 128), fa3_stages(256, 64)
        (4, 3, 2)
    """
    fits = [s for s in (4, 3, 2)
            if fa3_smem_bytes(head_dim, fa3_tiles(s, tkv)) <= SMEM_PER_CTA]
    return fits[0] if fits else 1
