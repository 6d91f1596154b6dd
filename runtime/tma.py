"""Host side of TMA: CUDA tensor maps for kernels/tma.cuh (Hopper bulk tensor copies).

`tensor_map_2d(t, box_rows, box_cols)` describes a 2-D row-major CUDA tensor `t` (bf16/fp16;
any row stride that is a multiple of 16 bytes) as tiles of `box_rows x box_cols` with the
128-byte swizzle, and returns the 128-byte map in a small uint8 CUDA tensor (64-byte aligned,
as TMA requires) whose address kernels take. Encoding needs the CUDA driver (cuda-bindings).

Example:
    >>> import torch
    >>> if torch.cuda.is_available():  # doctest: +SKIP
    ...     k = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    ...     tmap = tensor_map_2d(k, 64, 64)      # pass tmap.data_ptr() to the kernel
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .launcher import _driver, driver_check

__all__ = ["tensor_map_2d"]

_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
           torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}


def tensor_map_2d(t: torch.Tensor, box_rows: int, box_cols: int, swizzle: str = "128B"
                  ) -> torch.Tensor:
    """A CUDA tensor map for the 2-D tensor `t` in boxes of `box_rows x box_cols` elements."""
    if t.dim() != 2 or t.device.type != "cuda" or t.dtype not in _DTYPES:
        raise ValueError(f"tensor_map_2d needs a 2-D bf16/fp16 CUDA tensor, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        raise ValueError(f"tensor_map_2d: rows must be contiguous, 16-byte aligned and a "
                         f"multiple of 16 bytes apart; strides {t.stride()}")
    if swizzle == "128B" and box_cols * t.element_size() > 128:
        raise ValueError(f"box_cols={box_cols}: with the 128-byte swizzle a box row holds at "
                         f"most 128 bytes ({128 // t.element_size()} elements)")
    d = _driver()
    sw = {"128B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
          "none": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE}[swizzle]
    tmap: Any = driver_check(d.cuTensorMapEncodeTiled(
        getattr(d.CUtensorMapDataType, _DTYPES[t.dtype]), 2, t.data_ptr(),
        [d.cuuint64_t(t.shape[1]), d.cuuint64_t(t.shape[0])],
        [d.cuuint64_t(t.stride(0) * t.element_size())],
        [d.cuuint32_t(box_cols), d.cuuint32_t(box_rows)],
        [d.cuuint32_t(1), d.cuuint32_t(1)],
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    raw = np.array([int(w) & 0xFFFFFFFFFFFFFFFF for w in tmap.opaque], dtype=np.uint64)
    return torch.from_numpy(raw.view(np.uint8).copy()).to(t.device)  # 256-byte aligned
