"""attncc.ir.intervals: sound integer intervals over a call's shapes, and the captured-read
check built on them (attncc.ir.analysis.check_captured_reads)."""
from __future__ import annotations

import random

import pytest
import torch

import attncc
from attncc.ir.analysis import CapturedReadError, Shapes, check_captured_reads
from attncc.ir.evaluator import evaluate
from attncc.ir.intervals import Domain, band_points, implied_band, interval, ranges
from attncc.ir.nodes import I32, binary, const, load, unary, var, where
from attncc.ir.simplify import simplify_variant

Q, KV, B, H = var("q_idx"), var("kv_idx"), var("b"), var("h")


def _random_expr(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.25:
        return rng.choice([Q, KV, B, H, const(rng.randint(-9, 9))])
    a = _random_expr(rng, depth - 1)
    op = rng.choice(["add", "sub", "mul", "mulc", "mod", "floordiv", "min", "max", "neg",
                     "abs", "where"])
    if op in ("neg", "abs"):
        return unary(op, a)
    if op == "mulc":
        return binary("mul", a, const(rng.choice([-3, 2, 7])))
    if op in ("mod", "floordiv"):
        return binary(op, a, const(rng.choice([-4, 3, 5])))
    b = _random_expr(rng, depth - 1)
    if op == "where":
        return where(binary("ge", a, b), a, b)
    return binary(op, a, b)


@pytest.mark.parametrize("band", [None, (None, 0), (-3, 0), (1, 4)])
def test_intervals_contain_every_value_on_the_domain(band) -> None:
    rng = random.Random(hash(band) & 0xFFFF)
    sizes = {"b": 2, "h": 3, "q_idx": 9, "kv_idx": 7}
    env = {"b": torch.arange(2).view(2, 1, 1, 1), "h": torch.arange(3).view(1, 3, 1, 1),
           "q_idx": torch.arange(9).view(1, 1, 9, 1), "kv_idx": torch.arange(7).view(1, 1, 1, 7)}
    rel = env["kv_idx"] - env["q_idx"]
    inside = torch.ones_like(rel, dtype=torch.bool)
    if band is not None:
        inside = ((rel >= band[0]) if band[0] is not None else inside) & (
            (rel <= band[1]) if band[1] is not None else inside)
    inside = inside.expand(2, 3, 9, 7)
    dom = Domain(sizes, band=band)
    checked = 0
    for _ in range(300):
        e = _random_expr(rng, 4)
        got = interval(e, dom)
        vals = evaluate(e, env).expand(2, 3, 9, 7)[inside]
        if got is None or not vals.numel():
            continue
        checked += 1
        assert got[0] <= int(vals.min()) and int(vals.max()) <= got[1], (e, got)
    assert checked > 200


def test_linear_indices_are_exact_under_a_band() -> None:
    dom = Domain({"q_idx": 100, "kv_idx": 100})
    assert interval(Q - KV, dom) == (-99, 99)
    assert interval(Q - KV, dom.with_band(implied_band(Q >= KV))) == (0, 99)
    win = (Q >= KV) & (Q - KV <= 8)
    assert interval(Q - KV + 8, dom.with_band(implied_band(win))) == (8, 16)
    assert interval(KV * 2 - Q * 2, dom.with_band((-8, 0))) == (-16, 0)
    assert band_points(Domain({"q_idx": 4, "kv_idx": 4}, band=(5, None))) == []


def test_values_past_32_bits_show_in_the_interval() -> None:
    e = Q * 70000 * 70000
    assert interval(e, Domain({"q_idx": 2})) == (0, 70000 * 70000)
    assert ranges(e, Domain({"q_idx": 2}))[id(Q * 70000)] == (0, 70000)


def test_unknowns_stay_unknown() -> None:
    t = load("tbl", (Q,), I32)
    dom = Domain({"q_idx": 4})
    assert interval(t, dom) is None and interval(t + 1, dom) is None
    assert interval(binary("floordiv", Q, Q - 1), dom) is None  # divisor range holds 0
    assert interval(t, Domain({"q_idx": 4}, tensor_ranges={"tbl": (0, 3)})) == (0, 3)


# ----------------------------------------------------------------------------- captured reads

SH = Shapes(B=2, Hq=4, Hkv=2, Sq=64, Skv=64, D=64, Dv=64)


def _check(variant, shapes=SH):
    ir, bind = variant.trace()
    return check_captured_reads(simplify_variant(ir), shapes, bind.tensors, bind.scalars)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_reads_proven_inside_everywhere_are_left_alone() -> None:
    slopes, doc = torch.ones(4), torch.zeros(2, 64, dtype=torch.int32)
    v = attncc.Variant(score_mod=lambda s, b, h, q, kv: s - slopes[h] * (q - kv),
                       mask_mod=lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv))
    got = _check(v)
    assert not got.clamp and not got.undecided


def test_read_inside_only_at_kept_positions_is_clamped_not_an_error() -> None:
    tbl = torch.zeros(64)
    got = _check(attncc.Variant(score_mod=lambda s, b, h, q, kv: s + tbl[q - kv],
                                mask_mod=causal))
    assert [(n.attr, d) for n, d in got.clamp.items()] == [("tbl", (0,))] and not got.undecided


def test_guard_band_proves_a_where_guarded_read() -> None:
    tbl = torch.zeros(64)
    got = _check(attncc.Variant(
        score_mod=lambda s, b, h, q, kv: s + torch.where(q >= kv, tbl[q - kv], 0.0)))
    assert not got.clamp


def test_read_outside_at_a_kept_position_is_an_error_with_a_witness() -> None:
    tbl = torch.zeros(64)

    def unmasked_bias(s, b, h, q_idx, kv_idx):
        return s + tbl[q_idx - kv_idx]

    with pytest.raises(CapturedReadError, match=r"test_intervals.py:\d+ \(unmasked_bias\): "
                       r"score_mod reads tbl\[q_idx - kv_idx\] = tbl\[-63\] at \(b=0, h=0, "
                       r"q_idx=0, kv_idx=63\)"):
        _check(attncc.Variant(score_mod=unmasked_bias))
    with pytest.raises(CapturedReadError, match=r"tbl\[64\] at \(b=0, h=0, q_idx=64, kv_idx=0\)"):
        _check(attncc.Variant(score_mod=unmasked_bias, mask_mod=causal),
               Shapes(B=1, Hq=1, Hkv=1, Sq=65, Skv=65, D=64, Dv=64))
    slopes = torch.ones(3)
    with pytest.raises(CapturedReadError, match=r"slopes\[h\] = slopes\[3\] at \(b=0, h=3"):
        _check(attncc.Variant(score_mod=lambda s, b, h, q, kv: s * slopes[h]))


def test_undecided_reads_are_clamped_and_listed() -> None:
    perm, tbl = torch.arange(64), torch.zeros(64)
    got = _check(attncc.Variant(score_mod=lambda s, b, h, q, kv: s + tbl[perm[q]]))
    assert [n.attr for n in got.undecided] == ["tbl"] and len(got.clamp) == 1


def test_reads_of_an_empty_tensor_are_an_error() -> None:
    nothing = torch.zeros(0)
    with pytest.raises(CapturedReadError, match=r"nothing\[0\] at .* outside dim 0 of nothing "
                                                r"\[0, 0\)"):
        _check(attncc.Variant(score_mod=lambda s, b, h, q, kv: s + nothing[h % 1]))


def test_an_empty_call_reads_nothing() -> None:
    tbl = torch.zeros(3)
    v = attncc.Variant(score_mod=lambda s, b, h, q, kv: s + tbl[q - kv])
    from dataclasses import replace

    got = _check(v, replace(SH, Sq=0))
    assert not got.clamp and not got.undecided


def test_a_window_width_captured_as_a_scalar_bounds_the_kept_distances() -> None:
    window = 16
    tbl = torch.zeros(window + 1)
    v = attncc.Variant(score_mod=lambda s, b, h, q, kv: s + tbl[q - kv],
                       mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv <= window))
    got = _check(v)
    assert [n.attr for n in got.clamp] == ["tbl"] and not got.undecided  # masked-only: proven
