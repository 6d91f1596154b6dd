"""NaN and inf propagate as torch's FlexAttention does (CPU path and the CPU merge).

torch 2.x `torch.nn.attention.flex_attention.flex_attention` in eager mode on the CPU, with
`return_lse=True` (float32; one (B, H) slice, 6 query rows, 6 keys, "row r" = query r, "key j" =
key/value position j). Every case here is checked against torch itself by
`test_cpu_matches_torch_flex_attention`.

| case                                         | output                       | LSE            |
|----------------------------------------------|------------------------------|----------------|
| NaN in q (row r)                              | row r all NaN                | row r NaN      |
| NaN in k (key j)                              | every row keeping j: all NaN | those rows NaN |
| NaN in v (key j, element d)                   | column d NaN in rows keeping j | unchanged    |
| +inf / -inf in k or q making a score +inf     | that row all NaN             | +inf           |
| ... making a score -inf                       | key j drops out of that row  | finite         |
| +inf in v (key j)                             | +-inf in rows keeping j (col d) | unchanged   |
| score_mod NaN on key j (or torch.log(score))  | every row keeping j: all NaN | NaN            |
| score_mod +inf on key j (or on several keys)  | every row keeping j: all NaN | +inf           |
| score_mod -inf on key j                       | key j drops out              | finite         |
| score_mod -inf on every key of row r          | row r is 0                   | -inf           |
| a NaN and a +inf score in one row             | that row all NaN             | NaN            |
| masked key whose score would be NaN / +inf    | no effect (never read)       | no effect      |
| row with no kept key (mask or block mask)     | 0, even if q is NaN          | -inf           |
| NaN / inf in v at a masked key                | attncc: no effect (*)        | no effect      |

(*) torch's eager path computes `softmax @ v` over all keys, so `0 * NaN` turns column d of
every row NaN, fully masked rows included; its compiled kernels do the same for keys inside a
block they read and not for skipped blocks. attncc's CPU path takes "masked" literally: the key is
never read. Its GPU kernels behave like torch's compiled ones (a masked key that shares a key
tile with a row's kept keys is multiplied by 0 in the P V product), see docs/semantics.md.

normalize="none" (`out = sum over kept keys of score * v`) follows IEEE products: a NaN score on a
kept key makes its row NaN; masked keys are never read.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import pytest
import torch

import attncc
from attncc.runtime.serving.merge import merge_pair, merge_state, merge_states

flex = pytest.importorskip("torch.nn.attention.flex_attention")

NAN, INF = float("nan"), float("inf")
B, H, S, D = 1, 2, 6, 8


def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q >= kv


def row2_masked(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q != 2


def nothing(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q < 0


def _qkv(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, generator=g)  # type: ignore[return-value]
                 for _ in range(3))


def _poke(name: str, row: int, col: int, val: float) -> Callable:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        {"q": q, "k": k, "v": v}[name][0, 0, row, col] = val
    return f


def _score_at(kv_j: int | None, val: float, q_i: int | None = None) -> Callable:
    def score_mod(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        if q_i is None:
            return torch.where(kv == kv_j, val, s)
        return torch.where(q == q_i, val, s)
    return score_mod


def _log_score(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return torch.log(s)


# (name, poke inputs, score_mod, mask_mod)
CASES = [
    ("nan_q_row", _poke("q", 2, 1, NAN), None, None),
    ("nan_k_key", _poke("k", 3, 1, NAN), None, None),
    ("nan_v_key", _poke("v", 3, 1, NAN), None, None),
    ("posinf_k_key", _poke("k", 3, 1, INF), None, None),
    ("neginf_k_key", _poke("k", 3, 1, -INF), None, None),
    ("posinf_q_row", _poke("q", 2, 1, INF), None, None),
    ("posinf_v_key", _poke("v", 3, 1, INF), None, None),
    ("score_nan_key", None, _score_at(3, NAN), None),
    ("score_log", None, _log_score, None),
    ("score_posinf_key", None, _score_at(3, INF), None),
    ("score_neginf_key", None, _score_at(3, -INF), None),
    ("score_neginf_row", None, _score_at(None, -INF, q_i=2), None),
    ("score_nan_and_posinf", None, lambda s, b, h, q, kv: torch.where(
        kv == 1, NAN, torch.where(kv == 3, INF, s)), None),
    ("causal_score_nan_key", None, _score_at(3, NAN), causal),
    ("causal_score_posinf_key", None, _score_at(3, INF), causal),
    ("causal_score_log", None, _log_score, causal),
    ("causal_nan_k_key", _poke("k", 3, 1, NAN), None, causal),
    ("causal_posinf_k_key", _poke("k", 3, 1, INF), None, causal),
    ("causal_nan_q_row", _poke("q", 2, 1, NAN), None, causal),
    ("masked_row", None, None, row2_masked),
    ("masked_row_nan_q", _poke("q", 2, 1, NAN), None, row2_masked),
    ("masked_row_nan_k", _poke("k", 3, 1, NAN), None, row2_masked),
    ("masked_row_score_nan", None, _score_at(None, NAN, q_i=2), row2_masked),
    ("all_masked", None, None, nothing),
    ("all_masked_nan_q", _poke("q", 1, 0, NAN), None, nothing),
]


def _inputs(case: tuple, seed: int = 0) -> tuple[torch.Tensor, ...]:
    q, k, v = _qkv(seed)
    if case[1] is not None:
        case[1](q, k, v)
    return q, k, v


def _torch_flex(q, k, v, score_mod, mask_mod):
    bm = None if mask_mod is None else flex.create_block_mask(mask_mod, None, None, S, S,
                                                              device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)


def _attncc(q, k, v, score_mod, mask_mod, block_mask: bool = False):
    if block_mask and mask_mod is not None:
        bm = attncc.create_block_mask(mask_mod, None, None, S, S, device="cpu")
        return attncc.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                     return_lse=True)
    variant = attncc.Variant(score_mod=score_mod, mask_mod=mask_mod)
    return attncc.flex_attention(q, k, v, score_mod=variant, return_lse=True)


def assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same NaN pattern, same infinities, finite values within tolerance."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan()), (
        f"{what}: NaN at {got.isnan().nonzero().tolist()}, "
        f"expected {want.isnan().nonzero().tolist()}")
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{what}: infinities"
    fin = want.isfinite()
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-5, msg=what)


@pytest.mark.parametrize("block_mask", [False, True], ids=["mask_mod", "block_mask"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpu_matches_torch_flex_attention(case: tuple, block_mask: bool) -> None:
    q, k, v = _inputs(case)
    want_o, want_lse = _torch_flex(q, k, v, case[2], case[3])
    got_o, got_lse = _attncc(q, k, v, case[2], case[3], block_mask)
    assert_same_nonfinite(got_o, want_o, f"{case[0]} out")
    assert_same_nonfinite(got_lse, want_lse, f"{case[0]} lse")


def test_fully_masked_rows_are_zero_with_lse_neg_inf() -> None:
    q, k, v = _inputs(CASES[0])  # NaN in q row 2
    out, lse = _attncc(q, k, v, None, row2_masked)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.isneginf(lse[:, :, 2]).all()


@pytest.mark.parametrize("val", [NAN, INF, -INF])
@pytest.mark.parametrize("mask", [causal, row2_masked, nothing], ids=["causal", "row2", "none"])
def test_nonfinite_value_at_masked_key_is_never_read(val: float, mask: Callable) -> None:
    """torch's eager path turns every row NaN here (0 * NaN in softmax @ v); attncc does not."""
    q, k, v = _qkv(1)
    v_bad = v.clone()
    v_bad[:, :, 4, 3] = val
    got_o, got_lse = _attncc(q, k, v_bad, None, mask)
    clean_o, clean_lse = _attncc(q, k, v, None, mask)
    keeps4 = torch.tensor([bool(mask(0, 0, torch.tensor(r), torch.tensor(4))) for r in range(S)])
    torch.testing.assert_close(got_o[:, :, ~keeps4], clean_o[:, :, ~keeps4], rtol=0, atol=0)
    torch.testing.assert_close(got_lse, clean_lse, rtol=0, atol=0)
    col = got_o[:, :, keeps4, 3]
    assert (col.isnan() if math.isnan(val) else col == val).all()


@pytest.mark.parametrize("score_val,v_val", [(NAN, NAN), (INF, INF), (INF, -INF), (-INF, NAN)],
                         ids=["nan-nan", "inf-inf", "inf-neginf", "neginf-nan"])
def test_normalize_none_uses_ieee_products_and_never_reads_masked_keys(score_val: float,
                                                                      v_val: float) -> None:
    """out = sum over kept keys of score * v, each product as IEEE gives it: key 1's score is
    `score_val` (kept by rows 1..), its value row has `v_val` at element 0 (finite elsewhere);
    key 5's value row is NaN (masked for rows 0..4 by causal)."""
    q, k, v = _qkv(2)
    v[:, :, 5, 0] = NAN
    v[:, :, 1, 0] = v_val
    variant = attncc.Variant(score_mod=lambda s, b, h, qi, ki: torch.where(ki == 1, score_val, s),
                             mask_mod=causal, normalize="none")
    out = attncc.flex_attention(q, k, v, score_mod=variant)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    s[..., 1] = score_val
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    want = torch.stack([torch.where(keep[r, :, None], s[..., r, :, None] * v.double(), 0).sum(-2)
                        for r in range(S)], dim=2)
    assert_same_nonfinite(out, want, "normalize=none")
    assert torch.isfinite(out[:, :, 0]).all()  # row 0 keeps key 0 only
    assert not torch.isfinite(out[:, :, 1:, 0]).any()


# ------------------------------------------------------------------------------------ merging
def _split_states(q, k, v, score_mod, mask_mod, cut: int):
    """States of keys [0, cut) and [cut, S) from the CPU reference, and the full one."""
    def part(lo: int, hi: int):
        def mm(b, h, qi, kv):
            inside = (kv >= lo) & (kv < hi)
            return inside if mask_mod is None else inside & mask_mod(b, h, qi, kv)
        return _attncc(q, k, v, score_mod, mm)
    return part(0, cut), part(cut, S), _attncc(q, k, v, score_mod, mask_mod)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_merging_split_states_keeps_the_nan_inf_pattern(case: tuple) -> None:
    q, k, v = _inputs(case)
    (oa, la), (ob, lb), (o, lse) = _split_states(q, k, v, case[2], case[3], cut=3)
    for got_o, got_lse in (merge_state(oa, la, ob, lb),
                           merge_states(torch.stack([oa, ob]), torch.stack([la, lb]))):
        assert_same_nonfinite(got_o, o, f"{case[0]} merged out")
        assert_same_nonfinite(got_lse, lse, f"{case[0]} merged lse")


def test_merge_propagates_nan_and_posinf_states() -> None:
    o = torch.tensor([[1.0, 2.0], [NAN, NAN], [NAN, NAN], [5.0, 6.0]], dtype=torch.float64)
    lse = torch.tensor([0.0, NAN, INF, -INF], dtype=torch.float64)
    other_o = torch.tensor([[3.0, 4.0]] * 4, dtype=torch.float64)
    other_lse = torch.zeros(4, dtype=torch.float64)
    for mo, ml in (merge_state(o, lse, other_o, other_lse),
                   merge_pair(o, lse, other_o, other_lse),
                   merge_states(torch.stack([o, other_o]), torch.stack([lse, other_lse]))):
        assert ml[0] == pytest.approx(math.log(2)) and mo[0].tolist() == [2.0, 3.0]
        assert ml[1].isnan() and mo[1].isnan().all()
        assert ml[2] == INF and mo[2].isnan().all()
        assert ml[3] == 0.0 and mo[3].tolist() == [3.0, 4.0]  # empty state: o never read


def test_merge_of_nan_output_with_finite_lse_stays_nan() -> None:
    """A NaN value row keeps a finite LSE but a NaN output; merging must not drop it even when
    its weight underflows to 0."""
    o = torch.tensor([[NAN, 1.0]], dtype=torch.float64)
    mo, ml = merge_state(o, torch.tensor([-1000.0], dtype=torch.float64),
                         torch.tensor([[2.0, 2.0]], dtype=torch.float64),
                         torch.tensor([0.0], dtype=torch.float64))
    assert ml.item() == 0.0 and mo[0, 0].isnan() and mo[0, 1].item() == 2.0
