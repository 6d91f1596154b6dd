"""Time the dense FA3 kernel built from another revision of kernels/fa3/fa3_prefill.cuh against the
current one: same process, same inputs, interleaved (this machine's run-to-run spread is ~5%, so
figures from different runs cannot separate small changes).

The other revision is read from a file (e.g. `git show REV:kernels/fa3/fa3_prefill.cuh > old.cuh`):
the dense kernel's file, which in older revisions also held what fa3_consumer.cuh and
fa3_store.cuh hold now (those are then left out); a later revision replaces fa3_prefill.cuh alone.
A revision from before the persistent kernel (a 2-D grid of (batch x head, query block)) is
rewritten to take its block from a 1-D grid in the same order, and launched one CTA per tile
(kernel_options PERSISTENT=False); a persistent revision runs as it is. The current kernel runs
as attncc runs it by default. Variants and inputs are bench/prefill.py's (B*S = 16384, H = 16,
D = 128, bf16); figures are the best of `--rounds` interleaved medians, in TFLOP/s (`ab_kernels.compare`).

    python -m scripts.experiments.fa3_ab_source old.cuh --S 2048 8192 16384 --variants full causal
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable


_GRID_2D = ("const int hq = blockIdx.x % p.num_q_heads, b = blockIdx.x / p.num_q_heads;",
            "const int q0 = (gridDim.y - 1 - blockIdx.y) * kTQ;")
_GRID_1D = ("const int bh_ = blockIdx.x % (p.batch * p.num_q_heads);\n"
            "  const int qb_ = blockIdx.x / (p.batch * p.num_q_heads);\n"
            "  const int hq = bh_ % p.num_q_heads, b = bh_ / p.num_q_heads;",
            "const int q0 = ((p.q_len + kTQ - 1) / kTQ - 1 - qb_) * kTQ;")


def one_d_grid(text: str) -> str:
    """`text` with a 2-D (batch x head, query block) grid read from a 1-D grid of the same order
    (unchanged if it has no 2-D grid)."""
    if _GRID_2D[0] not in text:
        return text
    for old, new in zip(_GRID_2D, _GRID_1D):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def main() -> None:
    import attncc.kernels as shipped
    from attncc.runtime.flex import gpu_flex
    from attncc.runtime.jit import kernels

    from bench.prefill import VARIANTS
    from scripts.ab_kernels import compare

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path, nargs="+", help="one or more revisions, each timed "
                    "against the current kernel")
    ap.add_argument("--S", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--variants", nargs="+", default=["full", "causal"], choices=VARIANTS)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    read_template = shipped.read_template
    # name -> (kernel text or None for the current one, kernel_options)
    builds: dict[str, tuple[str | None, dict[str, Any]]] = {"current": (None, {"KERNEL": "fa3"})}
    for path in args.old:
        raw = path.read_text()
        text = one_d_grid(raw)
        # a revision with the 2-D grid predates the persistent kernel: one CTA per tile
        opts = {"KERNEL": "fa3"} if text == raw else {"KERNEL": "fa3", "PERSISTENT": False}
        builds[path.stem] = (text, opts)

    def build(text: str | None) -> Callable[[], None]:
        def setup() -> None:
            if text is None:
                shipped.read_template = read_template
                return
            # a revision from before the split holds fa3_consumer.cuh and fa3_store.cuh's code too
            whole = "consume_tiles(int n" in text
            shipped.read_template = lambda name: (
                text if name == "fa3/fa3_prefill.cuh"
                else "" if whole and name in ("fa3/fa3_consumer.cuh", "fa3/fa3_store.cuh")
                else read_template(name))
            kernels.clear_loaded()
            gpu_flex._CALLS.clear()
        return setup

    compare([(name, build(text), opts) for name, (text, opts) in builds.items()],
            args.S, args.variants, args.rounds)


if __name__ == "__main__":
    main()
