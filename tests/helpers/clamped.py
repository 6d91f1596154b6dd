"""A captured-table read the bounds analysis clamps (issue 27, finding 4): the score_mod and the
simplified, clamped IR the GPU path runs, for the spill checks in tests/runtime/flex/ and
tests/runtime/serving/. tests/gpu/test_bounds_gpu.py keeps its own copy of the score_mod,
because its error-message tests name the file the mod is defined in."""
from __future__ import annotations

from typing import Any

import torch

import attncc
from attncc.gym import causal
from attncc.ir.analysis import Shapes
from attncc.runtime.flex import gpu_flex


def distance_bias(table: torch.Tensor) -> Any:
    def distance_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx]

    return distance_bias


def clamped_ir(S: int, H: int, D: int) -> Any:
    """The simplified, clamped IR the GPU path runs for a [H, S] distance table under causal."""
    from attncc.runtime.flex.api import _trace

    table = torch.randn(H, S)
    ir, bind = _trace(attncc.Variant(score_mod=distance_bias(table), mask_mod=causal,
                                     name="distance_bias"))
    got, sizes = gpu_flex._clamped(ir, Shapes(1, H, H, S, S, D, D), bind.tensors, bind.scalars)
    assert got is not ir and set(sizes) == {"table_size1"}
    return got
