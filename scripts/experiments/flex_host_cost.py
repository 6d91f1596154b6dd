"""Host cost of one eager attncc.flex_attention call (bench/prefill.py's cells): the time to
enqueue N calls without synchronizing, the GPU time of the same N calls (CUDA events), and a
cProfile of the enqueue loop. Where the host time per call exceeds the kernel's, an eager
benchmark measures the host, not the kernel.

    python -m scripts.experiments.flex_host_cost --S 512 --variants full causal softcap_causal
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    import torch

    from bench.prefill import Bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=512)
    ap.add_argument("--variants", nargs="+", default=["full", "causal", "softcap_causal"])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    bench = Bench(a.S)
    for variant in a.variants:
        fn = bench.fn("attncc", variant)
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(a.calls):
            fn()
        t_host = (time.perf_counter() - t0) / a.calls * 1e6
        end.record()
        torch.cuda.synchronize()
        t_gpu = start.elapsed_time(end) / a.calls * 1e3
        print(f"S={a.S} {variant:16s} host {t_host:7.1f} us/call   wall (events) "
              f"{t_gpu:7.1f} us/call", flush=True)
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(s.getvalue())


if __name__ == "__main__":
    main()
