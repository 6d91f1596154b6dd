"""bench/plan_time.py's step timings of plan() (`--phases`) run without CUDA: the upload steps
are skipped, the others are timed and add up to at most the plan() call."""
from __future__ import annotations


def test_phases_on_the_cpu() -> None:
    from bench.plan_time import phase_report, phases

    from attncc.runtime.serving import batch
    from attncc.runtime.serving.plan import planner

    used_ranges = batch.used_ranges
    got = phases(16, 4, "uniform", "cpu", runs=5)
    assert batch.used_ranges is used_ranges  # the timer wrapped it only while it ran
    assert len(got["plan"]) == 5 and "upload" not in got and set(got["copies"]) == {0}
    if planner.available():  # a decode loop's steps: one C call with the last plan's tiles
        steps = ("fast path", "check+plan+stage (C)", "staging")
        assert "config" not in got
    else:  # the numpy path
        steps = ("new tiles / numpy", "config", "staging")
    for name in steps:
        assert all(0 < t <= p for t, p in zip(got[name], got["plan"])), name
    assert "staging" in phase_report("cell", got)
