"""`attncc warm`: compile ahead of time, without a GPU, the kernels `attncc.flex_attention` will
run for given variants, shapes and GPUs, into the cache directory (e.g. while building a
deployment image), so the first call in production reads them from disk (docs/jit.md,
"Warming a cache").

The kernels are the ones a call plans (`gpu_flex.plan_shapes`): the same tile choice, CTA
pairs and pre-pass split, decided from the shapes and the GPU's SM count instead of from
tensors. A variant's mask_mod can instead be passed the way FlexAttention users pass it, as a
block mask (`create_block_mask(mask_mod, B, H, S, S)`, `split_block_mask`): that runs other
kernels than the same mask inside the variant.

Example:
    >>> parse_shape("2,16,4096")
    Shape(batch=2, num_q_heads=16, q_len=4096, num_kv_heads=16, kv_len=4096)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from attncc.errors import InvalidArgument
from attncc.frontend import Variant
from attncc.ir.program import Bindings, VariantIR

from ..jit.kernels import KernelSpec
from ..jit.nvrtc import normalize_arch
from .block_mask import create_block_mask
from .gpu_flex import compile_jobs, mask_plan, plan_shapes, plan_specs

# SMs of the GPUs each arch names, for the tile choice (override with `num_sms`)
DEFAULT_SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132, "sm_90a": 132}


@dataclass(frozen=True)
class Shape:
    """One call's sizes: q is [batch, num_q_heads, q_len, D], k/v [batch, num_kv_heads,
    kv_len, D]."""

    batch: int
    num_q_heads: int
    q_len: int
    num_kv_heads: int
    kv_len: int


def parse_shape(text: str) -> Shape:
    """`B,H,S`, `B,H,S,HKV` or `B,H,SQ,HKV,SKV` (comma-separated positive integers)."""
    try:
        nums = [int(x) for x in text.split(",")]
    except ValueError:
        nums = []
    if len(nums) not in (3, 4, 5) or min(nums) < 1:
        raise InvalidArgument(f"shape {text!r}: give B,H,S or B,H,S,HKV or B,H,SQ,HKV,SKV "
                              f"(positive integers), e.g. 1,32,8192,8")
    b, h, sq = nums[:3]
    hkv = nums[3] if len(nums) > 3 else h
    if h % hkv:
        raise InvalidArgument(f"shape {text!r}: {h} query heads do not group over {hkv} KV "
                              f"heads (H must be a multiple of HKV)")
    return Shape(b, h, sq, hkv, nums[4] if len(nums) > 4 else sq)


def warm_specs(ir: VariantIR, bindings: Bindings, shape: Shape, *, head_dim: int, dtype: str,
               arch: str, num_sms: int | None = None, mask_mod: Callable[..., Any] | None = None,
               kernel_options: Mapping[str, Any] | None = None) -> list[KernelSpec]:
    """The kernel specs `flex_attention(q, k, v, score_mod=<the variant>, block_mask=...)`
    plans at `shape` on an `arch` GPU with `num_sms` SMs (default: `DEFAULT_SMS`), contiguous
    bf16/fp16 q/k/v; `mask_mod`: the block mask's (None: no block mask)."""
    arch = normalize_arch(arch)
    sms = num_sms if num_sms is not None else DEFAULT_SMS.get(arch)
    if sms is None:
        raise InvalidArgument(f"no SM count known for {arch}: pass num_sms (--sms)")
    if dtype not in ("bfloat16", "float16"):
        raise InvalidArgument(f"dtype {dtype!r}: the compiled kernels run bfloat16 or float16")
    mask, mscal, mtens = None, {}, {}
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, shape.batch, shape.num_q_heads, shape.q_len,
                               shape.kv_len, device="cpu")
        ir, bindings, mask, mscal, mtens = mask_plan(ir, bindings, bm, shape.batch,
                                                     shape.num_q_heads, shape.q_len,
                                                     shape.kv_len, torch.device("cpu"))
    pl = plan_shapes(ir, bindings, batch=shape.batch, num_q_heads=shape.num_q_heads,
                     num_kv_heads=shape.num_kv_heads, q_len=shape.q_len, kv_len=shape.kv_len,
                     head_dim=head_dim, dtype=dtype, num_sms=sms,
                     fa3_ok=arch in ("sm_90", "sm_90a"), mask=mask,
                     kernel_options=kernel_options, mask_scalars=mscal, mask_tensors=mtens)
    return plan_specs(pl)


def split_block_mask(variant: Variant) -> tuple[VariantIR, Bindings, Callable[..., Any]]:
    """(the variant without its mask_mod, traced; the mask_mod to pass as a block mask)."""
    if variant.mask_mod is None:
        raise InvalidArgument(f"variant {variant.name!r} has no mask_mod to pass as a block mask")
    ir, bindings = replace(variant, mask_mod=None).trace()
    return ir, bindings, variant.mask_mod


def warm(targets: list[tuple[VariantIR, Bindings, Callable[..., Any] | None]],
         shapes: list[Shape], *, head_dims: list[int], dtypes: list[str], archs: list[str],
         num_sms: int | None = None, max_workers: int | None = None) -> list[str]:
    """Compile every kernel the combinations need (in parallel processes) into the cache
    directory; `targets`: (traced variant, its bindings, block mask's mask_mod or None).
    Returns one line per kernel."""
    wanted = []
    for arch, (ir, bindings, mask_mod), shape, d, dtype in itertools.product(
            (normalize_arch(a) for a in archs), targets, shapes, head_dims, dtypes):
        wanted += [(spec, arch) for spec in warm_specs(ir, bindings, shape, head_dim=d,
                                                         dtype=dtype, arch=arch, num_sms=num_sms,
                                                         mask_mod=mask_mod)]
    jobs = compile_jobs(wanted, max_workers)
    return [f"{spec.kind:12s} {spec.ir.name if spec.ir else '-'} d{spec.head_dim} {spec.dtype} "
            f"{arch}" for spec, arch in jobs]
