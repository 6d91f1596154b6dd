"""Shared-prefix decode benchmark (the seed's Table 5): CascadeAttention vs one BatchAttention.

Every request of a batch shares a prefix of P tokens and has its own 128-token suffix; each
decodes one token (bf16, Hq=32, Hkv=32 by default, D=128, page size 16). The single format lists
the prefix pages in every request's page table, so each request reads the prefix's KV; cascade
attention reads it once for the whole batch and merges. Reported: time of each and the speedup.

    python bench/shared_prefix.py               -> bench/results/shared-prefix-h200.json
    python bench/shared_prefix.py --report bench/results/shared-prefix-h200.json

Example (the page lists of one configuration):
    >>> pre, suf = page_lists(prefix=64, batch=2, suffix=32, page=16)
    >>> pre.tolist(), [s.tolist() for s in suf]
    ([0, 1, 2, 3], [[4, 5], [6, 7]])
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

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
    from triton.testing import do_bench

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
    t_c = do_bench(lambda: ca.run(q, (k, v)), warmup=25, rep=100, return_mode="median")
    t_s = do_bench(lambda: single.run(q, (k, v)), warmup=25, rep=100, return_mode="median")
    rec = {"prefix": prefix, "batch": batch, "hkv": hkv, "suffix": SUFFIX, "cascade_ms": t_c,
           "single_ms": t_s, "speedup": t_s / t_c, "rel_err": err}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, nargs="+", default=list(PREFIXES))
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--hkv", type=int, nargs="+", default=[32])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args(argv)
    from prefill import _meta, report, save

    if args.report is not None:
        report(args.report, table)
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
    save({"meta": _meta(), "results": results}, args.out, "shared-prefix-h200.json", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
