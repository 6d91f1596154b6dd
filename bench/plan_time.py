"""Host time of `BatchAttention.plan` (the issue's target: <= 50 us at batch 256).

The same batches as bench/decode.py (one query token per request, Hq=32, D=128, paged KV with
page size 16, `kv_lengths` "constant" / "uniform" / "skewed", kv_indices a random permutation),
planned on the CPU by default (`--device cpu`: the checks, the schedule and the packed staging
buffer, no H2D copy); `--device cuda` adds what plan() does on a GPU host: the async copies of
the used words to the workspace and an event record per plan, and the wait for the copies of
the plan before last. Each cell is the median of `--runs` plan() calls with the same arguments
after one warm-up call, as decode.py times it; `--repeat` measures every cell that many times,
interleaved, and keeps the lowest median (the CPUs these run on are shared and noisy).

    python -m bench.plan_time                       # batches 16/64/256 x Hkv 32/8/4 x 3 dists
    python -m bench.plan_time --batch 256 --hkv 8 --breakdown
    python -m bench.plan_time --numpy               # the numpy planner (no C compiler)
    python -m bench.plan_time --profile --batch 256 --hkv 4 --dist uniform
    python -m bench.plan_time --phases --batch 256 --hkv 32 8 4 --dist uniform   # on CUDA

`--phases` times the steps inside one plan() call (on CUDA unless `--device cpu`; without CUDA
the upload steps are skipped): `phases` wraps this instance's steps in perf_counter timers
(nothing changes for other instances) and reports each step's median and mean microseconds
per plan() over `--runs` calls; indented steps are part of the step above them, and `other`
is plan() minus the top-level steps (argument handling, bookkeeping, the timers themselves).

`--breakdown` adds the C call plan() makes with the compiled planner, timed from Python:
`check+stage` (`BatchPlanner.plan`: the input checks, the schedule, the packed plan and the page
tables written to the staging buffer, the page ids checked and copied in one pass), so plan()
minus `check+stage` is the Python around it (argument handling, bookkeeping); and `check`
(`BatchPlanner.check`: the input checks alone). Also `scheduler.plan_into` alone (schedule +
pack, what the numpy path of plan() calls) and the typed path,
`scheduler.plan(...).pack(layout)`.

The batches are bench/decode.py's `make_batch`.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.decode import BATCHES, DISTS, HKVS, HQ, make_batch
from bench.timing import median_us


def planned(batch: int, hkv: int, dist: str, device: str = "cpu"
            ) -> tuple[Any, tuple, dict[str, Any]]:
    """A BatchAttention on `device` that planned the cell's batch once, and plan()'s
    positional and keyword arguments for that batch."""
    from attncc.runtime.serving.batch import BatchAttention

    b = make_batch(batch, hkv, dist)
    ba = BatchAttention(None, kv_layout="NHD", max_batch=max(batch, 16),
                        max_qo_tokens=max(batch, 16), device=device)
    args = (b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_last_page_len"])
    ba.plan(*args, **b["kw"])
    return ba, args, b["kw"]


def cell_timers(batch: int, hkv: int, dist: str, breakdown: bool, device: str = "cpu"
                ) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """The functions to time for one cell, and what describes it (units, CTAs)."""
    from attncc.runtime.serving.plan import planner, scheduler

    ba, args, plan_kw = planned(batch, hkv, dist, device)
    assert ba.tiles is not None and ba.layout is not None
    info = {"units": ba._plan.num_units, "num_ctas": ba.tiles.num_ctas, "tq": ba.tiles.tq,
            "tkv": ba.tiles.tkv, "kv_chunk": ba._plan.kv_chunk}
    timers: dict[str, Callable[[], Any]] = {"plan": lambda: ba.plan(*args, **plan_kw)}
    if breakdown and isinstance(ba._planner, planner.BatchPlanner):
        bp, memo, buf, offsets = ba._planner, ba._last_config, ba._staging_np, ba._offsets
        assert memo is not None and memo[2].problem is not None
        page_size = plan_kw["page_size"]

        def check_and_stage() -> Any:
            code, checked = bp.plan(*args, page_size, memo[2].problem, memo[1], buf, offsets)
            assert code == planner.STAGED
            return checked

        timers["check"] = lambda: bp.check(*args, page_size=page_size)
        timers["check+stage"] = check_and_stage
    if breakdown:
        lay, out = ba.layout, np.zeros(ba.layout.size, dtype=np.int32)
        sched = (ba.qo_indptr, ba.kv_lens, HQ, hkv, ba.tiles.tq, ba.tiles.num_ctas)
        # the plan's own KV chunk as the floor gives that chunk again: the same plan
        kw = dict(kv_chunk_align=ba.tiles.tkv, min_kv_chunk=ba._plan.kv_chunk)
        timers["plan_into"] = lambda: scheduler.plan_into(out, lay, *sched, **kw, checked=True)
        timers["plan+pack"] = lambda: scheduler.plan(*sched, **kw).pack(lay, out=out)
    return timers, info


def measure(batches: list[int], hkvs: list[int], dists: list[str], runs: int, repeat: int,
            breakdown: bool, device: str = "cpu") -> list[dict[str, Any]]:
    """Every cell's medians (lowest of `repeat` interleaved measurements), in microseconds."""
    cells = [(b, h, d, *cell_timers(b, h, d, breakdown, device))
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


class _Clock:
    """Seconds spent in each wrapped step during one plan() call."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, adding its wall time to `spent[name]` on every call."""
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0
        return timed


# (step, depth): plan()'s steps in call order; a deeper step is part of the one above it.
# A plan whose tiles are the last plan's (every step of a decode loop) is the fast path's one
# C call; other plans are checked there ("check (C)") and staged by `_stage_plan` ("new tiles
# / numpy", also the whole of the numpy path), the used words listed by C or by used_ranges.
PHASES = (("fast path", 0), ("staging", 1), ("wait copy N-2", 2), ("check+plan+stage (C)", 1),
          ("check (C)", 1), ("new tiles / numpy", 0), ("config", 1), ("plan+stage (C)", 1),
          ("upload", 0), ("used ranges (C list)", 1), ("used_ranges", 1),
          ("cuMemcpyHtoDAsync", 1), ("event record", 1))


def phases(batch: int, hkv: int, dist: str, device: str, runs: int) -> dict[str, list[float]]:
    """Microseconds per plan() call of each of `PHASES` (and `plan`, `other`, `copies`: the
    copy calls per plan) over `runs` calls of one cell, with the steps of this instance (and,
    while it runs, `batch.used_ranges`) wrapped in timers."""
    from attncc.runtime.serving import batch as batch_mod

    ba, args, kw = planned(batch, hkv, dist, device)

    def plan() -> None:
        ba.plan(*args, **kw)

    plan()  # (CUDA: both staging halves and their events in use)
    clock = _Clock()
    ba._checked_fast = clock.wrap("fast path", ba._checked_fast)
    ba._stage_plan = clock.wrap("new tiles / numpy", ba._stage_plan)
    ba._config = clock.wrap("config", ba._config)
    ba._staging_for = clock.wrap("staging", ba._staging_for)
    ba._upload = clock.wrap("upload", ba._upload)
    if ba._planner:
        bp = ba._planner
        bp.plan = clock.wrap("check+plan+stage (C)", bp.plan)
        bp.check = clock.wrap("check (C)", bp.check)
        bp.plan_and_stage = clock.wrap("plan+stage (C)", bp.plan_and_stage)
        bp.used_ranges = clock.wrap("used ranges (C list)", bp.used_ranges)
    copies = [0]
    up = ba._uploader
    if up is not None:
        memcpy = clock.wrap("cuMemcpyHtoDAsync", up.memcpy)

        def counted(*args: Any) -> Any:
            copies[0] += 1
            return memcpy(*args)

        up.memcpy = counted
        up.wait = clock.wrap("wait copy N-2", up.wait)
        up.events = tuple(types.SimpleNamespace(record=clock.wrap("event record", ev.record),
                                                synchronize=ev.synchronize)
                          for ev in up.events)
    used_ranges = batch_mod.used_ranges
    batch_mod.used_ranges = clock.wrap("used_ranges", used_ranges)
    out: dict[str, list[float]] = {}
    try:
        for _ in range(runs):
            clock.spent.clear()
            copies[0] = 0
            t0 = time.perf_counter()
            plan()
            total = time.perf_counter() - t0
            top = sum(clock.spent.get(name, 0.0) for name, depth in PHASES if depth == 0)
            for name, sec in (("plan", total), *clock.spent.items(), ("other", total - top)):
                out.setdefault(name, []).append(sec * 1e6)
            out.setdefault("copies", []).append(copies[0])
    finally:
        batch_mod.used_ranges = used_ranges
    return out


def phase_report(cell: str, got: dict[str, list[float]]) -> str:
    """`phases`' figures as text: one line per step, median and mean microseconds."""
    lines = [f"{cell}: {np.median(got['copies']):.0f} copies per plan",
             f"  {'step':24} {'median us':>10} {'mean us':>10}"]
    for name, depth in (("plan", 0), *PHASES, ("other", 0)):
        if name in got:
            label = "  " * (depth + (name != "plan")) + name
            lines.append(f"  {label:24} {np.median(got[name]):10.1f} {np.mean(got[name]):10.1f}")
    return "\n".join(lines)


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
    ap.add_argument("--phases", action="store_true",
                    help="time the steps inside plan() instead (on CUDA unless --device cpu)")
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    help="where plan() uploads (default: cpu; with --phases cuda when present)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.numpy:
        os.environ["ATTNCC_NO_C_PLANNER"] = "1"  # read when the planner is first built
    from attncc.runtime.serving.plan import planner

    print(f"compiled planner: {planner.available()}", flush=True)
    if a.profile:
        profile(a.batch[0], a.hkv[0], a.dist[0])
        return
    if a.phases:
        import torch

        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            print("device cpu: no upload (the copies, event record and wait are skipped)")
        for b in a.batch:
            for h in a.hkv:
                for d in a.dist:
                    got = phases(b, h, d, device, max(a.runs, 200))
                    print(phase_report(f"batch {b} Hkv {h} {d} ({device})", got), flush=True)
        return
    rows = measure(a.batch, a.hkv, a.dist, a.runs, a.repeat, a.breakdown, a.device or "cpu")
    print(report(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
