"""Paged prefill against dense prefill (issue 5: paged, page size 16, within 15% of dense).

The same queries, keys and values, bf16, D=128, B*S = 16384 tokens per step: dense
`attncc.flex_attention` on contiguous [B, H, S, D] tensors (the FA3 template on an H200), and
`attncc.BatchAttention` over a paged KV cache ([pages, 16, H_kv, D], page ids shuffled) with the
queries as one ragged [B*S, H, D] batch -- with the FA3 batch kernel and, for comparison, the
FA2 batch kernel. Full attention (no mask): BatchAttention has no block lists, so a causal
variant evaluates the mask on every tile of the request's KV range (twice a causal kernel's
work); the causal rows are reported with that caveat. GPU time of one CUDA-graph replay for the
batch paths (bench/timing.py) and do_bench for the dense call; outputs compared.

    python -m bench.paged_prefill --S 2048 8192          -> bench/results/paged-prefill-h200.json
    python -m bench.paged_prefill --report bench/results/paged-prefill-h200.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


TOKENS, HQ, D, PAGE = 16384, 16, 128, 16


def run_cell(S: int, hkv: int, variant: str) -> list[dict[str, Any]]:
    import torch
    from bench.timing import time_call
    from triton.testing import do_bench

    import attncc
    from attncc.gym import causal

    B = TOKENS // S
    g = torch.Generator(device="cuda").manual_seed(S + hkv)
    q = torch.randn(B, HQ, S, D, generator=g, device="cuda").bfloat16()
    k = torch.randn(B, hkv, S, D, generator=g, device="cuda").bfloat16()
    v = torch.randn(B, hkv, S, D, generator=g, device="cuda").bfloat16()
    mask = causal if variant == "causal" else None
    flops = 4.0 * D * B * HQ * S * S * (0.5 if variant == "causal" else 1.0)
    recs: list[dict[str, Any]] = []

    bm = attncc.create_block_mask(mask, None, None, S, S, device="cuda") if mask else None
    dense_out = attncc.flex_attention(q, k, v, block_mask=bm, enable_gqa=hkv != HQ)
    ms = do_bench(lambda: attncc.flex_attention(q, k, v, block_mask=bm, enable_gqa=hkv != HQ),
                  warmup=25, rep=100, return_mode="median")
    recs.append({"impl": "dense", "S": S, "hkv": hkv, "variant": variant, "ms": ms,
                 "tflops": flops / (ms * 1e-3) / 1e12})

    # the paged cache: each request's S tokens in S / PAGE shuffled pages
    n_pages = B * S // PAGE
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(S))
    kc = torch.empty(n_pages, PAGE, hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    kc[perm] = k.transpose(1, 2).reshape(n_pages, PAGE, hkv, D)
    vc[perm] = v.transpose(1, 2).reshape(n_pages, PAGE, hkv, D)
    qr = q.transpose(1, 2).reshape(B * S, HQ, D).contiguous()
    qo = np.arange(B + 1) * S
    kv_indptr = np.arange(B + 1) * (S // PAGE)
    last = np.full(B, PAGE)
    var = attncc.Variant(mask_mod=mask) if mask else None
    for kernel in ("fa3", "fa2"):
        ba = attncc.BatchAttention(var, kv_layout="NHD", max_batch=max(B, 16),
                                   max_qo_tokens=B * S, kernel=kernel)
        try:
            ba.plan(qo, kv_indptr, perm.numpy(), last, num_qo_heads=HQ, num_kv_heads=hkv,
                    head_dim=D, page_size=PAGE)
            out = ba.run(qr, (kc, vc))
            t = time_call(lambda: ba.run(qr, (kc, vc)))
        except Exception as e:  # a comparison that cannot run is reported, not fatal
            recs.append({"impl": f"paged_{kernel}", "S": S, "hkv": hkv, "variant": variant,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        ref = dense_out.transpose(1, 2).reshape(B * S, HQ, D).float()
        err = float((out.float() - ref).norm() / ref.norm())
        ms = t.get("ms_graph") or t["ms_eager"]
        recs.append({"impl": f"paged_{kernel}", "S": S, "hkv": hkv, "variant": variant,
                     "ms": ms, "ms_eager": t["ms_eager"], "tflops": flops / (ms * 1e-3) / 1e12,
                     "rel_diff_vs_dense": err, "units": ba._plan.num_units,
                     "num_ctas": ba.tiles.num_ctas, "tiles": [ba.tiles.tq, ba.tiles.tkv]})
    recs.append(ragged_cell(q, k, v, dense_out, var, S, hkv, variant, flops))
    return recs


def ragged_cell(q: Any, k: Any, v: Any, dense_out: Any, var: Any, S: int, hkv: int,
                variant: str, flops: float) -> dict[str, Any]:
    """The same batch with a ragged (contiguous [tokens, H_kv, D]) KV cache on the persistent
    FA3 batch kernel: one TMA box per K/V tile, no page table -- what a persistent dense kernel
    would cost."""
    from bench.timing import time_call

    import attncc

    B = q.shape[0]
    kr = k.transpose(1, 2).reshape(B * S, hkv, D).contiguous()
    vr = v.transpose(1, 2).reshape(B * S, hkv, D).contiguous()
    qr = q.transpose(1, 2).reshape(B * S, HQ, D).contiguous()
    indptr = np.arange(B + 1) * S
    rec: dict[str, Any] = {"impl": "ragged_fa3", "S": S, "hkv": hkv, "variant": variant}
    try:
        ba = attncc.BatchAttention(var, kv_layout="ragged", max_batch=max(B, 16),
                                   max_qo_tokens=B * S, kernel="fa3")
        ba.plan(indptr, indptr, num_qo_heads=HQ, num_kv_heads=hkv, head_dim=D)
        out = ba.run(qr, (kr, vr))
        t = time_call(lambda: ba.run(qr, (kr, vr)))
    except Exception as e:  # reported, not fatal
        return {**rec, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    ref = dense_out.transpose(1, 2).reshape(B * S, HQ, D).float()
    ms = t.get("ms_graph") or t["ms_eager"]
    return {**rec, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
            "rel_diff_vs_dense": float((out.float() - ref).norm() / ref.norm()),
            "num_ctas": ba.tiles.num_ctas}


def table(doc: dict[str, Any]) -> str:
    """Markdown: TFLOP/s per path and paged / dense."""
    res = [r for r in doc["results"] if "tflops" in r]
    by = {(r["impl"], r["S"], r["hkv"], r["variant"]): r["tflops"] for r in res}
    cells = sorted({(r["S"], r["hkv"], r["variant"]) for r in res})
    m = doc["meta"]
    lines = [f"{m['gpu']}, torch {m['torch']}, attncc {m['attncc_commit'][:10]}, "
             f"{m['date'][:10]}; bf16, Hq={HQ}, D={D}, B*S={TOKENS}, page size {PAGE}; TFLOP/s "
             f"(causal counts half). Target: paged FA3 >= 0.85 x dense.", "",
             "| variant | S | Hkv | dense | paged FA3 | paged FA2 | ragged FA3 | FA3 paged / dense |",
             "|---|---|---|---|---|---|---|---|"]
    for S, hkv, var in cells:
        d = by.get(("dense", S, hkv, var))
        p3, p2 = by.get(("paged_fa3", S, hkv, var)), by.get(("paged_fa2", S, hkv, var))
        r3 = by.get(("ragged_fa3", S, hkv, var))
        fmt = [f"{x:.0f}" if x else "-" for x in (d, p3, p2, r3)]
        ratio = f"{p3 / d:.2f}" if d and p3 else "-"
        lines.append(f"| {var} | {S} | {hkv} | " + " | ".join(fmt) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Bars of TFLOP/s per cell: dense, paged FA3, paged FA2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in doc["results"] if "tflops" in r]
    cells = sorted({(r["variant"], r["S"], r["hkv"]) for r in res})
    by = {(r["impl"], r["variant"], r["S"], r["hkv"]): r["tflops"] for r in res}
    fig, ax = plt.subplots(figsize=(1.2 * len(cells) + 2, 3.6))
    for i, impl in enumerate(("dense", "paged_fa3", "paged_fa2", "ragged_fa3")):
        ax.bar([c + 0.2 * (i - 1.5) for c in range(len(cells))],
               [by.get((impl, *cell), 0) for cell in cells], width=0.2, label=impl)
    ax.set_xticks(range(len(cells)), [f"{v}\nS={S} Hkv={h}" for v, S, h in cells], fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8)
    ax.set_title(f"paged (page {PAGE}) vs dense prefill, {doc['meta']['gpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from bench.prefill import _prefill_meta, report, save

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hkv", type=int, nargs="+", default=[16, 4])
    ap.add_argument("--variants", nargs="+", default=["full", "causal"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args()
    if args.report:
        report(args.report, table, plot)
        return
    results = []
    for S in args.S:
        for hkv in args.hkv:
            for var in args.variants:
                for r in run_cell(S, hkv, var):
                    print(json.dumps(r), flush=True)
                    results.append(r)
    meta = {**_prefill_meta(), "heads": HQ, "kv_heads": args.hkv, "page_size": PAGE}
    save({"meta": meta, "results": results}, args.out, "paged-prefill-h200.json", table)


if __name__ == "__main__":
    main()
