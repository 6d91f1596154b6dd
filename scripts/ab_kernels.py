"""Time attncc with every kernel template read from other revisions' `kernels/` folders against
the current templates: same process, same inputs, interleaved rounds (a change of a few per cent
cannot be judged from two separate runs).

    git archive REV kernels | tar -x -C /tmp/rev      # then, on the GPU machine:
    python -m scripts.ab_kernels /tmp/rev/kernels [/tmp/rev2/kernels ...] --S 2048 --variants causal
    python -m scripts.ab_kernels /tmp/rev/kernels --D 64      # another head dim, same B*S and H
    python -m scripts.ab_kernels /tmp/rev/kernels --backward --variants causal alibi_learned_causal

The current codegen generates both translation units; only the templates differ, so a revision
whose templates expect another codegen does not compile. Variants and inputs are
bench/prefill.py's (B*S = 16384, H = 16, D = 128 unless --D, bf16); figures are the best of `--rounds`
interleaved medians in TFLOP/s (each revision named by its folder's parent), and max|diff|
compares each output with the current one. `--backward` compares the backward instead, on
bench/backward.py's cells (its learnable-bias variants too): the backward's kernel TFLOP/s
(torch.profiler device time of forward + backward minus the forward's, best of the rounds),
and max|diff| over every gradient.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable


Build = tuple[str, Callable[[], None], dict[str, Any] | None]


def _interleaved(builds: list[Build], rounds: int,
                 run: Callable[[dict[str, Any] | None], tuple[float, list[Any]]]) -> str:
    """`run(kernel_options) -> (TFLOP/s, outputs)` for each build in `rounds` interleaved rounds,
    the first build's templates back in place after; each build's best TFLOP/s against the first
    build's, and the largest difference of its outputs (the last round's) from the first's.

    A build is (name, setup, kernel_options): `setup()` installs its templates before it runs.
    """
    best: dict[str, float] = {}
    outs: dict[str, list[Any]] = {}
    for _ in range(rounds):
        for name, setup, opts in builds:
            setup()
            tflops, outs[name] = run(opts)
            best[name] = max(best.get(name, 0.0), tflops)
    builds[0][1]()
    first = builds[0][0]

    def diff(name: str) -> float:
        return max(float((a.float() - b.float()).abs().max())
                   for a, b in zip(outs[first], outs[name]))
    return f"{first} {best[first]:6.1f}  " + "  ".join(
        f"{name} {best[name]:6.1f} ({first}/{name} {best[first] / best[name]:.3f}, "
        f"max|diff| {diff(name):.1e})" for name, _, _ in builds[1:])


def compare(builds: list[Build], seq_lens: list[int], variants: list[str], rounds: int) -> None:
    """Print, per (S, variant), each build's best interleaved median against the first build's
    (_interleaved)."""
    from triton.testing import do_bench

    from bench.prefill import HEAD_DIM, HEADS, Bench, pairs

    for S in seq_lens:
        bench = Bench(S)
        for variant in variants:
            flops = 4 * HEAD_DIM * bench.B * HEADS * pairs(variant, S)

            def run(opts: dict[str, Any] | None) -> tuple[float, list[Any]]:
                fn = bench.fn("attncc", variant, kernel_options=opts)
                out = fn()
                return flops / do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e9, [out]
            print(f"{variant:20s} S={S:5d}: {_interleaved(builds, rounds, run)}", flush=True)


def compare_backward(builds: list[Build], seq_lens: list[int], variants: list[str],
                     rounds: int) -> None:
    """`compare` for the backward: per (S, variant) each build's backward kernel TFLOP/s
    (bench.timing.device_ms, so host paths do not blur a kernel change) and the largest
    difference of any gradient, against the first build's."""
    from bench.backward import BackwardBench, bwd_flops
    from bench.timing import device_ms

    for S in seq_lens:
        bench = BackwardBench(S)
        for variant in variants:
            flops = bwd_flops(variant, S, bench.B)

            def run(opts: dict[str, Any] | None) -> tuple[float, list[Any]]:
                fwd = bench.fn("attncc", variant, opts)
                step = bench.fwdbwd(fwd, variant)
                grads = list(step())
                return flops / (device_ms(step) - device_ms(fwd)) / 1e9, grads
            print(f"{variant:20s} S={S:5d}: {_interleaved(builds, rounds, run)}", flush=True)


def template_switch() -> Callable[[Path | None], None]:
    """`use(folder)`, which makes every later compile read its templates from `folder`'s
    kernels (None: the installed ones) and drops what was loaded or planned with the others.
    Turns compile_spec's form memo off for the process: it is keyed by the installed sources,
    not by the templates a build reads, so left on every build would get the first build's
    kernels (identical outputs). scripts/ab_decode.py uses it too."""
    import attncc.kernels as shipped
    from attncc.runtime.flex import gpu_flex
    from attncc.runtime.jit import forms, kernels

    forms.FormMemo.load = lambda self, key: None  # type: ignore[method-assign]
    forms.FormMemo.save = lambda self, key, form: None  # type: ignore[method-assign]
    current = shipped.read_template

    def use(folder: Path | None) -> None:
        shipped.read_template = current if folder is None else (
            lambda name: (folder / name).read_text(encoding="utf-8"))
        kernels.clear_loaded()
        gpu_flex._CALLS.clear()

    return use


def main() -> None:
    from bench.backward import VARIANTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, nargs="+", help="other revisions' kernels/ folders")
    ap.add_argument("--S", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--variants", nargs="+", default=["full", "causal"], choices=VARIANTS,
                    help="bench/prefill.py's, and with --backward bench/backward.py's "
                         "learnable-bias variants too")
    ap.add_argument("--backward", action="store_true",
                    help="compare the backward (kernel TFLOP/s, every gradient) instead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--D", type=int, default=None, choices=(64, 128, 256),
                    help="head dim (default: bench/prefill.py's, 128)")
    args = ap.parse_args()
    from bench.prefill import VARIANTS as FORWARD_VARIANTS

    if args.backward and args.D is not None:
        ap.error("--D: the backward cells are bench/backward.py's, head dim 128")
    if not args.backward and set(args.variants) - set(FORWARD_VARIANTS):
        ap.error(f"--variants {' '.join(sorted(set(args.variants) - set(FORWARD_VARIANTS)))}: "
                 f"learnable-bias variants are bench/backward.py's; add --backward")
    if args.D is not None:
        import bench.prefill

        bench.prefill.HEAD_DIM = args.D  # read by Bench and by compare's FLOP count
    use = template_switch()
    builds = [("current", lambda: use(None), None)] + [
        (f.resolve().parent.name, lambda f=f: use(f), None) for f in args.base]
    (compare_backward if args.backward else compare)(builds, args.S, args.variants,
                                                      args.rounds)


if __name__ == "__main__":
    main()
