"""GPU timing shared by the benchmarks: eager calls and CUDA-graph replays of the same call.

`time_call(fn)` returns the median milliseconds of `fn()` timed eagerly with
`triton.testing.do_bench` and, when `fn` can be captured, of one CUDA-graph replay of it (also
through `do_bench`, which clears the L2 cache before every replay, so a replay reads its inputs
from device memory like an eager call). The graph figure is the GPU's own time: a serving step is
replayed from a graph, and for the small decode batches (a few MB of KV, under 10 us of
bandwidth) the eager figure measures the Python host path instead of the kernel. `host_us` is
the host time of one eager call (median over back-to-back calls without synchronizing).

Example:
    >>> import torch
    >>> if torch.cuda.is_available():  # doctest: +SKIP
    ...     a = torch.randn(1 << 20, device="cuda")
    ...     t = time_call(lambda: a.mul_(1.0))
    ...     sorted(t)          # ['host_us', 'ms_eager', 'ms_graph']
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

TIME_CALL_TIMING = ("bench/timing.py: ms = median of one CUDA-graph replay of the call through "
                    "triton.testing.do_bench (warmup 25 ms, rep 100 ms, L2 cleared before each), "
                    "ms_eager = the same for eager calls, host_us = host time of one eager call")
"""`time_call`'s figures, as a benchmark's JSON meta describes them."""


def median_us(fn: Callable[[], Any], runs: int, warmup: bool = True) -> float:
    """Median wall time of `runs` calls of fn (after one warm-up call), in microseconds."""
    if warmup:
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def host_us(fn: Callable[[], Any], calls: int = 50) -> float:
    """Median host microseconds of one call of `fn` (no synchronization between calls)."""
    import torch

    torch.cuda.synchronize()
    us = median_us(fn, calls, warmup=False)
    torch.cuda.synchronize()
    return us


def spin_gpu(seconds: float = 0.3) -> None:
    """Keep the GPU busy with bf16 matmuls for about `seconds`. Call it before the first timed
    call after the GPU idled (e.g. while the host compiled FlexAttention): its clocks drop when
    idle, and triton's 25 ms warm-up does not always bring them back before the measurement
    (bench/decode.py: two identical attncc plans in one cell measured 0.84 and 0.92
    of copy bandwidth, the first one timed right after the previous cell's compiles)."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def profiled_kernels(fn: Callable[[], Any], calls: int) -> Any:
    """torch.profiler's per-kernel averages (CUDA activity only) over `calls` calls of `fn`,
    after one untimed call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def device_ms(fn: Callable[[], Any], calls: int = 5) -> float:
    """GPU kernel milliseconds of one call of `fn`: the summed device time of every kernel and
    memory operation torch.profiler (CUPTI) records over `calls` calls, per call. It leaves out
    the host time and the launch gaps that an eager timing of a short call measures, so two
    implementations' device work compares even where their host paths differ."""
    return sum(e.self_device_time_total for e in profiled_kernels(fn, calls)) / calls / 1e3


def graph_of(fn: Callable[[], Any]) -> Any:
    """`fn` captured in a CUDA graph (after warm-up on a side stream); raises if it cannot be."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_call(fn: Callable[[], Any], graph: bool = True) -> dict[str, float]:
    """{'ms_eager', 'ms_graph' (when capturable), 'host_us'} of `fn` (see the module docstring)."""
    from triton.testing import do_bench

    out = {"ms_eager": do_bench(fn, warmup=25, rep=100, return_mode="median"),
           "host_us": host_us(fn)}
    if graph:
        try:
            g = graph_of(fn)
        except Exception as e:  # noqa: BLE001 -- reported, the eager figure stands
            print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        else:
            out["ms_graph"] = do_bench(g.replay, warmup=25, rep=100, return_mode="median")
    return out
