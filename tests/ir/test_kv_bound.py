"""attncc.ir.kv_bound.causal_bound: the bound it claims holds on every (q, kv) the mask keeps,
and it is tight for the plain comparisons; masks it cannot bound get None. kv_window: the band it
claims is exactly the mask."""
from __future__ import annotations

import pytest
import torch

from attncc.ir.evaluator import evaluate
from attncc.ir.kv_bound import causal_bound, kv_window
from attncc.ir.nodes import I32, Node, binary, const, load, param, var
from attncc.ir.simplify import simplify_variant
from attncc.gym import GYM

q, kv = var("q_idx"), var("kv_idx")
N = 48


def _kept(mask: Node, tensors: dict | None = None, params: dict | None = None) -> torch.Tensor:
    """mask over an N x N grid of (q_idx, kv_idx), b = h = 0 (by default: prefix = 5, doc ids
    in runs of 7)."""
    qi = torch.arange(N).view(N, 1).expand(N, N)
    ki = torch.arange(N).view(1, N).expand(N, N)
    if tensors is None:
        tensors = {"doc_ids": torch.arange(N).view(1, N) // 7}
    env = {"q_idx": qi, "kv_idx": ki, "b": 0, "h": 0}
    out = evaluate(mask, env, tensors=tensors, params={"prefix": 5} if params is None else params)
    return out.expand(N, N).bool()


def _check(mask: Node, c: int | None, tight: bool = False) -> None:
    assert causal_bound(mask) == c
    if c is None:
        return
    kept = _kept(mask)
    qi, ki = torch.nonzero(kept, as_tuple=True)
    assert bool((ki <= qi + c).all()), f"kept a key past q + {c}"
    if tight:
        assert bool((ki == qi + c).any()), "the bound is not reached"


@pytest.mark.parametrize("op,c", [("ge", 0), ("gt", -1), ("eq", 0)])
@pytest.mark.parametrize("shift", [-3, 0, 4])
def test_comparisons_both_ways_round(op: str, c: int, shift: int) -> None:
    """q_idx + shift op kv_idx and its mirrored spelling give kv <= q + shift + c, reached."""
    lhs = q + const(shift) if shift else q
    mirrored = {"ge": "le", "gt": "lt", "eq": "eq"}[op]
    _check(binary(op, lhs, kv), shift + c, tight=True)
    _check(binary(mirrored, kv, lhs), shift + c, tight=True)
    _check(binary(op, lhs - kv, const(0)), shift + c, tight=True)


def test_lower_bounds_and_other_shapes_claim_nothing() -> None:
    for m in (kv >= q, q <= kv, q - kv < 3, binary("floordiv", q, const(2)) >= kv,
              q >= kv * 2, binary("ne", kv, q), q * 2 >= kv * 2):
        _check(m, None)


def test_and_or() -> None:
    window = (q >= kv) & (q - kv <= 8)
    _check(window, 0, tight=True)
    _check((q >= kv + 2) & (kv >= q - 9), -2, tight=True)      # kv <= q - 2
    _check((q > kv) | binary("eq", kv, q + 3), 3, tight=True)
    _check((kv < param("prefix", I32)) | (q >= kv), None)       # prefix-LM keeps later keys
    same_doc = binary("eq", load("doc_ids", (var("b"), q), I32), load("doc_ids", (var("b"), kv), I32))
    _check(same_doc & (q >= kv), 0, tight=True)                 # document-causal
    _check(same_doc, None)


@pytest.mark.parametrize("name", sorted(GYM))
def test_gym_masks(name: str) -> None:
    """Every AttentionGym mask: the claimed bound holds on the grid; the causal ones get 0."""
    traced, bind = GYM[name](1, 4, N, 64).trace()
    m = simplify_variant(traced).hook("mask_mod")
    if m.is_identity:
        return
    c = causal_bound(m.expr)
    if name in ("causal", "sliding_window", "document_causal", "alibi_causal",
                "softcap_causal"):
        assert c == 0
    if c is not None:
        i, j = torch.nonzero(_kept(m.expr, dict(bind.tensors), dict(bind.scalars)),
                             as_tuple=True)
        assert bool((j <= i + c).all())


def _band(w: tuple[int | None, int | None]) -> torch.Tensor:
    qi = torch.arange(N).view(N, 1)
    d = torch.arange(N).view(1, N) - qi  # kv - q
    lo = d >= w[0] if w[0] is not None else torch.ones_like(d, dtype=torch.bool)
    hi = d <= w[1] if w[1] is not None else torch.ones_like(d, dtype=torch.bool)
    return lo & hi


@pytest.mark.parametrize("mask,want", [
    (q >= kv, (None, 0)), (kv < q, (None, -1)), (kv >= q, (0, None)), (q - kv < 3, (-2, None)),
    (binary("eq", kv, q + const(2)), (2, 2)),
    ((q >= kv) & (q - kv <= 8), (-8, 0)),
    ((q >= kv + 2) & (kv >= q - 9) & (kv > q - 20), (-9, -2)),
])
def test_kv_window_is_exactly_the_mask(mask: Node, want: tuple) -> None:
    assert kv_window(mask) == want
    assert torch.equal(_kept(mask), _band(want))


def test_kv_window_refuses_what_is_not_a_band() -> None:
    """A band implied is not enough: or-masks, other coefficients, loads, params, != all None."""
    same_doc = binary("eq", load("doc_ids", (var("b"), q), I32), load("doc_ids", (var("b"), kv), I32))
    for m in ((q > kv) | binary("eq", kv, q + 3), q >= kv * 2, same_doc & (q >= kv),
              (kv < param("prefix", I32)) & (q >= kv), binary("ne", kv, q),
              binary("floordiv", q, const(2)) >= kv):
        assert kv_window(m) is None


@pytest.mark.parametrize("name", sorted(GYM))
def test_gym_kv_windows(name: str) -> None:
    """Every AttentionGym mask that gets a band is exactly that band; the causal ones get
    (None, 0)."""
    traced, bind = GYM[name](1, 4, N, 64).trace()
    m = simplify_variant(traced).hook("mask_mod")
    if m.is_identity:
        return
    w = kv_window(m.expr)
    if name in ("causal", "alibi_causal", "softcap_causal"):
        assert w == (None, 0)
    if name in ("document_mask", "document_causal", "prefix_lm"):
        assert w is None
    if w is not None:
        assert torch.equal(_kept(m.expr, dict(bind.tensors), dict(bind.scalars)), _band(w))
