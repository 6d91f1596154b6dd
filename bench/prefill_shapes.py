"""Prefill across shapes (issue 32): head dims 64 / 128 / 256, short and long sequences, and the
Llama-3.1 GQA shape; attncc vs FlexAttention (torch.compile) vs SDPA (flash, cuDNN), one process.

Shapes (`SHAPES`): D in {64, 128, 256} with H * D = 2048 and B * S = 16384 at S in {512, 2048,
8192, 16384}; Llama-3.1's 64 query / 8 KV heads at D = 128, B = 1, S in {4096, 16384, 32768}.
Variants: full and causal everywhere, softcap + causal at D = 256 (Gemma-2). bf16 inputs, fresh
per shape; TFLOP/s count 4 * D FLOPs per unmasked (query, key) pair, causal half of S^2
(bench/prefill.py `pairs`). Timing as bench/prefill.py: do_bench medians, interleaved rounds.
SDPA gets K/V expanded to the query heads for the GQA shape (expanded once, outside the timing),
flex and attncc take `enable_gqa=True`. Every attncc cell is checked against another
implementation's output (`rel_err`). Records carry `impl`, `variant`, `S`, `D`, `hq`, `hkv`,
`B`, `ms`, `tflops`.

    python -m bench.prefill_shapes                               # -> $OUT or bench/results/
    python -m bench.prefill_shapes --D 256 --impls attncc sdpa_cudnn --variants full causal
    python -m bench.prefill_shapes --S 512 --graph          # + CUDA-graph replays (host-bound S)
    python -m bench.prefill_shapes --report bench/results/prefill-shapes-h200.json  # CPU ok

Example (the shape list and one target check):
    >>> [s for s in SHAPES if s.D == 256][:2]
    [Shape(D=256, hq=8, hkv=8, S=512, B=32), Shape(D=256, hq=8, hkv=8, S=2048, B=8)]
    >>> len(SHAPES), len(cells(SHAPES))
    (15, 34)
    >>> target_checks(Shape(128, 16, 16, 512, 32), {"sdpa_cudnn": 0.96, "flex": 1.5})
    [('sdpa_cudnn', 0.95, True), ('flex', 1.3, True)]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from bench.prefill import _compiled_flex, _meta, _rel_err, pairs, report, save

TOKENS = 16384
HIDDEN = 2048  # H * D of the head-dim sweep
IMPLS = ("attncc", "flex", "sdpa_flash", "sdpa_cudnn")
VARIANTS = ("full", "causal", "softcap_causal")
SOFTCAP = 30.0
# (impl, ratio attncc / impl must reach) at S >= 2048, and at S = 512 (issue 32's targets)
TARGETS_LONG = (("sdpa_cudnn", 1.0), ("flex", 1.3))
TARGETS_SHORT = (("sdpa_cudnn", 0.95), ("flex", 1.3))


class Shape(NamedTuple):
    """One problem: head dim, query / KV heads, sequence length, batch."""

    D: int
    hq: int
    hkv: int
    S: int
    B: int

    @property
    def label(self) -> str:
        return f"D={self.D} H={self.hq}" + (f"/{self.hkv}" if self.hkv != self.hq else "")


SHAPES: tuple[Shape, ...] = tuple(
    [Shape(D, HIDDEN // D, HIDDEN // D, S, TOKENS // S)
     for D in (64, 128, 256) for S in (512, 2048, 8192, 16384)]
    + [Shape(128, 64, 8, S, 1) for S in (4096, 16384, 32768)])


def variants_of(shape: Shape) -> tuple[str, ...]:
    """full and causal; softcap + causal too at D = 256 (Gemma-2's head dim)."""
    return VARIANTS if shape.D == 256 else VARIANTS[:2]


def cells(shapes: tuple[Shape, ...]) -> list[tuple[Shape, str]]:
    """Every (shape, variant) the sweep measures."""
    return [(s, v) for s in shapes for v in variants_of(s)]


def target_checks(shape: Shape, ratios: dict[str, float]) -> list[tuple[str, float, bool]]:
    """(impl, wanted ratio, met) for each target that applies to `shape` and was measured;
    `ratios` maps an impl to attncc's TFLOP/s over its."""
    targets = TARGETS_SHORT if shape.S < 2048 else TARGETS_LONG
    return [(i, x, ratios[i] >= x) for i, x in targets if i in ratios]


class ShapeBench:
    """Inputs and callables of one shape."""

    def __init__(self, shape: Shape) -> None:
        import torch

        import attncc
        from attncc.gym import causal

        self.shape = shape
        g = torch.Generator(device="cuda").manual_seed(shape.S * 1000 + shape.D)
        B, S, D = shape.B, shape.S, shape.D

        def randn(h: int) -> Any:
            return torch.randn(B, h, S, D, generator=g, device="cuda", dtype=torch.bfloat16)

        self.q, self.k, self.v = randn(shape.hq), randn(shape.hkv), randn(shape.hkv)
        rep = shape.hq // shape.hkv
        # SDPA's flash and cuDNN backends on the query heads' K/V (expanded once)
        self.k_sdpa = self.k.repeat_interleave(rep, dim=1) if rep > 1 else self.k
        self.v_sdpa = self.v.repeat_interleave(rep, dim=1) if rep > 1 else self.v
        self.gqa = rep > 1
        self._causal = causal
        self.attncc_bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
        self._torch_bm: Any = None

    def score_mod(self, variant: str) -> Any:
        from attncc.gym import softcap

        return softcap(SOFTCAP) if variant == "softcap_causal" else None

    def torch_bm(self) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        if self._torch_bm is None:
            self._torch_bm = create_block_mask(self._causal, None, None, self.shape.S,
                                               self.shape.S, device="cuda")
        return self._torch_bm

    def fn(self, impl: str, variant: str, kernel_options: dict | None = None
           ) -> Callable[[], Any] | None:
        import torch.nn.functional as F

        import attncc

        q, k, v, gqa = self.q, self.k, self.v, self.gqa
        masked = variant != "full"
        sm = self.score_mod(variant)
        if impl == "attncc":
            bm = self.attncc_bm if masked else None
            return lambda: attncc.flex_attention(q, k, v, score_mod=sm, block_mask=bm,
                                                 enable_gqa=gqa, kernel_options=kernel_options)
        if impl == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            compiled = _compiled_flex(flex_attention)
            bm = self.torch_bm() if masked else None
            return lambda: compiled(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=gqa)
        if impl in ("sdpa_flash", "sdpa_cudnn") and variant in ("full", "causal"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = (SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash"
                       else SDPBackend.CUDNN_ATTENTION)
            ks, vs, is_causal = self.k_sdpa, self.v_sdpa, variant == "causal"

            def run() -> Any:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, ks, vs, is_causal=is_causal)
            return run
        return None

    def kernel_record(self, variant: str, kernel_options: dict | None) -> dict[str, Any]:
        """The kernel cache's record of the attncc kernel this cell runs (resources)."""
        from attncc.runtime.flex import gpu_flex
        from attncc.runtime.flex.api import _as_variant, _trace

        ir, b = _trace(_as_variant(self.score_mod(variant)))
        info = gpu_flex.compiled_kernel_info(
            self.q, self.k, self.v, ir, b,
            block_mask=self.attncc_bm if variant != "full" else None,
            kernel_options=kernel_options, enable_gqa=self.gqa)
        return {k: info[k] for k in ("kernel", "tq", "tkv", "stages", "threads", "registers",
                                     "spill_bytes", "local_bytes", "retries", "smem_bytes")}


def _time(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _time_graph(fn: Callable[[], Any]) -> float | None:
    """do_bench median of one CUDA-graph replay of `fn`, or None if it cannot be captured."""
    from bench.timing import graph_of

    try:
        g = graph_of(fn)
    except Exception as e:  # noqa: BLE001 -- reported, the eager figure stands
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        return None
    return _time(g.replay)


def run(shapes: tuple[Shape, ...], variants: tuple[str, ...], impls: tuple[str, ...],
        sweep: list[dict] | None = None, rounds: int = 3,
        graph: bool = False) -> list[dict[str, Any]]:
    """Measure every (shape, variant, impl) cell (rounds interleaved as bench/prefill.py run).
    `graph`: also time one CUDA-graph replay of each cell (`ms_graph`, `tflops_graph`;
    bench/timing.py), the kernels' own time where an eager call is host-bound (S = 512)."""
    import torch

    from attncc.errors import ResourceError

    results: list[dict[str, Any]] = []
    for shape in shapes:
        bench = ShapeBench(shape)
        for variant in (v for v in variants_of(shape) if v in variants):
            outs: dict[str, Any] = {}
            timed: list[tuple[dict[str, Any], Callable[[], Any], float]] = []
            flops = 4.0 * shape.D * shape.B * shape.hq * pairs(variant, shape.S)
            todo = [(i, None) for i in impls] + [("attncc", o) for o in (sweep or [])
                                                 if "attncc" in impls]
            for impl, opts in todo:
                fn = bench.fn(impl, variant, opts)
                if fn is None:
                    continue
                base = {"impl": impl, "variant": variant, "S": shape.S, "D": shape.D,
                        "hq": shape.hq, "hkv": shape.hkv, "B": shape.B}
                try:
                    t0 = time.time()
                    out = fn()
                    torch.cuda.synchronize()
                    first_s = time.time() - t0
                    ms = _time(fn)
                except ResourceError:  # unexpected local memory: never timed
                    raise
                except Exception as e:  # a comparison that cannot run is reported
                    print(f"{shape.label} S={shape.S} {variant} {impl} FAILED "
                          f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                    results.append({**base, "error": f"{type(e).__name__}: {str(e)[:500]}"})
                    continue
                rec = {**base, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                       "first_call_s": round(first_s, 2)}
                if graph:
                    ms_graph = _time_graph(fn)
                    if ms_graph is not None:
                        rec["ms_graph"] = ms_graph
                        rec["tflops_graph"] = flops / (ms_graph * 1e-3) / 1e12
                if opts is not None:
                    rec["kernel_options"] = opts
                if impl == "attncc":
                    rec["kernel"] = bench.kernel_record(variant, opts)
                    rec["_out"] = out
                else:
                    outs[impl] = out
                timed.append((rec, fn, flops))
                results.append(rec)
            for r in range(1, rounds):
                for rec, fn, _ in (timed[::-1] if r % 2 else timed):
                    rec.setdefault("ms_rounds", [rec["ms"]]).append(_time(fn))
            for rec, _, fl in timed:
                if "ms_rounds" in rec:
                    rec["ms"] = statistics.median(rec["ms_rounds"])
                    rec["tflops"] = fl / (rec["ms"] * 1e-3) / 1e12
                out = rec.pop("_out", None)
                ref = next((i for i in ("sdpa_flash", "sdpa_cudnn", "flex") if i in outs), None)
                if out is not None and ref is not None:
                    rec["rel_err_vs"], rec["rel_err"] = ref, _rel_err(out, outs[ref])
                kk = rec.get("kernel", {})
                extra = (f" [{kk['kernel'].split('_')[-4] if kk else ''} tkv={kk.get('tkv')} "
                         f"s={kk.get('stages')} spill={kk.get('spill_bytes')} "
                         f"local={kk.get('local_bytes')}] rel_err {rec.get('rel_err', -1):.1e}"
                         if kk else "")
                label = rec["impl"] + (json.dumps(rec["kernel_options"], sort_keys=True)
                                       if "kernel_options" in rec else "")
                print(f"{shape.label:12s} S={shape.S:6d} {variant:15s} {label:28s} "
                      f"{rec['ms']:8.3f} ms {rec['tflops']:7.1f} TFLOP/s{extra}", flush=True)
        del bench
        torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------ report
def _by(doc: dict[str, Any], key: str = "tflops") -> dict[tuple, float]:
    return {(r["impl"], r["variant"], r["D"], r["hq"], r["hkv"], r["S"]): r[key]
            for r in doc["results"] if key in r and "kernel_options" not in r}


def table(doc: dict[str, Any]) -> str:
    """Markdown table: TFLOP/s per (shape, variant), attncc's ratios, the issue's targets; and
    the same of the CUDA-graph replays when the run timed them (`--graph`)."""
    m = doc["meta"]
    lines = [f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
             f"attncc {m['attncc_commit'][:10]}, {m['date'][:10]}; bf16, TFLOP/s (causal counts "
             f"half). Head-dim sweep: H * D = {HIDDEN}, B * S = {TOKENS}; GQA: Llama-3.1 "
             f"64/8 heads, D = 128, B = 1. Targets: S >= 2048 "
             + ", ".join(f">= {x} x {i}" for i, x in TARGETS_LONG) + "; S < 2048 "
             + ", ".join(f">= {x} x {i}" for i, x in TARGETS_SHORT) + ".",
             *([m["note"]] if "note" in m else [])]
    lines += _rows(_by(doc), "eager calls")
    if any("tflops_graph" in r for r in doc["results"]):
        lines += _rows(_by(doc, "tflops_graph"), "one CUDA-graph replay (the kernels' time)")
    return "\n".join(lines) + "\n"


def _rows(by: dict[tuple, float], title: str) -> list[str]:
    lines = ["", f"TFLOP/s of {title}:", "",
             "| shape | variant | S | attncc | flex | sdpa_flash | sdpa_cudnn | / flex "
             "| / cuDNN | targets met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        for variant in variants_of(shape):
            key = (variant, shape.D, shape.hq, shape.hkv, shape.S)
            if ("attncc", *key) not in by:
                continue
            mine = by[("attncc", *key)]
            cells_ = [f"{by[(i, *key)]:.0f}" if (i, *key) in by else "-" for i in IMPLS]
            ratios = {i: mine / by[(i, *key)] for i in ("flex", "sdpa_cudnn")
                      if (i, *key) in by}
            checks = target_checks(shape, ratios)
            met = "-" if not checks else ("yes" if all(c[2] for c in checks) else "**no**")
            lines.append(f"| {shape.label} | {variant} | {shape.S} | " + " | ".join(cells_)
                         + " | " + " | ".join(f"{ratios[i]:.2f}" if i in ratios else "-"
                                              for i in ("flex", "sdpa_cudnn")) + f" | {met} |")
    return lines


def plot(doc: dict[str, Any], path: Path) -> None:
    """A grid of panels, one per (shape family, variant): TFLOP/s against S per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in doc["results"] if "tflops" in r and "kernel_options" not in r]
    label = {id(r): f"{Shape(r['D'], r['hq'], r['hkv'], 0, 0).label} {r['variant']}" for r in res}
    panels = sorted(set(label.values()))
    cols = 3
    rows = -(-len(panels) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for impl in IMPLS:
            pts = sorted((r["S"], r["tflops"]) for r in res
                         if r["impl"] == impl and label[id(r)] == panel)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(panel, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("TFLOP/s")
    fig.suptitle(f"prefill shapes, {doc['meta']['gpu']}, bf16 (x: S)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--S", type=int, nargs="+", default=None, help="only these lengths")
    ap.add_argument("--gqa", choices=("with", "without", "only"), default="with",
                    help="the Llama-3.1 GQA shapes: with the head-dim sweep, without, only")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--sweep", type=json.loads, nargs="*", default=None,
                    help="extra attncc cells with these kernel_options (JSON dicts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true",
                    help="also time one CUDA-graph replay per cell (ms_graph, tflops_graph)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None,
                    help="only write the markdown table and PNG of an existing JSON")
    args = ap.parse_args(argv)
    if args.report is not None:
        report(args.report, table, plot)
        return 0
    keep_gqa = {"with": (False, True), "without": (False,), "only": (True,)}[args.gqa]
    shapes = tuple(s for s in SHAPES if s.D in args.D and (args.S is None or s.S in args.S)
                   and (s.hq != s.hkv) in keep_gqa)
    meta = {**_meta(), "tokens": TOKENS, "hidden": HIDDEN, "rounds": args.rounds,
            "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms), eager calls; "
                      f"a cell's ms is the median of {args.rounds} interleaved rounds",
            "sdpa_gqa": "K/V expanded to the query heads before timing"}
    doc = {"meta": meta, "results": run(shapes, tuple(args.variants), tuple(args.impls),
                                        args.sweep, args.rounds, args.graph)}
    save(doc, args.out, "prefill-shapes-h200.json", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
