"""Writing new tokens' keys and values into a paged KV cache, and the index helpers a serving
loop needs around it (FlashInfer's `append_paged_kv_cache` / `get_batch_indices_positions` /
`get_seq_lens`, same arguments; docs/serving.md, "KV append").

A request's KV tokens live in its pages `kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`, token `p`
in page `p // page_size`, slot `p % page_size`; its length is `(pages - 1) * page_size +
kv_last_page_len[b]` (the lengths *after* this append). Appended token `t` of request
`batch_indices[t]` goes to position `positions[t]`. The cache is a (k_cache, v_cache) pair or one
`[num_pages, 2, ...]` tensor, NHD (`[pages, page_size, heads, dim]`) or HND (`[pages, heads,
page_size, dim]`), as `BatchAttention.run` reads it.

`key_mod` (an `attncc.Variant` with a key_mod, e.g. RoPE) transforms each key at its position on
the way in, so the cache holds transformed keys: read it with a variant *without* that key_mod.

An fp8 cache (torch.float8_e4m3fn / float8_e5m2) is written quantized: `k / k_scale` and
`v / v_scale` (a float or a tensor [num_kv_heads], default 1) in float32, rounded to the cache's
dtype by torch's `.to()` (round to nearest even); `BatchAttention.run` reads it with the same
scales (runtime/kv8.py, docs/serving.md "fp8 KV cache").

Example:
    >>> import torch
    >>> k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    >>> kv_indptr, kv_indices = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 3])
    >>> last = torch.tensor([5, 3])                    # lengths 5 and 19 after the append
    >>> append_indptr = torch.tensor([0, 1, 3])        # 1 new token, then 2
    >>> seq_lens = get_seq_lens(kv_indptr, last, page_size=16)
    >>> b, pos = get_batch_indices_positions(append_indptr, seq_lens, nnz=3)
    >>> b.tolist(), pos.tolist()
    ([0, 1, 1], [4, 17, 18])
    >>> k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    >>> append_paged_kv_cache(k, v, b, pos, (k_cache, v_cache), kv_indices, kv_indptr, last)
    >>> bool((k_cache[3, 1] == k[1]).all())            # request 1, position 17: page 3, slot 1
    True
"""
from __future__ import annotations

from typing import Any

import torch

from attncc.errors import InvalidArgument
from attncc.frontend import Variant

from ..kv8 import FP8_KV_DTYPES, kv_scale, quantize
from .operands import _split_cache

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """Each request's KV length: `(pages - 1) * page_size + kv_last_page_len` (0 pages: 0)."""
    pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    return torch.where(pages > 0, (pages - 1) * page_size + kv_last_page_len.to(torch.int64),
                       torch.zeros_like(pages))


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor,
                                nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each appended token, its KV position): the tokens of request b are
    `append_indptr[b]:append_indptr[b + 1]`, the last `n_b` positions of its `seq_lens[b]`
    (lengths after the append). int32, on append_indptr's device; `nnz` = append_indptr[-1]."""
    counts = (append_indptr[1:] - append_indptr[:-1]).to(torch.int64)
    batch = torch.repeat_interleave(torch.arange(len(counts), device=append_indptr.device),
                                    counts, output_size=nnz)
    offset = torch.arange(nnz, device=append_indptr.device) - append_indptr[batch].to(torch.int64)
    start = seq_lens.to(append_indptr.device).to(torch.int64) - counts
    return batch.to(torch.int32), (start[batch] + offset).to(torch.int32)


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor,
                          batch_indices: torch.Tensor, positions: torch.Tensor,
                          paged_kv_cache: Any, kv_indices: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                          kv_layout: str = "NHD", *, key_mod: Variant | None = None,
                          k_scale: Any = None, v_scale: Any = None) -> None:
    """Write `append_key` / `append_value` ([nnz, num_kv_heads, head_dim]) into the paged cache
    at (`batch_indices`, `positions`) (module docstring). Every position is checked to lie
    inside its request's pages and length before anything is written: a position past them
    would land in another request's page. An fp8 cache gets `k / k_scale`, `v / v_scale`
    rounded to its dtype."""
    k_cache, v_cache = _split_cache(paged_kv_cache, ragged=False)
    if kv_layout not in ("NHD", "HND"):
        raise InvalidArgument(f"kv_layout={kv_layout!r}: use 'NHD' or 'HND' (paged caches)")
    heads_dim = 2 if kv_layout == "NHD" else 1
    page_size = k_cache.shape[1 if kv_layout == "NHD" else 2]
    _check(append_key, append_value, k_cache, v_cache, heads_dim)
    scales = _scales(k_cache, k_cache.shape[heads_dim], k_scale, v_scale)
    dev = k_cache.device
    b = batch_indices.to(dev, torch.int64)
    pos = positions.to(dev, torch.int64)
    indptr, last = kv_indptr.to(dev, torch.int64), kv_last_page_len.to(dev, torch.int64)
    lens = get_seq_lens(indptr, last, page_size)
    if b.shape != (append_key.shape[0],) or pos.shape != b.shape:
        raise InvalidArgument(f"batch_indices and positions must be [nnz={append_key.shape[0]}]"
                              f"; got {tuple(batch_indices.shape)} and {tuple(positions.shape)}")
    bad_b = (b < 0) | (b >= len(lens))
    if b.numel() and (not len(lens) or bool(  # one device-to-host read for both checks
            (bad_b | (pos < 0) | (pos >= lens[b.clamp(0, len(lens) - 1)])).any())):
        if not len(lens) or bool(bad_b.any()):
            raise InvalidArgument(f"batch_indices must lie in [0, {len(lens)}) (one per "
                                  f"request of kv_indptr)")
        raise InvalidArgument("positions must lie inside each request's length after the "
                              "append, (pages - 1) * page_size + kv_last_page_len: grow the "
                              "request's pages and kv_last_page_len first "
                              "(get_batch_indices_positions gives the positions)")
    page = kv_indices.to(dev, torch.int64)[indptr[b] + pos // page_size]
    slot = pos % page_size
    key = append_key if key_mod is None else _transformed_keys(key_mod, append_key, b, pos)
    key, value = _stored(key, k_cache.dtype, scales[0]), _stored(append_value, v_cache.dtype,
                                                                  scales[1])
    if kv_layout == "NHD":
        k_cache[page, slot] = key
        v_cache[page, slot] = value
    else:
        k_cache[page, :, slot] = key
        v_cache[page, :, slot] = value


def _scales(k_cache: torch.Tensor, heads: int, k_scale: Any,
            v_scale: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An fp8 cache's (k, v) scales as float32 tensors [num_kv_heads] (default 1, checked
    positive and finite); (None, None) for a 16-bit cache, which takes no scales."""
    if k_cache.dtype not in FP8_KV_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise InvalidArgument(f"k_scale / v_scale quantize an fp8 cache on write; this "
                                  f"cache holds {k_cache.dtype}: drop them")
        return None, None
    return (kv_scale(1.0 if k_scale is None else k_scale, heads, "k_scale"),
            kv_scale(1.0 if v_scale is None else v_scale, heads, "v_scale"))


def _stored(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """`t` [nnz, heads, dim] as the cache stores it: quantized per head with `scale` (an fp8
    cache), else rounded to `dtype`."""
    if scale is None:
        return t.to(dtype)
    return quantize(t, scale, head_axis=1, dtype=dtype)


def _check(k: Any, v: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, heads_dim: int) -> None:
    """append_key/append_value: [nnz, num_kv_heads, head_dim] on the cache's device."""
    want = (k_cache.shape[heads_dim], k_cache.shape[3])
    for name, t in (("append_key", k), ("append_value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != want \
                or t.device != k_cache.device:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(f"{name} must be [nnz, {want[0]}, {want[1]}] on "
                                  f"{k_cache.device} (the cache's heads and head dim); got {got}")
    if k.shape[0] != v.shape[0]:
        raise InvalidArgument(f"append_key has {k.shape[0]} tokens, append_value {v.shape[0]}")
    if k_cache.shape != v_cache.shape:
        raise InvalidArgument(f"k_cache {tuple(k_cache.shape)} and v_cache "
                              f"{tuple(v_cache.shape)} differ")


def _transformed_keys(variant: Variant, key: torch.Tensor, b: torch.Tensor,
                      pos: torch.Tensor) -> torch.Tensor:
    """The variant's key_mod at each token's (request, KV head, position), computed in float32
    as the kernels apply it, rounded to the key's dtype."""
    from attncc.ir.evaluator import evaluate

    ir, bindings = variant.trace()
    if "key_mod" not in ir.hooks:
        raise InvalidArgument(f"key_mod: variant {ir.name!r} has no key_mod to apply on append")
    n, H, D = key.shape
    dev = key.device
    env = {"k": key.float(), "b": b.view(n, 1, 1), "h": torch.arange(H, device=dev).view(1, H, 1),
           "kv_idx": pos.view(n, 1, 1), "d": torch.arange(D, device=dev).view(1, 1, D)}
    tensors = {name: t.to(dev) for name, t in bindings.tensors.items()}
    out = evaluate(ir.expr("key_mod"), env, tensors, dict(bindings.scalars), torch.float32)
    return out.expand(n, H, D).to(key.dtype)
