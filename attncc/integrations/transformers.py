"""An "attncc" attention implementation for Hugging Face transformers.

`register()` adds two entries under one name: the attention function (`AttentionInterface`)
and the mask builder (`AttentionMaskInterface`). Then `attn_implementation="attncc"` runs every
attention layer through `attncc.flex_attention`:

- masks: transformers describes a layer's mask as index functions (causal, sliding window,
  chunks, packed sequences) plus the 2-D padding mask. The mask builder traces those functions
  into an attncc `BlockMask`; the padding mask is a captured [B, kv_len] tensor that the
  mask_mod reads (`pad[b, kv_idx]`), never an O(S^2) dense mask. A mask function attncc cannot
  trace falls back to transformers' own dense boolean mask, read the same way.
- the attention function takes that BlockMask, a torch BlockMask, a 4-D bool or additive float
  mask (what transformers passes through from the user), or None (`is_causal`);
  `scaling` -> `scale`, `softcap` -> a `softcap * tanh(score / softcap)` score_mod, grouped
  key/value heads -> `enable_gqa`.

transformers is an optional extra (`pip install attncc[hf]`): this module imports it only in
`register()`. The mapping is described in docs/integrations.md.

Example (the tests build tiny random Llama, Qwen2 and Gemma-2 models the same way):
    >>> import torch
    >>> from attncc.integrations.transformers import attncc_attention
    >>> class Layer(torch.nn.Module):
    ...     is_causal = True
    >>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    >>> out, weights = attncc_attention(Layer(), q, k, v, None, scaling=0.5)
    >>> out.shape, weights        # [B, S, H, D], as transformers' attention functions return
    (torch.Size([1, 5, 2, 8]), None)
"""
from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import math
import numbers
import sys
from collections import OrderedDict
from typing import Any, Callable

import torch

from attncc.errors import (InvalidArgument, InvalidArgumentType, MissingDependency,
                           TraceError)
from attncc.frontend import Variant, and_masks, or_masks
from attncc.runtime.flex.api import flex_attention
from attncc.runtime.flex.block_mask import BlockMask, create_block_mask

NAME = "attncc"
INSTALL_HINT = "pip install attncc[hf]"

# transformers' mask combinators (masking_utils.and_masks / or_masks) start from
# `q_idx.new_ones(())`, which has no meaning on a traced index; their parts are plain index
# functions, so the builder recombines the parts with attncc's combinators (docs/integrations.md)
_COMBINATORS = {"and_masks.<locals>.and_mask": and_masks,
                "or_masks.<locals>.or_mask": or_masks}
# keyword arguments some models pass that change the result and attncc does not implement
_UNSUPPORTED = {"position_bias": "an additive position bias", "head_mask": "a head mask"}


def hub_kernels_first() -> None:
    """Import the `kernels` distribution (Hugging Face's hub kernels) from where it is installed,
    if it is and nothing named `kernels` is imported yet. transformers (>= 5.25) imports it at
    import time, and in a source checkout of attncc, with the checkout on sys.path (its root as
    the working directory, or pytest's rootdir), the checkout's `kernels/` directory -- attncc's
    CUDA templates, installed as `attncc.kernels` -- would be found first.

    Example:
        >>> import sys
        >>> hub_kernels_first()
        >>> "kernels" not in sys.modules or not hasattr(sys.modules["kernels"], "read_template")
        True
    """
    if "kernels" in sys.modules:
        return
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    spec = importlib.machinery.PathFinder.find_spec("kernels", [str(dist.locate_file(""))])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


def _transformers() -> tuple[Any, Any]:
    """transformers' two registries, or MissingDependency naming the extra to install."""
    hub_kernels_first()
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise MissingDependency(f"attncc's Hugging Face backend needs transformers (>= 5.0) "
                                f"with its masking_utils: {INSTALL_HINT} ({e})") from e
    return AttentionInterface, AttentionMaskInterface


def register(name: str = NAME) -> str:
    """Register attncc as transformers attention implementation `name` and return the name:
    `AutoModelForCausalLM.from_config(cfg, attn_implementation=name)` or
    `model.set_attn_implementation(name)` then runs attention through attncc."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentType(f"name must be a non-empty string, got {name!r}")
    attention, masks = _transformers()
    attention.register(name, attncc_attention)
    masks.register(name, attncc_mask)
    return name


# ------------------------------------------------------------------------------ mask builder
def traceable_mask(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with transformers' and_masks / or_masks closures rebuilt from their parts by
    attncc's combinators (recursively); any other function unchanged."""
    combine = None
    if getattr(fn, "__module__", None) == "transformers.masking_utils":
        combine = _COMBINATORS.get(getattr(fn, "__qualname__", ""))
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if combine is None or code is None or not cells:
        return fn
    captured = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    parts = captured.get("mask_functions")
    if not isinstance(parts, tuple) or not parts:
        return fn
    return combine(*(traceable_mask(p) for p in parts))


def _padding(attention_mask: torch.Tensor | None, batch: int, kv_length: int,
             kv_offset: int) -> torch.Tensor | None:
    """The [B, kv_length] bool keep-mask of this call's keys (transformers' 2-D mask covers
    positions from 0; keys past its end count as padding), or None when it keeps every key."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] not in (1, batch):
        raise InvalidArgument(f"attention_mask has shape {tuple(attention_mask.shape)}; the 2-D "
                              f"padding mask must be [batch={batch}, key positions]")
    pad = attention_mask.to(torch.bool)[:, kv_offset:kv_offset + kv_length]
    if pad.shape[1] < kv_length:
        pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[1]), value=False)
    if bool(pad.all()):
        return None
    return pad.expand(batch, kv_length).contiguous()


def _query_positions(q_length: int | None, q_offset: Any, cache_position: Any
                     ) -> tuple[int, int | None, torch.Tensor | None]:
    """(q_length, q_offset, positions): transformers >= 5.x passes q_length / q_offset (an int
    or a 0-d tensor); earlier 5.x releases pass `cache_position`, read as a captured tensor."""
    if q_length is not None:
        off = 0 if q_offset is None else q_offset
        return int(q_length), int(off.item() if isinstance(off, torch.Tensor) else off), None
    if not isinstance(cache_position, torch.Tensor) or cache_position.dim() != 1:
        raise InvalidArgument("the mask builder needs q_length (and q_offset) or a 1-D "
                              "cache_position tensor; got neither from transformers")
    return int(cache_position.shape[0]), None, cache_position.to(torch.int64)


def attncc_mask(**kwargs: Any) -> Any:
    """transformers' mask interface (keyword arguments as `hf_block_mask`'s): its BlockMask as
    torch's BlockMask class, which transformers recognises as a prepared 4-D mask when
    generate() builds masks ahead of the model call (static caches), or the dense fallback."""
    mask = hf_block_mask(**kwargs)
    return mask.to_torch() if isinstance(mask, BlockMask) else mask


def hf_block_mask(batch_size: int, kv_length: int,
                  mask_function: Callable[..., Any] | None = None,
                  attention_mask: torch.Tensor | None = None, q_length: int | None = None,
                  q_offset: Any = None, kv_offset: int = 0, cache_position: Any = None,
                  device: Any = None, **kwargs: Any) -> BlockMask | torch.Tensor:
    """The layer's mask as an attncc BlockMask over [batch_size, 1 head, q_length, kv_length],
    keys and queries shifted by their offsets as transformers' flex mask does, padding read
    from the 2-D mask as a captured tensor.

    A mask function attncc cannot trace (TraceError) falls back to transformers' dense
    `sdpa_mask` (bool [B, 1, q, kv]), which `attncc_attention` reads as a captured tensor."""
    from transformers.masking_utils import causal_mask_function

    kv_offset = int(kv_offset.item() if isinstance(kv_offset, torch.Tensor) else kv_offset)
    q_len, q_off, q_pos = _query_positions(q_length, q_offset, cache_position)
    base = traceable_mask(mask_function if mask_function is not None else causal_mask_function)
    pad = _padding(attention_mask, batch_size, kv_length, kv_offset)
    if device is None:  # transformers 5.0 passes no device: the model's tensors carry it
        held = [t.device for t in (attention_mask, cache_position) if isinstance(t, torch.Tensor)]
        device = held[0] if held else "cpu"

    def hf_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_at = q_idx + q_off if q_pos is None else q_pos[q_idx]
        keep = base(b, h, q_at, kv_idx + kv_offset)
        return keep if pad is None else keep & pad[b, kv_idx]

    try:
        return create_block_mask(hf_mask, batch_size, None, q_len, kv_length, device=device)
    except TraceError:
        from transformers.masking_utils import sdpa_mask

        passed = dict(kwargs, batch_size=batch_size, kv_length=kv_length, device=device,
                      mask_function=mask_function or causal_mask_function,
                      attention_mask=None if attention_mask is None
                      else attention_mask.to(torch.bool), allow_is_causal_skip=False,
                      allow_is_bidirectional_skip=False)
        if q_length is not None:
            passed.update(q_length=q_length, q_offset=q_offset, kv_offset=kv_offset)
        else:
            passed.update(cache_position=cache_position, kv_offset=kv_offset)
        return sdpa_mask(**passed)


# -------------------------------------------------------------------------- attention function
@functools.lru_cache(maxsize=64)
def _causal_block_mask(q_len: int, kv_len: int, window: int | None, device: torch.device
                       ) -> BlockMask:
    """sdpa's `is_causal` (top-left aligned), optionally within a sliding window."""
    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    def causal_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    fn = causal if window is None else causal_window
    return create_block_mask(fn, None, None, q_len, kv_len, device=device)


def _unmasked(causal: bool, q_len: int, kv_len: int, window: int | None,
              device: torch.device) -> BlockMask | None:
    """No mask given: sdpa's rule (`is_causal` aligned top-left for several queries, nothing
    for one). A causal sliding window needs the queries' positions, known only when they are
    the keys' (q_len == kv_len); a window that would cut keys otherwise is an error, not a
    guess."""
    if window is not None and kv_len > window and (not causal or q_len != kv_len):
        raise InvalidArgument(f"sliding_window={window} with no attention mask (is_causal="
                              f"{causal}, {q_len} queries over {kv_len} keys): the queries' "
                              f"positions are unknown; pass the mask transformers builds "
                              f"(register() installs the builder) or a 4-D mask")
    if not causal or q_len == 1:
        return None
    return _causal_block_mask(q_len, kv_len, window if q_len == kv_len else None, device)


def _dense_mask(mask: torch.Tensor, q_len: int, kv_len: int, heads: int) -> torch.Tensor:
    """A 4-D [B|1, H|1, q|1, >=kv] mask cut to this call's keys (as transformers' eager
    attention cuts it), or InvalidArgument naming the shapes that do not fit."""
    if (mask.shape[1] not in (1, heads) or mask.shape[2] not in (1, q_len)
            or mask.shape[3] < kv_len):
        raise InvalidArgument(f"attention_mask has shape {tuple(mask.shape)}; a 4-D mask must "
                              f"be [batch|1, heads={heads}|1, queries={q_len}|1, keys>={kv_len}]")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise InvalidArgumentType(f"attention_mask has dtype {mask.dtype}; a 4-D mask is bool "
                                  f"(True = attend) or floating point (added to the scores)")
    return mask[..., :kv_len]


# (softcap, id(bias), id(keep)) -> (bias, keep, Variant); the tensors are held so their ids stay
# theirs. One forward passes the same mask tensor to every layer of a kind (full, sliding): one
# trace per forward. Small, as it keeps that many dense masks alive after the forward.
_VARIANTS: "OrderedDict[tuple, tuple[Any, Any, Variant]]" = OrderedDict()
_VARIANTS_SIZE = 4


def _variant(softcap: float | None, bias: torch.Tensor | None, keep: torch.Tensor | None
             ) -> Variant | None:
    """The Variant of a softcap and a dense 4-D mask (additive `bias` or boolean `keep`)."""
    if softcap is None and bias is None and keep is None:
        return None
    key = (softcap, id(bias), id(keep))
    hit = _VARIANTS.get(key)
    if hit is not None and hit[0] is bias and hit[1] is keep:
        return hit[2]
    # a broadcast dimension of the dense mask reads its index 0
    bb, bh, bq = ((bias.shape[i] > 1 for i in range(3)) if bias is not None else (0, 0, 0))
    kb, kh, kq = ((keep.shape[i] > 1 for i in range(3)) if keep is not None else (0, 0, 0))

    def hf_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if softcap is not None:  # Gemma-2: softcap the scaled logits, then add the mask
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[b if bb else 0, h if bh else 0, q_idx if bq else 0, kv_idx]
        return score

    def hf_keep(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return keep[b if kb else 0, h if kh else 0, q_idx if kq else 0, kv_idx]

    variant = Variant(score_mod=hf_score if softcap is not None or bias is not None else None,
                      mask_mod=hf_keep if keep is not None else None, name="hf_attention")
    _VARIANTS[key] = (bias, keep, variant)
    while len(_VARIANTS) > _VARIANTS_SIZE:
        _VARIANTS.popitem(last=False)
    return variant


def _check_kwargs(dropout: Any, softcap: Any, kwargs: dict[str, Any]) -> None:
    if dropout is not None and float(dropout) != 0.0:
        raise InvalidArgument(f"dropout={dropout}: attncc has no attention dropout; run the "
                              f"model in eval() mode or set the config's attention_dropout=0")
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise InvalidArgument(f"{name} is set: attncc's transformers backend does not "
                                  f"implement {what}; use attn_implementation='eager' or 'sdpa'")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not math.isfinite(softcap) or softcap <= 0):
        raise InvalidArgument(f"softcap must be a positive finite number or None, got "
                              f"{softcap!r}")


def _is_block_mask(mask: Any) -> bool:
    return isinstance(mask, BlockMask) or (type(mask).__name__ == "BlockMask"
                                           and hasattr(mask, "kv_num_blocks"))


def attncc_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function: query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D] ->
    ([B, Sq, Hq, D], None). `sliding_window` is applied only when no mask is given (a mask
    from `attncc_mask` already carries the window, as transformers' sdpa and flex assume).
    `s_aux` (gpt-oss's sinks, [Hq]) becomes `sinks=` (docs/flex-api.md, "Attention sinks")."""
    _check_kwargs(dropout, softcap, kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    block_mask = bias = keep = None
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        block_mask = _unmasked(bool(causal), q_len, kv_len, sliding_window, query.device)
    elif _is_block_mask(attention_mask):
        block_mask = attention_mask
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        mask = _dense_mask(attention_mask, q_len, kv_len, query.shape[1])
        keep, bias = (mask, None) if mask.dtype == torch.bool else (None, mask)
    else:
        raise InvalidArgumentType(f"attention_mask must be None, a BlockMask or a 4-D tensor, "
                                  f"got {type(attention_mask).__name__} "
                                  f"{tuple(getattr(attention_mask, 'shape', ()))}")
    if query.is_cuda:  # the compiled kernels want 16-byte aligned rows; FA3 contiguous tensors
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = flex_attention(query, key, value, score_mod=_variant(softcap, bias, keep),
                         block_mask=block_mask, scale=scaling,
                         enable_gqa=query.shape[1] != key.shape[1],
                         sinks=kwargs.get("s_aux"))  # gpt-oss's per-head sinks
    return out.transpose(1, 2).contiguous(), None


__all__ = ["INSTALL_HINT", "NAME", "attncc_attention", "attncc_mask", "hf_block_mask",
           "register", "traceable_mask"]
