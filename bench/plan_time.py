"""Host time of `BatchAttention.plan` (the issue's target: <= 50 us at batch 256).

The same batches as bench/decode.py (one query token per request, Hq=32, D=128, paged KV with
page size 16, `kv_lengths` "constant" / "uniform" / "skewed", kv_indices a random permutation),
planned on the CPU (`device="cpu"`: the checks, the schedule and the packed staging buffer, no
H2D copy; on a GPU host plan() adds one `copy_` and an event record). Each cell is the median
of `--runs` plan() calls with the same arguments after one warm-up call, as decode.py times it;
`--repeat` measures every cell that many times, interleaved, and keeps the lowest median (the
CPUs these run on are shared and noisy).

    python bench/plan_time.py                       # batches 16/64/256 x Hkv 32/8/4 x 3 dists
    python bench/plan_time.py --batch 256 --hkv 8 --breakdown
    python bench/plan_time.py --numpy               # the numpy planner (no C compiler)
    python bench/plan_time.py --profile --batch 256 --hkv 4 --dist uniform

`--breakdown` adds the two C calls plan() makes with the compiled planner, timed from Python:
`check` (`BatchPlanner.check`: the input checks, one pass over the page ids) and `check+stage`
(that and `BatchPlanner.plan_and_stage`: the schedule, the packed plan and the page tables
written to the staging buffer), so plan() minus `check+stage` is the Python around them (tile
choice, bookkeeping). Also `scheduler.plan_into` alone (schedule + pack, what the numpy path
of plan() calls) and the typed path, `scheduler.plan(...).pack(layout)`.

The batches are bench/decode.py's `make_batch`.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode import BATCHES, DISTS, HKVS, HQ, make_batch  # noqa: E402
from timing import median_us  # noqa: E402


def cell_timers(batch: int, hkv: int, dist: str, breakdown: bool
                ) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """The functions to time for one cell, and what describes it (units, CTAs)."""
    from attncc.runtime import planner, scheduler
    from attncc.runtime.batch import BatchAttention

    b = make_batch(batch, hkv, dist)
    ba = BatchAttention(None, kv_layout="NHD", max_batch=max(batch, 16),
                        max_qo_tokens=max(batch, 16), device="cpu")
    args = (b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_last_page_len"])
    ba.plan(*args, **b["kw"])
    assert ba.tiles is not None and ba.layout is not None
    info = {"units": ba._plan.num_units, "num_ctas": ba.tiles.num_ctas, "tq": ba.tiles.tq,
            "tkv": ba.tiles.tkv, "kv_chunk": ba._plan.kv_chunk}
    timers: dict[str, Callable[[], Any]] = {"plan": lambda: ba.plan(*args, **b["kw"])}
    if breakdown and isinstance(ba._planner, planner.BatchPlanner):
        bp, cfg, buf, offsets = ba._planner, ba._config_memo, ba._staging_np, ba._offsets
        assert cfg is not None and cfg.problem is not None

        def check() -> Any:
            return bp.check(*args, page_size=b["kw"]["page_size"])

        timers["check"] = check
        timers["check+stage"] = lambda: check() and bp.plan_and_stage(cfg.problem, buf, offsets)
    if breakdown:
        lay, out = ba.layout, np.zeros(ba.layout.size, dtype=np.int32)
        sched = (ba.qo_indptr, ba.kv_lens, HQ, hkv, ba.tiles.tq, ba.tiles.num_ctas)
        # the plan's own KV chunk as the floor gives that chunk again: the same plan
        kw = dict(kv_chunk_align=ba.tiles.tkv, min_kv_chunk=ba._plan.kv_chunk)
        timers["plan_into"] = lambda: scheduler.plan_into(out, lay, *sched, **kw, checked=True)
        timers["plan+pack"] = lambda: scheduler.plan(*sched, **kw).pack(lay, out=out)
    return timers, info


def measure(batches: list[int], hkvs: list[int], dists: list[str], runs: int, repeat: int,
            breakdown: bool) -> list[dict[str, Any]]:
    """Every cell's medians (lowest of `repeat` interleaved measurements), in microseconds."""
    cells = [(b, h, d, *cell_timers(b, h, d, breakdown))
             for b in batches for h in hkvs for d in dists]
    best: dict[tuple, dict[str, float]] = {}
    for _ in range(repeat):
        for b, h, d, timers, _info in cells:
            got = best.setdefault((b, h, d), {})
            for name, fn in timers.items():
                got[name] = min(got.get(name, float("inf")), median_us(fn, runs))
    return [{"batch": b, "hkv": h, "dist": d, **info, **{f"{k}_us": v
                                                        for k, v in best[(b, h, d)].items()}}
            for b, h, d, _timers, info in cells]


def report(rows: list[dict[str, Any]]) -> str:
    """A text table of `measure`'s rows."""
    keys = [k for k in rows[0] if k.endswith("_us")]
    head = f"{'batch':>5} {'Hkv':>3} {'dist':9} {'units':>6} {'CTAs':>5} " + " ".join(
        f"{k[:-3] + ' us':>14}" for k in keys)
    lines = [head]
    for r in rows:
        lines.append(f"{r['batch']:5d} {r['hkv']:3d} {r['dist']:9} {r['units']:6d} "
                     f"{r['num_ctas']:5d} " + " ".join(f"{r[k]:14.1f}" for k in keys))
    return "\n".join(lines)


def profile(batch: int, hkv: int, dist: str, calls: int = 2000) -> None:
    """cProfile of `calls` plan() calls of one cell: where the Python time goes."""
    timers, _ = cell_timers(batch, hkv, dist, breakdown=False)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        timers["plan"]()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--hkv", type=int, nargs="+", default=list(HKVS))
    ap.add_argument("--dist", nargs="+", default=list(DISTS), choices=DISTS)
    ap.add_argument("--runs", type=int, default=50, help="plan() calls per median")
    ap.add_argument("--repeat", type=int, default=5, help="medians per cell (lowest kept)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time plan()'s C calls, scheduler.plan_into and "
                         "scheduler.plan + Plan.pack")
    ap.add_argument("--numpy", action="store_true", help="the numpy planner (no C planner)")
    ap.add_argument("--profile", action="store_true", help="cProfile the first cell instead")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.numpy:
        os.environ["ATTNCC_NO_C_PLANNER"] = "1"  # read when the planner is first built
    from attncc.runtime import planner

    print(f"compiled planner: {planner.available()}", flush=True)
    if a.profile:
        profile(a.batch[0], a.hkv[0], a.dist[0])
        return
    rows = measure(a.batch, a.hkv, a.dist, a.runs, a.repeat, a.breakdown)
    print(report(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
