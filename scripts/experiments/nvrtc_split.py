"""Where a cold kernel compile spends its time: NVRTC to PTX only (front end + NVVM) against
the full compile to a cubin (the difference is ptxas), for the FA3 D=128 form of AttentionGym
variants (issue 30, cold start: measure before choosing precompiled headers, smaller units,
threads or ptxas options).

    python -m scripts.experiments.nvrtc_split --variants noop causal softcap_causal --reps 2
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from attncc.codegen.tiles import fa3_tiles
    from attncc.gym import GYM
    from attncc.ir.simplified import simplify_variant
    from attncc.runtime.jit.kernels import KernelSpec, generate
    from attncc.runtime.jit.nvrtc import compile_cuda

    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["noop", "causal", "softcap_causal",
                                                      "alibi_causal", "document_mask"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    print(f"{'variant':16s} {'source KB':>9s} {'to PTX s':>9s} {'to cubin s':>10s} "
          f"{'ptxas share':>11s}")
    for name in a.variants:
        ir = simplify_variant(GYM[name](1, 16, 4096, 128).trace()[0])
        gen = generate(KernelSpec("fa3_prefill", ir, 128, "bfloat16", fa3_tiles(3)))
        times = {"ptx": [], "cubin": []}
        for _ in range(a.reps):
            for emit in ("ptx", "cubin"):
                t = time.perf_counter()
                compile_cuda(gen.source, arch=a.arch, name=f"{gen.kernel_name}.cu", emit=emit)
                times[emit].append(time.perf_counter() - t)
        ptx, cubin = statistics.median(times["ptx"]), statistics.median(times["cubin"])
        print(f"{name:16s} {len(gen.source) / 1024:9.0f} {ptx:9.2f} {cubin:10.2f} "
              f"{(cubin - ptx) / cubin:11.0%}", flush=True)


if __name__ == "__main__":
    main()
