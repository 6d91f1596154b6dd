"""Merging partial attention states: the CPU reference of the split-KV reduction.

Attention of a query row over a KV range ``K`` is a *state* ``(o, lse)``: ``lse = log sum_{j in K}
exp(s_j)`` (natural log of the softmax denominator, the convention of `attention_reference`)
and ``o = sum_j exp(s_j - lse) v_j``. The states of two disjoint ranges compose into the state
of their union:

    lse = logaddexp(lse_a, lse_b)
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

The operator is associative and commutative (exactly, in real arithmetic; up to rounding in
floating point). An empty range has ``lse = -inf`` and contributes nothing, whatever its ``o``
holds; merging only empty states gives ``o = 0`` and ``lse = -inf`` (a fully masked row).
NaN and +inf propagate as in a softmax over the union: a NaN lse makes the merged o and lse NaN,
a +inf lse (a row with a +inf score) makes o NaN and lse +inf, and a NaN in a non-empty o stays
NaN however small its weight (``0 * NaN``).

An attention sink (a logit with no value, docs/serving.md "Attention sinks") is the state
``(0, sink)``: partial states never include it, and `merge_state(..., sink=)` /
`merge_states(..., sink=)` join it once to the merged state (``reference.add_sink``).

`merge_state` merges two states, `merge_states` a stack of ``n`` states along dim 0 in index
order; both are what the GPU kernels consuming `serving.plan.scheduler` plans must match
(the scheduler lists the partial states of a split row in ascending KV order so that the
result is bitwise reproducible).

Example:
    >>> import torch
    >>> s, v = torch.randn(6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    >>> o_full, lse_full = torch.softmax(s, 0) @ v, torch.logsumexp(s, 0)
    >>> parts = [(torch.softmax(s[a:b], 0) @ v[a:b], torch.logsumexp(s[a:b], 0))
    ...          for a, b in ((0, 2), (2, 6))]
    >>> o, lse = merge_state(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    >>> bool(torch.allclose(o, o_full)), bool(torch.allclose(lse, lse_full))
    (True, True)
"""
from __future__ import annotations

import torch

from attncc.errors import InvalidArgument, InvalidArgumentType

from ..reference import add_sink

__all__ = ["merge_state", "merge_states", "merge_pair"]


def _check(o: torch.Tensor, lse: torch.Tensor, name: str, lead: int = 0) -> None:
    if o.dim() != lse.dim() + 1 or o.shape[:-1] != lse.shape:
        raise ValueError(f"{name}: o must be lse's shape plus a head_dim axis, got o "
                         f"{tuple(o.shape)} and lse {tuple(lse.shape)}")
    if o.dim() < 1 + lead:
        raise ValueError(f"{name}: o needs at least {1 + lead} dims, got {tuple(o.shape)}")
    if not (o.is_floating_point() and lse.is_floating_point()):
        raise TypeError(f"{name}: o and lse must be floating point, got {o.dtype} and {lse.dtype}")


def _check_sink(sink: object, lse: torch.Tensor, name: str) -> torch.Tensor:
    """The sink argument of a merge: a finite float tensor on lse's device that broadcasts to
    lse's shape (per-head sinks [H] for serving states [tokens, H])."""
    if not isinstance(sink, torch.Tensor):
        raise InvalidArgumentType(f"{name}: sink must be a torch.Tensor of sink logits that "
                                  f"broadcasts to lse's shape (or None), got "
                                  f"{type(sink).__name__}")
    if not sink.is_floating_point() or sink.device != lse.device:
        raise InvalidArgument(f"{name}: sink must be a float tensor on {lse.device}, got "
                              f"{sink.dtype} on {sink.device}")
    try:
        torch.broadcast_shapes(sink.shape, lse.shape)
        ok = torch.broadcast_shapes(sink.shape, lse.shape) == lse.shape
    except RuntimeError:
        ok = False
    if not ok:
        raise InvalidArgument(f"{name}: sink has shape {tuple(sink.shape)}, which does not "
                              f"broadcast to lse's {tuple(lse.shape)}; pass one logit per "
                              f"head, e.g. [H] for states [tokens, H]")
    capturing = sink.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not bool(torch.isfinite(sink).all()):
        raise InvalidArgument(f"{name}: sink holds a NaN or an infinity; sink logits must be "
                              f"finite")
    return sink


def merge_state(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                lse_b: torch.Tensor, sink: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint KV ranges: ``(o [..., D], lse [...])``.

    ``o_*`` is ``[..., D]``, ``lse_*`` is ``[...]`` (natural log). Computes in the promoted
    dtype of the inputs; CUDA states that fit `merge_kernel.py`'s kernel (one storage
    type, contiguous, float32 lse, head dim a multiple of 8) merge in one launch, in float32.
    A ``-inf`` lse marks an empty state: its ``o`` is ignored (even if it is nan); two empty
    states give ``o = 0``, ``lse = -inf``. `sink` (broadcast to lse's shape, e.g. ``[H]``):
    attention-sink logits joined once to the merged state, whose lse then includes them (two
    empty states give ``o = 0``, ``lse = sink``); the inputs must not include them.

    Example:
        >>> import torch
        >>> o, lse = merge_state(torch.tensor([[1.0, 0.0]]), torch.tensor([0.0]),
        ...                      torch.tensor([[0.0, 1.0]]), torch.tensor([0.0]))
        >>> o.tolist(), round(float(lse), 6) == round(float(torch.log(torch.tensor(2.0))), 6)
        ([[0.5, 0.5]], True)
        >>> ninf = torch.tensor([float("-inf")])
        >>> merge_state(torch.tensor([[float("nan")]]), ninf, torch.tensor([[3.0]]), ninf)
        (tensor([[0.]]), tensor([-inf]))
    """
    _check(o_a, lse_a, "merge_state(o_a, lse_a)")
    _check(o_b, lse_b, "merge_state(o_b, lse_b)")
    if o_a.shape != o_b.shape:
        raise ValueError(f"merge_state: o_a {tuple(o_a.shape)} and o_b {tuple(o_b.shape)} differ")
    if sink is not None:
        _check_sink(sink, lse_a, "merge_state")
    merged = None
    if o_a.is_cuda:
        from .merge_kernel import fits_kernel, merge_fitting_states

        if fits_kernel(o_a, lse_a, o_b, lse_b):  # one launch, float32 math
            merged = merge_fitting_states(o_a, lse_a, o_b, lse_b)
    o, lse = merged if merged is not None else merge_pair(o_a, lse_a, o_b, lse_b)
    return (o, lse) if sink is None else add_sink(o, lse, sink)


def merge_pair(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
               lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge_state` without its argument checks: no host synchronisation, so it can run inside
    a CUDA graph (the checks read values back to raise errors). Callers guarantee the inputs.

    Example:
        >>> import torch
        >>> merge_pair(torch.ones(1, 2), torch.zeros(1), torch.ones(1, 2), torch.zeros(1))[0]
        tensor([[1., 1.]])
    """
    lse = torch.logaddexp(lse_a, lse_b)  # NaN if either is NaN, +inf if either is +inf
    base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - base).unsqueeze(-1)
    w_b = torch.exp(lse_b - base).unsqueeze(-1)
    zero = torch.zeros((), dtype=w_a.dtype, device=w_a.device)
    # only an empty state is skipped: a NaN o with a tiny weight stays NaN, as 0 * NaN would
    o = (torch.where(torch.isneginf(lse_a).unsqueeze(-1), zero, w_a * o_a)
         + torch.where(torch.isneginf(lse_b).unsqueeze(-1), zero, w_b * o_b))
    return o, lse


def merge_states(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``n`` attention states stacked along dim 0: ``o [n, ..., D]``, ``lse [n, ...]``.

    Same result (up to rounding) as folding `merge_state` over the states in index order, but
    computed in one pass: ``m = max_i lse_i``, ``d = sum_i exp(lse_i - m)``,
    ``lse = m + log d``, ``o = sum_i (exp(lse_i - m) / d) o_i``, summed in index order.
    Empty states (``lse = -inf``) are ignored; if all are empty the result is ``(0, -inf)``;
    ``n = 0`` is allowed and gives that too. `sink` (broadcast to ``lse[0]``'s shape): as in
    `merge_state`, joined once to the merged state.

    Example:
        >>> import torch
        >>> o = torch.tensor([[[2.0]], [[4.0]], [[float("nan")]]])
        >>> lse = torch.tensor([[0.0], [0.0], [float("-inf")]])
        >>> merge_states(o, lse)[0].tolist()
        [[3.0]]
    """
    _check(o, lse, "merge_states(o, lse)", lead=1)
    if sink is not None:
        _check_sink(sink, lse[0] if lse.shape[0] else lse.new_empty(lse.shape[1:]),
                    "merge_states")
        return add_sink(*merge_states(o, lse), sink)
    if o.shape[0] == 0:
        return (torch.zeros(o.shape[1:], dtype=o.dtype, device=o.device),
                torch.full(lse.shape[1:], float("-inf"), dtype=lse.dtype, device=lse.device))
    m = lse.amax(dim=0)  # NaN if any state's lse is NaN
    empty = torch.isneginf(m)
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)                       # 0 for empty states, <= 1 otherwise
    d = w.sum(dim=0)                                  # NaN when m is NaN or +inf
    scale = torch.where(empty, torch.zeros_like(d), 1.0 / torch.where(empty, torch.ones_like(d), d))
    w = (w * scale).unsqueeze(-1)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    out = torch.where(torch.isneginf(lse).unsqueeze(-1), zero, w * o).sum(dim=0)
    lse_out = torch.where(empty | torch.isposinf(m), m,
                          m_safe + torch.log(torch.where(empty, torch.ones_like(d), d)))
    return out, lse_out
