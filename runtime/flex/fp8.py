"""`attncc.flex_attention` with an fp8 key / value (docs/flex-api.md, "fp8 key and value").

key and value in torch.float8_e4m3fn or float8_e5m2 stand for `key8 * k_scale` and
`value8 * v_scale` (a float or a tensor [Hkv] each, default 1; runtime/kv8.py); query stays
bf16 / fp16 / fp32. `fp8_flex_attention` turns the call into one on 16-bit or float64 operands
and calls flex_attention again:

- exact path (CPU, or float32 query): key and value dequantized in float64 (exact) with a
  float64 query, the result cast back to query's dtype -- the fp64 reference on the
  dequantized cache;
- compiled path (CUDA bf16 / fp16): fp8 widens exactly into query's dtype, so a per-tensor
  k_scale is folded into `scale` (the score a score_mod sees is q . (key8 * k_scale) * scale,
  as it should) and v_scale multiplies the output in float32 (out = v_scale * sum p v8). A
  per-head k_scale is applied to the widened key instead (one rounding to query's dtype).
  The flex kernels read that widened copy: the fp8 load path is the serving kernels'
  (kernels/fa2/fa2_kv8.cuh).

Example:
    >>> import torch
    >>> import attncc
    >>> q = torch.randn(1, 2, 4, 16)
    >>> k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    >>> k8, v8 = (k / 2).to(torch.float8_e4m3fn), (v * 4).to(torch.float8_e4m3fn)
    >>> out = attncc.flex_attention(q, k8, v8, k_scale=2.0, v_scale=0.25)
    >>> ref = attncc.flex_attention(q, k8.float() * 2, v8.float() / 4)
    >>> bool(torch.allclose(out, ref, atol=1e-6))
    True
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from attncc.errors import InvalidArgument

from ..kv8 import FP8_KV_DTYPES, dequantize, kv_scale

__all__ = ["fp8_flex_attention", "wants_fp8"]


def wants_fp8(key: Any, value: Any, k_scale: Any, v_scale: Any) -> bool:
    """Whether flex_attention's call is an fp8 one: an fp8 key / value, or scales given."""
    return (getattr(key, "dtype", None) in FP8_KV_DTYPES
            or getattr(value, "dtype", None) in FP8_KV_DTYPES
            or k_scale is not None or v_scale is not None)


def _checked(query: Any, key: Any, value: Any, k_scale: Any,
             v_scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) scales [Hkv] (float32, on the CPU) of an fp8 key and value; raises naming
    the argument for a key / value that is not fp8 of one dtype, or a bad scale."""
    named = (("query", query), ("key", key), ("value", value))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for _, t in named):
        raise InvalidArgument("query, key and value must be 4-D tensors [B, H, S, D]")
    if key.dtype not in FP8_KV_DTYPES or value.dtype != key.dtype:
        raise InvalidArgument(f"k_scale / v_scale go with an fp8 key and value of one dtype "
                              f"({', '.join(map(str, FP8_KV_DTYPES))}); got key={key.dtype}, "
                              f"value={value.dtype}")
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidArgument(f"query has dtype {query.dtype}: with an fp8 key and value "
                              f"query is bfloat16, float16 or float32")
    heads = key.shape[1]
    return (kv_scale(1.0 if k_scale is None else k_scale, heads, "k_scale").cpu(),
            kv_scale(1.0 if v_scale is None else v_scale, heads, "v_scale").cpu())


def _with_out(result: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """flex_attention's result (out, or a tuple starting with out) with `f(out)` for out."""
    if isinstance(result, tuple):
        return (f(result[0]), *result[1:])
    return f(result)


def fp8_flex_attention(flex: Callable[..., Any], query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, scale: float | None, enable_gqa: bool,
                       k_scale: Any, v_scale: Any, **rest: Any) -> Any:
    """flex_attention (`flex`) of an fp8 key and value (module docstring); `rest` are its
    other arguments, passed on."""
    ks, vs = _checked(query, key, value, k_scale, v_scale)
    base = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    exact = query.device.type != "cuda" or query.dtype == torch.float32
    if exact:
        k = dequantize(key, ks, head_axis=1)
        v = dequantize(value, vs, head_axis=1)
        res = flex(query.to(torch.float64), k, v, scale=base, enable_gqa=enable_gqa, **rest)
        return _with_out(res, lambda o: o.to(query.dtype))
    dt = query.dtype
    if bool((ks == ks[0]).all()):  # per tensor: widen exactly, fold the scale
        k, base = key.to(dt), base * float(ks[0])
    else:
        k = (key.to(torch.float32) * ks.to(key.device).view(1, -1, 1, 1)).to(dt)
    res = flex(query, k, value.to(dt), scale=base, enable_gqa=enable_gqa, **rest)
    group = query.shape[1] // key.shape[1]
    per_q = vs.to(query.device).repeat_interleave(group).view(1, -1, 1, 1)
    return _with_out(res, lambda o: (o.to(torch.float32) * per_q).to(dt))
