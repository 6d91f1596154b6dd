"""Time attncc with every kernel template read from other revisions' `kernels/` folders against
the current templates: same process, same inputs, interleaved rounds (a change of a few per cent
cannot be judged from two separate runs).

    git archive REV kernels | tar -x -C /tmp/rev      # then, on the GPU machine:
    python scripts/ab_kernels.py /tmp/rev/kernels [/tmp/rev2/kernels ...] --S 2048 --variants causal

The current codegen generates both translation units; only the templates differ, so a revision
whose templates expect another codegen does not compile. Variants and inputs are
bench/prefill.py's (B*S = 16384, H = 16, D = 128, bf16); figures are the best of `--rounds`
interleaved medians in TFLOP/s (each revision named by its folder's parent), and max|diff|
compares each output with the current one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from triton.testing import do_bench

    import attncc.kernels as shipped
    from attncc.runtime.flex import gpu_flex

    sys.path.insert(0, str(ROOT / "bench"))
    from prefill import HEAD_DIM, HEADS, VARIANTS, Bench, pairs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", type=Path, nargs="+", help="other revisions' kernels/ folders")
    ap.add_argument("--S", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--variants", nargs="+", default=["full", "causal"], choices=VARIANTS)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    current = shipped.read_template
    builds = [("current", None)] + [(f.resolve().parent.name, f) for f in args.base]

    def use(folder: Path | None) -> None:
        shipped.read_template = current if folder is None else (
            lambda name: (folder / name).read_text(encoding="utf-8"))
        gpu_flex._KERNELS.clear()
        gpu_flex._CALLS.clear()

    for S in args.S:
        bench = Bench(S)
        for variant in args.variants:
            flops = 4 * HEAD_DIM * bench.B * HEADS * pairs(variant, S)
            best: dict[str, float] = {}
            outs: dict[str, Any] = {}
            for _ in range(args.rounds):
                for name, folder in builds:
                    use(folder)
                    fn = bench.fn("attncc", variant)
                    outs[name] = fn()
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    best[name] = max(best.get(name, 0.0), flops / ms / 1e9)
            use(None)
            others = "  ".join(
                f"{name} {best[name]:6.1f} (current/{name} {best['current'] / best[name]:.3f}, "
                f"max|diff| {float((outs['current'].float() - outs[name].float()).abs().max()):.1e})"
                for name, _ in builds[1:])
            print(f"{variant:15s} S={S:5d}: current {best['current']:6.1f}  {others}", flush=True)


if __name__ == "__main__":
    main()
