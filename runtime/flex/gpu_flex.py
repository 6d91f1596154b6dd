"""FlexAttention on CUDA tensors with attncc's kernels: FA3 (kernels/fa3/fa3_prefill.cuh) on sm_90
where it applies, FA2 (kernels/fa2/fa2_prefill.cuh) otherwise.

`gpu_flex_attention(q, k, v, ir, bindings, block_mask=..., scale=..., enable_gqa=...,
return_lse=..., kernel_options=...)` is what `attncc.flex_attention` runs for CUDA tensors: it
validates every argument before any launch (errors name the argument), merges the block mask's
mask_mod into the variant, picks tile sizes (`tile_choice`), compiles (NVRTC, cached on disk and
in memory) and launches on torch's current stream. Launches are CUDA-graph capturable once the
kernel is loaded (call once before capturing).

Example (planning only; launching needs a GPU):
    >>> from attncc.runtime.jit.tiles import fa2_config
    >>> fa2_config(128, 128, 64, 2).threads
    256
"""
from __future__ import annotations

import math
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from attncc.codegen import constants
from attncc.codegen.tiles import FA3_PADDED_MIN_DIM, KernelTiles, fa3_tiles
from attncc.errors import InvalidArgument
from attncc.ir.nodes import Node, load, param, rebuild, rewrite, walk
from attncc.ir.program import TRANSFORM_HOOKS, Bindings, ScalarParam, TensorParam, VariantIR
from ..jit.device import num_sms
from ..jit.launch_args import ELEM_NAMES, captured, clamped
from ..jit.kernels import KernelSpec, LoadedKernel, compile_spec, get_kernel
from ..jit.launcher import current_raw_stream, zero_ints
from ..jit.tiles import padded_head_dim
from ..jit.tma import MapCache, MapSlot
from ..reference import check_sinks, is_noop_mask, trace_mask, validate_attention_inputs
from .fa3_split import TailSplit, tail_split
from .tile_choice import TilePlan, choose_tiles

__all__ = ["LaunchPlan", "plan_launch", "precompile", "gpu_flex_attention", "compiled_kernel_info",
           "fa3_compiled_form", "fa3_pairs", "check_forced_fa3", "kernel_spec"]

_TORCH_NOOP_BLOCK = 1 << 30


# --------------------------------------------------------------------------------- kernels
def kernel_spec(ir: VariantIR, head_dim: int, dtype: str, plan: TilePlan,
                device: int | None = None) -> KernelSpec:
    """The kernel cache's spec (runtime/jit/kernels.py) of a checked plan: FA3 at the plan's
    tiles and pair form, or FA2 at its tiles (forced ones compiled as given).

    Example:
        >>> from attncc.runtime.flex.tile_choice import TilePlan
        >>> kernel_spec(VariantIR(), 128, "bfloat16", TilePlan(128, 64, 2, 1, 2)).tiles
        KernelTiles(tq=128, tkv=64, stages=2, m_frags=2, kv_warps=1, half_rows=False)
    """
    if plan.kernel == "fa3":
        return KernelSpec("fa3_prefill", ir, head_dim, dtype, fa3_tiles(plan.stages, plan.tkv),
                          paired=plan.paired, fast_math=plan.fast_math, device=device,
                          head_dims=plan.head_dims)
    return KernelSpec("fa2_prefill", ir, head_dim, dtype,
                      KernelTiles(plan.tq, plan.tkv, plan.stages, plan.m_frags),
                      fast_math=plan.fast_math, forced=plan_forced(plan), device=device,
                      head_dims=plan.head_dims)


def _kernel_for(ir: VariantIR, head_dim: int, dtype: str, plan: TilePlan,
                device: int) -> LoadedKernel:
    return get_kernel(kernel_spec(ir, head_dim, dtype, plan, device))


def fa3_compiled_form(ir: VariantIR, head_dim: int, dtype: str, plan: TilePlan,
                      arch: str) -> tuple[Any, Any, TilePlan]:
    """The FA3 translation unit attncc runs for a checked plan (`ir` simplified), compiled
    (jit/kernels.py compile_spec: its low-pressure form if the first spills; a CTA-pair plan
    whose pair forms still spill comes back unpaired, and the launch follows the returned
    plan): (generated kernel, NVRTC result, plan). Needs NVRTC, not a GPU.

    Example:
        >>> from attncc.runtime.flex.tile_choice import TilePlan
        >>> fa3_compiled_form(ir, 128, "bfloat16", plan, "sm_90a")  # doctest: +SKIP
    """
    form = compile_spec(kernel_spec(ir, head_dim, dtype, plan), arch)
    return form.gen, form.result, replace(plan, paired=form.spec.paired)


_FA3_MAPS = MapCache(64)  # the dense FA3 kernel's q/k/v maps (runtime/jit/tma.py)
# head dims at which the dense FA3 kernel is persistent (kernels/fa3/fa3_prefill.cuh
# kPersistentHeadDim): its grid is then at most one CTA per SM, else one CTA per 128-row item
FA3_PERSISTENT_HEAD_DIMS = constants.FA3_PERSISTENT_HEAD_DIMS
# head dims at which it also has the split tail and CTA pairs (kSplitHeadDim; not D = 256)
FA3_SPLIT_HEAD_DIMS = constants.FA3_SPLIT_HEAD_DIMS
# Without kernel_options PAIRED, launches with at most this many keys pair: pairs win up to
# 8192 keys and lose at 16384, where the split tail beats them (docs/fa3.md#cta-pairs).
FA3_PAIRED_MAX_KEYS = 8192


def fa3_pairs(tiles: TilePlan, masked: bool, q_len: int, kv_len: int, head_dim: int,
              kernel_options: Mapping[str, Any] | None) -> bool:
    """Whether a dense FA3 launch runs on CTA pairs (kernels/fa3/fa3_prefill.cuh produce_pairs):
    clusters of two CTAs that run two query blocks of one head over the same K/V tiles, each
    tile read from L2 once and multicast into both CTAs' shared memory. Needs what makes the
    two blocks' tile lists equal and the pairs whole: no block mask (`masked` False), an even
    number of 128-row query blocks, head dim 64 or 128. kernel_options PAIRED True / False
    forces it on / off (default: on up to FA3_PAIRED_MAX_KEYS keys); PERSISTENT False turns it
    off. Pairs take the place of the split tail.

    Example:
        >>> from attncc.runtime.flex.tile_choice import TilePlan
        >>> fa3 = TilePlan(128, 128, 3, 1, kernel="fa3")
        >>> fa3_pairs(fa3, False, 2048, 2048, 128, None)
        True
        >>> fa3_pairs(fa3, False, 2048 + 128, 2048, 128, None)  # 17 query blocks
        False
        >>> fa3_pairs(fa3, False, 2048, 16384, 128, None), fa3_pairs(fa3, False, 2048, 16384,
        ...                                                          128, {"PAIRED": True})
        (False, True)
    """
    opts = kernel_options or {}
    return (tiles.kernel == "fa3" and not masked and head_dim in FA3_SPLIT_HEAD_DIMS
            and bool(opts.get("PAIRED", kv_len <= FA3_PAIRED_MAX_KEYS))
            and opts.get("PERSISTENT", True) and -(-q_len // tiles.tq) % 2 == 0)


def _fa3_tensor_maps(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     out: torch.Tensor, stream: int | None = None) -> MapSlot:
    """The q, k, v TMA maps over [rows, head_dim] views and out's over [B, H, S, Dv] (512 bytes
    on the device; the dense FA3 kernel's epilogue stores [64 rows][64] boxes through the last;
    `out`'s strides are multiples of 16 bytes, as gpu_flex_attention requires). Each map has
    its tensor's real width: a padded form's boxes past it load zeros and store nothing."""
    from ..jit.tma import encode_map

    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_contiguous():
            raise ValueError(f"kernel_options['KERNEL']='fa3' reads {name} with TMA and needs it "
                             f"contiguous: pass {name}.contiguous()")
    return _FA3_MAPS.get(
        (*((t.data_ptr(), tuple(t.shape), t.dtype, t.device) for t in (query, key, value)),
         (out.data_ptr(), tuple(out.shape), out.stride())), query.device,
        lambda: b"".join([*(encode_map(t.view(-1, t.shape[-1]), (64, 64))
                            for t in (query, key, value)),
                          encode_map(out, (1, 1, 64, 64))]), stream)


def plan_forced(plan: TilePlan) -> bool:
    """True when the tiles came from kernel_options (then they are used as given)."""
    return getattr(plan, "forced", False)


# --------------------------------------------------------------------------------- validation
def _validate(query: Any, key: Any, value: Any, enable_gqa: bool) -> None:
    """GPU device/dtype per argument, the shared `validate_attention_inputs`, then GPU limits."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            continue  # validate_attention_inputs names it
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; the GPU kernel needs CUDA tensors")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name} has dtype {t.dtype}; the GPU kernel runs bfloat16 or "
                             f"float16 (convert with .to(torch.bfloat16))")
    validate_attention_inputs(query, key, value, None, enable_gqa)
    padded_head_dim(query.shape[3], value.shape[3])  # ValueError naming the bad head dim
    for name, t in (("query", query), ("key", key), ("value", value)):
        # cp.async moves 16-byte chunks: the head dim must be contiguous and every row start
        # 16-byte aligned
        if t.stride(3) != 1 or any(t.stride(i) % 8 for i in range(3) if t.shape[i] > 1) \
                or t.data_ptr() % 16:
            raise ValueError(f"{name} has strides {tuple(t.stride())} (data_ptr % 16 = "
                             f"{t.data_ptr() % 16}); the GPU kernel needs a contiguous head "
                             f"dim and 16-byte aligned rows: pass {name}.contiguous()")
        if max(t.shape[2], 1) * max(t.shape[1], 1) >= 2**31:
            raise ValueError(f"{name} has {t.shape[1]} heads x {t.shape[2]} positions; the GPU "
                             f"kernel indexes rows with 32-bit ints")


# --------------------------------------------------------------------------------- block masks
_TRACED_MASKS: "weakref.WeakKeyDictionary[Any, tuple[VariantIR, Bindings]]" = \
    weakref.WeakKeyDictionary()


def _mask_program(block_mask: Any) -> tuple[Node, tuple[ScalarParam, ...],
                                              tuple[TensorParam, ...], Bindings] | None:
    """The block mask's mask_mod as (expr, scalar decls, tensor decls, values), or None (noop)."""
    fn = getattr(block_mask, "mask_mod", None)
    expr = getattr(block_mask, "mask_ir", None)
    bind = getattr(block_mask, "bindings", None)
    if expr is not None and bind is not None:
        scal = {n.attr: ScalarParam(n.attr, n.dtype) for n in walk(expr) if n.op == "param"}
        tens = {}
        for n in walk(expr):
            if n.op == "load":
                t = bind.tensors[n.attr]
                idx = [a for a in n.args]
                tens[n.attr] = TensorParam(n.attr, ELEM_NAMES[t.dtype], len(idx), n.dtype)
        return expr, tuple(scal.values()), tuple(tens.values()), bind
    if is_noop_mask(fn):
        return None
    try:
        cached = _TRACED_MASKS.get(fn)
    except TypeError:
        cached = None
    if cached is None:
        cached = trace_mask(fn)
        try:
            _TRACED_MASKS[fn] = cached
        except TypeError:
            pass
    mir, mbind = cached
    return mir.expr("mask_mod"), mir.scalars, mir.tensors, mbind


def _merge_mask(ir: VariantIR, bindings: Bindings, block_mask: Any
                ) -> tuple[VariantIR, Bindings]:
    """`ir` whose mask_mod is ANDed with the block mask's (captured names renamed apart)."""
    prog = _mask_program(block_mask)
    if prog is None:
        return ir, bindings
    expr, scal, tens, mbind = prog
    taken = {s.name for s in ir.scalars} | {t.name for t in ir.tensors}
    rename: dict[str, str] = {}
    for nm in [s.name for s in scal] + [t.name for t in tens]:
        new = f"bm_{nm}"
        while new in taken:
            new += "_"
        taken.add(new)
        rename[nm] = new

    def fn(n: Node, args: tuple[Node, ...]) -> Node:
        if n.op == "param":
            return param(rename[n.attr], n.dtype)
        if n.op == "load":
            return load(rename[n.attr], args, n.dtype)
        return rebuild(n, args)

    bm_expr = rewrite(expr, fn) if rename else expr
    own = ir.hook("mask_mod")
    merged = bm_expr if own.is_identity else (own.expr & bm_expr)
    new_ir = ir.with_exprs({"mask_mod": merged})
    new_ir = VariantIR(hooks=new_ir.hooks, normalize=ir.normalize, name=ir.name,
                       scalars=ir.scalars + tuple(ScalarParam(rename[s.name], s.dtype)
                                                  for s in scal),
                       tensors=ir.tensors + tuple(TensorParam(rename[t.name], t.elem, t.ndim,
                                                              t.dtype) for t in tens))
    new_bind = Bindings(
        {**bindings.scalars, **{rename[s.name]: mbind.scalars[s.name] for s in scal}},
        {**bindings.tensors, **{rename[t.name]: mbind.tensors[t.name] for t in tens}})
    return new_ir, new_bind


def _fold_full(num: torch.Tensor, idx: torch.Tensor, fnum: torch.Tensor, fidx: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One partial list holding the partial blocks, then the full ones (mask applied to all)."""
    n = idx.shape[-1]
    slot = torch.arange(2 * n, device=idx.device, dtype=torch.int64)
    np_ = num.to(torch.int64)[..., None]
    first = torch.gather(idx.expand(*num.shape, n), -1, slot.clamp(max=n - 1).expand(
        *num.shape, 2 * n))
    second = torch.gather(fidx.expand(*num.shape, n), -1, (slot - np_).clamp(0, n - 1))
    merged = torch.where(slot < np_, first, second)
    return (num + fnum).to(torch.int32).contiguous(), merged.to(torch.int32).contiguous()


@dataclass
class _MaskArgs:
    num: torch.Tensor
    idx: torch.Tensor
    fnum: torch.Tensor | None
    fidx: torch.Tensor | None
    block_q: int
    block_kv: int
    head_uniform: bool
    derived: bool = False  # lists were rebuilt from the mask's (folded / made contiguous)


def _block_size(bm: Any) -> tuple[int, int]:
    bs = bm.BLOCK_SIZE
    if isinstance(bs, int):
        return bs, bs
    return int(bs[0]), int(bs[1])


def _mask_args(block_mask: Any, variant_has_mask: bool, B: int, Hq: int, Sq: int, Skv: int,
               device: torch.device) -> _MaskArgs | None:
    for attr in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE"):
        if not hasattr(block_mask, attr):
            raise TypeError(f"block_mask must be a BlockMask (attncc.create_block_mask or torch's "
                            f"create_block_mask); {type(block_mask).__name__} has no .{attr}")
    bq, bkv = _block_size(block_mask)
    if bq >= _TORCH_NOOP_BLOCK and bkv >= _TORCH_NOOP_BLOCK:
        return None
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    fnum = getattr(block_mask, "full_kv_num_blocks", None)
    fidx = getattr(block_mask, "full_kv_indices", None)
    for name, t in (("kv_num_blocks", num), ("kv_indices", idx), ("full_kv_num_blocks", fnum),
                    ("full_kv_indices", fidx)):
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"block_mask.{name} is on {t.device} but query is on {device}; "
                             f"create the mask with device=query.device or use "
                             f"block_mask.to(query.device)")
        if t.dtype != torch.int32:
            raise ValueError(f"block_mask.{name} has dtype {t.dtype}; block masks hold int32")
    if num.dim() != 3 or idx.dim() != 4:
        raise ValueError(f"block_mask.kv_num_blocks must be [B, H, q_blocks] and kv_indices "
                         f"[B, H, q_blocks, kv_blocks], got {tuple(num.shape)} and "
                         f"{tuple(idx.shape)}")
    Bm, Hm, nqb = num.shape
    if Bm not in (1, B) or Hm not in (1, Hq):
        raise ValueError(f"block_mask has shape {tuple(num.shape[:2])} for (B, H) but query has "
                         f"({B}, {Hq}); create it with B={B} (or None) and H={Hq} (or None)")
    if nqb * bq < Sq:
        raise ValueError(f"block_mask covers {nqb * bq} query rows but query has seq_len {Sq}; "
                         f"create it with Q_LEN={Sq}")
    if (fnum is None) != (fidx is None):
        raise ValueError("block_mask has only one of full_kv_num_blocks / full_kv_indices")
    if fnum is not None and variant_has_mask:
        # the variant's own mask_mod applies everywhere, so no block may skip it
        num, idx = _fold_full(num, idx, fnum, fidx)
        fnum = fidx = None
    if num.stride(-1) != 1:
        num = num.contiguous()
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    if fnum is not None:
        fnum = fnum if fnum.stride(-1) == 1 else fnum.contiguous()
        fidx = fidx if fidx.stride(-1) == 1 else fidx.contiguous()
        if _bstrides(fnum) != _bstrides(num) or _bstrides(fidx) != _bstrides(idx):
            num, idx, fnum, fidx = (t.contiguous() for t in (num, idx, fnum, fidx))
            if _bstrides(fnum) != _bstrides(num) or _bstrides(fidx) != _bstrides(idx):
                raise ValueError("block_mask.full_kv_* and kv_* have different shapes")
    head_uniform = Hm == 1 or (num.stride(1) == 0 and idx.stride(1) == 0 and
                               (fnum is None or (fnum.stride(1) == 0 and fidx.stride(1) == 0)))
    derived = not (num is block_mask.kv_num_blocks and idx is block_mask.kv_indices)
    return _MaskArgs(num, idx, fnum, fidx, bq, bkv, head_uniform, derived)


def _bstrides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides with 0 for size-1 dims (a broadcast dimension's stride is irrelevant)."""
    return tuple(0 if s == 1 else st for s, st in zip(t.shape, t.stride()))


# --------------------------------------------------------------------------------- entry
@dataclass
class LaunchPlan:
    """Everything decided before a launch: merged variant, captured values, tiles, mask lists."""

    ir: VariantIR
    bindings: Bindings
    tiles: TilePlan
    mask: _MaskArgs | None
    dtype: str
    head_dim: int
    device: int
    # captures of the block mask's mask_mod under their renamed names (see _merge_mask)
    mask_scalars: Mapping[str, Any] = field(default_factory=dict)
    mask_tensors: Mapping[str, Any] = field(default_factory=dict)
    # the variant's query/key/value transforms hoisted out of `ir` into the pre-pass
    # (runtime/flex/prepass.py), or None when the attention kernel applies them itself
    prepass: VariantIR | None = None


def _hoist(ir: VariantIR, tiles: TilePlan, *, q_len: int, num_q_heads: int, num_kv_heads: int,
           kernel_options: Mapping[str, Any] | None) -> tuple[VariantIR | None, VariantIR]:
    """`(prepass, attention variant)` for this launch (runtime/prepass.choose_prepass)."""
    from attncc.ir.hoist import split_transforms, transforms_in

    from .prepass import choose_prepass

    if not transforms_in(ir):
        return None, ir
    hooks = choose_prepass(ir, option=(kernel_options or {}).get("PREPASS"), q_len=q_len,
                           num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           rows_per_cta=tiles.tq, head_fusion=tiles.gf)
    if not hooks:
        return None, ir
    from attncc.ir.simplified import simplify_variant

    return split_transforms(simplify_variant(ir), hooks)


def _fa3_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, device: int) -> bool:
    """What the FA3 kernel needs beyond the shape (tile_choice checks that): an sm_90 GPU and
    q/k/v contiguous (TMA reads them as [rows, head_dim]). Every variant hook runs on it."""
    return (torch.cuda.get_device_capability(device) == (9, 0)
            and all(t.is_contiguous() for t in (query, key, value)))


def check_forced_fa3(capability: tuple[int, int]) -> None:
    """kernel_options KERNEL='fa3' on a GPU other than sm_90: an error naming what runs there,
    before NVRTC would fail in ptxas.

    Example:
        >>> check_forced_fa3((9, 0))
        >>> check_forced_fa3((8, 0))
        Traceback (most recent call last):
        ...
        attncc.errors.InvalidArgument: kernel_options['KERNEL']='fa3' needs an sm_90 GPU (H100/H200) but this one is sm_80: the FA3 kernel is built on wgmma and TMA, which exist only there; use kernel_options={'KERNEL': 'fa2'} (or leave KERNEL out: attncc picks the kernel)
    """
    if tuple(capability) != (9, 0):
        sm = f"sm_{capability[0]}{capability[1]}"
        raise InvalidArgument(f"kernel_options['KERNEL']='fa3' needs an sm_90 GPU (H100/H200) "
                              f"but this one is {sm}: the FA3 kernel is built on wgmma and TMA, "
                              f"which exist only there; use kernel_options={{'KERNEL': 'fa2'}} "
                              f"(or leave KERNEL out: attncc picks the kernel)")


def plan_launch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ir: VariantIR,
                bindings: Bindings | None = None, *, block_mask: Any = None,
                enable_gqa: bool = False, kernel_options: Mapping[str, Any] | None = None
                ) -> LaunchPlan:
    """Validate the arguments and decide the launch (no compile, no launch).

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     plan = plan_launch(q, k, v, ir, bindings)
    """
    bindings = bindings if bindings is not None else Bindings()
    _validate(query, key, value, enable_gqa)
    B, Hq, Sq, D = query.shape
    Dv = value.shape[3]
    Hkv, Skv = key.shape[1], key.shape[2]
    device = query.device
    dev_index = device.index if device.index is not None else torch.cuda.current_device()
    ir, bindings, margs, mscal, mtens = mask_plan(ir, bindings, block_mask, B, Hq, Sq, Skv,
                                                  device)
    dtype = "bfloat16" if query.dtype == torch.bfloat16 else "float16"
    pl = plan_shapes(ir, bindings, batch=B, num_q_heads=Hq, num_kv_heads=Hkv, q_len=Sq,
                     kv_len=Skv, head_dim=D, head_dim_vo=Dv, dtype=dtype,
                     num_sms=num_sms(dev_index),
                     fa3_ok=_fa3_ok(query, key, value, dev_index), mask=margs,
                     kernel_options=kernel_options, device=dev_index, mask_scalars=mscal,
                     mask_tensors=mtens)
    if pl.tiles.kernel == "fa3":
        check_forced_fa3(torch.cuda.get_device_capability(dev_index))
    return pl


def mask_plan(ir: VariantIR, bindings: Bindings, block_mask: Any, B: int, Hq: int, Sq: int,
              Skv: int, device: torch.device
              ) -> tuple[VariantIR, Bindings, _MaskArgs | None, dict[str, Any], dict[str, Any]]:
    """A block mask's part of a plan: (variant with the mask's mask_mod merged in, bindings,
    checked block lists or None, the mask_mod's captured scalars and tensors)."""
    if block_mask is None:
        return ir, bindings, None, {}, {}
    margs = _mask_args(block_mask, not ir.hook("mask_mod").is_identity, B, Hq, Sq, Skv, device)
    if margs is None:
        return ir, bindings, None, {}, {}
    ir, merged = _merge_mask(ir, bindings, block_mask)
    mscal = {k: v for k, v in merged.scalars.items() if k not in bindings.scalars}
    mtens = {k: v for k, v in merged.tensors.items() if k not in bindings.tensors}
    return ir, merged, margs, mscal, mtens


def _padded_plan(ir: VariantIR, head_dim: int, head_dim_vo: int | None,
                 kernel_options: Mapping[str, Any] | None) -> tuple[int, bool, bool]:
    """(kernel head dim, padded, FA3 may run it) of a call (attncc.codegen.tiles.padded_head_dim),
    with the padded form's limits checked: no q/k/v/output transform (they see whole rows,
    padding columns included), and FA3's padded form only for real head dims of
    FA3_PADDED_MIN_DIM or more (its TMA boxes are that wide)."""
    D, padded = padded_head_dim(head_dim, head_dim_vo)
    if not padded:
        return D, False, True
    dv = head_dim if head_dim_vo is None else head_dim_vo
    dims = f"head dims {head_dim}/{dv} (q/k, v)"
    fa3 = min(head_dim, dv) >= FA3_PADDED_MIN_DIM
    if (kernel_options or {}).get("KERNEL") == "fa3" and not fa3:
        raise ValueError(f"kernel_options['KERNEL']='fa3' runs padded head dims of "
                         f"{FA3_PADDED_MIN_DIM} or more; {dims} run on FA2: drop KERNEL or use "
                         f"'fa2'")
    from attncc.ir.hoist import transforms_in

    rows = transforms_in(ir, TRANSFORM_HOOKS)
    if rows:
        raise ValueError(f"variant {ir.name!r} has {', '.join(rows)}: with {dims} the GPU "
                         f"kernels run a padded head dim, which these hooks would see; use head "
                         f"dim 64, 128 or 256 for q, k and v, or run the hooks on the tensors "
                         f"before the call")
    return D, True, fa3


def plan_shapes(ir: VariantIR, bindings: Bindings, *, batch: int, num_q_heads: int,
                num_kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype: str,
                num_sms: int, fa3_ok: bool, mask: _MaskArgs | None = None,
                kernel_options: Mapping[str, Any] | None = None, device: int = -1,
                mask_scalars: Mapping[str, Any] | None = None,
                mask_tensors: Mapping[str, Any] | None = None,
                head_dim_vo: int | None = None) -> LaunchPlan:
    """The launch decided from shapes and device facts alone (`plan_launch` past its tensor
    checks; `attncc warm` without a GPU): tiles, CTA pairs, the pre-pass split. `head_dim` is
    the query/key head dim, `head_dim_vo` the value's (None: the same); head dims other than
    64/128/256 (or two different ones) run a padded form (`_padded_plan`: FA3's where it may,
    else FA2's), whose width is the plan's `head_dim`.

    Example:
        >>> from attncc.ir.program import VariantIR
        >>> pl = plan_shapes(VariantIR(name="p"), Bindings(), batch=1, num_q_heads=16,
        ...                  num_kv_heads=16, q_len=4096, kv_len=4096, head_dim=128,
        ...                  dtype="bfloat16", num_sms=132, fa3_ok=True)
        >>> pl.tiles.kernel, pl.tiles.paired
        ('fa3', True)
    """
    B, Hq, Hkv, Sq, Skv = batch, num_q_heads, num_kv_heads, q_len, kv_len
    D, padded, fa3_padded = _padded_plan(ir, head_dim, head_dim_vo, kernel_options)
    dims = (head_dim, head_dim if head_dim_vo is None else head_dim_vo)
    tiles = choose_tiles(D, q_len=Sq, kv_len=Skv, group=Hq // Hkv, heads=Hq, batch=B,
                         num_sms=num_sms, block_q=mask.block_q if mask else None,
                         block_kv=mask.block_kv if mask else None,
                         mask_head_uniform=mask.head_uniform if mask else True,
                         kernel_options=kernel_options, fa3_ok=fa3_ok and fa3_padded)
    if padded:
        tiles = replace(tiles, head_dims=dims)
    if fa3_pairs(tiles, mask is not None, Sq, Skv, D, kernel_options):
        tiles = replace(tiles, paired=True)
    if Hq // tiles.gf > 65535 or B > 65535:
        raise ValueError(f"batch {B} x heads {Hq}: the GPU kernel's grid allows at most 65535 "
                         f"head slots and 65535 batches")
    pre, ir = _hoist(ir, tiles, q_len=Sq, num_q_heads=Hq, num_kv_heads=Hkv,
                     kernel_options=kernel_options)
    return LaunchPlan(ir, bindings, tiles, mask, dtype, D, device, mask_scalars or {},
                      mask_tensors or {}, pre)


def plan_specs(pl: LaunchPlan) -> list[KernelSpec]:
    """The kernel specs a plan runs: the attention kernel's (simplified IR) and the pre-pass's."""
    from attncc.ir.simplified import simplify_variant

    specs = [kernel_spec(simplify_variant(pl.ir), pl.head_dim, pl.dtype, pl.tiles)]
    if pl.prepass is not None:
        specs.append(KernelSpec("prepass", pl.prepass, pl.head_dim, pl.dtype,
                                fast_math=pl.tiles.fast_math))
    return specs


def _compile_job(job: tuple[KernelSpec, str]) -> str:
    spec, arch = job
    return compile_spec(spec, arch).gen.kernel_name  # with its fallback forms


def precompile(plans: "list[LaunchPlan]", max_workers: int | None = None) -> int:
    """Compile the kernels `plans` need in parallel processes, into the on-disk cache.

    NVRTC holds the GIL, so threads do not help; a process pool does. Later calls then load the
    cubins from the cache (a form that spilled past its budget is not cached: jit/kernels.py).
    Returns how many distinct kernels were compiled or found.

    Example:
        >>> precompile([])
        0
    """
    if not plans:
        return 0
    from ..jit.nvrtc import device_arch

    jobs = []
    for pl in plans:
        with torch.cuda.device(pl.device):
            arch = device_arch()
        jobs += [(spec, arch) for spec in plan_specs(pl)]
    return len(compile_jobs(jobs, max_workers))


def compile_jobs(jobs: "list[tuple[KernelSpec, str]]", max_workers: int | None = None
                 ) -> "list[tuple[KernelSpec, str]]":
    """Compile the distinct (spec, arch) jobs (and their fallback forms) into the on-disk cache,
    in parallel processes when there are several; returns them, in first-seen order."""
    import multiprocessing
    import os
    import sys
    from concurrent.futures import ProcessPoolExecutor

    jobs = list(dict.fromkeys(jobs))
    workers = max_workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            _compile_job(job)
    else:
        # spawn re-imports __main__ from its file; a script read from stdin has none, so fork
        # then (the children only run NVRTC, never CUDA, so forking after CUDA init is safe)
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        method = "spawn" if main_file and os.path.isfile(main_file) else "fork"
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as ex:
            list(ex.map(_compile_job, jobs))
    return jobs


@dataclass
class _CallEntry:
    plan: LaunchPlan
    kernel: LoadedKernel | None  # compiled on first use (_safe_reads): a call may need clamps
    block_mask: Any  # held so its id cannot be reused while cached; compared by identity
    prepass: Any = None  # the pre-pass's KernelLauncher when plan.prepass is set
    read_names: tuple[str, ...] | None = None  # captured tensors its IRs read (_safe_reads)


def _prepass_for(pl: LaunchPlan) -> Any:
    from .prepass import prepass_kernel

    if pl.prepass is None:
        return None
    return prepass_kernel(pl.prepass, head_dim=pl.head_dim, dtype=pl.dtype,
                          fast_math=pl.tiles.fast_math, device=pl.device)


_CALLS: "OrderedDict[tuple, _CallEntry]" = OrderedDict()
_CALLS_LOCK = threading.Lock()  # guards _CALLS and _READS
_CALL_CACHE_SIZE = 256


# ------------------------------------------------------------------------- captured reads
@dataclass
class _Reads:
    """A call's variant with its captured reads made safe (attncc.ir.analysis): the IRs to run,
    with the reads that can leave their tensor clamped, the clamps' size parameters, and the
    kernels compiled for them."""

    plan: LaunchPlan  # held so its id cannot be reused while cached
    ir: VariantIR
    prepass: VariantIR | None
    sizes: Mapping[str, int]
    kernel: LoadedKernel
    prepass_kernel: Any


_READS: "OrderedDict[tuple, _Reads]" = OrderedDict()


def _clamped(ir: VariantIR | None, shapes: Any, tensors: Mapping[str, Any],
             scalars: Mapping[str, Any], block_mask: Any = None
             ) -> tuple[VariantIR | None, dict[str, int]]:
    """`launch_args.clamped` at the positions the kernel computes (in a block `block_mask`
    does not leave out)."""
    if ir is None or not ir.tensors:
        return ir, {}
    computed = _block_computed(block_mask, shapes.Skv) if block_mask is not None else None
    return clamped(ir, shapes, tensors, scalars, computed)


def _block_computed(block_mask: Any, kv_len: int) -> Any:
    """Whether the kernel evaluates the hooks at positions (b, h, q_idx, kv_idx): not in a block
    the block mask leaves out. Reads the mask's lists to the host, only when a witness is
    checked."""
    from ..reference import block_size, block_states

    def computed(env: Mapping[str, torch.Tensor]) -> torch.Tensor:
        st = block_states(block_mask, kv_len, torch.device("cpu"))
        bq, bkv = block_size(block_mask)
        b, h = env["b"] % st.shape[0], env["h"] % st.shape[1]
        qb = (env["q_idx"] // bq).clamp(max=st.shape[2] - 1)
        kb = (env["kv_idx"] // bkv).clamp(max=st.shape[3] - 1)
        return st[b, h, qb, kb] != 0

    return computed


def _check_reads_exactly(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         ir: VariantIR, bindings: Bindings, block_mask: Any,
                         scale: float | None, enable_gqa: bool) -> None:
    """ATTNCC_CHECK_BOUNDS=1, for a call whose kernel clamps reads the analysis could not prove:
    evaluate the variant exactly on the GPU (the fp32 reference, synchronising: a debug mode)
    and raise CapturedReadError at the first position the mask keeps where a read leaves its
    tensor -- what the CPU path raises -- before the kernel runs."""
    from ..reference import attention_reference

    attention_reference(query, key, value, ir, bindings, block_mask=block_mask, scale=scale,
                        enable_gqa=enable_gqa, float_dtype=torch.float32)


def _safe_reads(entry: _CallEntry, bindings: Bindings, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> _Reads:
    """The call's IRs and kernels with captured reads checked against its shapes (cached per
    plan, shapes, captured tensors' shapes and scalar values): a new sequence length recompiles
    only when it changes which reads need clamping."""
    pl = entry.plan
    if not pl.ir.tensors and (pl.prepass is None or not pl.prepass.tensors):
        if entry.kernel is None:  # nothing captured is read: nothing to check
            entry.kernel = _kernel_for(pl.ir, pl.head_dim, pl.dtype, pl.tiles, pl.device)
            entry.prepass = _prepass_for(pl)
        return _Reads(pl, pl.ir, pl.prepass, {}, entry.kernel, entry.prepass)
    if entry.read_names is None:
        entry.read_names = tuple(sorted({t.name for t in pl.ir.tensors} | (
            {t.name for t in pl.prepass.tensors} if pl.prepass is not None else set())))
    tensors = {n: bindings.tensors.get(n) for n in entry.read_names}
    rkey = _reads_key(pl, tensors, bindings, query, key, value)
    hit = _READS.get(rkey) if rkey is not None else None
    if hit is not None and hit.plan is pl:
        return hit
    shapes = _reads_shapes(query, key, value)
    ir, sizes = _clamped(pl.ir, shapes, tensors, bindings.scalars, entry.block_mask)
    pre, pre_sizes = _clamped(pl.prepass, shapes, tensors, bindings.scalars)
    if ir is pl.ir and entry.kernel is None:
        entry.kernel = _kernel_for(pl.ir, pl.head_dim, pl.dtype, pl.tiles, pl.device)
    kernel = entry.kernel if ir is pl.ir else _kernel_for(ir, pl.head_dim, pl.dtype, pl.tiles,
                                                          pl.device)
    if pre is pl.prepass and pre is not None and entry.prepass is None:
        entry.prepass = _prepass_for(pl)
    pre_kernel = entry.prepass
    if pre is not pl.prepass:
        from .prepass import prepass_kernel

        pre_kernel = prepass_kernel(pre, head_dim=pl.head_dim, dtype=pl.dtype,
                                    fast_math=pl.tiles.fast_math, device=pl.device)
    got = _Reads(pl, ir, pre, {**sizes, **pre_sizes}, kernel, pre_kernel)
    _remember(_READS, rkey, got)
    return got


def _reads_key(pl: Any, tensors: Mapping[str, Any], bindings: Bindings, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor) -> tuple | None:
    """The key a call's checked reads are cached under: the plan, the shapes, the captured
    tensors' shapes and the scalar values (the plan fixes the scalar names, so their values
    identify the call); None for an unhashable captured value (checked every call)."""
    rkey = (id(pl), query.shape, key.shape, value.shape[-1],
            tuple(t.shape for t in tensors.values() if isinstance(t, torch.Tensor)),
            tuple(bindings.scalars.values()))
    try:
        hash(rkey)
    except TypeError:
        return None
    return rkey


def _reads_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
    """The call's shapes as the clamp analysis takes them (attncc.ir.analysis.Shapes)."""
    from attncc.ir.analysis import Shapes

    B, Hq, Sq, D = query.shape
    return Shapes(B, Hq, key.shape[1], Sq, key.shape[2], D, value.shape[-1])


def _remember(cache: "OrderedDict[tuple, Any]", ckey: tuple | None, value: Any) -> None:
    """`value` into an LRU cache of _CALL_CACHE_SIZE entries, unless it has no key or was made
    during a CUDA graph capture (its tensors exist only when the graph replays)."""
    if ckey is None or torch.cuda.is_current_stream_capturing():
        return
    with _CALLS_LOCK:
        cache[ckey] = value
        while len(cache) > _CALL_CACHE_SIZE:
            cache.popitem(last=False)


_CLAMPED: "OrderedDict[tuple, tuple]" = OrderedDict()  # the backward's clamped IRs


def clamped_reads(entry: _CallEntry, bindings: Bindings, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor) -> tuple[VariantIR, dict[str, int]]:
    """The backward's side of `_safe_reads`: the plan's IR with its captured reads clamped for
    this call's shapes and captured values, and the sizes the clamps bind (no kernel), cached
    under the same key. The clamp analysis may read the block mask to the host; a training step
    runs it once, not every backward."""
    pl = entry.plan
    if not pl.ir.tensors:
        return pl.ir, {}
    names = sorted({t.name for t in pl.ir.tensors})
    tensors = {n: bindings.tensors.get(n) for n in names}
    ckey = _reads_key(pl, tensors, bindings, query, key, value)
    hit = _CLAMPED.get(ckey) if ckey is not None else None
    if hit is not None and hit[0] is pl:  # (the entry holds pl, so its id is not reused)
        return hit[1], hit[2]
    ir, sizes = _clamped(pl.ir, _reads_shapes(query, key, value), tensors, bindings.scalars,
                         entry.block_mask)
    _remember(_CLAMPED, ckey, (pl, ir, sizes))
    return ir, sizes


def _call_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: VariantIR, block_mask: Any,
              enable_gqa: bool, kernel_options: Mapping[str, Any] | None) -> tuple:
    """What a launch plan depends on: the variant's content (interned IR nodes), the block mask's
    identity, and the inputs' shapes, strides, dtype and device (alignment is checked per call)."""
    return (_ir_key(ir), id(block_mask), q.shape, q.stride(), k.shape, k.stride(), v.shape,
            v.stride(), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            bool(enable_gqa),
            tuple(sorted(kernel_options.items())) if kernel_options else None)


_IR_KEYS: dict[int, tuple[VariantIR, tuple]] = {}  # id -> (the IR, held; its content key)


def _ir_key(ir: VariantIR) -> tuple:
    """The variant's content as a launch plan depends on it (interned IR nodes), built once per
    IR object: a traced variant's IR is the same object call after call."""
    hit = _IR_KEYS.get(id(ir))
    if hit is not None and hit[0] is ir:
        return hit[1]
    key = (tuple((n, h.expr) for n, h in ir.hooks.items()), ir.normalize, ir.name, ir.scalars,
           ir.tensors)
    if len(_IR_KEYS) >= _CALL_CACHE_SIZE:
        _IR_KEYS.clear()
    _IR_KEYS[id(ir)] = (ir, key)
    return key


def _outputs(query: torch.Tensor, value: torch.Tensor, return_lse: bool,
             out: torch.Tensor | None, lse_out: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output buffers of a launch ([B, Hq, Sq, Dv]): the given ones, checked, or new ones."""
    B, Hq, Sq, _ = query.shape
    shape = (B, Hq, Sq, value.shape[3])
    device = query.device
    if out is None:
        out = torch.empty(shape, dtype=query.dtype, device=device)
    elif (out.shape != shape or out.dtype != query.dtype or out.device != device
          or out.stride(3) != 1 or any(out.stride(i) % 8 for i in range(3))
          or out.data_ptr() % 16):
        raise ValueError(f"out must be a {shape} {query.dtype} tensor on {device} "
                         f"with a contiguous, 16-byte aligned head dim; got {tuple(out.shape)} "
                         f"{out.dtype} strides {tuple(out.stride())}")
    lse = None
    if return_lse:
        lse = lse_out if lse_out is not None else torch.empty(B, Hq, Sq, dtype=torch.float32,
                                                              device=device)
        if (lse.shape != (B, Hq, Sq) or lse.dtype != torch.float32 or lse.device != device
                or (Sq > 1 and lse.stride(2) != 1)):
            raise ValueError(f"lse_out must be a ({B}, {Hq}, {Sq}) float32 tensor on {device} "
                             f"with a contiguous last dim")
    return out, lse


def _no_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ir: VariantIR,
             bindings: Bindings, block_mask: Any, scale: float | None, enable_gqa: bool,
             return_lse: bool, out: torch.Tensor | None, lse_out: torch.Tensor | None,
             sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero keys: every row is fully masked, so out is output_mod(0) and lse -inf -- what the
    reference computes cheaply with no keys. Nothing is compiled or launched (a TMA map of an
    empty K would be rejected by the driver)."""
    from ..reference import attention_reference

    _validate(query, key, value, enable_gqa)
    out, lse = _outputs(query, value, return_lse, out, lse_out)
    o, l = attention_reference(query, key, value, ir, bindings, block_mask=block_mask,
                               scale=scale, enable_gqa=enable_gqa, float_dtype=torch.float32,
                               sinks=sinks)
    out.copy_(o)
    if lse is not None and l is not None:
        lse.copy_(l)
    return out, lse


def gpu_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       ir: VariantIR, bindings: Bindings | None = None, *, block_mask: Any = None,
                       scale: float | None = None, enable_gqa: bool = False,
                       return_lse: bool = False,
                       kernel_options: Mapping[str, Any] | None = None,
                       out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                       sinks: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a traced variant on CUDA tensors with the FA3 or FA2 kernel: `(out, lse or None)`.

    query [B, Hq, Sq, D], key [B, Hkv, Skv, D], value [B, Hkv, Skv, Dv] (bf16 or fp16; D and
    Dv multiples of 8 from 32 to 256; other than D = Dv in 64/128/256 they run a padded
    form) -> out [B, Hq, Sq, Dv] in query's dtype; lse [B, Hq, Sq] float32 (natural log, -inf for a fully
    masked row) when `return_lse`. The variant's mask_mod applies everywhere; the block mask's
    mask_mod only in its partial blocks (FlexAttention's semantics); absent blocks are skipped.
    `out` / `lse_out` may be given (e.g. static buffers for CUDA graphs). `sinks` [Hq]: per-head
    sink logits joined to each row's denominator in the kernels' epilogue (or their merge); the
    LSE then includes them (docs/flex-api.md, "Attention sinks"). Every argument is checked
    before anything is launched.

    Example:
        >>> import torch, attncc
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     q, k, v = (torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
        ...                for _ in range(3))
        ...     ir, b = attncc.Variant(mask_mod=lambda b, h, qi, ki: qi >= ki).trace()
        ...     out, lse = gpu_flex_attention(q, k, v, ir, b, return_lse=True)
    """
    if return_lse and not ir.use_softmax:
        raise ValueError("return_lse=True but the variant has normalize='none': there is no "
                         "softmax, so no log-sum-exp")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(float(scale))):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    sinks32 = _sinks_arg(sinks, query, ir)
    bindings = user_bindings = bindings if bindings is not None else Bindings()
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        _validate(query, key, value, enable_gqa)  # raises TypeError naming the argument
    if key.dim() == 4 and key.shape[2] == 0:
        return _no_keys(query, key, value, ir, bindings, block_mask, scale, enable_gqa,
                        return_lse, out, lse_out, sinks)
    entry = _call_entry(query, key, value, ir, bindings, block_mask, enable_gqa, kernel_options)
    pl = entry.plan
    device = query.device
    if pl.mask_scalars or pl.mask_tensors:
        bindings = Bindings({**bindings.scalars, **pl.mask_scalars},
                            {**bindings.tensors, **pl.mask_tensors})
    reads = _safe_reads(entry, bindings, query, key, value)
    if reads.sizes and os.environ.get("ATTNCC_CHECK_BOUNDS", "0") not in ("", "0"):
        _check_reads_exactly(query, key, value, ir, user_bindings, block_mask, scale,
                             enable_gqa)
    if reads.sizes:
        bindings = Bindings({**bindings.scalars, **reads.sizes}, bindings.tensors)
    values = captured(reads.ir, bindings, device)
    out, lse = _outputs(query, value, return_lse, out, lse_out)
    if out.numel() == 0:
        return out, lse
    if reads.prepass_kernel is not None:  # q/k/v transforms once per row, before attention
        from .prepass import run_prepass

        query, key, value = run_prepass(reads.prepass_kernel, reads.prepass, query, key, value,
                                        captured(reads.prepass, bindings, device))
    sm_scale = 1.0 / math.sqrt(query.shape[3]) if scale is None else float(scale)
    kern = reads.kernel
    args = _attention_args(query, key, value, out, lse, sm_scale, pl.mask)
    if sinks32 is not None:
        args["sinks"] = sinks32.data_ptr()
    stream = current_raw_stream(device.index)  # once: the maps' copy, the memset, the launch
    if pl.tiles.kernel == "fa3":
        launch = _fa3_launch(pl, kern, kernel_options, args, query, key, value, out, stream)
    else:
        launch = _fa2_launch(pl, kern, args, query)
    _launch(kern, launch, values, stream)
    del sinks32  # alive until the launch is enqueued
    return out, lse


def _sinks_arg(sinks: Any, query: Any, ir: VariantIR) -> torch.Tensor | None:
    """The kernels' sinks operand: float32, contiguous, checked (reference.check_sinks)."""
    if sinks is None:
        return None
    if not ir.use_softmax:
        raise InvalidArgument("sinks were given but the variant has normalize='none': a sink "
                              "joins a softmax denominator; drop sinks")
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        return None  # _validate names the bad query first
    check_sinks(sinks, query.shape[1], query.device, query.dtype)
    return sinks.detach().to(torch.float32).contiguous()


def _call_entry(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ir: VariantIR,
                bindings: Bindings, block_mask: Any, enable_gqa: bool,
                kernel_options: Mapping[str, Any] | None) -> _CallEntry:
    """The call's launch plan: cached per `_call_key` (alignment checked again per call), or
    planned now (and cached unless its mask lists were rebuilt for this call or a CUDA graph is
    being captured)."""
    ckey = _call_key(query, key, value, ir, block_mask, enable_gqa, kernel_options)
    entry = _CALLS.get(ckey)
    if entry is not None and entry.block_mask is block_mask:
        _CALLS.move_to_end(ckey)
        if (query.data_ptr() | key.data_ptr() | value.data_ptr()) % 16:
            _validate(query, key, value, enable_gqa)  # raises, naming the misaligned argument
        return entry
    pl = plan_launch(query, key, value, ir, bindings, block_mask=block_mask,
                     enable_gqa=enable_gqa, kernel_options=kernel_options)
    entry = _CallEntry(pl, None, block_mask)
    # (_remember keeps nothing while a CUDA graph records: its inputs are copies in the graph's
    # pool, which must hold no live tensor the graph does not output; docs/compile.md, "CUDA
    # graphs")
    if pl.mask is None or not pl.mask.derived:
        _remember(_CALLS, ckey, entry)
    return entry


@dataclass
class _Launch:
    """One attention launch: grid, AttentionParams values, cluster size, and the buffers its
    arguments point into (held until the launch is enqueued)."""

    grid: tuple[int, int, int]
    args: dict[str, Any]
    cluster: int = 1
    keep: tuple[Any, ...] = ()


def _attention_args(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, sm_scale: float,
                    m: _MaskArgs | None) -> dict[str, Any]:
    """The AttentionParams values every prefill kernel reads: tensors, strides, sizes, scale
    and the block mask's lists (kernels/params.cuh); the FA3-only members are 0 here."""
    B, Hq, Sq, _ = query.shape
    qs, ks, vs, os_ = query.stride(), key.stride(), value.stride(), out.stride()
    ls = lse.stride() if lse is not None else (0, 0)
    ap = {
        "q": query.data_ptr(), "k": key.data_ptr(), "v": value.data_ptr(), "o": out.data_ptr(),
        "lse": lse.data_ptr() if lse is not None else 0,
        "q_stride_b": qs[0], "q_stride_h": qs[1], "q_stride_s": qs[2],
        "k_stride_b": ks[0], "k_stride_h": ks[1], "k_stride_s": ks[2],
        "v_stride_b": vs[0], "v_stride_h": vs[1], "v_stride_s": vs[2],
        "o_stride_b": os_[0], "o_stride_h": os_[1], "o_stride_s": os_[2],
        "lse_stride_b": ls[0], "lse_stride_h": ls[1],
        "batch": B, "num_q_heads": Hq, "num_kv_heads": key.shape[1], "q_len": Sq,
        "kv_len": key.shape[2], "sm_scale": sm_scale,
        "kv_num_blocks": 0, "kv_indices": 0, "full_kv_num_blocks": 0, "full_kv_indices": 0,
        "bm_stride_b": 0, "bm_stride_h": 0, "bi_stride_b": 0, "bi_stride_h": 0,
        "bi_stride_q": 0, "block_q": 0, "block_kv": 0,
        "tma": 0, "item_counter": 0, "split_partials": 0, "sinks": 0,
    }
    if m is not None:
        nb, ix = _bstrides(m.num), _bstrides(m.idx)
        ap.update(kv_num_blocks=m.num.data_ptr(), kv_indices=m.idx.data_ptr(),
                  full_kv_num_blocks=m.fnum.data_ptr() if m.fnum is not None else 0,
                  full_kv_indices=m.fidx.data_ptr() if m.fidx is not None else 0,
                  bm_stride_b=nb[0], bm_stride_h=nb[1], bi_stride_b=ix[0], bi_stride_h=ix[1],
                  bi_stride_q=m.idx.stride(2), block_q=m.block_q, block_kv=m.block_kv)
    return ap


def _fa2_launch(pl: LaunchPlan, kern: LoadedKernel, args: dict[str, Any],
                query: torch.Tensor) -> _Launch:
    """kernels/fa2/fa2_prefill.cuh: one CTA per (query tile of gf fused heads, head group, batch)."""
    B, Hq, Sq, _ = query.shape
    gf = pl.tiles.gf
    return _Launch((-(-(Sq * gf) // kern.config.tq), Hq // gf, B), args)


def _fa3_launch(pl: LaunchPlan, kern: LoadedKernel, kernel_options: Mapping[str, Any] | None,
                args: dict[str, Any], query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, out: torch.Tensor, stream: int) -> _Launch:
    """kernels/fa3/fa3_prefill.cuh: one CTA per 128-row item, or persistent CTAs (at most one per
    SM; whole clusters of two on CTA pairs) reading q/k/v/out through TMA maps."""
    B, Hq, Sq, _ = query.shape
    D = pl.head_dim  # (the kernel's: a padded form's width)
    items = B * Hq * -(-Sq // kern.config.tq)
    persistent = D in FA3_PERSISTENT_HEAD_DIMS and (kernel_options or {}).get("PERSISTENT",
                                                                              True)
    grid = min(items, num_sms(pl.device)) if persistent else items
    if kern.paired:  # whole clusters of two (items is even: fa3_pairs)
        grid = grid // 2 * 2
    maps = _fa3_tensor_maps(query, key, value, out, stream)
    keep: tuple[Any, ...] = (maps,)
    args["tma"] = maps.data_ptr()
    if D in FA3_PERSISTENT_HEAD_DIMS:
        split = _fa3_tail_split(pl, kernel_options, items, grid, key.shape[2],
                                kern.config.tkv, persistent and D in FA3_SPLIT_HEAD_DIMS,
                                kern.paired)
        keep += _fa3_split_args(split, D, query.device, args, stream)
    return _Launch((grid, 1, 1), args, 2 if kern.paired else 1, keep)


def _fa3_split_args(split: TailSplit, head_dim: int, device: torch.device,
                    args: dict[str, Any], stream: int | None = None
                    ) -> tuple[torch.Tensor, ...]:
    """The persistent FA3 kernel's item counter and, with a split tail (fa3_split.py), the
    tail's arrival counters (one zeroed buffer) and its partial-state workspace (written before
    it is read: not cleared); sets their AttentionParams members, returns the buffers.

    The dynamic item order claims items past the first from the counter: zeroed once per
    launch (a memset on the stream; in a CUDA graph, a memset node), so no two launches share
    one."""
    counter = torch.empty(split.counter_ints(), dtype=torch.int32, device=device)
    zero_ints(counter, stream)
    args["item_counter"] = counter.data_ptr()
    if not split.pieces:
        return (counter,)
    partials = torch.empty(split.partial_floats(head_dim), dtype=torch.float32, device=device)
    args["split_partials"] = partials.data_ptr()
    return counter, partials


def _launch(kern: LoadedKernel, launch: _Launch, values: Mapping[str, Any],
            stream: int) -> None:
    """Pack the variant's captured values and launch on `stream` (torch's current one)."""
    from attncc.codegen.generate import variant_param_values

    kl, cfg = kern.launcher, kern.config
    vp = variant_param_values(kl.vp.layout, values["scalars"], values["tensors"])
    kl.launch(launch.grid, (cfg.threads, 1, 1), cfg.smem_bytes, kl.ap.flatten(launch.args),
              kl.vp.flatten(vp), stream=stream, cluster=launch.cluster)


def _fa3_tail_split(pl: LaunchPlan, kernel_options: Mapping[str, Any] | None, items: int,
                    grid: int, kv_len: int, tkv: int, persistent: bool,
                    paired: bool = False) -> TailSplit:
    """The split tail of a dense FA3 launch (kernels/fa3/fa3_split.cuh): persistent CTAs over
    full-length items (no block mask) of a softmax variant with no output transform, not on CTA
    pairs (`paired`), unless kernel_options SPLIT_TAIL is False. The kernel checks the same
    conditions."""
    if (persistent and not paired and pl.mask is None and pl.ir.use_softmax
            and "output_mod" not in pl.ir.hooks
            and (kernel_options or {}).get("SPLIT_TAIL", True)):
        return tail_split(items, grid, kv_len, tkv)
    return TailSplit(items, 0, 0, 0)


def compiled_kernel_info(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         ir: VariantIR, bindings: Bindings | None = None, **kw: Any) -> dict:
    """Which kernel a call would run and its resources (tiles, and the kernel cache's record:
    registers, ptxas's spill bytes, the driver's local bytes, recompiles), compiling it if
    needed. For benchmarks and notes.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     compiled_kernel_info(q, k, v, ir)["registers"]
    """
    pl = plan_launch(query, key, value, ir, bindings, **kw)
    kern = _kernel_for(pl.ir, pl.head_dim, pl.dtype, pl.tiles, pl.device)
    rec, cfg = kern.record, kern.config
    return {"kernel": rec.kernel_name, "tq": cfg.tq, "tkv": cfg.tkv, "stages": cfg.stages,
            "m_frags": cfg.m_frags, "gf": pl.tiles.gf, "paired": kern.paired,
            "threads": cfg.threads, "smem_bytes": cfg.smem_bytes, "registers": rec.registers,
            "local_bytes": rec.local_bytes, "spill_bytes": rec.spill_bytes,
            "retries": rec.retries}
