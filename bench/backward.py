"""Backward benchmark: attncc vs FlexAttention (torch.compile) vs SDPA (flash, cuDNN), fwd+bwd.

All implementations run in one process on the same inputs (bf16, H=16, D=128, B*S=16384), with
bench/prefill.py's variants plus two learnable biases with a causal mask: `relbias_causal`, a
relative-position table (`score + bias[h, q_idx - kv_idx + S - 1]`, the table requires grad),
and `alibi_learned_causal`, ALiBi with learnable slopes (`score + slopes[h] * (kv_idx -
q_idx)`). Each cell
times the forward (inputs requiring grad, as in training) and forward+backward
(`torch.autograd.grad` of a fixed output gradient, so nothing accumulates between calls);
backward-only = fwdbwd - fwd. FLOPs: the forward counts 4*D per unmasked (query, key) pair
(`bench.prefill.pairs`: causal half), the backward 2.5x the forward, as FlashAttention's
benchmarks do. Every attncc cell's dq/dk/dv (and dbias) are checked against FlexAttention's on
the same inputs (SDPA flash's where Flex did not run; relative Frobenius error), so a fast wrong
backward cannot pass. A cell that cannot run (e.g. a checkout whose CUDA output has no grad_fn)
is recorded with its error and the sweep goes on.

    python -m bench.backward                      # full sweep -> bench/results/backward-h200.*
    python -m bench.backward --S 2048 --variants causal relbias_causal --impls attncc flex
    python -m bench.backward --report bench/results/backward-h200.json   # table + PNG (CPU ok)
    python -m bench.backward --report a.json b.json --out bench/results/backward-h200.json

A full sweep spends most of its time compiling FlexAttention (a forward and a backward graph per
variant and S); to keep each run short, measure a few S per run and merge the JSONs with
`--report A B --out C` (the records together, the first run's meta, every run's commit and date).

Example (the FLOP count of a causal cell's backward, in TFLOP):
    >>> bwd_flops("causal", 2048, B=8) / 1e12 == 2.5 * 4 * 128 * 8 * 16 * 2048 ** 2 / 2 / 1e12
    True
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.prefill import (HEAD_DIM, HEADS, SEQ_LENS, TOKENS, Bench, _prefill_meta, _rel_err,
                           pairs, plot_panels, report, save)
from bench.prefill import VARIANTS as PREFILL_VARIANTS

VARIANTS = (*PREFILL_VARIANTS, "relbias_causal", "alibi_learned_causal")
IMPLS = ("attncc", "flex", "sdpa_flash", "sdpa_cudnn")
BWD_FLOP_FACTOR = 2.5
# issue 29's targets, for every S >= 2048: (variant, compared impl, ratio of backward TFLOP/s)
TARGETS = (*((v, "flex", 1.3) for v in VARIANTS), ("full", "sdpa_cudnn", 1.0),
           ("causal", "sdpa_cudnn", 1.0))
TARGET_MIN_S = 2048
GRAD_NAMES = ("dq", "dk", "dv", "dbias")
TIMING = ("triton.testing.do_bench median (warmup 25 ms, rep 100 ms), eager calls (host cost "
          "included); fwd_ms: the forward with inputs requiring grad, fwdbwd_ms: forward + "
          "torch.autograd.grad of a fixed output gradient, bwd_ms = fwdbwd_ms - fwd_ms; "
          "bwd_tflops counts 2.5x the forward's FLOPs (4*D per unmasked pair, causal half); "
          "*_kernel_ms: the GPU time of the same calls' kernels and copies (torch.profiler, "
          "5 calls, bench/timing.py device_ms), bwd_kernel_tflops from their difference")


def fwd_flops(variant: str, S: int, B: int) -> float:
    """FLOPs of one forward over the batch: 4*D per unmasked (query, key) pair and head."""
    return 4.0 * HEAD_DIM * B * HEADS * pairs(variant, S)


def bwd_flops(variant: str, S: int, B: int) -> float:
    """FLOPs the backward-only figure counts: 2.5x the forward's (dS, dP, dV, dQ, dK matmuls)."""
    return BWD_FLOP_FACTOR * fwd_flops(variant, S, B)


class BackwardBench(Bench):
    """`bench.prefill.Bench` with q, k, v requiring grad, a fixed output gradient, and two
    learnable-bias variants: `relbias_causal` (a relative-position table, read at positions)
    and `alibi_learned_causal` (ALiBi with learnable per-head slopes, read once per head)."""

    def __init__(self, S: int) -> None:
        import torch

        super().__init__(S)
        for t in (self.q, self.k, self.v):
            t.requires_grad_(True)
        g = torch.Generator(device="cuda").manual_seed(S + 1)
        self.dout = torch.randn(self.q.shape, generator=g, device="cuda", dtype=torch.bfloat16)
        # one fp32 entry per head and relative offset q_idx - kv_idx in [-(S-1), S-1]
        self.bias = (0.5 * torch.randn(HEADS, 2 * S - 1, generator=g, device="cuda")
                     ).requires_grad_(True)
        bias = self.bias

        def relbias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + bias[h, q_idx - kv_idx + S - 1]

        self.score_mod["relbias_causal"] = relbias
        self.mask_of["relbias_causal"] = "causal"
        # ALiBi's geometric slopes 2^(-8 (h + 1) / H), learnable
        self.slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device="cuda") / HEADS
                                 ).requires_grad_(True)
        slopes = self.slopes

        def alibi_learned(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score + slopes[h] * (kv_idx - q_idx)

        self.score_mod["alibi_learned_causal"] = alibi_learned
        self.mask_of["alibi_learned_causal"] = "causal"
        self.learned = {"relbias_causal": [self.bias], "alibi_learned_causal": [self.slopes]}

    def inputs(self, variant: str) -> list[Any]:
        """The tensors whose gradients a training step of `variant` needs."""
        return [self.q, self.k, self.v, *self.learned.get(variant, [])]

    def fwdbwd(self, fwd: Callable[[], Any], variant: str) -> Callable[[], Any]:
        """forward + backward of `fwd` for this bench's output gradient (`fwd_bwd`)."""
        return fwd_bwd(fwd, self.inputs(variant), self.dout)


def fwd_bwd(fwd: Callable[[], Any], inputs: list[Any], dout: Any) -> Callable[[], Any]:
    """A call running `fwd` and its backward: the gradients of `inputs` for output gradient
    `dout` (`torch.autograd.grad`, so nothing accumulates in `.grad` between timed calls)."""
    import torch

    def step() -> Any:
        out = fwd()
        if out.grad_fn is None:
            raise RuntimeError("the output has no grad_fn: this implementation has no "
                               "backward for these inputs (attncc: no GPU backward in this "
                               "checkout, issue 29)")
        return torch.autograd.grad(out, inputs, dout)
    return step


def _time(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _set_times(rec: dict[str, Any], fwd_ms: float, fwdbwd_ms: float) -> None:
    """A record's times and TFLOP/s from its forward and forward+backward milliseconds."""
    S, B, variant = rec["S"], rec["B"], rec["variant"]
    bwd_ms = fwdbwd_ms - fwd_ms
    rec.update(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, bwd_ms=bwd_ms,
               fwd_tflops=fwd_flops(variant, S, B) / (fwd_ms * 1e-3) / 1e12,
               fwdbwd_tflops=(fwd_flops(variant, S, B) + bwd_flops(variant, S, B))
               / (fwdbwd_ms * 1e-3) / 1e12)
    # a backward too fast to separate from the forward's noise gets no figure, never a wild one
    rec["bwd_tflops"] = (bwd_flops(variant, S, B) / (bwd_ms * 1e-3) / 1e12 if bwd_ms > 0
                         else None)


def grad_errors(mine: list[Any], ref: list[Any]) -> dict[str, float]:
    """Relative Frobenius error of each gradient (named dq, dk, dv, dbias) against `ref`'s."""
    return {name: _rel_err(a, b) for name, a, b in zip(GRAD_NAMES, mine, ref)}


# a forward + backward call this slow after its first one compiles again on every call (Flex's
# with a captured tensor that requires grad): timed by single calls, not by do_bench's dozens
SLOW_CALL_S = 1.0


def _measure_cell(bench: BackwardBench, impl: str, variant: str,
                  opts: dict | None
                  ) -> tuple[dict[str, Any], Any, Callable | None, Callable | None] | None:
    """First calls (compiles) and one timing of a cell: (record, grads, fwd, fwdbwd), or None
    when `impl` does not run `variant`; a cell that recompiles on every call (SLOW_CALL_S) is
    timed by one call of each and returns no callables (no rounds). Raises what the
    implementation raises."""
    import torch

    from bench.timing import spin_gpu

    fwd = bench.fn(impl, variant, opts)
    if fwd is None:
        return None
    step = bench.fwdbwd(fwd, variant)
    t0 = time.time()
    fwd()
    torch.cuda.synchronize()
    t1 = time.time()
    grads = [g.detach().clone() for g in step()]
    torch.cuda.synchronize()
    rec: dict[str, Any] = {"impl": impl, "variant": variant, "S": bench.S, "B": bench.B,
                           "first_fwd_s": round(t1 - t0, 2),
                           "first_fwdbwd_s": round(time.time() - t1, 2)}
    if opts is not None:
        rec["kernel_options"] = opts
    t2 = time.time()
    step()
    torch.cuda.synchronize()
    again = time.time() - t2
    if again > SLOW_CALL_S:  # recompiles per call: one call each, no rounds, no kernel times
        t3 = time.time()
        fwd()
        torch.cuda.synchronize()
        rec["recompiles_per_call"] = True
        _set_times(rec, (time.time() - t3) * 1e3, again * 1e3)
        return rec, grads, None, None
    spin_gpu()  # the clocks dropped while the host compiled (bench/timing.py)
    _set_times(rec, _time(fwd), _time(step))
    _set_kernel_times(rec, fwd, step)
    return rec, grads, fwd, step


def _set_kernel_times(rec: dict[str, Any], fwd: Callable[[], Any], step: Callable[[], Any]
                      ) -> None:
    """The cell's GPU-only figures (`bench.timing.device_ms`): the kernels of the forward and of
    forward+backward, and the backward's share as TFLOP/s, free of each implementation's host
    path (the eager figures above include it)."""
    from bench.timing import device_ms

    f, fb = device_ms(fwd), device_ms(step)
    S, B, variant = rec["S"], rec["B"], rec["variant"]
    rec.update(fwd_kernel_ms=f, fwdbwd_kernel_ms=fb, bwd_kernel_ms=fb - f,
               bwd_kernel_tflops=(bwd_flops(variant, S, B) / ((fb - f) * 1e-3) / 1e12
                                  if fb > f else None))


def _line(rec: dict[str, Any], label: str, note: str = "") -> str:
    bwd = f"{rec['bwd_tflops']:7.1f}" if rec["bwd_tflops"] is not None else "      -"
    kern = (f" (kernels {rec['bwd_kernel_tflops']:5.0f})" if rec.get("bwd_kernel_tflops")
            else "")
    return (f"S={rec['S']:6d} {rec['variant']:15s} {label:28s} fwd {rec['fwd_ms']:8.3f} ms "
            f"fwd+bwd {rec['fwdbwd_ms']:8.3f} ms  bwd {bwd} TFLOP/s{kern}{note}")


def _add_rel_errs(recs: list[dict[str, Any]], grads: dict[int, list[Any]],
                  refs: dict[str, list[Any]]) -> None:
    """Each attncc record's gradient errors against Flex's (else SDPA flash's) on its inputs."""
    ref_impl = next((r for r in ("flex", "sdpa_flash") if r in refs), None)
    if ref_impl is None:
        return
    for rec in recs:
        if rec["impl"] == "attncc" and id(rec) in grads:
            errs = grad_errors(grads[id(rec)], refs[ref_impl])
            rec.update(rel_err_vs=ref_impl, rel_err=max(errs.values()), rel_err_grads=errs)


def run_cell_group(bench: BackwardBench, variant: str, cells: list[tuple[str, dict | None]],
                   rounds: int) -> list[dict[str, Any]]:
    """Every cell of one (S, variant): measured, timed again in `rounds` - 1 interleaved rounds
    (every other round in reverse order; each time is the median of its rounds, as
    bench/prefill.py's run explains), and attncc's gradients checked."""
    import torch

    from attncc.errors import ResourceError

    results: list[dict[str, Any]] = []
    timed: list[tuple[dict[str, Any], Callable, Callable, str]] = []
    grads: dict[int, list[Any]] = {}
    refs: dict[str, list[Any]] = {}
    for impl, opts in cells:
        label = impl if opts is None else f"attncc{json.dumps(opts, sort_keys=True)}"
        try:
            got = _measure_cell(bench, impl, variant, opts)
        except ResourceError:  # a kernel with unexpected local memory: never timed
            raise
        except Exception as e:  # noqa: BLE001 -- a cell that cannot run is reported
            print(f"S={bench.S:6d} {variant:15s} {label:28s} FAILED {type(e).__name__}: "
                  f"{str(e)[:200]}", flush=True)
            results.append({"impl": impl, "variant": variant, "S": bench.S,
                            **({"kernel_options": opts} if opts is not None else {}),
                            "error": f"{type(e).__name__}: {str(e)[:500]}"})
            torch.cuda.empty_cache()
            continue
        if got is None:
            continue
        rec, cell_grads, fwd, step = got
        if impl == "attncc":
            grads[id(rec)] = cell_grads
        elif impl in ("flex", "sdpa_flash"):
            refs[impl] = cell_grads
        results.append(rec)
        if fwd is not None and step is not None:
            timed.append((rec, fwd, step, label))
        print(_line(rec, label, " (recompiles every call: one call timed)"
                    if rec.get("recompiles_per_call") else ""), flush=True)
    for r in range(1, rounds):
        for rec, fwd, step, _ in (timed[::-1] if r % 2 else timed):
            rec.setdefault("fwd_ms_rounds", [rec["fwd_ms"]]).append(_time(fwd))
            rec.setdefault("fwdbwd_ms_rounds", [rec["fwdbwd_ms"]]).append(_time(step))
    for rec, _, _, label in timed:
        if "fwd_ms_rounds" in rec:
            _set_times(rec, statistics.median(rec["fwd_ms_rounds"]),
                       statistics.median(rec["fwdbwd_ms_rounds"]))
            print(_line(rec, label, f" (median of {len(rec['fwd_ms_rounds'])} rounds)"),
                  flush=True)
    _add_rel_errs(results, grads, refs)
    for rec in results:
        if "rel_err" in rec:
            errs = " ".join(f"{k} {v:.1e}" for k, v in rec["rel_err_grads"].items())
            print(f"S={bench.S:6d} {variant:15s} attncc grads vs {rec['rel_err_vs']}: {errs}",
                  flush=True)
    return results


def run(seq_lens: tuple[int, ...], variants: tuple[str, ...], impls: tuple[str, ...],
        sweep: list[dict] | None = None, rounds: int = 1) -> list[dict[str, Any]]:
    """Measure every (S, variant, impl) cell (plus attncc cells with each `sweep` entry as
    kernel_options); returns the result records."""
    import torch

    results: list[dict[str, Any]] = []
    for S in seq_lens:
        print(f"--- S={S} (B={TOKENS // S})", flush=True)
        bench = BackwardBench(S)
        cells: list[tuple[str, dict | None]] = [(impl, None) for impl in impls]
        if sweep and "attncc" in impls:
            cells += [("attncc", opts) for opts in sweep]
        for variant in variants:
            results += run_cell_group(bench, variant, cells, rounds)
        del bench
        torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------ report
def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(doc: dict[str, Any]) -> str:
    """Markdown table of backward TFLOP/s with attncc's ratios, forward+backward times, the
    gradient check and issue 29's targets; attncc cells with kernel_options follow in a second
    table."""
    res = [r for r in doc["results"] if "kernel_options" not in r]
    by = {(r["impl"], r["variant"], r["S"]): r for r in res}
    m = doc["meta"]
    lines = [f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
             f"attncc {m['attncc_commit'][:10]}, {m['date'][:10]}; bf16, H={m['heads']}, "
             f"D={m['head_dim']}, B*S={m['tokens']}; backward-only TFLOP/s (fwd+bwd time minus "
             f"fwd time; 2.5x the forward's FLOPs, causal counts half, the sliding window its "
             f"unmasked pairs). rel_err: attncc's worst of dq/dk/dv(/dbias) against the named "
             f"implementation (relative Frobenius). Targets (S >= {TARGET_MIN_S}): "
             + ", ".join(f"{v} >= {x} x {i}" for v, i, x in TARGETS) + ".",
             *_provenance(m), "",
             "| variant | S | attncc | flex | sdpa_flash | sdpa_cudnn | / flex | / cuDNN "
             "| kernels only: attncc / flex / cuDNN | fwd+bwd ms attncc / flex | rel_err "
             "| targets met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        for S in sorted({r["S"] for r in res if r["variant"] == variant}):
            lines.append(_table_row(by, variant, S))
    lines += _sweep_table(doc["results"], by)
    return "\n".join(lines) + "\n"


def _provenance(meta: dict[str, Any]) -> list[str]:
    """Lines naming the merged runs (commit, date) and the trees they measured, when a table
    joins several runs (`--report A B --out C`).

    Example:
        >>> _provenance({"runs": [{"attncc_commit": "abc1234def", "date": "2026-12-03T18:49"},
        ...                       {"attncc_commit": "fff", "date": "2026-12-02T01:00"}]})
        ['Runs: abc1234def (2026-12-03), fff (2026-12-02).']
    """
    runs = meta.get("runs") or []
    lines = (["Runs: " + ", ".join(f"{r['attncc_commit'][:10]} ({r['date'][:10]})" for r in runs)
              + "."] if len(runs) > 1 else [])
    return lines + ([meta["tree_note"][:1].upper() + meta["tree_note"][1:] + "."]
                    if meta.get("tree_note") else [])


def _table_row(by: dict[tuple, dict], variant: str, S: int) -> str:
    def tf(impl: str) -> float | None:
        r = by.get((impl, variant, S))
        return None if r is None else r.get("bwd_tflops")

    mine_rec = by.get(("attncc", variant, S), {})
    mine = tf("attncc")
    cells = ["err" if "error" in by.get((i, variant, S), {}) else _fmt(tf(i)) for i in IMPLS]
    ratios = {i: mine / tf(i) for i in ("flex", "sdpa_cudnn") if mine and tf(i)}
    checks = [ratios.get(i, 0.0) >= x for v, i, x in TARGETS
              if v == variant and tf(i) and S >= TARGET_MIN_S]
    met = "-" if not checks else ("yes" if all(checks) else "**no**")
    times = " / ".join(_fmt(by.get((i, variant, S), {}).get("fwdbwd_ms"), ".2f")
                       for i in ("attncc", "flex"))
    kernels = " / ".join(_fmt(by.get((i, variant, S), {}).get("bwd_kernel_tflops"))
                         for i in ("attncc", "flex", "sdpa_cudnn"))
    err = (f"{mine_rec['rel_err']:.1e} vs {mine_rec['rel_err_vs']}" if "rel_err" in mine_rec
           else "-")
    return (f"| {variant} | {S} | " + " | ".join(cells) + " | "
            + " | ".join(_fmt(ratios.get(i), ".2f") for i in ("flex", "sdpa_cudnn"))
            + f" | {kernels} | {times} | {err} | {met} |")


def _sweep_table(results: list[dict[str, Any]], by: dict[tuple, dict]) -> list[str]:
    """attncc cells run with kernel_options (`--sweep`): their figures against attncc's default."""
    rows = [r for r in results if "kernel_options" in r]
    if not rows:
        return []
    lines = ["", "attncc with kernel_options (`--sweep`), against its default:", "",
             "| variant | S | kernel_options | bwd TFLOP/s | / default | fwd+bwd ms | rel_err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = by.get(("attncc", r["variant"], r["S"]), {}).get("bwd_tflops")
        tfl = r.get("bwd_tflops")
        ratio = tfl / base if tfl and base else None
        lines.append(f"| {r['variant']} | {r['S']} | `{json.dumps(r['kernel_options'])}` | "
                     f"{'err' if 'error' in r else _fmt(tfl)} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(r.get('fwdbwd_ms'), '.2f')} | {_fmt(r.get('rel_err'), '.1e')} |")
    return lines


def plot(doc: dict[str, Any], path: Path) -> None:
    """One panel per variant: backward TFLOP/s against S for every implementation."""
    res = [r for r in doc["results"] if r.get("bwd_tflops") and "kernel_options" not in r]
    plot_panels(res, "bwd_tflops", VARIANTS, IMPLS, "backward TFLOP/s",
                f"backward, {doc['meta']['gpu']}, bf16, H=16, D=128", path)


def write_outputs(doc: dict[str, Any], out: Path | None) -> Path:
    """The JSON (`bench.prefill.save`), then the markdown table and the PNG beside it."""
    path = save(doc, out, "backward-h200.json", table)
    path.with_suffix(".md").write_text(table(doc))
    try:
        plot(doc, path.with_suffix(".png"))
    except ImportError as e:  # the GPU image may lack matplotlib: --report makes it later
        print(f"no PNG ({e}); run python -m bench.backward --report {path}", flush=True)
    return path


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one document: the first run's meta, with each run's commit and
    date in `meta["runs"]` (a document merged before brings its own runs); a cell measured
    twice keeps the later run's record."""
    by: dict[tuple, dict[str, Any]] = {}
    for doc in docs:
        for r in doc["results"]:
            opts = json.dumps(r.get("kernel_options"), sort_keys=True)
            by[(r["impl"], r["variant"], r["S"], opts)] = r
    runs = [run for d in docs for run in d["meta"].get("runs") or
            [{k: d["meta"].get(k) for k in ("attncc_commit", "date")}]]
    return {"meta": {**docs[0]["meta"], "runs": runs}, "results": list(by.values())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="+", default=list(SEQ_LENS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--sweep", type=json.loads, nargs="*", default=None,
                    help="extra attncc cells with these kernel_options (JSON dicts), e.g. "
                         "'{\"DETERMINISTIC\": true}'")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path; the .md and .png go beside it (default "
                         "$OUT/backward-h200.json or bench/results/)")
    ap.add_argument("--report", type=Path, nargs="+", default=None,
                    help="only write the markdown table and PNG of an existing JSON; several "
                         "JSONs are merged into --out first")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per cell; each time is their median")
    args = ap.parse_args(argv)
    bad = [S for S in args.S if S <= 0 or TOKENS % S]
    if bad:
        ap.error(f"--S {bad}: each S must divide B*S = {TOKENS}")
    if args.report and len(args.report) > 1 and args.out is None:
        ap.error("--report with several JSONs merges them: name the merged file with --out")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        path = args.report[0]
        if len(args.report) > 1:
            path = args.out
            doc = merge([json.loads(p.read_text()) for p in args.report])
            path.write_text(json.dumps(doc, indent=1))
        report(path, table, plot)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench.backward measures on a CUDA GPU and torch sees none here; --report FILE "
              "rebuilds the table and PNG of a results JSON on any machine", file=sys.stderr)
        return 2
    meta = {**_prefill_meta(args.rounds), "timing": TIMING + (
        f"; each time is the median of {args.rounds} interleaved rounds (*_ms_rounds)"),
        "bwd_flop_factor": BWD_FLOP_FACTOR}
    doc = {"meta": meta, "results": run(tuple(args.S), tuple(args.variants), tuple(args.impls),
                                        args.sweep, args.rounds)}
    write_outputs(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
