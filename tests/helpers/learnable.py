"""Learnable-bias variants for the backward tests: captured float tensors that require grad.

`LEARNABLE[name](H, Sq, Skv, seed=0, dtype=torch.float32)` returns `(score_mod, {tensor name:
tensor})`; the tensors are fresh leaves of `dtype` with `requires_grad=True`.

- `rel_table`: a relative-position table `bias[h, q_idx - kv_idx + Skv - 1]`, [H, Sq + Skv - 1];
- `alibi_slopes`: learnable ALiBi slopes, `score + slopes[h] * (kv_idx - q_idx)`;
- `head_scale`: a per-head temperature, `score * scales[h]`;
- `t5_bucket`: T5's bidirectional log buckets (32 buckets, max distance 128) into `table[h, bucket]`.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

ScoreMod = Callable[..., Any]


_DTYPE = [torch.float32]  # the dtype _leaf makes (set per factory call)


def _leaf(shape: tuple[int, ...], seed: int, scale: float = 1.0, shift: float = 0.0
          ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift
    return x.to(_DTYPE[0]).requires_grad_(True)


def rel_table(H: int, Sq: int, Skv: int, seed: int = 0) -> tuple[ScoreMod, dict[str, torch.Tensor]]:
    bias = _leaf((H, Sq + Skv - 1), seed, 0.5)
    C = Skv - 1

    def rel_table_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + bias[h, q_idx - kv_idx + C]

    return rel_table_mod, {"bias": bias}


def alibi_slopes(H: int, Sq: int, Skv: int, seed: int = 0
                 ) -> tuple[ScoreMod, dict[str, torch.Tensor]]:
    slopes = _leaf((H,), seed, 0.05, 0.1)

    def alibi_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_mod, {"slopes": slopes}


def head_scale(H: int, Sq: int, Skv: int, seed: int = 0) -> tuple[ScoreMod, dict[str, torch.Tensor]]:
    scales = _leaf((H,), seed, 0.2, 1.0)

    def head_scale_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score * scales[h]

    return head_scale_mod, {"scales": scales}


def t5_bucket(H: int, Sq: int, Skv: int, seed: int = 0) -> tuple[ScoreMod, dict[str, torch.Tensor]]:
    table = _leaf((H, 32), seed, 0.5)
    half, exact, max_distance = 16, 8, 128

    def t5_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        rel = kv_idx - q_idx
        side = torch.where(rel > 0, half, 0)
        dist = torch.abs(rel)
        far = exact + (torch.log(dist.float() / exact) / math.log(max_distance / exact)
                       * (half - exact)).int()
        far = torch.clamp(far, max=half - 1)
        bucket = side + torch.where(dist < exact, dist, far)
        return score + table[h, bucket]

    return t5_mod, {"table": table}


def _with_dtype(f: Callable[..., tuple[ScoreMod, dict[str, torch.Tensor]]]
                ) -> Callable[..., tuple[ScoreMod, dict[str, torch.Tensor]]]:
    def make(H: int, Sq: int, Skv: int, seed: int = 0, dtype: torch.dtype = torch.float32
             ) -> tuple[ScoreMod, dict[str, torch.Tensor]]:
        _DTYPE[0] = dtype
        try:
            return f(H, Sq, Skv, seed)
        finally:
            _DTYPE[0] = torch.float32
    return make


LEARNABLE: dict[str, Callable[..., tuple[ScoreMod, dict[str, torch.Tensor]]]] = {
    n: _with_dtype(f) for n, f in (("rel_table", rel_table), ("alibi_slopes", alibi_slopes),
                                   ("head_scale", head_scale), ("t5_bucket", t5_bucket))}
