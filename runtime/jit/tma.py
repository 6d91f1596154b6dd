"""Host side of TMA: CUDA tensor maps for kernels/hopper/tma.cuh (Hopper bulk tensor copies).

`tensor_map_2d(t, box_rows, box_cols)` describes a 2-D row-major CUDA tensor `t` (bf16/fp16;
any row stride that is a multiple of 16 bytes) as tiles of `box_rows x box_cols` with the
128-byte swizzle, and returns the 128-byte map in a small uint8 CUDA tensor (64-byte aligned,
as TMA requires) whose address kernels take. `tensor_map_3d` and `tensor_map_4d` do the same
for 3-D and 4-D tensors and boxes (the FA3 batch kernel's GQA query boxes; the dense FA3
kernel's output, [batch, heads, seq, head_dim] with any 16-byte strides). Encoding needs the
CUDA driver (cuda-bindings).

Example:
    >>> import torch
    >>> if torch.cuda.is_available():  # doctest: +SKIP
    ...     k = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    ...     tmap = tensor_map_2d(k, 64, 64)      # pass tmap.data_ptr() to the kernel
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np
import torch

from .launcher import driver, driver_check

__all__ = ["tensor_map_2d", "tensor_map_3d", "tensor_map_4d", "MapCache"]

_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
           torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}


def tensor_map_2d(t: torch.Tensor, box_rows: int, box_cols: int, swizzle: str = "128B"
                  ) -> torch.Tensor:
    """A CUDA tensor map for the 2-D tensor `t` in boxes of `box_rows x box_cols` elements."""
    if t.dim() != 2:
        raise ValueError(f"tensor_map_2d needs a 2-D tensor, got {tuple(t.shape)}")
    return _encode(t, (box_rows, box_cols), swizzle, "tensor_map_2d")


def tensor_map_3d(t: torch.Tensor, box: tuple[int, int, int], swizzle: str = "128B"
                  ) -> torch.Tensor:
    """A CUDA tensor map for the 3-D tensor `t` in boxes of `box` = (n0, n1, n2) elements
    (outermost first, as `t.shape`).

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     q = torch.randn(1000, 32, 128, device="cuda", dtype=torch.bfloat16)
        ...     tmap = tensor_map_3d(q, (8, 8, 64))  # 8 tokens x 8 heads x 64 columns
    """
    if t.dim() != 3:
        raise ValueError(f"tensor_map_3d needs a 3-D tensor, got {tuple(t.shape)}")
    return _encode(t, box, swizzle, "tensor_map_3d")


def tensor_map_4d(t: torch.Tensor, box: tuple[int, int, int, int], swizzle: str = "128B"
                  ) -> torch.Tensor:
    """A CUDA tensor map for the 4-D tensor `t` in boxes of `box` elements (outermost first).

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     o = torch.empty(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
        ...     tmap = tensor_map_4d(o, (1, 1, 64, 64))  # 64 rows x 64 columns of one head
    """
    if t.dim() != 4:
        raise ValueError(f"tensor_map_4d needs a 4-D tensor, got {tuple(t.shape)}")
    return _encode(t, box, swizzle, "tensor_map_4d")


def _encode(t: torch.Tensor, box: tuple[int, ...], swizzle: str, what: str) -> torch.Tensor:
    """cuTensorMapEncodeTiled for `t` (innermost dim contiguous) and a box of `box` elements."""
    if t.device.type != "cuda" or t.dtype not in _DTYPES:
        raise ValueError(f"{what} needs a {len(box)}-D bf16/fp16 CUDA tensor, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    outer = t.stride()[:-1]
    if t.stride(-1) != 1 or any((st * t.element_size()) % 16 for st in outer) or \
            t.data_ptr() % 16:
        raise ValueError(f"{what}: rows must be contiguous, 16-byte aligned and a multiple of "
                         f"16 bytes apart; strides {t.stride()}")
    if swizzle == "128B" and box[-1] * t.element_size() > 128:
        raise ValueError(f"box {box}: with the 128-byte swizzle a box row holds at most 128 bytes "
                         f"({128 // t.element_size()} elements)")
    if any(not 1 <= n <= 256 for n in box):
        raise ValueError(f"box {box}: every box dimension must be 1..256 elements")
    d = driver()
    sw = {"128B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
          "none": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE}[swizzle]
    rank = t.dim()
    tmap: Any = driver_check(d.cuTensorMapEncodeTiled(
        getattr(d.CUtensorMapDataType, _DTYPES[t.dtype]), rank, t.data_ptr(),
        [d.cuuint64_t(n) for n in reversed(t.shape)],
        [d.cuuint64_t(st * t.element_size()) for st in reversed(outer)],
        [d.cuuint32_t(n) for n in reversed(box)],
        [d.cuuint32_t(1)] * rank,
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    raw = np.array([int(w) & 0xFFFFFFFFFFFFFFFF for w in tmap.opaque], dtype=np.uint64)
    return torch.from_numpy(raw.view(np.uint8).copy()).to(t.device)  # 256-byte aligned


class MapCache:
    """Device copies of tensor maps by what they encode (addresses, shapes, strides, boxes), the
    least recently used dropped past `size`: a repeated launch -- and a CUDA graph capture after
    a warm-up launch -- reuses the copy instead of encoding maps and copying them to the GPU (a
    host-synchronous copy). The cache holds the maps' memory, so a launch never reads a freed map.

    Example:
        >>> c = MapCache(2)
        >>> c.get("a", lambda: 1), c.get("a", lambda: 2), c.get("b", lambda: 3)
        (1, 1, 3)
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._maps: "OrderedDict[Hashable, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The maps for `key`, made by `make()` the first time."""
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                self._maps.move_to_end(key)
                return hit
        hit = make()
        with self._lock:
            self._maps[key] = hit
            while len(self._maps) > self.size:
                self._maps.popitem(last=False)
        return hit
