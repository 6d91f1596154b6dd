"""fp8 KV caches: the dtypes, the checks of their scales, quantization and dequantization
(docs/serving.md, "fp8 KV cache").

A cache in `torch.float8_e4m3fn` or `torch.float8_e5m2` holds `k / k_scale` and `v / v_scale`
rounded to fp8 (torch's `.to()`: round to nearest even); it stands for the keys
`k8 * k_scale` and values `v8 * v_scale`. A scale is a positive finite float (one for the
whole tensor) or a tensor `[num_kv_heads]` (one per KV head), FlashInfer's `k_scale` /
`v_scale`. The fp64 references compute on the dequantized cache (`dequantize`), the kernels
widen the fp8 values exactly and apply the scales in fp32.

Example:
    >>> import torch
    >>> k = torch.tensor([[[1.1, -3.0]], [[0.5, 448.0]]])        # [tokens, heads, dim]
    >>> s = kv_scale(2.0, 1, "k_scale")
    >>> k8 = quantize(k, s, head_axis=1, dtype=torch.float8_e4m3fn)
    >>> dequantize(k8, s, head_axis=1).tolist()    # 1.1 / 2 rounds to 0.5625 (3 mantissa bits)
    [[[1.125, -3.0]], [[0.5, 448.0]]]
"""
from __future__ import annotations

import math
from typing import Any

import torch

from attncc.errors import InvalidArgument

__all__ = ["FP8_KV_DTYPES", "is_fp8", "check_scale_shape", "kv_scale", "quantize",
           "dequantize"]

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(t: Any) -> bool:
    """Whether `t` is a tensor of an fp8 KV dtype."""
    return isinstance(t, torch.Tensor) and t.dtype in FP8_KV_DTYPES


def kv_scale(scale: Any, num_kv_heads: int, name: str) -> torch.Tensor:
    """`scale` (a float, a 0-d tensor or a tensor [num_kv_heads]) as a float32 tensor
    [num_kv_heads] on the scale's device (a float: the CPU), checked positive and finite; raises
    InvalidArgument naming `name` otherwise. Reads a device tensor's values once (the check).

    Example:
        >>> kv_scale(0.5, 2, "k_scale").tolist()
        [0.5, 0.5]
        >>> kv_scale(torch.tensor([1.0, 0.0]), 2, "v_scale")
        Traceback (most recent call last):
        attncc.errors.InvalidArgument: v_scale must be positive and finite (one float, or a tensor [num_kv_heads=2] of them); got [1.0, 0.0]
    """
    check_scale_shape(scale, num_kv_heads, name)
    if isinstance(scale, torch.Tensor):
        s = scale.detach().to(torch.float32).reshape(-1).expand(num_kv_heads)
    else:
        s = torch.full((num_kv_heads,), float(scale), dtype=torch.float32)
    vals = s.tolist()
    if not all(math.isfinite(x) and x > 0 for x in vals):
        raise InvalidArgument(f"{name} must be positive and finite (one float, or a tensor "
                              f"[num_kv_heads={num_kv_heads}] of them); got "
                              f"{vals if len(vals) <= 8 else vals[:8] + ['...']}")
    return s.contiguous()


def check_scale_shape(scale: Any, num_kv_heads: int, name: str) -> None:
    """`scale` is a float or a float tensor of one or `num_kv_heads` values (its values are
    `kv_scale`'s to check); raises InvalidArgument naming `name` otherwise."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise InvalidArgument(f"{name} must be a float or a tensor [num_kv_heads="
                              f"{num_kv_heads}]; got {type(scale).__name__}")
    if isinstance(scale, torch.Tensor) and not (
            scale.is_floating_point() and scale.numel() in (1, num_kv_heads)
            and scale.dim() <= 1):
        raise InvalidArgument(f"{name} must be a float tensor [num_kv_heads={num_kv_heads}] "
                              f"(or one value); got {scale.dtype} {tuple(scale.shape)}")


def _per_head(scale: torch.Tensor, t: torch.Tensor, head_axis: int,
              dtype: torch.dtype) -> torch.Tensor:
    """`scale` [heads] shaped to broadcast along `t`'s `head_axis`."""
    shape = [1] * t.dim()
    shape[head_axis] = -1
    return scale.to(t.device, dtype).view(shape)


def quantize(t: torch.Tensor, scale: torch.Tensor, *, head_axis: int,
             dtype: torch.dtype) -> torch.Tensor:
    """`t / scale` (per head, in float32) rounded to the fp8 `dtype` by torch's `.to()`."""
    return (t.to(torch.float32) / _per_head(scale, t, head_axis, torch.float32)).to(dtype)


def dequantize(t: torch.Tensor, scale: torch.Tensor, *, head_axis: int) -> torch.Tensor:
    """The float64 values an fp8 cache stands for: `t * scale` per head (exact)."""
    return t.to(torch.float64) * _per_head(scale, t, head_axis, torch.float64)
