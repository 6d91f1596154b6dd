"""The compiled planner (runtime/planner.c) gives exactly the numpy scheduler's plan."""
from __future__ import annotations

import time

import numpy as np
import pytest

from attncc.runtime import planner, scheduler

needs_cc = pytest.mark.skipif(not planner.available(), reason="no C compiler to build the planner")

FIELDS = ("units", "cta_indptr", "cta_units", "merge_indptr", "merge_slots", "merge_out",
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
