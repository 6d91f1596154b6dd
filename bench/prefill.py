"""Prefill benchmark: attncc vs FlexAttention (torch.compile) vs SDPA (flash, cuDNN) on one GPU.

All implementations run in one process on the same inputs (bf16, H=16, D=128, B*S=16384).
TFLOP/s count 4*D FLOPs per unmasked (query, key) pair: causal counts half of S^2, the sliding
window its exact pair count. Every attncc cell is also checked against another implementation's
output on the same inputs (relative error recorded), so a fast wrong kernel cannot pass.
Each timed attncc kernel prints the kernel cache's record (`spill=`, `local=`, `retries=`);
under ATTNCC_STRICT_RESOURCES=1 (scripts/gpu_check.sh) a kernel loaded with local memory its
form is expected to run without stops the run with a ResourceError.

    python -m bench.prefill                       # full sweep -> bench/results/prefill-h200.json
    python -m bench.prefill --S 4096 --variants causal --impls attncc sdpa_flash
    python -m bench.prefill --report bench/results/prefill-h200.json   # table + PNG (CPU ok)

Example (what one record looks like; the FLOP count of a causal cell):
    >>> pairs("causal", 4096) == 4096 * 4096 / 2
    True
    >>> round(pairs("sliding1024", 2048) / 2048**2, 3)
    0.375
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = ("full", "causal", "softcap_causal", "alibi_causal", "sliding1024")
IMPLS = ("attncc", "flex", "sdpa_flash", "sdpa_cudnn")
SEQ_LENS = (512, 2048, 8192, 16384)
TOKENS, HEADS, HEAD_DIM, WINDOW = 16384, 16, 128, 1024
# targets of the FA3 issue (issue 5), for every S >= 2048: (variant, compared impl, ratio)
TARGETS = (("full", "flex", 1.3), ("full", "sdpa_cudnn", 1.0), ("causal", "flex", 1.3),
           ("causal", "sdpa_cudnn", 1.0), ("softcap_causal", "flex", 1.3),
           ("alibi_causal", "flex", 1.3), ("sliding1024", "flex", 1.3))
TARGET_MIN_S = 2048


def pairs(variant: str, S: int) -> float:
    """Unmasked (query, key) pairs of one head: what the TFLOP/s figure counts."""
    if variant == "full":
        return float(S * S)
    if variant == "sliding1024":  # query i sees keys max(0, i - WINDOW) .. i
        return float(sum(min(i, WINDOW) + 1 for i in range(S)))
    return S * S / 2.0  # causal variants count half, as FlashAttention's benchmarks do


DO_BENCH_TIMING = ("triton.testing.do_bench median (warmup 25 ms, rep 100 ms), eager calls "
                   "(host cost included)")


def _meta() -> dict[str, Any]:
    """What every benchmark's JSON records of the machine, the versions and the commit (each
    adds its own shapes and timing)."""
    import torch

    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    try:
        import cuda.bindings as cb
        cb_v = cb.__version__
    except ImportError:
        cb_v = None
    commit = os.environ.get("ATTNCC_COMMIT")
    if not commit:
        try:
            # --dirty: a copy whose files differ from the commit git finds (the device machine's
            # tree is sent without its history) says so instead of naming that commit
            commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"],
                                    cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton_v, "cuda": torch.version.cuda, "cuda_bindings": cb_v,
            "attncc_commit": commit, "dtype": "bfloat16"}


def _prefill_meta(rounds: int | None = None) -> dict[str, Any]:
    """`_meta` with this benchmark's shapes and do_bench timing (also those of the benchmarks
    that share them); `rounds`: run's interleaved rounds, recorded when given."""
    meta = {**_meta(), "heads": HEADS, "head_dim": HEAD_DIM, "tokens": TOKENS,
            "timing": DO_BENCH_TIMING}
    if rounds is not None:
        meta["timing"] += (f"; a cell's ms is the median of {rounds} interleaved rounds "
                           f"(ms_rounds)")
        meta["rounds"] = rounds
    return meta


class Bench:
    """Inputs, masks and callables of one sequence length."""

    def __init__(self, S: int) -> None:
        import torch

        import attncc
        from attncc.gym import alibi_slopes, causal, sliding_window, softcap

        self.S, self.B = S, TOKENS // S
        g = torch.Generator(device="cuda").manual_seed(S)
        self.q, self.k, self.v = (torch.randn(self.B, HEADS, S, HEAD_DIM, generator=g,
                                              device="cuda", dtype=torch.bfloat16)
                                  for _ in range(3))
        masks = {"causal": causal, "sliding1024": sliding_window(WINDOW)}
        self.mask_of = {"full": None, "causal": "causal", "softcap_causal": "causal",
                        "alibi_causal": "causal", "sliding1024": "sliding1024"}
        self.attncc_bm = {n: attncc.create_block_mask(m, None, None, S, S, device="cuda")
                          for n, m in masks.items()}
        self._masks = masks
        self._torch_bm: dict[str, Any] = {}
        slopes = alibi_slopes(HEADS).cuda()

        def alibi_dev(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + slopes[h] * (kv_idx - q_idx)

        self.score_mod = {"full": None, "causal": None, "softcap_causal": softcap(30.0),
                          "alibi_causal": alibi_dev, "sliding1024": None}

    def torch_bm(self, name: str) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        if name not in self._torch_bm:
            self._torch_bm[name] = create_block_mask(self._masks[name], None, None, self.S,
                                                     self.S, device="cuda")
        return self._torch_bm[name]

    def fn(self, impl: str, variant: str, kernel_options: dict | None = None
           ) -> Callable[[], Any] | None:
        import torch.nn.functional as F

        import attncc

        q, k, v = self.q, self.k, self.v
        mask = self.mask_of[variant]
        sm = self.score_mod[variant]
        if impl == "attncc":
            bm = self.attncc_bm[mask] if mask else None
            return lambda: attncc.flex_attention(q, k, v, score_mod=sm, block_mask=bm,
                                                 kernel_options=kernel_options)
        if impl == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            compiled = _compiled_flex(flex_attention)
            bm = self.torch_bm(mask) if mask else None
            return lambda: compiled(q, k, v, score_mod=sm, block_mask=bm)
        if impl in ("sdpa_flash", "sdpa_cudnn") and variant in ("full", "causal"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = (SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash"
                       else SDPBackend.CUDNN_ATTENTION)
            causal_ = variant == "causal"

            def run() -> Any:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal_)
            return run
        return None


_FLEX: list[Any] = []


def _compiled_flex(flex_attention: Any) -> Any:
    import torch

    if not _FLEX:
        # one compiled function for every (variant, S): raise dynamo's recompile limit
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def _rel_err(a: Any, b: Any) -> float:
    a, b = a.float(), b.float()
    if not bool(a.isfinite().all()):
        return math.inf
    return float((a - b).norm() / b.norm())


def run(seq_lens: tuple[int, ...], variants: tuple[str, ...], impls: tuple[str, ...],
        sweep: list[dict] | None = None, rounds: int = 1) -> list[dict[str, Any]]:
    """Measure every (S, variant, impl) cell; returns the result records.

    With `rounds` > 1 every cell of a (S, variant) is timed again rounds - 1 times, the cells in
    reverse order on every other round, and its `ms` is the median of the rounds (`ms_rounds`):
    the H200's power-limited clock drifts by a few per cent over a sweep (single passes of the
    same kernel differed by up to ~5 %; docs/fa3.md, intro), and interleaving makes each
    implementation see the drift alike.
    """
    import torch
    from triton.testing import do_bench

    from attncc.errors import ResourceError
    from attncc.runtime.flex import gpu_flex

    results: list[dict[str, Any]] = []
    for S in seq_lens:
        bench = Bench(S)
        for variant in variants:
            outs: dict[str, Any] = {}
            # (record, call, FLOPs, label) of each cell timed, for the further rounds
            timed: list[tuple[dict[str, Any], Callable[[], Any], float, str]] = []
            cells = [(impl, None) for impl in impls]
            if sweep and "attncc" in impls:
                cells += [("attncc", opts) for opts in sweep]
            for impl, opts in cells:
                fn = bench.fn(impl, variant, opts)
                if fn is None:
                    continue
                label = impl if opts is None else f"attncc{json.dumps(opts, sort_keys=True)}"
                try:
                    t0 = time.time()
                    out = fn()
                    torch.cuda.synchronize()
                    first_s = time.time() - t0
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                except ResourceError:  # a kernel with unexpected local memory: never timed
                    raise
                except Exception as e:  # a comparison that cannot run is reported, not fatal
                    print(f"S={S:6d} {variant:15s} {label:28s} FAILED {type(e).__name__}: "
                          f"{str(e)[:200]}", flush=True)
                    results.append({"impl": impl, "variant": variant, "S": S,
                                    "error": f"{type(e).__name__}: {str(e)[:500]}"})
                    continue
                flops = 4.0 * HEAD_DIM * bench.B * HEADS * pairs(variant, S)
                rec: dict[str, Any] = {"impl": impl, "variant": variant, "S": S, "B": bench.B,
                                       "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                                       "first_call_s": round(first_s, 2)}
                if opts is not None:
                    rec["kernel_options"] = opts
                timed.append((rec, fn, flops, label))
                if impl == "attncc":
                    from attncc.runtime.flex.api import _as_variant, _trace

                    ir, b = _trace(_as_variant(bench.score_mod[variant]))
                    mask = bench.mask_of[variant]
                    info = gpu_flex.compiled_kernel_info(
                        bench.q, bench.k, bench.v, ir, b,
                        block_mask=bench.attncc_bm[mask] if mask else None,
                        kernel_options=opts)
                    # the kernel cache's record (runtime/jit/kernels.py): spill_bytes from
                    # ptxas's log, local_bytes as the driver reports them for the loaded kernel
                    # (spills land there), retries: recompiles of a form that spilled
                    rec["kernel"] = {k: info[k] for k in (
                        "kernel", "tq", "tkv", "stages", "m_frags", "threads", "registers",
                        "spill_bytes", "local_bytes", "retries", "smem_bytes")}
                    ref_impl = next((r for r in ("flex", "sdpa_flash") if r in outs), None)
                    if ref_impl is not None:
                        rec["rel_err_vs"] = ref_impl
                        rec["rel_err"] = _rel_err(out, outs[ref_impl])
                else:
                    outs[impl] = out
                results.append(rec)
                extra = ""
                if "rel_err" in rec:
                    extra = f" rel_err vs {rec['rel_err_vs']} {rec['rel_err']:.1e}"
                if "kernel" in rec:
                    kk = rec["kernel"]
                    extra += (f" [{'fa3' if '_fa3_' in kk['kernel'] else 'fa2'} tq={kk['tq']} "
                              f"tkv={kk['tkv']} s={kk['stages']} m={kk['m_frags']} "
                              f"regs={kk['registers']} spill={kk['spill_bytes']} "
                              f"local={kk['local_bytes']} retries={kk['retries']}]")
                print(f"S={S:6d} {variant:15s} {label:28s} {ms:8.3f} ms "
                      f"{rec['tflops']:7.1f} TFLOP/s{extra}", flush=True)
            for r in range(1, rounds):
                for rec, fn, _, _ in (timed[::-1] if r % 2 else timed):
                    rec.setdefault("ms_rounds", [rec["ms"]]).append(
                        do_bench(fn, warmup=25, rep=100, return_mode="median"))
            for rec, _, flops, label in timed:
                if "ms_rounds" in rec:
                    rec["ms"] = statistics.median(rec["ms_rounds"])
                    rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
                    print(f"S={S:6d} {variant:15s} {label:28s} {rec['ms']:8.3f} ms "
                          f"{rec['tflops']:7.1f} TFLOP/s (median of {len(rec['ms_rounds'])} "
                          f"rounds)", flush=True)
            # attncc is measured first; compare it with whichever reference ran after it
            for rec in results:
                if (rec.get("impl") == "attncc" and rec["S"] == S and rec["variant"] == variant
                        and "rel_err" not in rec and "error" not in rec):
                    ref_impl = next((r for r in ("flex", "sdpa_flash") if r in outs), None)
                    if ref_impl is not None:
                        fn = bench.fn("attncc", variant, rec.get("kernel_options"))
                        rec["rel_err_vs"] = ref_impl
                        rec["rel_err"] = _rel_err(fn(), outs[ref_impl])
        del bench
        torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------ report
def table(doc: dict[str, Any]) -> str:
    """Markdown table of TFLOP/s with attncc's ratios and the issue's targets; the FA2 template
    (a `--sweep '{"KERNEL": "fa2"}'` cell) gets its own column when it was measured."""
    res = [r for r in doc["results"] if "tflops" in r and "kernel_options" not in r]
    by = {(r["impl"], r["variant"], r["S"]): r["tflops"] for r in res}
    by.update({("attncc_fa2", r["variant"], r["S"]): r["tflops"] for r in doc["results"]
               if "tflops" in r and r.get("kernel_options") == {"KERNEL": "fa2"}})
    seqs = sorted({r["S"] for r in res})
    m = doc["meta"]
    lines = [f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
             f"attncc {m['attncc_commit'][:10]}, {m['date'][:10]}; bf16, H={m['heads']}, "
             f"D={m['head_dim']}, B*S={m['tokens']}; TFLOP/s (causal counts half, the sliding "
             f"window its unmasked pairs). Targets (S >= {TARGET_MIN_S}): "
             + ", ".join(f"{v} >= {x} x {i}" for v, i, x in TARGETS) + ".", "",
             "| variant | S | attncc | attncc FA2 | flex | sdpa_flash | sdpa_cudnn | / flex "
             "| / cuDNN | targets met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        for S in seqs:
            if ("attncc", variant, S) not in by:
                continue
            mine = by[("attncc", variant, S)]
            cells = [f"{by[(i, variant, S)]:.0f}" if (i, variant, S) in by else "-"
                     for i in ("attncc", "attncc_fa2", *IMPLS[1:])]
            ratios = {i: mine / by[(i, variant, S)] for i in ("flex", "sdpa_cudnn")
                      if (i, variant, S) in by}
            checks = [ratios[i] >= x for v, i, x in TARGETS
                      if v == variant and i in ratios and S >= TARGET_MIN_S]
            met = "-" if not checks else ("yes" if all(checks) else "**no**")
            lines.append(f"| {variant} | {S} | " + " | ".join(cells) + " | "
                         + " | ".join(f"{ratios[i]:.2f}" if i in ratios else "-"
                                      for i in ("flex", "sdpa_cudnn")) + f" | {met} |")
    return "\n".join(lines) + "\n"


def plot_panels(results: list[dict[str, Any]], key: str, variants: Sequence[str],
                impls: Sequence[str], ylabel: str, title: str, path: Path) -> None:
    """One panel per variant with results: `key` against S for every implementation (the
    prefill and backward benchmarks' PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [v for v in variants if any(r["variant"] == v for r in results)]
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(4 * max(1, len(shown)), 3.6),
                             squeeze=False)
    for ax, variant in zip(axes[0], shown):
        for impl in impls:
            pts = sorted((r["S"], r[key]) for r in results
                         if r["impl"] == impl and r["variant"] == variant)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(variant)
        ax.set_xlabel("S (B*S = 16384)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(doc: dict[str, Any], path: Path) -> None:
    """One panel per variant: TFLOP/s against S for every implementation."""
    res = [r for r in doc["results"] if "tflops" in r and "kernel_options" not in r]
    plot_panels(res, "tflops", VARIANTS, IMPLS, "TFLOP/s",
                f"prefill, {doc['meta']['gpu']}, bf16, H=16, D=128", path)


def report(json_path: Path, table_fn: Callable[[dict], str],
           plot_fn: Callable[[dict, Path], None] | None = None) -> None:
    """`--report`: the markdown table (and PNG) next to an existing results JSON, printed."""
    doc = json.loads(json_path.read_text())
    json_path.with_suffix(".md").write_text(table_fn(doc))
    if plot_fn is not None:
        plot_fn(doc, json_path.with_suffix(".png"))
    print(table_fn(doc))


def save(doc: dict[str, Any], out: Path | None, name: str,
         table_fn: Callable[[dict], str]) -> Path:
    """Write a results JSON to `out` (default $OUT/<name>, else bench/results/<name>), print the
    table, return the path."""
    out = out or Path(os.environ.get("OUT", ROOT / "bench" / "results")) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(table_fn(doc))
    print(f"wrote {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="+", default=list(SEQ_LENS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--sweep", type=json.loads, nargs="*", default=None,
                    help="extra attncc cells with these kernel_options (JSON dicts)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default $OUT/prefill-h200.json or bench/results/)")
    ap.add_argument("--report", type=Path, default=None,
                    help="only write the markdown table and PNG of an existing JSON")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per cell; ms is their median (see run)")
    args = ap.parse_args(argv)
    if args.report is not None:
        report(args.report, table, plot)
        return 0
    doc = {"meta": _prefill_meta(args.rounds), "results": run(tuple(args.S), tuple(args.variants),
                                                      tuple(args.impls), args.sweep, args.rounds)}
    save(doc, args.out, "prefill-h200.json", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
