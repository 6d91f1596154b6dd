"""Time the FA3 kernel with its macros or kernel_options changed, on the same inputs in one process.

Each configuration prepends `#define`s to the FA3 translation unit -- only the macros the kernels
read with `#ifndef` (`kernel_switches()`: ATTNCC_FA3_L2_SECTION_BYTES and the V descriptor
offsets; a name the kernels do not read is an error, not a silent no-op) --
compiles it under its own cache key, and times attncc.flex_attention with bench/prefill.py's
inputs and masks (triton do_bench median). Outputs are compared with the first configuration's.

    python -m scripts.experiments.fa3_experiment --S 2048 8192 \
        --variants full causal softcap_causal \
        --config "" --config ATTNCC_FA3_L2_SECTION_BYTES=25165824 --repeat 5

A configuration item `opt:NAME=VALUE` sets kernel_options NAME to the JSON VALUE for that
configuration instead (e.g. --config opt:PAIRED=true; CTA pairs need the cluster launch that
kernel_options PAIRED gives). The paired and low-pressure forms are codegen parameters
(`generate_source(paired=, low_pressure=)`), not macros. To A/B a change to the
kernels themselves, compare template folders of git revisions with `scripts/ab_kernels.py`.

With --repeat N the configurations run N times in turn per cell -- in the given order in even
rounds and reversed in odd ones, so a drift of the clock or temperature over a round favours
none of them -- and a summary gives each configuration's per-round ratio to the first one's: at
S = 2048 one comparison moves by ~5 % between runs on the H200 (docs/fa3.md, intro), so a
change of a few per cent shows only as a direction over many rounds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def pair_summary(records: list[dict[str, Any]]) -> list[str]:
    """One line per (S, variant) and configuration other than the cell's first: its TFLOP/s over
    the first configuration's in the same round, round by round, their median, and in how many
    rounds it was faster. A record's round is its "round" field, or else its place in run order
    (each round lists every configuration once); the cell's first configuration is the first
    record's.

    >>> recs = [{"S": 2048, "variant": "full", "config": c, "tflops": t, "round": r}
    ...         for c, t, r in (("shipped", 500, 0), ("X=1", 510, 0),
    ...                         ("X=1", 490, 1), ("shipped", 500, 1))]
    >>> pair_summary(recs)
    ['S=2048 full X=1: 1.020 0.980 median 1.000, faster in 1 of 2']
    """
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["S"], r["variant"]), []).append(r)
    lines = []
    for (S, variant), recs in cells.items():
        first = recs[0]["config"]
        per_round = len({r["config"] for r in recs})
        rounds: dict[int, dict[str, float]] = {}
        for i, r in enumerate(recs):
            rounds.setdefault(r.get("round", i // per_round), {})[r["config"]] = r["tflops"]
        ratios: dict[str, list[float]] = {}
        for rnd in sorted(rounds):
            for cfg, tf in rounds[rnd].items():
                if cfg != first:
                    ratios.setdefault(cfg, []).append(tf / rounds[rnd][first])
        for cfg, rs in ratios.items():
            med = statistics.median(rs)
            faster = sum(x > 1.0 for x in rs)
            lines.append(f"S={S} {variant} {cfg}: {' '.join(f'{x:.3f}' for x in rs)} "
                         f"median {med:.3f}, faster in {faster} of {len(rs)}")
    return lines


def kernel_switches() -> set[str]:
    """The macros the shipped kernels read with `#ifndef NAME` / `#define NAME` (include guards
    aside): the only names a configuration may define.

    >>> sorted(kernel_switches())  # doctest: +NORMALIZE_WHITESPACE
    ['ATTNCC_FA3_L2_SECTION_BYTES', 'ATTNCC_FA3_V_LBO', 'ATTNCC_FA3_V_SBO']
    """
    import re

    names: set[str] = set()
    for f in sorted((ROOT / "kernels").rglob("*.cuh")):
        names |= set(re.findall(r"^#ifndef (\w+)\n#define \1\b", f.read_text(), re.M))
    return {n for n in names if not n.endswith("_CUH")}


def check_configs(configs: list[str]) -> None:
    """SystemExit naming a configuration's define that the kernels do not read (a retired A/B
    switch, a typo): it would time the shipped kernel under another name.

    >>> check_configs(["", "ATTNCC_FA3_L2_SECTION_BYTES=0,opt:PAIRED=false"])
    >>> check_configs(["ATTNCC_FA3_PINGPONG=0"])
    Traceback (most recent call last):
    ...
    SystemExit: --config ATTNCC_FA3_PINGPONG=0: the kernels do not read ATTNCC_FA3_PINGPONG (they read ATTNCC_FA3_L2_SECTION_BYTES, ATTNCC_FA3_V_LBO, ATTNCC_FA3_V_SBO); A/B a kernel change against a git revision with scripts/ab_kernels.py
    """
    known = kernel_switches()
    for cfg in configs:
        for item in (d for d in cfg.split(",") if d and not d.startswith("opt:")):
            name = item.split("=", 1)[0]
            if name not in known:
                raise SystemExit(f"--config {cfg}: the kernels do not read {name} (they read "
                                 f"{', '.join(sorted(known))}); A/B a kernel change against a "
                                 f"git revision with scripts/ab_kernels.py")


def heat(fn: Any, seconds: float) -> None:
    """Call `fn` (a GPU launch) for about `seconds` of wall time, then synchronize."""
    import time

    import torch
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()


def main() -> None:
    import torch
    from triton.testing import do_bench

    import attncc
    from attncc.runtime.flex import gpu_flex
    from attncc.runtime.jit import kernels
    from bench.prefill import HEAD_DIM, HEADS, Bench, pairs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", nargs="+", default=["full", "causal", "softcap_causal"])
    ap.add_argument("--config", action="append", default=[],
                    help="comma-separated NAME=VALUE defines; '' is the kernel as shipped")
    ap.add_argument("--options", default="{}", help="kernel_options JSON for every cell")
    ap.add_argument("--out", default=None, help="JSON file for the records")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds per cell: the configurations run this many times in turn")
    ap.add_argument("--heat", type=float, default=0.0,
                    help="seconds of the shipped kernel before the first cell, so that every "
                         "cell runs at the clock the power cap settles at")
    args = ap.parse_args()
    order = args.config or [""]
    check_configs(order)
    # (round, configuration): even rounds in the given order, odd ones reversed
    configs = [(r, c) for r in range(args.repeat) for c in (order if r % 2 == 0 else order[::-1])]
    opts = {"KERNEL": "fa3", **json.loads(args.options)}
    original = kernels.generate
    records: list[dict[str, Any]] = []
    for S in args.S:
        bench = Bench(S)
        if args.heat > 0 and S == args.S[0]:
            heat(lambda: attncc.flex_attention(bench.q, bench.k, bench.v, kernel_options=opts),
                 args.heat)
        for variant in args.variants:
            first = None
            for rnd, cfg in configs:
                items = [d for d in cfg.split(",") if d]
                defines = "".join(f"#define {d.replace('=', ' ', 1)}\n"
                                  for d in items if not d.startswith("opt:"))
                cell_opts = {**opts, **{d[4:].split("=", 1)[0]: json.loads(d.split("=", 1)[1])
                                        for d in items if d.startswith("opt:")}}

                def patched(spec: Any, _d: str = defines) -> Any:
                    gen = original(spec)
                    if spec.kind != "fa3_prefill":
                        return gen
                    return dataclasses.replace(gen, source=_d + gen.source)
                kernels.generate = patched
                kernels.clear_loaded()
                gpu_flex._CALLS.clear()
                mask = bench.mask_of[variant]
                bm = bench.attncc_bm[mask] if mask else None
                sm = bench.score_mod[variant]

                def fn() -> Any:
                    return attncc.flex_attention(bench.q, bench.k, bench.v, score_mod=sm,
                                                 block_mask=bm, kernel_options=cell_opts)
                out = fn()
                torch.cuda.synchronize()
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                tf = 4.0 * HEAD_DIM * bench.B * HEADS * pairs(variant, S) / (ms * 1e-3) / 1e12
                err = 0.0 if first is None else float((out.float() - first.float()).norm()
                                                       / first.float().norm())
                first = out if first is None else first
                records.append({"S": S, "variant": variant, "config": cfg or "shipped",
                                "round": rnd,
                                "options": cell_opts, "ms": ms, "tflops": tf,
                                "rel_diff": err})
                print(f"S={S:6d} {variant:15s} {cfg or 'shipped':40s} {ms:8.3f} ms "
                      f"{tf:7.1f} TFLOP/s  diff vs first {err:.1e}", flush=True)
    kernels.generate = original
    if len(configs) > 1 and len(order) > 1:
        print("\n".join(pair_summary(records)))
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
