"""run()'s fp8 KV scales: `k_scale` / `v_scale` checked and turned into the two device pointers
BatchParams carries (docs/serving.md, "fp8 KV cache").

A scale is a float or a tensor [num_kv_heads] (runtime/kv8.py). A float32 CUDA tensor of
exactly [num_kv_heads] on the kernel's device is read where it is (a captured graph then reads
its current values); anything else is written into the instance's own [2, num_kv_heads] device
buffer, floats only when they change, so a decode loop with fixed float scales launches nothing
extra (while a CUDA graph captures, a float is always written: the graph's replays then
write it again). Values are checked positive and finite before any launch: floats every call, a tensor
once per (tensor, version) -- an in-place update bumps torch's version counter -- so a loop
passing the same tensor does not read it back every step.
"""
from __future__ import annotations

from typing import Any

import torch

from attncc.errors import InvalidArgument

from ..kv8 import FP8_KV_DTYPES, check_scale_shape, kv_scale

__all__ = ["KvScales", "check_kv_data_type"]


def check_kv_data_type(kv_data_type: Any, q_data_type: Any,
                       device: torch.device) -> torch.dtype | None:
    """plan()'s `kv_data_type`: None (or q's dtype) for a cache in q's dtype, else an fp8
    dtype, returned; anything else (or an fp8 `q_data_type`) raises, naming the argument. An fp8 cache needs an sm_89+
    GPU (the e4m3 widening is a cvt those have)."""
    if q_data_type in FP8_KV_DTYPES:
        raise InvalidArgument(f"q_data_type={q_data_type}: queries are bf16 or fp16; an fp8 "
                              f"KV cache is plan(..., kv_data_type={q_data_type})")
    if kv_data_type is None or kv_data_type == q_data_type:
        return None
    if kv_data_type not in FP8_KV_DTYPES:
        raise InvalidArgument(f"kv_data_type={kv_data_type}: use None (q's dtype, "
                              f"{q_data_type}) or an fp8 cache, torch.float8_e4m3fn or "
                              f"torch.float8_e5m2")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise InvalidArgument(f"kv_data_type={kv_data_type}: fp8 KV caches need an sm_89+ GPU "
                              f"(Ada, Hopper); this one is sm_"
                              f"{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    return kv_data_type


def _capturing(t: torch.Tensor) -> bool:
    """Whether `t` is a CUDA tensor and its device's current stream is capturing a graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class KvScales:
    """The device pointers of run()'s k_scale / v_scale (module docstring)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None  # [2, num_kv_heads] float32 on the device
        self._floats: tuple[Any, Any] = (None, None)  # the floats the buffer holds
        self._seen: set[tuple[int, int, int]] = set()  # (id, data_ptr, version) checked

    def pointers(self, k_scale: Any, v_scale: Any, num_kv_heads: int,
                 kv8: torch.dtype | None, device: torch.device) -> tuple[int, int]:
        """(k_scale, v_scale) device pointers for the planned cache: (0, 0) for a cache in q's
        dtype (where passing a scale raises), else each scale's [num_kv_heads] float32 values
        (default 1.0)."""
        if kv8 is None:
            if k_scale is not None or v_scale is not None:
                raise InvalidArgument("k_scale / v_scale are the scales of an fp8 cache; this "
                                      "plan's cache is in q's dtype (plan(kv_data_type=...) "
                                      "names an fp8 one)")
            return 0, 0
        self.reserve(num_kv_heads, device)
        return (self._pointer(0, 1.0 if k_scale is None else k_scale, "k_scale", num_kv_heads),
                self._pointer(1, 1.0 if v_scale is None else v_scale, "v_scale", num_kv_heads))

    def reserve(self, num_kv_heads: int, device: torch.device) -> None:
        """The [2, num_kv_heads] buffer on `device` (plan() makes it for an fp8 plan, outside
        any compiled region: one made in a torch.compile CUDA graph's pool would be kept)."""
        if self._buf is None or self._buf.shape[1] != num_kv_heads \
                or self._buf.device != device:
            self._buf = torch.empty(2, num_kv_heads, dtype=torch.float32, device=device)
            self._floats = (None, None)

    def _pointer(self, row: int, scale: Any, name: str, heads: int) -> int:
        buf = self._buf
        assert buf is not None
        if isinstance(scale, torch.Tensor):
            self._check_tensor(scale, name, heads)
            if scale.dtype == torch.float32 and scale.device == buf.device \
                    and scale.shape == (heads,) and scale.stride(0) == 1:
                return scale.data_ptr()
            buf[row].copy_(scale.detach().reshape(-1).expand(heads))
            self._forget_float(row)
            return buf[row].data_ptr()
        # while a CUDA graph captures, the fill is always recorded: the graph's replays then
        # write their own float, whatever an eager call wrote into the buffer since
        if isinstance(scale, bool) or self._floats[row] != scale or _capturing(buf):
            kv_scale(scale, heads, name)  # raises for a bad float
            buf[row].fill_(float(scale))
            self._floats = tuple(scale if i == row else f for i, f in enumerate(self._floats))
        return buf[row].data_ptr()

    def _forget_float(self, row: int) -> None:
        self._floats = tuple(None if i == row else f for i, f in enumerate(self._floats))

    def _check_tensor(self, t: torch.Tensor, name: str, heads: int) -> None:
        """A tensor scale's shape and dtype every call; its values once per version (a read
        back, skipped while a CUDA graph captures: it would break the capture)."""
        key = (id(t), t.data_ptr(), t._version)
        if key in self._seen:
            return
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            check_scale_shape(t, heads, name)
            return
        kv_scale(t, heads, name)
        if len(self._seen) > 64:
            self._seen.clear()
        self._seen.add(key)
