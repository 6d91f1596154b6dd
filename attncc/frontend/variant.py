"""`attncc.Variant`: the user-facing description of an attention variant, and mask helpers.

Example:
    >>> import torch
    >>> def softcap(score, b, h, q_idx, kv_idx):
    ...     return 30 * torch.tanh(score / 30)
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> v = Variant(score_mod=softcap, mask_mod=causal)
    >>> ir, _ = v.trace()
    >>> sorted(ir.hooks)
    ['mask_mod', 'score_mod']
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import TraceError
from ..ir.program import HOOK_ORDER, Bindings, VariantIR
from .trace import trace_mods

ScoreMod = Callable[..., Any]
MaskMod = Callable[..., Any]


@dataclass(frozen=True)
class Variant:
    """An attention variant: FlexAttention's score/mask mods plus q/k/v/output transforms.

    - `score_mod(score, b, h, q_idx, kv_idx) -> score` (score is already multiplied by `scale`)
    - `mask_mod(b, h, q_idx, kv_idx) -> bool`
    - `query_mod(q, b, h, q_idx, d)`, `key_mod(k, b, h, kv_idx, d)`,
      `value_mod(v, b, h, kv_idx, d)`, `output_mod(o, b, h, q_idx, d)`: element `d` of the new
      head vector; read the old one at any index, e.g. `q[(d + D // 2) % D]`.
    - `normalize="softmax"` (default) or `"none"`: output = sum(score_mod(...) * v) over
      unmasked keys, e.g. sigmoid attention.

    Example:
        >>> Variant(mask_mod=lambda b, h, q, kv: q >= kv).trace()[0].expr("mask_mod")
        <q_idx >= kv_idx : bool>
    """

    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    query_mod: Callable[..., Any] | None = None
    key_mod: Callable[..., Any] | None = None
    value_mod: Callable[..., Any] | None = None
    output_mod: Callable[..., Any] | None = None
    normalize: str = "softmax"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.normalize not in ("softmax", "none"):
            raise TraceError(f"Variant(normalize={self.normalize!r}): use 'softmax' or 'none'")

    def mods(self) -> dict[str, Callable[..., Any]]:
        return {h: getattr(self, h) for h in HOOK_ORDER if getattr(self, h) is not None}

    def trace(self) -> tuple[VariantIR, Bindings]:
        """Trace every hook into IR; returns the IR and the captured values."""
        return trace_mods(self.mods(), normalize=self.normalize, name=self.name)


def as_variant(x: Any) -> Variant:
    """Accept a Variant, or a plain score_mod (5 args) / mask_mod (4 args) function.

    Example:
        >>> as_variant(lambda b, h, q, kv: q >= kv).mask_mod is not None
        True
    """
    if isinstance(x, Variant):
        return x
    if x is None:
        return Variant()
    if callable(x):
        try:
            n = len([p for p in inspect.signature(x).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        except (TypeError, ValueError):
            n = -1
        if n == 5:
            return Variant(score_mod=x)
        if n == 4:
            return Variant(mask_mod=x)
        raise TraceError(f"cannot tell whether {getattr(x, '__name__', x)!r} is a score_mod "
                         f"(score, b, h, q_idx, kv_idx) or a mask_mod (b, h, q_idx, kv_idx): it "
                         f"takes {n} arguments; wrap it in attncc.Variant(score_mod=...) or "
                         f"Variant(mask_mod=...)")
    raise TraceError(f"expected an attncc.Variant or a mod function, got {type(x).__name__}")


def noop_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> bool:
    """The mask that keeps everything (FlexAttention's noop_mask)."""
    return True


def and_masks(*mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a position only where every given mask_mod keeps it.

    Example:
        >>> causal = lambda b, h, q, kv: q >= kv
        >>> window = lambda b, h, q, kv: q - kv < 256
        >>> m = and_masks(causal, window)
        >>> Variant(mask_mod=m).trace()[0].expr("mask_mod").op
        'and'
    """
    if not all(callable(m) for m in mods):
        raise TraceError("and_masks takes mask_mod functions")

    def and_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        out: Any = True
        for m in mods:
            r = m(b, h, q_idx, kv_idx)
            out = r if out is True else out & r
        return out

    return and_mask


def or_masks(*mods: MaskMod) -> MaskMod:
    """A mask_mod that keeps a position where any given mask_mod keeps it."""
    if not all(callable(m) for m in mods):
        raise TraceError("or_masks takes mask_mod functions")

    def or_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        out: Any = False
        for m in mods:
            r = m(b, h, q_idx, kv_idx)
            out = r if out is False else out | r
        return out

    return or_mask
