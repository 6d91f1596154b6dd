"""The simplifier: algebraic identities, constant folding, boolean/select rules, dtype
preservation, exact integer floor-div/mod, NaN/inf survival, identity-hook dropping, and
randomised equivalence of evaluate(simplify(e)) with evaluate(e)."""
from __future__ import annotations

import math
import random
import time

import pytest
import torch

from attncc.frontend import Variant
from attncc.ir.evaluator import evaluate
from attncc.ir.nodes import (F32, I32, Node, binary, cast, const, load, param, unary, var, walk,
                             where)
from attncc.ir.printer import format_expr, format_hook
from attncc.ir.simplify import simplify, simplify_variant

s, q, k, h, b = var("score"), var("q_idx"), var("kv_idx"), var("h"), var("b")
NEG_INF, INF, NAN = const(float("-inf")), const(float("inf")), const(float("nan"))


def div(x: Node, y: Node | float) -> Node:
    return binary("div", x, y if isinstance(y, Node) else const(float(y)))


def text(e: Node) -> str:
    return format_expr(simplify(e))


# ----------------------------------------------------------------------------- identities


@pytest.mark.parametrize("expr, want", [
    (s * 1 + 0, "score"),
    (div(s, 30) * 30, "score"),
    (div(s * 30, 30), "score"),
    (q - k + k, "q_idx"),
    (s * 0.1 * 10, "score"),
    (s + cast(q, F32) - cast(q, F32), "score"),
    (unary("neg", unary("neg", s)), "score"),
    ((q - k) * 2 + k * 2, "2 * q_idx"),
    (h * (q - k) + h * k, "h * q_idx"),
    (q * q - (q - 1) * (q + 1), "1"),
    ((s + 1.0) * (s + 1.0) - s * s, "2.0 * score + 1.0"),
    (s * -1, "-score"),
    (const(3) * q - q - q - q, "0"),
])
def test_algebraic_identities(expr: Node, want: str) -> None:
    assert text(expr) == want


def test_rational_coefficients_come_back_as_float_division_or_constant() -> None:
    assert text(div(s, 3) * 2) == "0.6666666666666666 * score"
    assert text(div(s, 30) + div(cast(q, F32), 30)) == "(score + f32(q_idx)) / 30.0"
    out = simplify(div(s, 3) * 2)
    assert all(n.dtype is F32 for n in walk(out))


def test_never_more_ops_than_the_input() -> None:
    # sympy distributes 2*(q-k) into 2q - 2k (one op more): a two-op form is kept
    ops = lambda n: sum(1 for m in walk(n) if m.args)  # noqa: E731
    assert ops(simplify((q - k) * 2)) == 2
    assert ops(simplify(h * q + h * k)) == 2  # and factor_terms finds h * (q + k)
    assert text((q - k) * 4 - k) == "4 * q_idx - 5 * kv_idx"


# ----------------------------------------------------------------------------- folding


def test_constant_folding_uses_f32_math() -> None:
    import numpy as np

    assert simplify(unary("tanh", const(1.0))).attr == float(np.tanh(np.float32(1.0)))
    assert text(unary("exp", const(0.0)) * s) == "score"
    assert text(unary("tanh", const(0.0)) + s) == "score"
    assert text(binary("pow", const(2.0), const(10.0)) + s) == "score + 1024.0"  # const last
    assert text(cast(const(7), F32)) == "7.0"
    assert text(cast(binary("add", const(2.5), const(0.2)), I32)) == "2"
    assert text(binary("mod", const(-7), const(3))) == "2"
    assert text(binary("floordiv", const(-7), const(2))) == "-4"
    assert text(binary("max", const(3), const(-1)) * q) == "3 * q_idx"


def test_folding_never_raises_or_overflows_i32() -> None:
    e = binary("floordiv", const(7), const(0))
    assert simplify(e) is e  # the division by zero stays for the user (and the device) to see
    e = binary("mod", q, const(0))
    assert simplify(e) is e
    big = const(2**30) * 4
    assert simplify(big) is big
    assert text(big - big + q) == "q_idx"  # cancels exactly even though the parts overflow


def test_closed_subexpressions_fold_inside_larger_ones() -> None:
    e = s * unary("sigmoid", const(0.0)) * 2
    assert text(e) == "score"
    e = where(binary("lt", const(1), const(2)), s, NEG_INF)
    assert simplify(e) is s


# ----------------------------------------------------------------------------- boolean rules


causal = q >= k


@pytest.mark.parametrize("expr, want", [
    (causal & const(True), "q_idx >= kv_idx"),
    (causal & const(False), "False"),
    (causal | const(True), "True"),
    (causal | const(False), "q_idx >= kv_idx"),
    (unary("not", unary("not", causal)), "q_idx >= kv_idx"),
    (unary("not", q < k), "q_idx >= kv_idx"),
    (unary("not", binary("eq", q, k)), "q_idx != kv_idx"),
    (unary("not", binary("eq", s, const(1.0))), "score != 1.0"),
    (causal & unary("not", causal), "False"),
    (causal | unary("not", causal), "True"),
    (causal & causal, "q_idx >= kv_idx"),
    (where(const(True), s, s * 2), "score"),
    (where(const(False), s, s * 2), "2.0 * score"),
    (where(causal, s, s), "score"),
    (where(causal, const(True), const(False)), "q_idx >= kv_idx"),
    (where(causal, const(False), const(True)), "q_idx < kv_idx"),
    (where(causal, h >= 1, const(False)), "(q_idx >= kv_idx) & (h >= 1)"),
    (where(causal, where(causal, s, NEG_INF), const(0.0)), "where(q_idx >= kv_idx, score, 0.0)"),
    (binary("lt", const(1.5), const(2.0)), "True"),
    (binary("eq", q, q), "True"),
    (binary("ne", q, q), "False"),
    (binary("lt", s, s), "False"),
    (binary("min", q, q), "q_idx"),
    (binary("max", s, s), "score"),
])
def test_boolean_and_select_rules(expr: Node, want: str) -> None:
    assert text(expr) == want


def test_float_comparisons_keep_nan_semantics() -> None:
    for e in (binary("eq", s, s), binary("ne", s, s), binary("le", s, s),
              unary("not", s < const(0.0))):
        assert simplify(e) is e  # NaN == NaN is False, ~(NaN < 0) is True: no rewrite


# ----------------------------------------------------------------------------- dtypes


def test_i32_island_stays_i32_and_mixed_islands_keep_their_casts() -> None:
    e = (q - k) * h + h * k + 3
    out = simplify(e)
    assert out.dtype is I32 and all(n.dtype is I32 for n in walk(out))
    assert format_expr(out) == "h * q_idx + 3"
    mixed = s - param("slope", F32) * cast(q - k + k, F32) + cast(h, F32) * 0.5
    out = simplify(mixed)
    assert out.dtype is F32
    assert "f32(q_idx)" in format_expr(out)
    for n in walk(out):
        if n.op in ("add", "sub", "mul", "neg"):
            assert {a.dtype for a in n.args} == {n.dtype}


def test_simplify_preserves_dtype_of_every_hook_kind() -> None:
    for e in (s, q, causal, const(True), cast(q, F32) * 0, q * 0, causal & const(True)):
        assert simplify(e).dtype is e.dtype


# ----------------------------------------------------------------------------- floordiv / mod


def test_floordiv_and_mod_stay_opaque_and_exact_on_negatives() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-50, 50, (400,), generator=g)
    y = torch.randint(-9, 10, (400,), generator=g)
    y = torch.where(y == 0, torch.ones_like(y), y)
    env = {"q_idx": x, "kv_idx": y}
    exprs = [
        binary("floordiv", q - k + k, k),
        binary("mod", q * 1 + 0, k),
        binary("floordiv", q, k) * k + binary("mod", q, k) - q,  # == 0, but sympy must not know
        binary("floordiv", q * 3 - q * 2, const(-3)) + binary("mod", q, const(-7)),
        binary("floordiv", q, const(1)) + binary("mod", q, const(-1)),
        binary("floordiv", q, const(-1)),
    ]
    for e in exprs:
        out = simplify(e)
        assert torch.equal(evaluate(out, env), evaluate(e, env)), format_expr(e)
    assert text(exprs[0]) == "q_idx // kv_idx"
    assert text(exprs[4]) == "q_idx"
    assert {n.op for n in walk(simplify(exprs[2]))} >= {"floordiv", "mod"}


# ----------------------------------------------------------------------------- NaN / inf


def test_nan_and_inf_constants_survive() -> None:
    assert text(s + NEG_INF) == "score + -inf"
    e = s * NAN - s * NAN  # x - x is not 0 when x is NaN
    env = {"score": torch.randn(5)}
    assert torch.isnan(evaluate(simplify(e), env)).all()
    e = (s + NEG_INF) - NEG_INF  # sympy would cancel the infinities: the island is kept
    assert torch.isnan(evaluate(simplify(e), env)).all()
    assert text(where(causal, s, NEG_INF)) == "where(q_idx >= kv_idx, score, -inf)"
    assert text(s * 0 + NEG_INF) == "-inf"
    assert math.isnan(simplify((s - s) * NEG_INF).attr)  # (0) * -inf folds to NaN, as computed
    assert text(div(s, 0.0)) == "score / 0.0"  # sympy's zoo never reaches the IR


# ----------------------------------------------------------------------------- variants


def test_identity_hooks_are_dropped_with_their_captures() -> None:
    bias = torch.randn(4)
    scale = 2.0

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 1 + bias[h] * 0 + (scale - scale)

    ir, _ = Variant(score_mod=score_mod, query_mod=lambda q, b, h, qi, d: q[d],
                    key_mod=lambda k, b, h, kv, d: k[d] * 2 - k[d],
                    mask_mod=lambda b, h, qi, kv: (qi >= kv) | (h >= 0) | True).trace()
    assert ir.tensors and ir.scalars
    simple = simplify_variant(ir)
    assert simple.hooks == {}
    assert simple.tensors == () and simple.scalars == ()


def test_simplify_variant_keeps_real_hooks_and_their_captures() -> None:
    slopes = torch.rand(4)
    cap = 30.0

    def alibi_softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh((score - slopes[h] * (q_idx - kv_idx)) / cap)

    ir, _ = Variant(score_mod=alibi_softcap, mask_mod=lambda b, h, qi, kv: (qi >= kv) & True,
                    value_mod=lambda v, b, h, kv, d: v[d] * 1.0).trace()
    simple = simplify_variant(ir)
    assert sorted(simple.hooks) == ["mask_mod", "score_mod"]
    assert [t.name for t in simple.tensors] == ["slopes"]
    assert [p.name for p in simple.scalars] == ["cap"]
    assert format_expr(simple.expr("mask_mod")) == "q_idx >= kv_idx"
    assert simple.hooks["score_mod"].source == ir.hooks["score_mod"].source


@pytest.mark.speed
def test_typical_hooks_simplify_in_milliseconds() -> None:
    slopes = torch.rand(8)
    D = 64

    def rope(q, b, h, q_idx, d):
        half = D // 2
        rot = torch.where(d < half, -q[(d + half) % D], q[(d - half) % D])
        ang = q_idx * (10000.0 ** (-(d % half).float() * 2 / D))
        return q[d] * torch.cos(ang) + rot * torch.sin(ang)

    irs = [Variant(score_mod=lambda s, b, h, qi, kv: 30 * torch.tanh(s / 30)).trace()[0],
           Variant(score_mod=lambda s, b, h, qi, kv: s - slopes[h] * (qi - kv)).trace()[0],
           Variant(query_mod=rope).trace()[0]]
    simplify_variant(irs[1])  # warm sympy up (its first call imports and caches internals)
    start = time.perf_counter()
    for ir in irs:
        simplify_variant(ir)
    # a few ms each on a laptop; the bound only catches pathological regressions
    assert time.perf_counter() - start < 1.0


# ----------------------------------------------------------------------------- randomised


B_, H_, Q_, K_ = 2, 3, 5, 7
PARAMS = {"n": 3, "c": 0.7}


def _env() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"score": torch.randn(B_, H_, Q_, K_, generator=g, dtype=torch.float64) * 2,
            "b": torch.arange(B_).view(B_, 1, 1, 1), "h": torch.arange(H_).view(1, H_, 1, 1),
            "q_idx": torch.arange(Q_).view(1, 1, Q_, 1),
            "kv_idx": torch.arange(K_).view(1, 1, 1, K_)}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"tab": torch.randn(H_, K_, generator=g, dtype=torch.float64),
            "ids": torch.randint(-3, 4, (H_, Q_), generator=g)}


class _RandomExpr:
    """Random well-typed IR over every op. Float discontinuities (floor, to_i32, float
    comparisons) only see leaves, so rounding differences cannot flip them; divisors are
    never zero, so evaluation never raises."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def leaf(self, kind: str) -> Node:
        r = self.r
        if kind == "i":
            return r.choice([lambda: var(r.choice(["b", "h", "q_idx", "kv_idx"])),
                             lambda: const(r.randint(-4, 4)), lambda: param("n", I32),
                             lambda: load("ids", (h, q), I32)])()
        if kind == "f":
            return r.choice([lambda: s, lambda: param("c", F32),
                             lambda: const(r.choice([0.0, 1.0, -1.0, 0.5, 2.0, 30.0, 0.1, -2.5])),
                             lambda: load("tab", (h, k), F32)])()
        return r.choice([lambda: const(r.random() < 0.5), lambda: causal,
                         lambda: binary("eq", h, const(1)), lambda: s > const(0.0)])()

    def expr(self, kind: str, depth: int) -> Node:
        r = self.r
        if depth == 0 or r.random() < 0.2:
            return self.leaf(kind)
        sub = lambda kd: self.expr(kd, depth - 1)  # noqa: E731
        cmp = ["lt", "le", "gt", "ge", "eq", "ne"]
        if kind == "i":
            c = r.randrange(10)
            if c < 4:
                return binary(r.choice(["add", "sub", "mul", "add", "sub"]), sub("i"), sub("i"))
            if c == 4:
                return unary("neg", sub("i"))
            if c == 5:
                den = r.choice([const(r.choice([-7, -3, -2, -1, 1, 2, 3, 5, 8])),
                                binary("add", unary("abs", sub("i")), const(1))])
                return binary(r.choice(["floordiv", "mod"]), sub("i"), den)
            if c == 6:
                return binary(r.choice(["min", "max"]), sub("i"), sub("i"))
            if c == 7:
                return where(sub("b"), sub("i"), sub("i"))
            if c == 8:
                return unary("abs", sub("i"))
            return cast(self.leaf("f") * 3.0, I32)
        if kind == "f":
            c = r.randrange(12)
            if c < 4:
                return binary(r.choice(["add", "sub", "mul"]), sub("f"), sub(r.choice("fi")))
            if c == 4:
                den = r.choice([binary("add", unary("abs", sub("f")), const(1.0)),
                                const(r.choice([30.0, -2.0, 0.5, 3.0]))])
                return binary("div", sub("f"), den)
            if c == 5:
                return unary(r.choice(["tanh", "sigmoid", "sin", "cos", "abs", "neg"]), sub("f"))
            if c == 6:
                return unary("sqrt", unary("abs", sub("f")))
            if c == 7:
                clamped = binary("min", binary("max", sub("f"), const(-8.0)), const(8.0))
                return unary("exp", clamped)
            if c == 8:
                return cast(sub("i"), F32)
            if c == 9:
                return where(sub("b"), sub("f"), sub(r.choice("fi")))
            if c == 10:
                return binary(r.choice(["min", "max"]), sub("f"), sub("f"))
            return unary("floor", self.leaf("f"))
        c = r.randrange(6)
        if c < 2:
            return binary(r.choice(cmp), sub("i"), sub("i"))
        if c == 2:
            return binary(r.choice(cmp), self.leaf("f"), self.leaf("f"))
        if c == 3:
            return binary(r.choice(["and", "or"]), sub("b"), sub("b"))
        if c == 4:
            return unary("not", sub("b"))
        return where(sub("b"), sub("b"), sub("b"))


@pytest.mark.speed
def test_random_expressions_evaluate_the_same_after_simplify() -> None:
    """~300 random expressions of every op and dtype, evaluated in float64 on a full grid."""
    env, tensors = _env(), _tensors()
    changed = 0
    start = time.perf_counter()
    for seed in range(300):
        kind = "fib"[seed % 3]
        e = _RandomExpr(seed).expr(kind, 4)
        out = simplify(e)
        assert out.dtype is e.dtype
        changed += out is not e
        want = evaluate(e, env, tensors, PARAMS, torch.float64)
        got = evaluate(out, env, tensors, PARAMS, torch.float64)
        want, got = torch.broadcast_tensors(want, got)
        msg = f"seed {seed}\n{format_hook('before', e)}\n{format_hook('after', out)}"
        if e.dtype is F32:
            scale = 1.0 + float(torch.nan_to_num(want, posinf=0, neginf=0).abs().max())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale, equal_nan=True,
                                       msg=lambda m: f"{msg}\n{m}")
        else:
            assert torch.equal(got, want), msg
    assert changed > 100  # the generator really exercises the rewrites
    assert time.perf_counter() - start < 20.0


def test_special_constants_in_random_contexts_survive() -> None:
    env = {**_env(), "score": torch.tensor([float("nan"), 1.0, -2.0, 0.0], dtype=torch.float64)}
    env = {n: (t.flatten()[:1] if n != "score" else t) for n, t in env.items()}
    tensors = _tensors()
    for seed in range(60):
        e = _RandomExpr(1000 + seed).expr("f", 3)
        special = const(random.Random(seed).choice([float("nan"), float("inf"), float("-inf")]))
        for wrapped in (e + special - special, (e - special) * 2 + special, e * special - e):
            out = simplify(wrapped)
            want = evaluate(wrapped, env, tensors, PARAMS, torch.float64)
            got = evaluate(out, env, tensors, PARAMS, torch.float64)
            want, got = torch.broadcast_tensors(want, got)
            assert torch.equal(torch.isnan(got), torch.isnan(want)), format_hook("e", wrapped)
            assert torch.equal(torch.isinf(got), torch.isinf(want)), format_hook("e", wrapped)


def test_simplify_is_idempotent_without_the_cache() -> None:
    from attncc.ir.simplify import clear_cache

    for seed in range(500, 620):
        e = _RandomExpr(seed).expr("fib"[seed % 3], 4)
        clear_cache()
        once = simplify(e)
        clear_cache()
        assert simplify(once) is once, format_hook("once", once)


@pytest.mark.speed
def test_long_chains_do_not_recurse_or_go_quadratic() -> None:
    total = q
    for i in range(3000):  # a sum built in a Python loop: one very deep island
        total = total + (k if i % 2 else const(i % 5))
    mask = causal
    for i in range(1500):
        mask = mask & binary("ne", q - k, const(i))
    x = s
    for _ in range(100):  # every level is shared by tanh and by the next island
        x = unary("tanh", x) + x * 0.5
    start = time.perf_counter()
    out = simplify(total)
    simplify(mask)
    simplify(x)
    assert time.perf_counter() - start < 20.0
    env = {"q_idx": torch.arange(-3, 4), "kv_idx": torch.arange(7) * 5}
    assert torch.equal(evaluate(out, env), evaluate(total, env))
