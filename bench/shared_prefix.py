"""Shared-prefix decode benchmark (the seed's Table 5): CascadeAttention vs one BatchAttention.

Every request of a batch shares a prefix of P tokens and has its own 128-token suffix; each
decodes one token (bf16, Hq=32, Hkv=32 by default, D=128, page size 16). The single format lists
the prefix pages in every request's page table, so each request reads the prefix's KV; cascade
attention reads it once for the whole batch and merges. Reported: time of each (GPU time of a
CUDA-graph replay, bench/timing.py; the eager times are kept too) and the speedup.

    python -m bench.shared_prefix               -> bench/results/shared-prefix-h200.json
    python -m bench.shared_prefix --report bench/results/shared-prefix-h200.json

Example (the page lists of one configuration):
    >>> pre, suf = page_lists(prefix=64, batch=2, suffix=32, page=16)
    >>> pre.tolist(), [s.tolist() for s in suf]
    ([0, 1, 2, 3], [[4, 5], [6, 7]])
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np


HQ, D, PAGE, SUFFIX = 32, 128, 16, 128
PREFIXES, BATCHES = (1024, 8192, 32768), (16, 64)


def page_lists(prefix: int, batch: int, suffix: int, page: int
               ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Page ids: the prefix's pages first, then each request's suffix pages."""
    npre, nsuf = -(-prefix // page), -(-suffix // page)
    pre = np.arange(npre)
    return pre, [npre + i * nsuf + np.arange(nsuf) for i in range(batch)]


def run_cell(prefix: int, batch: int, hkv: int) -> dict[str, Any]:
    import torch
    from bench.timing import time_call

    import attncc

    pre, suf = page_lists(prefix, batch, SUFFIX, PAGE)
    total = len(pre) + sum(len(s) for s in suf)
    g = torch.Generator(device="cuda").manual_seed(prefix + batch)
    k = torch.randn(total, PAGE, hkv, D, generator=g, device="cuda").bfloat16()
    v = torch.randn(total, PAGE, hkv, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(batch, HQ, D, generator=g, device="cuda").bfloat16()
    qo = np.arange(batch + 1)
    heads = dict(num_qo_heads=HQ, num_kv_heads=hkv, head_dim=D, page_size=PAGE)
    last = SUFFIX - (len(suf[0]) - 1) * PAGE

    ca = attncc.CascadeAttention(None, kv_layout="NHD", max_qo_tokens=max(batch, 16))
    ca.plan(qo, prefix_indices=pre, prefix_last_page_len=PAGE, suffix_indptr=np.concatenate(
        [[0], np.cumsum([len(s) for s in suf])]), suffix_indices=np.concatenate(suf),
        suffix_last_page_len=np.full(batch, last), **heads)
    single = attncc.BatchAttention(None, kv_layout="NHD", max_batch=max(batch, 16),
                                   max_qo_tokens=max(batch, 16))
    lists = [np.concatenate([pre, s]) for s in suf]
    single.plan(qo, np.concatenate([[0], np.cumsum([len(x) for x in lists])]),
                np.concatenate(lists), np.full(batch, last), **heads)
    a, b = ca.run(q, (k, v)), single.run(q, (k, v))
    torch.cuda.synchronize()
    err = float((a.float() - b.float()).norm() / b.float().norm())
    tc, ts = time_call(lambda: ca.run(q, (k, v))), time_call(lambda: single.run(q, (k, v)))
    t_c, t_s = tc.get("ms_graph", tc["ms_eager"]), ts.get("ms_graph", ts["ms_eager"])
    rec = {"prefix": prefix, "batch": batch, "hkv": hkv, "suffix": SUFFIX, "cascade_ms": t_c,
           "single_ms": t_s, "speedup": t_s / t_c, "rel_err": err,
           "cascade": tc, "single": ts, "speedup_eager": ts["ms_eager"] / tc["ms_eager"]}
    print(f"prefix {prefix:6d} batch {batch:3d} Hkv {hkv:2d}: cascade {t_c * 1e3:8.1f} us, "
          f"single {t_s * 1e3:8.1f} us, speedup {t_s / t_c:5.2f}x (rel err {err:.1e})",
          flush=True)
    return rec


def table(doc: dict[str, Any]) -> str:
    m = doc["meta"]
    lines = [f"{m['gpu']}, torch {m['torch']}, attncc {m['attncc_commit'][:10]}, "
             f"{m['date'][:10]}; decode, bf16, Hq={HQ}, D={D}, page {PAGE}, suffix {SUFFIX}.",
             "", "| prefix | batch | Hkv | cascade us | single us | speedup |",
             "|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if "speedup" in r:
            lines.append(f"| {r['prefix']} | {r['batch']} | {r['hkv']} | "
                         f"{r['cascade_ms'] * 1e3:.1f} | {r['single_ms'] * 1e3:.1f} | "
                         f"{r['speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Bars: cascade vs single-format time per (prefix, batch), speedup on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in doc["results"] if "speedup" in r]
    x = np.arange(len(res))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(x - 0.2, [r["single_ms"] * 1e3 for r in res], 0.4, label="single format")
    ax.bar(x + 0.2, [r["cascade_ms"] * 1e3 for r in res], 0.4, label="cascade")
    for i, r in enumerate(res):
        ax.text(i, r["single_ms"] * 1e3, f"{r['speedup']:.1f}x", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(x, [f"P={r['prefix'] // 1024}K\nB={r['batch']}" for r in res], fontsize=8)
    ax.set_ylabel("us (CUDA-graph replay)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"shared prefix + {SUFFIX}-token suffixes, decode, {doc['meta']['gpu']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, nargs="+", default=list(PREFIXES))
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--hkv", type=int, nargs="+", default=[32])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args(argv)
    from bench.prefill import _meta, report, save
    from bench.timing import TIME_CALL_TIMING

    if args.report is not None:
        report(args.report, table, plot)
        return 0

    results = []
    for p in args.prefix:
        for b in args.batch:
            for h in args.hkv:
                try:
                    results.append(run_cell(p, b, h))
                except Exception as e:  # report and go on
                    print(f"prefix {p} batch {b} Hkv {h} FAILED {type(e).__name__}: {e}")
                    results.append({"prefix": p, "batch": b, "hkv": h,
                                    "error": f"{type(e).__name__}: {str(e)[:300]}"})
    meta = {**_meta(), "num_qo_heads": HQ, "head_dim": D, "page_size": PAGE, "suffix": SUFFIX,
            "timing": TIME_CALL_TIMING}
    save({"meta": meta, "results": results}, args.out, "shared-prefix-h200.json", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
