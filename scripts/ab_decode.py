"""Time BatchAttention decode with every kernel template read from another revision's `kernels/`
folder against the current templates: same process, same inputs, interleaved rounds (the decode
counterpart of scripts/ab_kernels.py).

    git archive REV kernels | tar -x -C /tmp/rev      # then, on the GPU machine:
    python -m scripts.ab_decode /tmp/rev/kernels [--rounds 3] [--no-grid]
    python -m scripts.ab_decode kernels --base-long-kv-keys 1000000000   # a planning policy

Cells: bench/decode.py's KV-dtype cells (long context B128 Hq64/Hkv8 kv 32768, B64 at 16K GQA
with bf16 / fp8 e4m3 / e5m2 caches, MHA 32/32 at 16K with bf16) and, unless --no-grid, its
Hq32/Hkv8 grid at batch 16/64/256 for each length distribution (bf16). Each figure is the best
of the rounds' CUDA-graph medians (bench/timing.py), as a fraction of the measured copy
bandwidth over the bytes the cache holds; `vs_bf16` is an fp8 cell's step time over the bf16
cell's in the same build; max|diff| compares the two builds' outputs.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

PAGE, D = 16, 128


def long_cell(batch: int, hq: int, hkv: int, kv_len: int) -> dict[str, Any]:
    """One constant-length cell (bench/decode.py's `kv_cell_inputs`)."""
    from bench.decode import kv_cell_inputs

    args, q, k, v = kv_cell_inputs(batch, hq, hkv, kv_len)
    kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=PAGE)
    return dict(args=args, kw=kw, q=q, k=k, v=v, elems=batch * kv_len * hkv * D * 2)


def grid_cell(batch: int, dist: str) -> dict[str, Any]:
    """bench/decode.py's make_batch cell (Hq32/Hkv8) with bf16 q, K, V."""
    import torch

    from bench.decode import make_batch

    mb = make_batch(batch, 8, dist)
    n = int(mb["kv_indptr"][-1])
    g = torch.Generator(device="cuda").manual_seed(batch)
    k = torch.randn(n, PAGE, 8, D, generator=g, device="cuda").bfloat16()
    v = torch.randn(n, PAGE, 8, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(batch, mb["kw"]["num_qo_heads"], D, generator=g, device="cuda").bfloat16()
    lens = (np.diff(mb["kv_indptr"]) - 1) * PAGE + mb["kv_last_page_len"]
    args = (mb["qo_indptr"], mb["kv_indptr"], mb["kv_indices"], mb["kv_last_page_len"])
    return dict(args=args, kw=dict(mb["kw"]), q=q, k=k, v=v, elems=int(lens.sum()) * 8 * D * 2)


def cells(grid: bool) -> list[tuple[str, dict[str, Any], str]]:
    """(label, cell, cache dtype name) of every timed cell."""
    out = []
    for c in ((128, 64, 8, 32768), (64, 64, 8, 16384), (64, 32, 32, 16384)):
        cell = long_cell(*c)
        names = ("bfloat16", "float8_e4m3fn", "float8_e5m2") if c[2] == 8 else ("bfloat16",)
        out += [(f"B{c[0]} {c[1]}/{c[2]} kv{c[3]} {n}", cell, n) for n in names]
    for b in (16, 64, 256) if grid else ():
        for dist in ("constant", "uniform", "skewed"):
            out.append((f"B{b} 32/8 {dist} bfloat16", grid_cell(b, dist), "bfloat16"))
    return out


def step(cell: dict[str, Any], name: str) -> tuple[float, Any]:
    """One plan of `cell` with a `name` cache (fp8: quantized with per-tensor amax scales): the
    CUDA-graph median ms of run() and its output."""
    import torch

    from attncc.runtime.serving.batch import BatchAttention
    from bench.decode import kv_cache
    from bench.timing import time_call

    q, k, v, kw = cell["q"], cell["k"], cell["v"], cell["kw"]
    kvdt = getattr(torch, name)
    cache, scales = kv_cache(k, v, name, kw["num_kv_heads"])
    n = max(q.shape[0], 16)
    ba = BatchAttention(None, kv_layout="NHD", max_batch=n, max_qo_tokens=n)
    ba.plan(*cell["args"], **kw, kv_data_type=None if kvdt.itemsize == 2 else kvdt)
    out = ba.run(q, cache, **scales).float()
    torch.cuda.synchronize()
    t = time_call(lambda: ba.run(q, cache, **scales))
    return t.get("ms_graph", t["ms_eager"]), out


def main() -> None:
    from bench.decode import copy_bandwidth
    from bench.timing import spin_gpu
    from scripts.ab_kernels import template_switch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, help="another revision's kernels/ folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-grid", action="store_true", help="only the KV-dtype cells")
    ap.add_argument("--base-long-kv-keys", type=int, default=None, metavar="N",
                    help="the base build plans with tiles.LONG_KV_KEYS = N (a huge N: never "
                         "three-stage decode tiles); with the current kernels/ as base, an A/B "
                         "of that planning policy alone")
    a = ap.parse_args()
    from attncc.runtime.serving import tiles

    policy = {"current": tiles.LONG_KV_KEYS, "base": a.base_long_kv_keys or tiles.LONG_KV_KEYS}
    use = template_switch()
    bw = copy_bandwidth()
    todo = cells(not a.no_grid)
    spin_gpu()
    best: dict[tuple[str, str], float] = {}
    diff: dict[str, float] = {}
    builds = (("current", None), ("base", a.base))
    for r in range(a.rounds):
        for label, cell, name in todo:
            outs = {}
            # alternate which build runs first: with a fixed order an A/A run (base = the current
            # kernels) read the first cell 5 % apart (journal 2026-12-02, "Session of 21:35")
            for build, folder in (builds if r % 2 == 0 else builds[::-1]):
                use(folder)
                tiles.LONG_KV_KEYS = policy[build]
                ms, outs[build] = step(cell, name)
                best[label, build] = min(best.get((label, build), float("inf")), ms)
            diff[label] = max(diff.get(label, 0.0),
                              float((outs["current"] - outs["base"]).abs().max()))
    use(None)
    for label, cell, name in todo:
        nbytes = cell["elems"] * (1 if "float8" in name else 2)
        cur, base = best[label, "current"], best[label, "base"]
        line = (f"{label:34s} current {cur * 1e3:8.1f} us ({nbytes / cur / 1e9 / (bw / 1e12):.3f}"
                f" of copy)  base {base * 1e3:8.1f} us ({nbytes / base / 1e9 / (bw / 1e12):.3f})"
                f"  base/current {base / cur:.3f}  max|diff| {diff[label]:.1e}")
        if "float8" in name:
            ref = label.rsplit(" ", 1)[0] + " bfloat16"
            line += (f"  vs_bf16 current {cur / best[ref, 'current']:.3f} "
                     f"base {base / best[ref, 'base']:.3f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
