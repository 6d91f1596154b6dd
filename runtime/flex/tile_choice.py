"""Tile sizes of the FA2/FA3 kernels for one FlexAttention-style call, and their launch geometry.

Tile heuristic (FlashInfer-style, on the effective query length l_q x group size): with at least
128 fused rows, D <= 128 and a grid of >= 2 CTAs per SM, T_q = 128 as 4 warps x 32 rows (two MMA
fragments per warp); otherwise T_q is the smallest of {16, 32, 64} that covers the fused rows.
T_kv comes from the head dim and the register/shared-memory budget (`_DEFAULT_TKV`). Head-group
fusion (all query heads of a GQA group in one CTA's rows) is used when it keeps block-mask lists
uniform per CTA. `kernel_options` (FlexAttention's names: BLOCK_M, BLOCK_N, num_stages,
num_warps, plus FAST_MATH and KERNEL="fa2" | "fa3") override the choice. On sm_90 the FA3
kernel (TMA + wgmma, 128 query rows x 128 keys) runs what it supports, FA2 the rest.

Example:
    >>> fa2_config(128, 128, 64, 2)
    LaunchConfig(head_dim=128, tq=128, tkv=64, stages=2, m_frags=1, warps=8, threads=256, smem_bytes=98304, kv_warps=1)
    >>> choose_tiles(128, q_len=4096, kv_len=4096, group=1, heads=16, batch=1, num_sms=132)
    TilePlan(tq=128, tkv=64, stages=2, gf=1, m_frags=2)
    >>> choose_tiles(128, q_len=1, kv_len=4096, group=8, heads=32, batch=4, num_sms=132).tq
    16
    >>> choose_tiles(128, q_len=2, kv_len=4096, group=8, heads=32, batch=4, num_sms=132).tq
    16
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from attncc.codegen.tiles import FA3_TKV_CHOICES, TKV_CHOICES, TQ_CHOICES, fa3_smem_bytes, fa3_tiles

from ..jit.tiles import SMEM_PER_CTA, fa2_config, fa3_stages

__all__ = ["TilePlan", "choose_tiles"]

# T_kv per (head_dim, T_q): the largest KV tile that compiles without register spills
# (ptxas report, sm_90a, every hook combination; docs/fa2.md, "KV tile per head dim").
_DEFAULT_TKV = {(64, 128): 64, (64, 64): 64, (64, 32): 64, (64, 16): 64,
                (128, 128): 64, (128, 64): 64, (128, 32): 64, (128, 16): 64,
                (256, 128): 32, (256, 64): 32, (256, 32): 32, (256, 16): 32}
# The FA3 kernel's KV tile when kernel_options has no BLOCK_N: 128 keys (one m64n128 wgmma per
# k-step of S, half the waits of 64-key tiles per FLOP;
# docs/fa3.md#warp-specialization-and-the-kv-ring).
FA3_DEFAULT_TKV = 128


@dataclass(frozen=True)
class TilePlan:
    """Chosen tiles: query rows per CTA, KV rows per tile, pipeline depth, head-group fusion."""

    tq: int
    tkv: int
    stages: int
    gf: int
    m_frags: int = 1
    forced: bool = field(default=False, repr=False)  # from kernel_options: compile exactly
    fast_math: bool = field(default=True, repr=False)  # kernel_options FAST_MATH
    kernel: str = field(default="fa2", repr=False)  # kernel_options KERNEL: "fa2" or "fa3"
    paired: bool = field(default=False, repr=False)  # FA3 on CTA pairs (gpu_flex.fa3_pairs)
    # a padded form (FA2's or FA3's): the real (query/key, value) head dims, whose padded width
    # the tiles were chosen for (attncc.codegen.tiles.padded_head_dim; docs/flex-api.md, "Head dims")
    head_dims: tuple[int, int] | None = field(default=None, repr=False)


def _fa3_plan(head_dim: int, block_q: int | None, block_kv: int | None,
              opts: Mapping[str, Any]) -> TilePlan:
    """The FA3 kernel's tiles for kernel_options `opts` (BLOCK_N, num_stages, FAST_MATH); a
    ValueError says what does not fit."""
    if head_dim not in (64, 128, 256):
        raise ValueError(f"kernel_options['KERNEL']='fa3' supports head dims 64, 128 and 256, "
                         f"not {head_dim}")
    tkv = opts.get("BLOCK_N") or (FA3_DEFAULT_TKV if head_dim <= 128 else 64)
    if tkv not in FA3_TKV_CHOICES:
        raise ValueError(f"kernel_options BLOCK_N={tkv}: the FA3 kernel's KV tiles are "
                         f"{' or '.join(map(str, FA3_TKV_CHOICES))} keys")
    if block_q is not None and (block_q % 128 or block_kv % tkv):  # type: ignore[operator]
        raise ValueError(f"kernel_options['KERNEL']='fa3' needs block mask blocks of 128 "
                         f"query rows (or a multiple) and a multiple of {tkv} keys (BLOCK_N), "
                         f"got BLOCK_SIZE={(block_q, block_kv)}")
    stages = opts.get("num_stages") or fa3_stages(head_dim, tkv)
    t = fa3_tiles(stages, tkv)  # CodegenError (a ValueError) for a bad stage count
    smem = fa3_smem_bytes(head_dim, t)
    if smem > SMEM_PER_CTA:
        raise ValueError(f"kernel_options num_stages={stages}: the FA3 kernel's Q tile and "
                         f"{stages} K/V stages of {tkv} keys need {smem // 1024} KB of shared "
                         f"memory at head dim {head_dim}, more than the "
                         f"{SMEM_PER_CTA // 1024} KB a CTA can have; use fewer stages or "
                         f"BLOCK_N=64")
    return TilePlan(t.tq, t.tkv, stages, 1, 1, True, bool(opts.get("FAST_MATH", True)), "fa3")


def choose_tiles(head_dim: int, *, q_len: int, kv_len: int, group: int, heads: int, batch: int,
                 num_sms: int = 132, block_q: int | None = None, block_kv: int | None = None,
                 mask_head_uniform: bool = True,
                 kernel_options: Mapping[str, Any] | None = None,
                 fa3_ok: bool = False) -> TilePlan:
    """Pick (T_q, T_kv, stages, gf) for a problem; `block_*` are the block mask's BLOCK_SIZE.

    `group` = num_q_heads / num_kv_heads; `heads` = num_q_heads. kernel_options may force
    BLOCK_M (T_q), BLOCK_N (T_kv) and num_stages; an impossible choice raises ValueError.
    `fa3_ok` (the caller checked an sm_90 GPU and contiguous inputs) picks the FA3 kernel for
    at least 128 query rows when the block mask's blocks suit it and kernel_options name no
    KERNEL or BLOCK_M; FA2 otherwise.

    Example:
        >>> choose_tiles(64, q_len=17, kv_len=17, group=4, heads=8, batch=1)
        TilePlan(tq=64, tkv=64, stages=2, gf=4, m_frags=1)
        >>> choose_tiles(128, q_len=1000, kv_len=1000, group=1, heads=16, batch=2,
        ...              block_q=128, block_kv=128)
        TilePlan(tq=64, tkv=64, stages=2, gf=1, m_frags=1)
        >>> choose_tiles(128, q_len=4096, kv_len=4096, group=1, heads=16, batch=4)
        TilePlan(tq=128, tkv=64, stages=2, gf=1, m_frags=2)
        >>> p = choose_tiles(128, q_len=4096, kv_len=4096, group=1, heads=16, batch=4, fa3_ok=True)
        >>> p.kernel, p.tkv, p.stages
        ('fa3', 128, 3)
    """
    opts = dict(kernel_options or {})
    masked = block_q is not None
    kernel = opts.get("KERNEL", "fa2")
    if kernel not in ("fa2", "fa3"):
        raise ValueError(f"kernel_options['KERNEL']={kernel!r}: use 'fa2' (default) or 'fa3' "
                         f"(the Hopper TMA + wgmma kernel; the sm_90 default where it applies)")
    if kernel == "fa3":
        return _fa3_plan(head_dim, block_q, block_kv, opts)
    if fa3_ok and "KERNEL" not in opts and "BLOCK_M" not in opts and q_len >= 128:
        try:  # the FA3 kernel when the shape suits it, else FA2 (never an error from here)
            return _fa3_plan(head_dim, block_q, block_kv, opts)
        except ValueError:
            pass
    if masked and (block_q % 16 or block_kv % 32):  # type: ignore[operator]
        raise ValueError(f"block_mask BLOCK_SIZE={(block_q, block_kv)}: the GPU kernel needs the "
                         f"query block size to be a multiple of 16 and the kv block size a "
                         f"multiple of 32; create the block mask with BLOCK_SIZE=128")

    def fusion_ok(tq: int, gf: int) -> bool:
        if gf == 1:
            return not masked or block_q % tq == 0  # type: ignore[operator]
        if not masked:
            return True
        return mask_head_uniform and tq % gf == 0 and block_q % (tq // gf) == 0  # type: ignore

    def default_tq(rows: int, gf: int) -> int:
        # D <= 128 with enough rows: T_q=128 as 4 warps x 32 rows (two MMA fragments per warp),
        # which beat 64-row CTAs as long as the grid still holds two CTAs per SM. Otherwise at
        # most 64 rows (4 warps x 16): T_q=128 as 8 warps x 16 rows was slower at every head dim,
        # and D=256 has no registers for a second fragment (docs/fa2.md, "Two fragments per
        # warp").
        if head_dim <= 128 and rows >= 128 and \
                -(-rows // 128) * (heads // gf) * batch >= 2 * num_sms:
            return 128
        return next((t for t in TQ_CHOICES if t >= rows), 64) if rows < 64 else 64

    forced_tq = opts.get("BLOCK_M")
    if forced_tq is not None and forced_tq not in TQ_CHOICES:
        raise ValueError(f"kernel_options['BLOCK_M']={forced_tq}: the FA2 kernel takes "
                         f"{TQ_CHOICES}")
    plan_tq = plan_gf = None
    for gf in ((group, 1) if group > 1 else (1,)):
        rows = q_len * gf
        tq = forced_tq or default_tq(rows, gf)
        cands = [tq] + [t for t in reversed(TQ_CHOICES) if t < tq and forced_tq is None]
        ok = [t for t in cands if fusion_ok(t, gf)]
        if ok:
            plan_tq, plan_gf = ok[0], gf
            break
    if plan_tq is None:
        raise ValueError(f"kernel_options['BLOCK_M']={forced_tq} does not divide the block "
                         f"mask's query block size {block_q}; pick a BLOCK_M that does")
    tkv = opts.get("BLOCK_N") or _DEFAULT_TKV[(head_dim, plan_tq)]
    if tkv not in TKV_CHOICES:
        raise ValueError(f"kernel_options['BLOCK_N']={tkv}: the FA2 kernel takes {TKV_CHOICES}")
    if masked and block_kv % tkv:  # type: ignore[operator]
        if opts.get("BLOCK_N"):
            raise ValueError(f"kernel_options['BLOCK_N']={tkv} does not divide the block mask's "
                             f"kv block size {block_kv}")
        tkv = max(t for t in TKV_CHOICES if t <= tkv and block_kv % t == 0)  # type: ignore
    stages = opts.get("num_stages") or 2
    if not 1 <= stages <= 4:
        raise ValueError(f"kernel_options['num_stages']={stages}: use 1 to 4")
    warps = opts.get("num_warps")
    if warps is None:
        m_frags = 2 if (plan_tq == 128 and head_dim <= 128) else 1
    elif warps in (plan_tq // 16, plan_tq // 32):
        m_frags = plan_tq // (16 * warps)
    else:
        raise ValueError(f"kernel_options['num_warps']={warps} with BLOCK_M={plan_tq}: each warp "
                         f"owns 16 or 32 query rows, so use num_warps={plan_tq // 16}"
                         + (f" or {plan_tq // 32}" if plan_tq >= 32 else ""))
    fa2_config(head_dim, plan_tq, tkv, stages, m_frags)  # validates
    forced = bool(opts.get("BLOCK_M") or opts.get("BLOCK_N") or warps)
    return TilePlan(plan_tq, tkv, stages, plan_gf, m_frags, forced,
                    bool(opts.get("FAST_MATH", True)))
