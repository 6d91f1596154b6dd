"""Captured-tensor gradients as exact integer sums: the deterministic mode's buffers.

With `kernel_options={"DETERMINISTIC": True}` the backward kernels' CapturedGrad adds each
fp32 term into EXACT_GRAD_WORDS int64 words per gradient element (kernels/common/exact_grad.cuh:
word k < 12 counts units of 2^(24 k - 149), unnormalized; the last word holds non-finite flags).
Integer sums do not depend on the order of their terms, so the float read back here is the same
bits in every run. It is the exact sum of the fp32 terms, added up word by word in fp64 (each
word exact there) and rounded to fp32: within an ulp of the correctly rounded sum, where fp32
atomics drift by one rounding per term. docs/backward.md, "Deterministic mode".

Example (words written as the kernel would for 1.5 and -0.25):
    >>> import torch
    >>> w = exact_grad_buffer((2,), torch.device("cpu"))
    >>> w[0, 6] = 48   # 1.5 = 48 * 2^(24 * 6 - 149)
    >>> w[1, 6] = -8   # -0.25
    >>> exact_grad_value(w).tolist()
    [1.5, -0.25]
"""
from __future__ import annotations

from typing import Sequence

import torch

from attncc.codegen.constants import EXACT_GRAD_WORDS

__all__ = ["exact_grad_buffer", "exact_grad_strides", "exact_grad_value"]

_SUM_WORDS = EXACT_GRAD_WORDS - 1  # the last word holds the flags
_BITS = 24  # payload bits a word counts (exact_grad.cuh: the term's 24-bit split)
_UNIT = -149  # word 0 counts units of 2^-149, fp32's smallest subnormal
_NAN, _POS_INF, _NEG_INF = 1, 2, 4


def exact_grad_buffer(shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """Zeroed words for a gradient of `shape`: int64 [*shape, EXACT_GRAD_WORDS]."""
    return torch.zeros(*shape, EXACT_GRAD_WORDS, dtype=torch.int64, device=device)


def exact_grad_strides(words: torch.Tensor) -> list[int]:
    """The element strides VariantGrads_<name> takes for `words` (the kernel multiplies an
    element's offset by EXACT_GRAD_WORDS)."""
    return [s // EXACT_GRAD_WORDS for s in words.stride()[:-1]]


def _normalize(w: torch.Tensor) -> None:
    """Carry every word but the top into [0, 2^24) in place (the top keeps the sign)."""
    for k in range(_SUM_WORDS - 1):
        carry = w[..., k] >> _BITS  # arithmetic shift: floor division by 2^24
        w[..., k] -= carry << _BITS
        w[..., k + 1] += carry


def exact_grad_value(words: torch.Tensor) -> torch.Tensor:
    """The float32 gradient the words hold: their exact sum, rounded; NaN where a term was NaN
    or terms of both infinities met, +-inf where an infinite term was."""
    w = words[..., :_SUM_WORDS].clone()
    _normalize(w)
    neg = w[..., -1] < 0
    w = torch.where(neg[..., None], -w, w)  # magnitudes: every word >= 0 after normalizing
    _normalize(w)
    scale = torch.tensor([2.0 ** (_BITS * k + _UNIT) for k in range(_SUM_WORDS)],
                         dtype=torch.float64, device=w.device)
    mag = torch.zeros(w.shape[:-1], dtype=torch.float64, device=w.device)
    for k in range(_SUM_WORDS):  # smallest first, each term exact in fp64
        mag += w[..., k].double() * scale[k]
    value = torch.where(neg, -mag, mag).float()
    flags = words[..., -1]
    nan = ((flags & _NAN) != 0) | ((flags & (_POS_INF | _NEG_INF)) == (_POS_INF | _NEG_INF))
    value = torch.where((flags & _POS_INF) != 0, torch.inf, value)
    value = torch.where((flags & _NEG_INF) != 0, -torch.inf, value)
    return torch.where(nan, torch.nan, value)
