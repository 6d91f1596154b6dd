"""Debug helper: per-kernel GPU time of BatchAttention.run in a few decode cells (torch.profiler).

    python -m scripts.experiments.profile_decode '{"tiles": [16, 64, 2, 4]}' ...
    python -m scripts.experiments.profile_decode breakdown [64:4:skewed ...]
        # kernel vs replay time, two ways to flush L2
"""
import json
import sys

import numpy as np
import torch

from attncc.runtime.serving.batch import BatchAttention
from bench.decode import D, HQ, PAGE, kv_lengths, make_batch


def cell(batch, hkv, dist, knobs):
    lens = kv_lengths(dist, batch, seed=batch * 7 + hkv)
    b = make_batch(batch, hkv, dist)
    k = torch.randn(int(b["kv_indptr"][-1]), PAGE, hkv, D, device="cuda").bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    ba = BatchAttention(None, kv_layout="NHD", max_batch=max(batch, 16), max_qo_tokens=max(batch, 16),
                        **knobs)
    ba.plan(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_last_page_len"], **b["kw"])
    for _ in range(5):
        ba.run(q, (k, v))
    torch.cuda.synchronize()
    pl = ba._plan
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            ba.run(q, (k, v))
        torch.cuda.synchronize()
    ev = [(e.key, e.device_time_total / e.count) for e in prof.key_averages() if e.device_time_total > 0]
    mb = float(lens.sum()) * hkv * D * 4 / 1e6
    print(f"B={batch} hkv={hkv} {dist} {knobs} KV {mb:.1f} MB ideal {mb / 4.25e6 * 1e6:.1f} us; "
          f"ctas {ba.tiles.num_ctas} units {getattr(pl, 'num_units', '?')} merges "
          f"{getattr(pl, 'num_merges', '?')}: " +
          ", ".join(f"{n[-30:]} {t:.1f} us" for n, t in ev), flush=True)


def cascade(prefix: int = 32768, batch: int = 16) -> None:
    """Kernel times of CascadeAttention.run in bench/shared_prefix.py's setup."""
    import attncc
    from bench.shared_prefix import SUFFIX, page_lists

    pre, suf = page_lists(prefix, batch, SUFFIX, PAGE)
    total = len(pre) + sum(len(s) for s in suf)
    k = torch.randn(total, PAGE, 32, D, device="cuda").bfloat16()
    v = torch.randn_like(k)
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    ca = attncc.CascadeAttention(None, kv_layout="NHD", max_qo_tokens=max(batch, 16))
    ca.plan(np.arange(batch + 1), prefix_indices=pre, prefix_last_page_len=PAGE,
            suffix_indptr=np.concatenate([[0], np.cumsum([len(s) for s in suf])]),
            suffix_indices=np.concatenate(suf), suffix_last_page_len=np.full(batch, PAGE),
            num_qo_heads=HQ, num_kv_heads=32, head_dim=D, page_size=PAGE)
    for _ in range(3):
        ca.run(q, (k, v))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            ca.run(q, (k, v))
        torch.cuda.synchronize()
    print(f"cascade prefix {prefix} batch {batch}: prefix tiles {ca.prefix.tiles} units "
          f"{ca.prefix._plan.num_units}; " + ", ".join(
              f"{e.key[-40:]} {e.device_time_total / 10:.1f} us/run ({e.count // 10}x)"
              for e in prof.key_averages() if e.device_time_total > 0), flush=True)


def _replay_us(fn, flush) -> float:
    """Median event time of fn() after flush() (the events bracket fn only)."""
    ts = []
    for _ in range(60):
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return float(np.median(ts[10:]))


def breakdown(cells: list[str]) -> None:
    """Where a small decode step's time goes: per-kernel GPU time (profiler; the merge kernel
    launched without programmatic dependent launch, so its time is its own) and the graph
    replay's event time (as run() launches), with L2 flushed by writing 256 MB (triton
    do_bench's zero_: leaves L2 full of dirty lines) or by reading 512 MB (leaves it clean), and
    a plain read of the same bytes (x.sum()) as the floor. `cells`: "batch:hkv:dist" strings."""
    from bench.timing import graph_of

    dirty = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    clean = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    flushes = {"zero": dirty.zero_, "read": lambda: clean.sum(dtype=torch.int64)}
    specs = [(int(c.split(":")[0]), int(c.split(":")[1]), c.split(":")[2]) for c in cells] or [
        (16, 4, "constant"), (16, 8, "constant"), (16, 32, "constant"), (64, 4, "constant"),
        (64, 8, "constant")]
    for batch, hkv, dist in specs:
        b = make_batch(batch, hkv, dist)
        k = torch.randn(int(b["kv_indptr"][-1]), PAGE, hkv, D, device="cuda").bfloat16()
        v = torch.randn_like(k)
        q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
        ba = BatchAttention(None, kv_layout="NHD", max_batch=max(batch, 16),
                            max_qo_tokens=max(batch, 16))
        ba.plan(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_last_page_len"],
                **b["kw"])
        g = graph_of(lambda: ba.run(q, (k, v)))
        ba._pdl = False
        g_plain = graph_of(lambda: ba.run(q, (k, v)))
        same_bytes = torch.empty(2 * k.numel(), dtype=torch.bfloat16, device="cuda").normal_()
        line = [f"B={batch} Hkv={hkv}: KV {4 * k.numel() / 1e6:.1f} MB, units "
                f"{ba._plan.num_units} merges {ba._plan.num_merges}"]
        for name, flush in flushes.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as pr:
                for _ in range(20):
                    flush()
                    g_plain.replay()
                torch.cuda.synchronize()
            kern = {e.key[-24:]: e.device_time_total / e.count for e in pr.key_averages()
                    if e.device_time_total > 0 and "elementwise" not in e.key
                    and "reduce" not in e.key and "fill" not in e.key.lower()}
            line.append(f"flush={name}: replay {_replay_us(g.replay, flush):.1f} us (without "
                        f"PDL {_replay_us(g_plain.replay, flush):.1f}), sum() "
                        f"{_replay_us(lambda: same_bytes.sum(), flush):.1f} us, kernels " +
                        ", ".join(f"{n} {t:.1f}" for n, t in kern.items()))
        print("\n  ".join(line), flush=True)


if sys.argv[1:2] == ["breakdown"]:
    breakdown(sys.argv[2:])
    sys.exit(0)
if sys.argv[1:] == ["cascade"]:
    cascade()
    cascade(1024, 16)
    sys.exit(0)
for knobs in [json.loads(a) for a in sys.argv[1:]] or [{}]:
    if "tiles" in knobs:
        knobs["tiles"] = tuple(knobs["tiles"])
    for b, h, dist in ((16, 4, "constant"), (16, 32, "constant"), (64, 4, "constant"),
                       (64, 4, "skewed"), (64, 32, "constant")):
        cell(b, h, dist, knobs)
