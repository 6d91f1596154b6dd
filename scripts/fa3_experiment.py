"""Time the FA3 kernel with compile-time switches flipped, on the same inputs in one process.

A kernel experiment without new product options: each configuration prepends `#define`s to the
FA3 translation unit (e.g. ATTNCC_FA3_PINGPONG=0, which the kernel reads with #ifndef), compiles
it under its own cache key, and times attncc.flex_attention with bench/prefill.py's inputs and
masks (triton do_bench median). Outputs are compared with the first configuration's.

    python scripts/fa3_experiment.py --S 2048 8192 --variants full causal softcap_causal \
        --config "" --config ATTNCC_FA3_PINGPONG=0 --repeat 5

With --repeat N the configurations run N times in turn per cell, and a summary gives each
configuration's per-round ratio to the first one's: at S = 2048 one comparison moves by ~5 %
between runs on the H200 (bench/NOTES.md, stop 22), so a change of a few per cent shows only as
a direction over many rounds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def pair_summary(records: list[dict[str, Any]]) -> list[str]:
    """One line per (S, variant) and configuration other than the cell's first: its TFLOP/s over
    the first configuration's in the same round, round by round, their median, and in how many
    rounds it was faster. Records are in run order: each round lists every configuration once.

    >>> recs = [{"S": 2048, "variant": "full", "config": c, "tflops": t}
    ...         for c, t in (("shipped", 500), ("X=1", 510), ("shipped", 500), ("X=1", 490))]
    >>> pair_summary(recs)
    ['S=2048 full X=1: 1.020 0.980 median 1.000, faster in 1 of 2']
    """
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["S"], r["variant"]), []).append(r)
    lines = []
    for (S, variant), recs in cells.items():
        first = recs[0]["config"]
        base: list[float] = []
        ratios: dict[str, list[float]] = {}
        for r in recs:
            if r["config"] == first:
                base.append(r["tflops"])
            else:
                ratios.setdefault(r["config"], []).append(r["tflops"] / base[-1])
        for cfg, rs in ratios.items():
            med = statistics.median(rs)
            faster = sum(x > 1.0 for x in rs)
            lines.append(f"S={S} {variant} {cfg}: {' '.join(f'{x:.3f}' for x in rs)} "
                         f"median {med:.3f}, faster in {faster} of {len(rs)}")
    return lines


def main() -> None:
    import torch
    from triton.testing import do_bench

    import attncc
    from attncc.runtime import gpu_flex
    from prefill import HEAD_DIM, HEADS, Bench, pairs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", nargs="+", default=["full", "causal", "softcap_causal"])
    ap.add_argument("--config", action="append", default=[],
                    help="comma-separated NAME=VALUE defines; '' is the kernel as shipped")
    ap.add_argument("--options", default="{}", help="kernel_options JSON for every cell")
    ap.add_argument("--out", default=None, help="JSON file for the records")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds per cell: the configurations run this many times in turn")
    args = ap.parse_args()
    configs = (args.config or [""]) * args.repeat
    opts = {"KERNEL": "fa3", **json.loads(args.options)}
    original = gpu_flex._fa3_generated
    records: list[dict[str, Any]] = []
    for S in args.S:
        bench = Bench(S)
        for variant in args.variants:
            first = None
            for cfg in configs:
                defines = "".join(f"#define {d.replace('=', ' ', 1)}\n"
                                  for d in cfg.split(",") if d)

                def patched(*a: Any, _d: str = defines, **k: Any) -> Any:
                    gk = original(*a, **k)
                    return dataclasses.replace(gk, source=_d + gk.source)
                gpu_flex._fa3_generated = patched
                gpu_flex._KERNELS.clear()
                gpu_flex._CALLS.clear()
                mask = bench.mask_of[variant]
                bm = bench.attncc_bm[mask] if mask else None
                sm = bench.score_mod[variant]

                def fn() -> Any:
                    return attncc.flex_attention(bench.q, bench.k, bench.v, score_mod=sm,
                                                 block_mask=bm, kernel_options=opts)
                out = fn()
                torch.cuda.synchronize()
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                tf = 4.0 * HEAD_DIM * bench.B * HEADS * pairs(variant, S) / (ms * 1e-3) / 1e12
                err = 0.0 if first is None else float((out.float() - first.float()).norm()
                                                       / first.float().norm())
                first = out if first is None else first
                records.append({"S": S, "variant": variant, "config": cfg or "shipped",
                                "options": opts, "ms": ms, "tflops": tf, "rel_diff": err})
                print(f"S={S:6d} {variant:15s} {cfg or 'shipped':40s} {ms:8.3f} ms "
                      f"{tf:7.1f} TFLOP/s  diff vs first {err:.1e}", flush=True)
    gpu_flex._fa3_generated = original
    if len(configs) > 1:
        print("\n".join(pair_summary(records)))
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
