"""Issue 29's measurement and example run on a GPU: bench/backward.py's cells (attncc's
gradients against FlexAttention's on the same inputs) and examples/train_relbias.py's two
trainings from one seed. They need attncc's GPU backward."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu


def _flex_out_of_resources(errors: list[str]) -> None:
    """FlexAttention (torch 2.11's inductor) cannot compile a score_mod whose captured bias
    requires grad at these shapes on an H200: every Triton config needs more shared memory than
    the SM has ("out of resource ... Hardware limit: 232448"), seen on the H200. Then there is
    nothing to compare attncc with: xfail, naming it (attncc's own gradients are checked against
    the fp64 reference in tests/gpu/test_backward_gpu.py)."""
    if errors and all("out of resource" in e for e in errors):
        pytest.xfail(f"FlexAttention cannot compile this variant here: {errors[0][:200]}")


def test_backward_bench_cells_run_and_agree_with_flex() -> None:
    """One short sweep (S=512, one round): every cell times, attncc's dq/dk/dv/dbias are within
    2e-2 (relative Frobenius) of Flex's, and the backward figure is a positive number."""
    from bench.backward import run

    recs = run((512,), ("causal", "relbias_causal"), ("attncc", "flex", "sdpa_flash"), rounds=1)
    assert [r for r in recs if "error" in r and r["impl"] != "flex"] == []
    _flex_out_of_resources([r["error"] for r in recs if "error" in r])
    mine = {r["variant"]: r for r in recs if r["impl"] == "attncc"}
    assert set(mine) == {"causal", "relbias_causal"}
    for variant, rec in mine.items():
        assert rec["rel_err_vs"] == "flex", variant
        want = {"dq", "dk", "dv"} | ({"dbias"} if variant == "relbias_causal" else set())
        assert set(rec["rel_err_grads"]) == want, variant
        assert rec["rel_err"] < 2e-2, (variant, rec["rel_err_grads"])
        assert rec["bwd_tflops"] is not None and rec["bwd_tflops"] > 0, (variant, rec)


def test_train_relbias_tracks_flex_on_cuda() -> None:
    """The example, 150 steps: the same start (identical weights and batches; bf16 attention,
    so the first loss agrees to rounding), both models solve the copy task (on the CPU the loss
    leaves chance, ~4.2, near step 60 and is below 0.02 by step 80 at batch 8), and they do so
    at nearly the same step. The bias table is the only position signal: no bias gradient, no
    learning."""
    from examples.train_relbias import main

    try:
        runs = main(["--device", "cuda", "--steps", "150"])
    except Exception as e:  # noqa: BLE001 - only Flex's own compile failure is excused
        _flex_out_of_resources([f"{type(e).__name__}: {e}"])
        raise
    mine, ref = runs["attncc"]["loss"], runs["flex"]["loss"]
    assert all(math.isfinite(x) for x in mine + ref)
    assert abs(mine[0] - ref[0]) < 1e-2 * ref[0]
    assert sum(mine[-10:]) / 10 < 0.1 and sum(ref[-10:]) / 10 < 0.1
    solved = [next(i for i, x in enumerate(curve) if x < 1.0) for curve in (mine, ref)]
    assert abs(solved[0] - solved[1]) <= 15, solved
