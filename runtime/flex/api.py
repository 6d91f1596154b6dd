"""`attncc.flex_attention`: FlexAttention's call signature, running attncc variants.

`score_mod` takes what torch's does (a `score_mod(score, b, h, q_idx, kv_idx)` function) or an
`attncc.Variant`, which brings every hook (query/key/value/output transforms, its own mask_mod,
`normalize="none"`). The variant's mask_mod and the block mask are ANDed.

On CPU tensors the exact reference runs (float64 inside, results in the input dtype; LSE float32).
On CUDA bf16/fp16 tensors the variant is compiled (NVRTC, cached) into a kernel template (FA3
on sm_90 where it applies, FA2 otherwise; `tile_choice`) and launched (`gpu_flex`). CUDA float32
tensors have no compiled kernel yet: the exact reference runs on the GPU (float64) after a
one-time warning.

A score_mod function (or Variant) is traced once: later calls reuse its IR while the captured
values it depends on would trace to the same IR (`attncc.frontend.trace.TraceGuard`), so a new
value of a captured scalar only changes the kernel's arguments.

Example:
    >>> import torch, attncc
    >>> q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    >>> def softcap(score, b, h, q_idx, kv_idx):
    ...     return 20 * torch.tanh(score / 20)
    >>> out = flex_attention(q, k, v, score_mod=softcap)
    >>> out.shape, out.dtype
    (torch.Size([1, 2, 16, 8]), torch.float32)
    >>> causal = attncc.Variant(score_mod=softcap, mask_mod=lambda b, h, qi, ki: qi >= ki)
    >>> out, lse = flex_attention(q, k, v, score_mod=causal, return_lse=True)
    >>> lse.shape, lse.dtype
    (torch.Size([1, 2, 16]), torch.float32)
"""
from __future__ import annotations

import math
import numbers
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Mapping

import torch

from attncc.errors import InvalidArgument, check_bool
from attncc.frontend import Variant
from attncc.frontend.variant import TraceCache, share_trace_cache
from attncc.ir.analysis import check_vector_indices
from attncc.ir.program import Bindings, VariantIR

from ..reference import attention_reference, check_sinks, validate_attention_inputs
from .fp8 import fp8_flex_attention, wants_fp8
from .torch_compat import aux_request, finish, forward_kernel_options

# kernel_options keys attncc understands: the compiled kernel's tile shape (query rows, kv
# columns, pipeline stages, warps per CTA), two promises FlexAttention also accepts, and
# FAST_MATH (attncc's: False compiles the hooks with exact libm math instead of one-instruction
# approximations), PREPASS (attncc's: "none", "kv" or "qkv" runs those transforms once per row in
# a pre-pass instead of inside the attention kernel; "auto", the default, see
# runtime/prepass.choose_prepass), PERSISTENT (attncc's, FA3: False launches one CTA per 128-row
# tile instead of at most one per SM), SPLIT_TAIL (attncc's, FA3: False runs the persistent grid's
# last, partial round of full-length items whole instead of splitting it by keys across every
# CTA, flex/fa3_split.py), PAIRED (attncc's, FA3: full-length items -- no block mask -- run on
# pairs of CTAs that share each K/V tile, read from L2 once and multicast into both; the default
# up to 8192 keys, True / False forces it; see runtime/gpu_flex.fa3_pairs). The exact reference
# path ignores them. Anything else is an error rather than a silent no-op.
SUPPORTED_KERNEL_OPTIONS: dict[str, type] = {
    "BLOCK_M": int,
    "BLOCK_N": int,
    "num_stages": int,
    "num_warps": int,
    "FAST_MATH": bool,
    "KERNEL": str,
    "ROWS_GUARANTEED_SAFE": bool,
    "BLOCKS_ARE_CONTIGUOUS": bool,
    "PREPASS": str,
    "PERSISTENT": bool,
    "SPLIT_TAIL": bool,
    "PAIRED": bool,
    "DETERMINISTIC": bool,  # the GPU backward: bitwise reproducible gradients (docs/backward.md)
    "BACKWARD_KERNEL": str,  # the GPU backward's template: "fa2" or "fa3" (docs/backward.md)
}

_warned_no_gpu_kernel = False


def _validate_kernel_options(kernel_options: Mapping[str, Any] | None) -> None:
    if kernel_options is None:
        return
    if not isinstance(kernel_options, Mapping):
        raise TypeError(f"kernel_options must be a dict, got {type(kernel_options).__name__}")
    for key, val in kernel_options.items():
        want = SUPPORTED_KERNEL_OPTIONS.get(key)
        if want is None:
            raise ValueError(f"kernel_options[{key!r}] is not supported by attncc; supported "
                             f"keys: {', '.join(SUPPORTED_KERNEL_OPTIONS)}")
        if want is bool and not isinstance(val, bool):
            raise ValueError(f"kernel_options[{key!r}] must be True or False, got {val!r}")
        if want is str and not isinstance(val, str):
            raise ValueError(f"kernel_options[{key!r}] must be a string, got {val!r}")
        if want is int and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
            raise ValueError(f"kernel_options[{key!r}] must be a positive int, got {val!r}")


def _check_sizes(query: Any, key: Any, value: Any) -> None:
    """Zero heads or a zero head_dim: no attention is defined (the head grouping and the default
    scale 1/sqrt(head_dim) divide by them). Runs before `validate_attention_inputs`, whose GQA
    message would otherwise suggest enable_gqa for zero key heads; it names non-tensors."""
    named = (("query", query), ("key", key), ("value", value))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for _, t in named):
        return
    for name, t in named:
        if t.shape[1] == 0:
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}: 0 heads; attention needs "
                                  f"at least one head in query, key and value [B, H, S, D]")
    for name, t in named[:2]:
        if t.shape[3] == 0:
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}: head_dim 0; query and key "
                                  f"need a head_dim >= 1 (scores are q . k, scaled by "
                                  f"1/sqrt(head_dim))")


# score_mod function -> the trace cache of the Variants made for it, so a plain function is not
# traced again on every call. The cache refers to the function only weakly (a Variant as the value
# would hold its own key and never leave the dict).
_FN_TRACE_CACHES: "weakref.WeakKeyDictionary[Any, TraceCache]" = weakref.WeakKeyDictionary()
# id(raw traced IR) -> (that IR, its simplification); holding the IR keeps its id from being
# reused. Bounded: the oldest entries go first.
_SIMPLIFIED: dict[int, tuple[VariantIR, VariantIR]] = {}
_SIMPLIFIED_SIZE = 256
_SIMPLIFIED_LOCK = threading.Lock()
_NO_MODS = Variant()  # plain attention: one Variant, so its trace is cached too


def _as_variant(score_mod: Any) -> Variant:
    if score_mod is None:
        return _NO_MODS
    if isinstance(score_mod, Variant):
        return score_mod
    if callable(score_mod):
        # strict like torch: this argument is a score_mod; a mask belongs in block_mask or in
        # Variant(mask_mod=...). The tracer's arity check says so if a mask_mod is passed here.
        variant = Variant(score_mod=score_mod)
        try:
            cache = _FN_TRACE_CACHES.get(score_mod)
            if cache is None:
                cache = _FN_TRACE_CACHES.setdefault(score_mod, TraceCache())
        except TypeError:  # not weak-referenceable or not hashable: trace every call
            return variant
        return share_trace_cache(variant, cache)
    raise TypeError(f"score_mod must be a function score_mod(score, b, h, q_idx, kv_idx) or an "
                    f"attncc.Variant, got {type(score_mod).__name__}")


def _trace(variant: Variant) -> tuple[VariantIR, Bindings]:
    ir, bindings = variant.trace()  # the same `ir` object while the variant's trace holds
    hit = _SIMPLIFIED.get(id(ir))
    if hit is not None and hit[0] is ir:
        return hit[1], bindings
    from attncc.ir.simplified import simplify_variant

    try:  # simplification preserves meaning; it only makes evaluation cheaper
        simplified = simplify_variant(ir)
    except ImportError:  # no sympy: run the IR as traced
        return ir, bindings
    with _SIMPLIFIED_LOCK:
        _SIMPLIFIED.pop(id(ir), None)
        while len(_SIMPLIFIED) >= _SIMPLIFIED_SIZE:
            del _SIMPLIFIED[next(iter(_SIMPLIFIED))]
        _SIMPLIFIED[id(ir)] = (ir, simplified)
    return simplified, bindings


# (simplified IR, shapes, captured scalars) already checked by _static_checks; bounded
_CHECKED: "OrderedDict[tuple, VariantIR]" = OrderedDict()


def _static_checks(ir: VariantIR, bindings: Bindings, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> None:
    """Before anything runs: TraceError when a transform reads its head vector outside this
    call's head dim (value_mod / output_mod: the value head dim; indices computed from
    positions or tensors too, at this call's shapes), and an IndexOverflowWarning
    for each i32 expression that can leave 32 bits at these shapes. Remembered per IR, shapes
    and scalar values, so a repeated call pays a dict lookup."""
    try:  # the same IR binds the same scalar names, so their values identify the call
        key_ = (id(ir), query.shape, key.shape, value.shape[-1],
                tuple(bindings.scalars.values()))
        if _CHECKED.get(key_) is ir:
            return
    except TypeError:  # an unhashable captured value: check every call
        key_ = None
    from attncc.ir.analysis import (IndexOverflowWarning, Shapes, check_vector_reads,
                                    index_overflows)

    B, Hq, Sq, D = query.shape
    shapes = Shapes(B, Hq, key.shape[1], Sq, key.shape[2], D, value.shape[-1])
    check_vector_indices(ir, D, bindings.scalars, v_head_dim=value.shape[-1])
    check_vector_reads(ir, shapes, bindings.tensors, bindings.scalars)
    for msg in index_overflows(ir, shapes, bindings.scalars):
        warnings.warn(msg, IndexOverflowWarning, stacklevel=3)
    if key_ is not None:
        with _SIMPLIFIED_LOCK:
            _CHECKED[key_] = ir
            while len(_CHECKED) > _SIMPLIFIED_SIZE:
                _CHECKED.popitem(last=False)


# what the torch.library op checks per call, as this module does (flex/ops.py EagerChecks)
EAGER_CHECKS = (_validate_kernel_options, _check_sizes, _static_checks)


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable[..., Any] | Variant | None = None, block_mask: Any = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: Mapping[str, Any] | None = None, *, return_aux: Any = None,
                   sinks: torch.Tensor | None = None, k_scale: Any = None,
                   v_scale: Any = None) -> Any:
    """FlexAttention-compatible attention; `score_mod` may be an `attncc.Variant`.

    query [B, Hq, Sq, D], key [B, Hkv, Skv, D], value [B, Hkv, Skv, Dv] -> out [B, Hq, Sq, Dv]
    in query's dtype, and with `return_lse=True` also lse [B, Hq, Sq] (float32, natural log;
    -inf for a fully masked row). `enable_gqa=True` lets Hq be a multiple of Hkv. `scale`
    defaults to 1/sqrt(D). `block_mask` comes from `attncc.create_block_mask` or torch's.
    `return_lse` is an error for a `normalize="none"` variant: it has no softmax.
    `kernel_options` takes the keys in `SUPPORTED_KERNEL_OPTIONS` (tile hints for the compiled
    kernel; the reference path ignores them) and torch's keys (honoured where they mean
    something here, else ignored with a one-time warning: `torch_compat`); any other key is an
    error naming it. `return_aux=AuxRequest(lse=, max_scores=)` (torch 2.13's) returns
    `(out, AuxOutput(lse, max_scores))`; max_scores, each row's max modified score, comes from
    the exact path only (CPU, CUDA float32): the compiled kernels do not return it.
    `sinks` [Hq] (float32 or query's dtype, on query's device, finite): attention sinks, one
    logit per query head joined to every row's softmax denominator with no value (gpt-oss);
    the returned LSE includes it, a fully masked row gives 0 and LSE = the sink, and it is
    differentiable (docs/flex-api.md, "Attention sinks").
    key / value may be fp8 (torch.float8_e4m3fn / float8_e5m2) standing for `key * k_scale`,
    `value * v_scale` (a float or a tensor [Hkv] each, default 1): runtime/flex/fp8.py.

    Example:
        >>> import torch
        >>> q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
        >>> sig = Variant(score_mod=lambda s, b, h, qi, ki: torch.sigmoid(s), normalize="none")
        >>> ref = torch.sigmoid(q @ k.transpose(-1, -2) / 8 ** 0.5) @ v
        >>> bool(torch.allclose(flex_attention(q, k, v, score_mod=sig), ref, atol=1e-6))
        True
    """
    global _warned_no_gpu_kernel
    if wants_fp8(key, value, k_scale, v_scale):  # a call on widened operands (flex/fp8.py)
        return fp8_flex_attention(flex_attention, query, key, value, scale, enable_gqa, k_scale,
                                  v_scale, score_mod=score_mod, block_mask=block_mask,
                                  return_lse=return_lse, kernel_options=kernel_options,
                                  return_aux=return_aux, sinks=sinks)
    if torch.compiler.is_compiling():  # Dynamo traces this: one op call (docs/compile.md)
        from .ops import compiled_flex_attention

        return compiled_flex_attention(query, key, value, score_mod, block_mask, scale,
                                       enable_gqa, return_lse, kernel_options, EAGER_CHECKS,
                                       sinks=sinks)
    check_bool("enable_gqa", enable_gqa)
    check_bool("return_lse", return_lse)
    _check_sizes(query, key, value)
    validate_attention_inputs(query, key, value, block_mask, enable_gqa)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(float(scale))):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    want_lse, want_max = aux_request(return_aux, return_lse)
    kernel_options = forward_kernel_options(kernel_options, SUPPORTED_KERNEL_OPTIONS)
    _validate_kernel_options(kernel_options)
    variant = _as_variant(score_mod)
    if want_lse and variant.normalize == "none":
        raise ValueError("return_lse=True but the variant has normalize='none': there is no "
                         "softmax, so no log-sum-exp; call with return_lse=False")
    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(f"query is on {query.device}; attncc runs on CPU and CUDA tensors")
    if sinks is not None:
        if variant.normalize == "none":
            raise InvalidArgument("sinks were given but the variant has normalize='none': a "
                                  "sink joins a softmax denominator; drop sinks")
        check_sinks(sinks, query.shape[1], query.device, query.dtype)
    ir, bindings = _trace(variant)
    _static_checks(ir, bindings, query, key, value)
    compiled = query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16)
    if compiled and want_max:
        raise InvalidArgument(f"return_aux=AuxRequest(max_scores=True): attncc's compiled CUDA "
                              f"kernels do not return the row max for {query.dtype}; ask for "
                              f"lse only, or run float32 / CPU tensors (exact path) for it")
    if compiled:
        from .autograd import differentiable_attention, needs_grad
        from .gpu_flex import gpu_flex_attention

        if needs_grad(query, key, value, bindings, sinks):  # training: the GPU backward
            out, lse = differentiable_attention(query, key, value, ir, bindings,
                                                block_mask=block_mask, scale=scale,
                                                enable_gqa=enable_gqa,
                                                kernel_options=kernel_options, sinks=sinks)
            return finish(out, lse if want_lse else None, None, return_lse, return_aux)
        out, lse = gpu_flex_attention(query, key, value, ir, bindings, block_mask=block_mask,
                                      scale=scale, enable_gqa=enable_gqa, return_lse=want_lse,
                                      kernel_options=kernel_options, sinks=sinks)
        return finish(out, lse, None, return_lse, return_aux)
    if query.device.type == "cuda" and not _warned_no_gpu_kernel:
        _warned_no_gpu_kernel = True
        warnings.warn("attncc.flex_attention: no compiled GPU kernel for "
                      f"{query.dtype} yet (bf16/fp16 are compiled); running the exact float64 "
                      "reference on the GPU instead (correct but slow)", RuntimeWarning,
                      stacklevel=2)
    stats: dict[str, torch.Tensor] | None = {} if want_max else None
    out, lse = attention_reference(query, key, value, ir, bindings, block_mask=block_mask,
                                   scale=scale, enable_gqa=enable_gqa, float_dtype=torch.float64,
                                   stats=stats, sinks=sinks)
    lse = None if lse is None or not want_lse else lse.to(torch.float32)
    mx = stats["max"].to(torch.float32) if stats is not None else None
    return finish(out.to(query.dtype), lse, mx, return_lse, return_aux)


__all__ = ["SUPPORTED_KERNEL_OPTIONS", "flex_attention"]
