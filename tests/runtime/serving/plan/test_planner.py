"""The compiled planner (serving/plan/planner.c) gives exactly the numpy scheduler's plan."""
from __future__ import annotations

import time

import numpy as np
import pytest

from attncc.runtime.serving.plan import planner, scheduler

needs_cc = pytest.mark.skipif(not planner.available(), reason="no C compiler to build the planner")

FIELDS = ("units", "cta_indptr", "cta_units", "merge_indptr", "merge_out",
          "qo_indptr", "kv_lens")


def _assert_same(a: scheduler.Plan, b: scheduler.Plan) -> None:
    assert (a.kv_chunk, a.num_partial_slots, a.num_units) == (b.kv_chunk, b.num_partial_slots,
                                                               b.num_units)
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape, f
        assert x.tobytes() == y.tobytes(), f


def _random_case(rng: np.random.Generator) -> tuple[tuple, dict]:
    B = int(rng.integers(1, 60))
    q = rng.integers(0, 300, B) * (rng.random(B) < 0.7) + (rng.random(B) < 0.5)
    kv = rng.integers(0, 5000, B) * (rng.random(B) < 0.9)
    if rng.random() < 0.3:  # long runs of equal costs: the round-robin path
        kv = np.full(B, int(rng.integers(1, 3000)))
    hk, g = int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 4, 8]))
    alpha = float(rng.choice([0.0, 1.0, 0.5, 3.0]))
    beta = float(rng.choice([1.0, 0.25, 2.0, 0.0])) or (1.0 if alpha == 0.0 else 0.0)
    args = (np.concatenate([[0], np.cumsum(q)]), kv, hk * g, hk, int(rng.choice([16, 32, 64, 128])),
            int(rng.integers(1, 300)))
    kw = dict(alpha=alpha, beta=beta, kv_chunk_align=int(rng.choice([1, 16, 64])),
              min_kv_chunk=int(rng.choice([1, 128, 512])))
    return args, kw


@needs_cc
def test_compiled_plan_equals_numpy_plan() -> None:
    rng = np.random.default_rng(2026)
    for _ in range(300):
        args, kw = _random_case(rng)
        _assert_same(scheduler.plan(*args, **kw, impl="numpy"),
                     scheduler.plan(*args, **kw, impl="c"))


@pytest.mark.speed
@needs_cc
def test_compiled_plan_is_faster() -> None:
    """Prints the medians; asserts only that C beats numpy (CI machines are noisy)."""
    rng = np.random.default_rng(0)
    qo, kv = np.arange(257), rng.integers(512, 1025, 256)

    def median_us(impl: str) -> float:
        ts = []
        for _ in range(60):
            t0 = time.perf_counter()
            scheduler.plan(qo, kv, 32, 8, 16, 792, kv_chunk_align=32, impl=impl)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts[10:])) * 1e6

    c, n = median_us("c"), median_us("numpy")
    print(f"\nplan() at decode batch 256: C {c:.0f} us, numpy {n:.0f} us")
    assert c < n


def test_impl_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="impl="):
        scheduler.plan([0, 1], [10], 1, 1, 16, 1, impl="rust")


# --------------------------------------------------------------------------- packed in one step

def _layout_for(rng: np.random.Generator, args: tuple) -> scheduler.PlanLayout:
    """A layout with room to spare for the plan of `args` (so the maxima are not the sizes)."""
    qo, _kv, hq, hk, tile_q, num_ctas = args
    return scheduler.PlanLayout(len(qo) - 1 + int(rng.integers(0, 4)),
                                int(qo[-1]) + int(rng.integers(0, 64)),
                                num_ctas + int(rng.integers(0, 8)), hq, hk, tile_q)


@needs_cc
def test_plan_into_writes_exactly_what_pack_writes() -> None:
    """Same words in the same buffer, the untouched ones included (a poisoned buffer)."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        args, kw = _random_case(rng)
        layout = _layout_for(rng, args)
        want = np.full(layout.size + 5, -7, dtype=np.int32)
        scheduler.plan(*args, **kw, impl="numpy").pack(layout, out=want[:layout.size])
        got = np.full(layout.size + 5, -7, dtype=np.int32)
        scheduler.plan_into(got[:layout.size], layout, *args, **kw)
        assert got.tobytes() == want.tobytes()


@needs_cc
@pytest.mark.parametrize("case", ["long equal runs, unequal loads", "zero costs", "one CTA",
                                  "more CTAs than units", "one request per CTA"])
def test_compiled_greedy_corner_cases(case: str) -> None:
    """The C greedy's paths: a run longer than the grid whose loads differ by more than a unit
    (taken in grid-sized pieces), free units, a one-CTA grid, an idle grid, a full deal."""
    rng = np.random.default_rng(3)
    qo = np.arange(41)
    kw: dict = {}
    if case == "long equal runs, unequal loads":
        kv = np.concatenate([rng.integers(1, 4000, 8), np.full(32, 999)])
        args = (qo, kv, 8, 8, 16, 5)
    elif case == "zero costs":
        kv = np.where(rng.random(40) < 0.5, 0, rng.integers(1, 900, 40))
        args, kw = (qo, kv, 4, 2, 16, 7), dict(alpha=0.0, beta=1.0, min_kv_chunk=64)
    elif case == "one CTA":
        args = (qo, rng.integers(0, 3000, 40), 4, 4, 16, 1)
    elif case == "more CTAs than units":
        args = (qo, rng.integers(1, 50, 40), 2, 1, 16, 999)
    else:
        args = (qo, np.full(40, 128), 1, 1, 16, 40)
    _assert_same(scheduler.plan(*args, **kw, impl="numpy"), scheduler.plan(*args, **kw, impl="c"))


@needs_cc
@pytest.mark.parametrize("hk", [4, 8, 32])
def test_compiled_plan_equals_numpy_plan_at_serving_scale(hk: int) -> None:
    """Decode-sized batches on a decode grid (792 CTAs): the C greedy's idle phase (units to
    CTAs never loaded yet), the run that outgrows it, and runs taken whole or unit by unit."""
    rng = np.random.default_rng(hk)
    for _ in range(12):
        batch = int(rng.integers(1, 257))
        kv = rng.choice([rng.integers(512, 1025, batch), np.full(batch, 1024),
                         np.minimum(rng.pareto(1.5, batch) * 700 + 16, 32768).astype(np.int64),
                         rng.integers(0, 8192, batch) * (rng.random(batch) < 0.9)])
        q = np.where(rng.random(batch) < 0.9, 1, rng.integers(0, 64, batch))
        args = (np.concatenate([[0], np.cumsum(q)]), kv, 32, hk, 16, 792)
        kw = dict(kv_chunk_align=int(rng.choice([16, 32])),
                  min_kv_chunk=int(rng.choice([128, 256])))
        _assert_same(scheduler.plan(*args, **kw, impl="numpy"),
                     scheduler.plan(*args, **kw, impl="c"))


@needs_cc
def test_compiled_greedy_free_units_while_ctas_are_idle() -> None:
    """Units of cost 0 when some CTAs have had nothing yet go to the first idle CTA."""
    qo = np.arange(31)
    kv = np.concatenate([np.full(10, 500), np.zeros(20, dtype=np.int64)])
    args = (qo, kv, 2, 2, 16, 100)
    kw = dict(alpha=0.0, beta=1.0, min_kv_chunk=1024)
    _assert_same(scheduler.plan(*args, **kw, impl="numpy"), scheduler.plan(*args, **kw, impl="c"))


def test_plan_into_names_the_exceeded_maximum_and_writes_nothing() -> None:
    layout = scheduler.PlanLayout(4, 64, 4, 4, 1, 16)
    out = np.full(layout.size, 5, dtype=np.int32)
    with pytest.raises(ValueError, match="num_ctas 6 > PlanLayout.max_ctas = 4"):
        scheduler.plan_into(out, layout, [0, 2, 3], [4000, 40], 4, 1, 16, num_ctas=6)
    with pytest.raises(ValueError, match="batch_size 5 > PlanLayout.max_batch = 4"):
        scheduler.plan_into(out, layout, np.arange(6), np.full(5, 9), 4, 1, 16, num_ctas=4)
    assert np.all(out == 5)


def test_plan_into_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """No C compiler: the numpy plan, packed, gives the same words."""
    args, layout = ([0, 1, 3, 3], [900, 40, 7], 8, 2, 16, 6), scheduler.PlanLayout(4, 8, 8, 8, 2,
                                                                                     16)
    with_c = np.zeros(layout.size, dtype=np.int32)
    scheduler.plan_into(with_c, layout, *args)
    monkeypatch.setattr(planner, "_LIB", False)
    without = np.zeros(layout.size, dtype=np.int32)
    scheduler.plan_into(without, layout, *args)
    assert without.tobytes() == with_c.tobytes()
    assert without.tobytes() == scheduler.plan(*args, impl="numpy").pack(layout).tobytes()


@needs_cc
@pytest.mark.parametrize("head_span", [True, False])
def test_compiled_head_spans_equal_numpy(head_span: bool) -> None:
    """Decode batches whose units span KV heads (and with spans off): the same plan, and the
    same packed words from plan_into."""
    rng = np.random.default_rng(31)
    spanned = 0
    for _ in range(20):
        batch, hk = int(rng.integers(1, 257)), int(rng.choice([2, 4, 6, 8, 32]))
        kv = np.minimum(rng.zipf(1.4, batch) * int(rng.integers(16, 600)), 60_000)
        q = np.where(rng.random(batch) < 0.85, 1, rng.integers(0, 40, batch))
        args = (np.concatenate([[0], np.cumsum(q)]), kv, hk * int(rng.choice([1, 4])), hk,
                int(rng.choice([16, 64])), int(rng.choice([132, 792])))
        kw = dict(kv_chunk_align=16, min_kv_chunk=256, alpha=float(rng.choice([1.0, 0.5])),
                  head_span=head_span)
        a = scheduler.plan(*args, **kw, impl="numpy")
        _assert_same(a, scheduler.plan(*args, **kw, impl="c"))
        spanned += int(a.units["kv_heads"].max(initial=1) > 1)
        layout = _layout_for(rng, args)
        want = a.pack(layout)
        got = np.zeros(layout.size, dtype=np.int32)
        scheduler.plan_into(got, layout, *args, **kw)
        assert got.tobytes() == want.tobytes()
    assert (spanned > 5) if head_span else spanned == 0


@needs_cc
def test_compiled_head_spans_at_the_limit() -> None:
    """Batches of equal decode requests whose span test ``s * c <= total / (2 P)`` is decided
    by rounding (planner.c compares c with a precomputed bound instead of forming the product):
    the same spans as numpy, ties and one-ulp misses included."""
    near = 0
    for hk in (3, 4, 6, 12, 32):
        for batch in (2, 3, 5, 6, 7, 12, 24):
            for s in [d for d in range(2, hk + 1) if hk % d == 0]:
                if (hk * batch) % (2 * s):
                    continue
                num_ctas = hk * batch // (2 * s)  # s * c is about the limit
                for alpha, beta in ((0.1, 0.3), (1 / 3, 0.7), (0.9, 1.1), (1.0, 1.0)):
                    for kv in (1, 2, 6, 7, 9, 100, 999, 1234, 4097):
                        args = (np.arange(batch + 1), np.full(batch, kv), hk, hk, 16, num_ctas)
                        kw = dict(alpha=alpha, beta=beta, min_kv_chunk=8192, kv_chunk_align=16)
                        a = scheduler.plan(*args, **kw, impl="numpy")
                        _assert_same(a, scheduler.plan(*args, **kw, impl="c"))
                        c = alpha * 1.0 + beta * kv
                        limit = hk * (alpha * float(batch) + beta * float(batch * kv)) / (
                            2.0 * num_ctas)
                        near += abs(s * c - limit) <= 2 * np.spacing(limit)
    assert near > 50
