"""attncc.runtime.serving.merge: the attention-state composition operator (CPU reference)."""
from __future__ import annotations

import math

import pytest
import torch

from attncc.runtime.serving.merge import merge_state, merge_states

NINF = float("-inf")


def attention_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (o [H, M, D], lse [H, M]) of q [H, M, D] over k, v [H, N, D] (rows with no kept
    key give o = 0, lse = -inf)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, NINF)
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else torch.full(s.shape[:-1], NINF,
                                                                       dtype=s.dtype)
    base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - base.unsqueeze(-1))
    return p @ v, lse


def random_qkv(gen: torch.Generator, h: int, m: int, n: int, d: int):
    return tuple(torch.randn(h, x, d, generator=gen, dtype=torch.float64) for x in (m, n, n))


@pytest.mark.parametrize("cuts", [[0, 7], [0, 3, 7], [0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 4, 4, 7]])
def test_merging_chunks_equals_full_attention(cuts: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(cuts))
    q, k, v = random_qkv(gen, 3, 5, 7, 16)
    o_full, lse_full = attention_state(q, k, v)
    parts = [attention_state(q, k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])]
    o, lse = merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(o, o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_full, rtol=1e-12, atol=1e-12)
    o2, lse2 = parts[0]
    for o_b, lse_b in parts[1:]:
        o2, lse2 = merge_state(o2, lse2, o_b, lse_b)
    torch.testing.assert_close(o2, o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse2, lse_full, rtol=1e-12, atol=1e-12)


def test_masked_chunks_and_fully_masked_rows() -> None:
    """Chunks where some rows see no key (empty partial) and a row masked everywhere."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = random_qkv(gen, 2, 6, 40, 8)
    keep = torch.rand(2, 6, 40, generator=gen) < 0.3
    keep[:, 0, :] = False                    # row 0 sees nothing at all
    keep[:, 1, 10:] = False                  # row 1 only sees the first chunk
    o_full, lse_full = attention_state(q, k, v, keep)
    cuts = [0, 10, 25, 40]
    parts = [attention_state(q, k[:, a:b], v[:, a:b], keep[..., a:b]) for a, b in zip(cuts, cuts[1:])]
    o, lse = merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(o, o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_full, rtol=1e-12, atol=1e-12)
    assert torch.isneginf(lse[:, 0]).all() and (o[:, 0] == 0).all()


def test_empty_state_contributes_nothing() -> None:
    gen = torch.Generator().manual_seed(2)
    o_a = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    lse_a = torch.randn(4, generator=gen, dtype=torch.float64)
    garbage = torch.full((4, 8), float("nan"), dtype=torch.float64)
    empty = torch.full((4,), NINF, dtype=torch.float64)
    for o, lse in (merge_state(o_a, lse_a, garbage, empty), merge_state(garbage, empty, o_a, lse_a)):
        assert torch.equal(o, o_a) and torch.equal(lse, lse_a)
    o, lse = merge_state(garbage, empty, garbage, empty)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o, lse = merge_states(torch.stack([garbage, o_a, garbage]), torch.stack([empty, lse_a, empty]))
    torch.testing.assert_close(o, o_a, rtol=1e-15, atol=0)
    torch.testing.assert_close(lse, lse_a, rtol=1e-15, atol=0)
    o, lse = merge_states(torch.stack([garbage, garbage]), torch.stack([empty, empty]))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_merge_states_edge_counts() -> None:
    o1 = torch.randn(1, 3, 5, dtype=torch.float64)
    lse1 = torch.randn(1, 3, dtype=torch.float64)
    o, lse = merge_states(o1, lse1)
    torch.testing.assert_close(o, o1[0], rtol=1e-15, atol=0)
    torch.testing.assert_close(lse, lse1[0], rtol=0, atol=0)
    o, lse = merge_states(o1[:0], lse1[:0])
    assert o.shape == (3, 5) and (o == 0).all() and torch.isneginf(lse).all()


def test_operator_is_commutative_and_associative() -> None:
    gen = torch.Generator().manual_seed(3)
    states = [(torch.randn(2, 4, generator=gen, dtype=torch.float64),
               10 * torch.randn(2, generator=gen, dtype=torch.float64)) for _ in range(3)]
    (a, la), (b, lb), (c, lc) = states
    ab = merge_state(a, la, b, lb)
    ba = merge_state(b, lb, a, la)
    torch.testing.assert_close(ab, ba, rtol=1e-14, atol=1e-14)
    left = merge_state(*ab, c, lc)
    right = merge_state(a, la, *merge_state(b, lb, c, lc))
    torch.testing.assert_close(left, right, rtol=1e-13, atol=1e-13)
    stacked = merge_states(torch.stack([a, b, c]), torch.stack([la, lb, lc]))
    torch.testing.assert_close(stacked, left, rtol=1e-13, atol=1e-13)


def test_large_lse_gaps_do_not_overflow() -> None:
    o = torch.tensor([[[1.0]], [[2.0]]], dtype=torch.float32)
    lse = torch.tensor([[1000.0], [-1000.0]], dtype=torch.float32)
    out, l = merge_states(o, lse)
    assert out.item() == 1.0 and l.item() == 1000.0
    out, l = merge_state(o[0], lse[0], o[1], lse[1])
    assert out.item() == 1.0 and l.item() == 1000.0


def test_low_precision_inputs_keep_their_dtype() -> None:
    o = torch.randn(3, 2, 8).to(torch.bfloat16)
    lse = torch.randn(3, 2)
    out, l = merge_states(o, lse)
    assert out.dtype == torch.float32 and l.dtype == torch.float32   # promoted with lse
    ref, lref = merge_states(o.double(), lse.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call, message", [
    (lambda: merge_state(torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3), torch.zeros(2)),
     "lse's shape plus a head_dim"),
    (lambda: merge_state(torch.zeros(2, 3), torch.zeros(2), torch.zeros(1, 3), torch.zeros(1)),
     "differ"),
    (lambda: merge_states(torch.zeros(3), torch.zeros(())), "at least 2 dims"),
    (lambda: merge_states(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2)),
     "floating point"),
])
def test_validation(call, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message.replace("+", r"\+")):
        call()
