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
from .trace import TraceGuard, trace_mods_guarded

ScoreMod = Callable[..., Any]
MaskMod = Callable[..., Any]


class TraceCache:
    """Holds a variant's last trace, `(normalize, name, ir, guard)`, for `Variant.trace`.

    A `Variant` makes its own; `share_trace_cache` gives several variants of the same mods one
    cache (e.g. `flex_attention`, which builds a `Variant` per call from a plain function). It
    refers to the traced functions only weakly, so it may be kept in a dict keyed by them.

    Example:
        >>> cache = TraceCache()
        >>> v = share_trace_cache(Variant(mask_mod=lambda b, h, q, kv: q >= kv), cache)
        >>> ir, _ = v.trace()
        >>> cache.entry[2] is ir
        True
    """

    __slots__ = ("entry", "__weakref__")

    def __init__(self) -> None:
        self.entry: tuple[str, str | None, VariantIR, TraceGuard] | None = None


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
        """Trace every hook into IR; returns the IR and the captured values.

        The last trace is cached: while its `TraceGuard` vouches that tracing again would give
        the same IR, the same IR object comes back with the captures' current values (a new
        value of a captured scalar that is a kernel parameter needs no new trace).

        Example:
            >>> import torch
            >>> cap = 30.0
            >>> v = Variant(score_mod=lambda s, b, h, q, kv: cap * torch.tanh(s / cap))
            >>> ir, bind = v.trace()
            >>> cap = 20.0
            >>> ir2, bind2 = v.trace()
            >>> ir2 is ir, bind2.scalars
            (True, {'cap': 20.0})
        """
        mods = self.mods()
        cache: TraceCache | None = self.__dict__.get("_trace_cache")
        entry = cache.entry if cache is not None else None
        if entry is not None and entry[0] == self.normalize and entry[1] == self.name and \
                entry[3].same_mods(mods):
            bindings = entry[3].rebind()
            if bindings is not None:
                return entry[2], bindings
        ir, bindings, guard = trace_mods_guarded(mods, normalize=self.normalize, name=self.name)
        if cache is None:
            cache = TraceCache()
            object.__setattr__(self, "_trace_cache", cache)  # not a field: no eq/repr/hash
        cache.entry = (self.normalize, self.name, ir, guard) if guard.cacheable else None
        return ir, bindings

    def __getstate__(self) -> dict[str, Any]:
        # copies and pickles start without the trace cache (it holds weak references)
        state = dict(self.__dict__)
        state.pop("_trace_cache", None)
        return state


def share_trace_cache(variant: Variant, cache: TraceCache) -> Variant:
    """Make `variant.trace()` use (and update) `cache`; returns `variant`.

    Example:
        >>> cache = TraceCache()
        >>> f = lambda s, b, h, q, kv: s * 2
        >>> ir1, _ = share_trace_cache(Variant(score_mod=f), cache).trace()
        >>> ir2, _ = share_trace_cache(Variant(score_mod=f), cache).trace()
        >>> ir1 is ir2
        True
    """
    object.__setattr__(variant, "_trace_cache", cache)
    return variant


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
