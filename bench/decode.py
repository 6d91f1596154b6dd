"""Decode benchmark: attncc BatchAttention vs FlexAttention vs SDPA on one GPU, same inputs.

One query token per request (bf16, Hq=32, D=128, paged KV with page size 16). KV lengths:
"constant" 1024, "uniform" 512..1024, "skewed" Zipf-like with mean ~1024 (a few very long
requests). Batches 16, 64, 256; Hkv 32 (MHA), 8 and 4 (GQA). Reported: achieved TB/s of the bytes
the attention must read (K and V of every request once, plus q and o), its fraction of a device
copy's bandwidth measured in the same process (GPU time of a CUDA-graph replay; the eager
figure, which includes the host path, is kept as `bw_fraction_eager`), plan() host time
(median of 200 calls after 20 warm-up calls, as a serving loop plans every step), the
host time of one run() call, and the no-scheduler ablation
(`attncc_noschedule`: one CTA per (request, KV head), no KV split). `read_floor` is a plain
`x.sum()` of a contiguous tensor of the same bytes, timed the same way: what just reading them
costs in this harness (at small batches it is well under the copy bandwidth, partly because
do_bench's L2 flush -- a 256 MB `zero_()` -- leaves dirty lines the next kernel writes back;
bench/results/decode-breakdown-h200.md).

FlexAttention and SDPA get the same KV in a padded [B, Hkv, max_len, D] cache with a length mask
(FlexAttention: a BlockMask from `kv_idx < len[b]`; SDPA: a boolean attn_mask). `flex_paged` is
FlexAttention's own paged helper (torch.nn.attention.experimental._paged_attention) over the same
pages, no padding (`flex_paged_call`; checked against the fp64 reference on the CPU).

    python -m bench.decode                               -> bench/results/decode-h200.json
    python -m bench.decode --batch 16 --hkv 8 --dist constant
    python -m bench.decode --report bench/results/decode-h200.json   # table + PNG (CPU ok)
    python -m bench.decode --multi-token            # add the multi-token decode cells

Multi-token decode cells (issue 31; `multi_token_cells`): Q_PER_REQUEST query tokens per
request, causal among them after the request's KV, Hq 64 / Hkv 8 (64 fused rows per KV head),
D 128, page 16, constant KV lengths (MT_CELLS: kv 8192 x batch 32, kv 32768 x batch 128), with
("attncc_tree") and without ("attncc") a random speculative tree mask; records carry `hq`,
`kv_len`, `q_per_request` and `kv_dtype` (no `dist`) and are tabled on their own.

    python -m bench.decode --kv-cells                    # the KV-dtype cells only (below)

KV-dtype cells (`--kv-cells`, `KV_CELLS`): the long-context cell (batch 128, Hq 64 / Hkv 8,
D 128, kv 32768, page 16) and batch 64 at 16K (GQA 64/8 and MHA 32/32), each with a bf16, an
fp8 e4m3 and an fp8 e5m2 cache (per-tensor scales) in the same process. Records carry
`kv_len`, `hq`, `q_per_request`, `kv_dtype` (the torch dtype's name), `bw_fraction` of the
bytes the cache actually holds (fp8: half of bf16's) and `vs_bf16`, the step time over the
bf16 cache's (the fp8 target: <= 0.55).

Example (the length distributions are deterministic):
    >>> [int(x) for x in kv_lengths("uniform", 4, seed=0)]
    [948, 838, 774, 650]
    >>> round(float(kv_lengths("skewed", 4096, seed=0).mean()))
    1024
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


HQ, D, PAGE = 32, 128, 16
BATCHES, HKVS, DISTS = (16, 64, 256), (32, 8, 4), ("constant", "uniform", "skewed")
IMPLS = ("attncc", "attncc_noschedule", "flex", "flex_paged", "sdpa_mask", "read_floor")
MT_HQ, MT_HKV, Q_PER_REQUEST = 64, 8, 8
MT_CELLS = ((32, 8192), (128, 32768))  # (batch, kv_len) of the multi-token decode cells
MT_IMPLS = ("attncc", "attncc_tree", "read_floor")
KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
# (batch, Hq, Hkv, kv_len) of the KV-dtype cells: long context, then batch 64 at 16K
KV_CELLS = ((128, 64, 8, 32768), (64, 64, 8, 16384), (64, 32, 32, 16384))
# fp8 decode tiles timed besides the default (T_q, T_kv, stages, kv_warps; long batches take
# 16 x 32 x 3 x 2): an fp8 tile is half the bytes, so how deep a ring the SM wants differs
# from bf16 (docs/serving.md, "fp8 KV cache"); records carry them as `knobs`
KV_TILE_SWEEP = ((16, 32, 2, 2), (16, 64, 2, 4), (16, 64, 3, 4))


def kv_lengths(dist: str, batch: int, seed: int = 0) -> np.ndarray:
    """KV lengths of one batch: constant 1024, uniform 512..1024, or skewed (Pareto, mean 1024,
    capped at 32K)."""
    rng = np.random.default_rng(seed)
    if dist == "constant":
        return np.full(batch, 1024, dtype=np.int64)
    if dist == "uniform":
        return rng.integers(512, 1025, batch).astype(np.int64)
    if dist == "skewed":
        raw = (rng.pareto(1.5, batch) + 1.0)
        lens = np.minimum(np.maximum(raw / raw.mean() * 1024, 16), 32768)
        return np.maximum(np.rint(lens * 1024 / lens.mean()), 1).astype(np.int64)
    raise ValueError(f"dist {dist!r}: one of {DISTS}")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB buffers."""
    import torch
    from triton.testing import do_bench

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=100, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def make_batch(batch: int, hkv: int, dist: str) -> dict[str, Any]:
    """plan()'s arguments for one cell: the `kv_lengths` of the cell, pages of PAGE tokens listed
    in a random (seeded) order. run_cell, bench/plan_time.py and
    scripts/experiments/profile_decode.py all plan these.

    Example (the batches are deterministic):
        >>> b = make_batch(16, 8, "uniform")
        >>> b["qo_indptr"].tolist()[:3], b["kw"]["num_kv_heads"], len(b["kv_indices"]) > 0
        ([0, 1, 2], 8, True)
    """
    import torch

    lens = kv_lengths(dist, batch, seed=batch * 7 + hkv)
    n_pages = -(-lens // PAGE)
    total_pages = int(n_pages.sum())
    perm = torch.randperm(total_pages, generator=torch.Generator().manual_seed(1))
    return {"qo_indptr": np.arange(batch + 1),
            "kv_indptr": np.concatenate([[0], np.cumsum(n_pages)]),
            "kv_indices": perm[:total_pages].numpy(),
            "kv_last_page_len": lens - (n_pages - 1) * PAGE,
            "kw": dict(num_qo_heads=HQ, num_kv_heads=hkv, head_dim=D, page_size=PAGE)}


def padded_call(impl: str, q: Any, k_cache: Any, v_cache: Any, page_ids: Any, kv_indptr: Any,
                lens: Any) -> Any:
    """FlexAttention ("flex", torch.compile) or SDPA ("sdpa_mask") over the pages copied into a
    padded [batch, Hkv, max_len, D] cache with a length mask. Returns a no-argument call
    producing [batch, Hq, 1, D]."""
    import torch

    batch, hkv = len(lens), k_cache.shape[2]
    maxlen = int(lens.max())
    kp = torch.zeros(batch, hkv, maxlen, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    for b in range(batch):
        ids = torch.as_tensor(page_ids[kv_indptr[b]:kv_indptr[b + 1]], device="cuda")
        kp[b, :, :lens[b]] = k_cache[ids].flatten(0, 1)[:lens[b]].transpose(0, 1)
        vp[b, :, :lens[b]] = v_cache[ids].flatten(0, 1)[:lens[b]].transpose(0, 1)
    lens_t = torch.as_tensor(lens, device="cuda")
    q4 = q[:, :, None]
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def length_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx < lens_t[b]

        bm = create_block_mask(length_mask, batch, None, 1, maxlen, device="cuda")
        fn = torch.compile(flex_attention, dynamic=False)
        return lambda: fn(q4, kp, vp, block_mask=bm, enable_gqa=hkv != HQ)
    import torch.nn.functional as F

    mask = (torch.arange(maxlen, device="cuda")[None] < lens_t[:, None])[:, None, None, :]
    return lambda: F.scaled_dot_product_attention(q4, kp, vp, attn_mask=mask,
                                                  enable_gqa=hkv != HQ)


def flex_paged_call(q: Any, k_cache: Any, v_cache: Any, page_ids: Any, kv_indptr: Any,
                    lens: Any, compile: bool = True) -> Any:
    """FlexAttention's own paged helper (torch.nn.attention.experimental._paged_attention) on
    the same pages: the cache as one [1, Hkv, pages * PAGE, D] sequence, each request's page
    table filled in, and its block mask (one 16-key block per page) converted to physical pages.
    Returns a no-argument call producing [batch, Hq, 1, D]."""
    import torch
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n_pages, page, hkv, d = k_cache.shape
    batch = len(lens)
    dev = k_cache.device
    kp = k_cache.permute(2, 0, 1, 3).reshape(1, hkv, n_pages * page, d)
    vp = v_cache.permute(2, 0, 1, 3).reshape(1, hkv, n_pages * page, d)
    pa = PagedAttention(n_pages, page, batch, device=dev)
    max_blocks = 0
    for b in range(batch):
        ids = torch.as_tensor(page_ids[kv_indptr[b]:kv_indptr[b + 1]], device=dev)
        n = ids.numel()
        pa.page_table[b, :n] = ids
        pa.physical_to_logical[b, ids] = torch.arange(n, device=dev)
        pa.capacity[b] = n * page
        max_blocks = max(max_blocks, n)
    pa.empty_pages = []
    lens_t = torch.as_tensor(lens, device=dev)

    def length_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lens_t[b]

    logical = create_block_mask(length_mask, batch, None, 1, max_blocks * page,
                                BLOCK_SIZE=(128, page), device=dev)
    bm = pa.convert_logical_block_mask(logical, kv_len=lens_t)
    fn = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
    q4 = q[:, :, None]
    return lambda: fn(q4, kp, vp, block_mask=bm, enable_gqa=hkv != q.shape[1])


def run_cell(batch: int, hkv: int, dist: str, impls: tuple[str, ...], copy_bw: float,
             sweep: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    import torch

    from attncc.errors import ResourceError
    from attncc.runtime.serving.batch import BatchAttention
    from bench.timing import median_us, spin_gpu, time_call

    lens = kv_lengths(dist, batch, seed=batch * 7 + hkv)
    pt = make_batch(batch, hkv, dist)
    kv_indptr, pages = pt["kv_indptr"], pt["kv_indices"]
    g = torch.Generator(device="cuda").manual_seed(int(lens.sum()) % 100000)
    total_pages = int(kv_indptr[-1])
    k_cache = torch.randn(total_pages, PAGE, hkv, D, generator=g, device="cuda").bfloat16()
    v_cache = torch.randn(total_pages, PAGE, hkv, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(batch, HQ, D, generator=g, device="cuda").bfloat16()
    kv_bytes = float(lens.sum()) * hkv * D * 2 * 2 + 2 * q.numel() * 2
    out: list[dict[str, Any]] = []

    def record(impl: str, ms: float, **extra: Any) -> None:
        tbs = kv_bytes / (ms * 1e-3) / 1e12
        rec = {"impl": impl, "batch": batch, "hkv": hkv, "dist": dist, "ms": ms,
               "tb_s": tbs, "bw_fraction": tbs * 1e12 / copy_bw, "kv_dtype": "bfloat16",
               **extra}
        if "ms_eager" in extra:
            rec["bw_fraction_eager"] = kv_bytes / (extra["ms_eager"] * 1e-3) / copy_bw
        out.append(rec)
        more = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in extra.items())
        print(f"B={batch:4d} Hkv={hkv:2d} {dist:9s} {impl:18s} {ms * 1e3:8.1f} us "
              f"{tbs:6.2f} TB/s ({rec['bw_fraction']:.2f} of copy) {more}", flush=True)

    ref = None
    spin_gpu()  # the first impl timed is not measured while the clocks ramp back up
    cells: list[tuple[str, dict[str, Any]]] = [(impl, {}) for impl in impls]
    cells += [("attncc", opts) for opts in (sweep or [])]
    for impl, opts in cells:
        try:
            if impl.startswith("attncc"):
                knobs = {}
                if "tiles" in opts:
                    knobs["tiles"] = tuple(opts["tiles"])
                if "min_kv_chunk" in opts:
                    knobs["min_kv_chunk"] = int(opts["min_kv_chunk"])
                ba = BatchAttention(None, kv_layout="NHD", max_batch=max(batch, 16),
                                    max_qo_tokens=max(batch, 16),
                                    balance=impl == "attncc", **knobs)
                if "pdl" in opts:  # programmatic dependent launch of the merge kernel (A/B)
                    ba._pdl = bool(opts["pdl"])
                args = (pt["qo_indptr"], kv_indptr, pages, pt["kv_last_page_len"])
                # plan() as a serving loop calls it, once per step: warm (the first calls
                # of a new instance allocate and fault in its buffers), then the median
                for _ in range(20):
                    ba.plan(*args, **pt["kw"])
                plan_us = median_us(lambda: ba.plan(*args, **pt["kw"]), 200)
                res = ba.run(q, (k_cache, v_cache))
                torch.cuda.synchronize()
                t = time_call(lambda: ba.run(q, (k_cache, v_cache)))
                ms = t.get("ms_graph", t["ms_eager"])
                kr = ba.kernel_record()  # ptxas's spill bytes, the driver's local bytes
                extra: dict[str, Any] = {**t, "plan_us": plan_us, "num_ctas": ba.tiles.num_ctas,
                                         "tq": ba.tiles.tq, "tkv": ba.tiles.tkv,
                                         "stages": ba.tiles.stages, "spill": kr.spill_bytes,
                                         "local": kr.local_bytes, "retries": kr.retries}
                if opts:
                    extra["knobs"] = json.dumps(opts, sort_keys=True)
                if ref is not None:
                    extra["rel_err"] = float((res.float() - ref).norm() / ref.norm())
                else:
                    ref = res.float()
                record(impl, ms, **extra)
            elif impl == "read_floor":  # the same bytes, read once by a reduction
                x = torch.empty(int(kv_bytes) // 2, dtype=torch.bfloat16, device="cuda")
                x.normal_(generator=g)
                t = time_call(lambda: x.sum(dtype=torch.float32))
                record(impl, t.get("ms_graph", t["ms_eager"]), **t)
                del x
            else:  # the comparisons: a call returning [batch, Hq, 1, D]
                torch._dynamo.config.cache_size_limit = 256
                if impl == "flex_paged":
                    call = flex_paged_call(q, k_cache, v_cache, pages, kv_indptr, lens)
                else:
                    call = padded_call(impl, q, k_cache, v_cache, pages, kv_indptr, lens)
                res = call()[:, :, 0]
                torch.cuda.synchronize()
                t = time_call(call)
                ms = t.get("ms_graph", t["ms_eager"])
                extra = dict(t)
                if ref is not None:
                    extra["rel_err"] = float((res.float() - ref).norm() / ref.norm())
                record(impl, ms, **extra)
        except ResourceError:  # a kernel run with local memory it should not have: stop
            raise
        except Exception as e:  # a comparison that cannot run is reported, not fatal
            print(f"B={batch} Hkv={hkv} {dist} {impl} FAILED {type(e).__name__}: "
                  f"{str(e)[:300]}", flush=True)
            out.append({"impl": impl, "batch": batch, "hkv": hkv, "dist": dist,
                        "error": f"{type(e).__name__}: {str(e)[:500]}"})
    return out


def multi_token_batch(batch: int, kv_len: int, tokens: int = Q_PER_REQUEST,
                      tree_seed: int | None = None) -> dict[str, Any]:
    """plan()'s arguments for a multi-token decode cell: `tokens` queries per request, each
    request `kv_len` keys in PAGE-token pages listed in a random (seeded) order; with
    `tree_seed`, a random speculative tree as FlashInfer's packed_custom_mask.

    Example:
        >>> b = multi_token_batch(2, 40, 4, tree_seed=0)
        >>> b["qo_indptr"].tolist(), b["kv_last_page_len"].tolist(), b["mask"]["packed_custom_mask"].size
        ([0, 4, 8], [8, 8], 40)
    """
    import torch

    from tests.helpers.trees import packed, tree_batch

    n_pages = -(-kv_len // PAGE)
    perm = torch.randperm(batch * n_pages, generator=torch.Generator().manual_seed(2)).numpy()
    out = {"qo_indptr": np.arange(batch + 1) * tokens,
           "kv_indptr": np.arange(batch + 1) * n_pages, "kv_indices": perm,
           "kv_last_page_len": np.full(batch, kv_len - (n_pages - 1) * PAGE),
           "kw": dict(num_qo_heads=MT_HQ, num_kv_heads=MT_HKV, head_dim=D, page_size=PAGE),
           "mask": {}}
    if tree_seed is not None:
        lq, lkv = [tokens] * batch, [kv_len] * batch
        out["mask"] = {"packed_custom_mask": packed(tree_batch(lq, lkv, tree_seed)[0], lq, lkv)}
    return out


def multi_token_cells(copy_bw: float, sweep: list[dict[str, Any]] | None = None,
                      cells: tuple[tuple[int, int], ...] = MT_CELLS,
                      tokens: int = Q_PER_REQUEST) -> list[dict[str, Any]]:
    """The multi-token decode cells (module docstring): per (batch, kv_len), attncc with the
    causal variant, with a tree mask as well, and the read floor of the same bytes; `sweep`
    adds attncc cells with BatchAttention knobs (`tiles`, `min_kv_chunk`, `kernel`)."""
    import torch

    from attncc.frontend import Variant
    from attncc.runtime.serving.batch import BatchAttention
    from bench.timing import spin_gpu, time_call

    causal = Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, name="mt_causal")
    out: list[dict[str, Any]] = []
    for batch, kv_len in cells:
        n_pages = batch * -(-kv_len // PAGE)
        g = torch.Generator(device="cuda").manual_seed(kv_len + batch)
        k = torch.empty(n_pages, PAGE, MT_HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.empty_like(k)
        k.normal_(generator=g)
        v.normal_(generator=g)
        q = torch.randn(batch * tokens, MT_HQ, D, generator=g, device="cuda").bfloat16()
        nbytes = float(batch * kv_len) * MT_HKV * D * 2 * 2 + 2 * q.numel() * 2
        base = {"batch": batch, "hq": MT_HQ, "hkv": MT_HKV, "kv_len": kv_len,
                "q_per_request": tokens, "kv_dtype": str(k.dtype).replace("torch.", "")}
        spin_gpu()
        ref = None
        runs = [(impl, {}) for impl in MT_IMPLS] + [("attncc", o) for o in (sweep or [])]
        for impl, opts in runs:
            try:
                if impl == "read_floor":
                    x = torch.empty(int(nbytes) // 2, dtype=torch.bfloat16, device="cuda")
                    x.normal_(generator=g)
                    t = time_call(lambda: x.sum(dtype=torch.float32))
                    del x
                    extra: dict[str, Any] = {}
                else:
                    pt = multi_token_batch(batch, kv_len, tokens,
                                           0 if impl == "attncc_tree" else None)
                    knobs = {key: tuple(val) if key == "tiles" else val
                             for key, val in opts.items()}
                    ba = BatchAttention(causal, kv_layout="NHD", max_batch=batch,
                                        max_qo_tokens=batch * tokens, **knobs)
                    ba.plan(pt["qo_indptr"], pt["kv_indptr"], pt["kv_indices"],
                            pt["kv_last_page_len"], **pt["kw"], **pt["mask"])
                    res = ba.run(q, (k, v))
                    torch.cuda.synchronize()
                    t = time_call(lambda: ba.run(q, (k, v)))
                    kr = ba.kernel_record()
                    extra = {"tq": ba.tiles.tq, "tkv": ba.tiles.tkv, "stages": ba.tiles.stages,
                             "kernel": ba.tiles.kernel, "num_ctas": ba.tiles.num_ctas,
                             "spill": kr.spill_bytes, "local": kr.local_bytes}
                    if opts:
                        extra["knobs"] = json.dumps(opts, sort_keys=True)
                    if impl == "attncc" and ref is None and not opts:
                        ref = res.float()
                    elif ref is not None and impl == "attncc":
                        extra["rel_err"] = float((res.float() - ref).norm() / ref.norm())
                    del ba
                ms = t.get("ms_graph", t["ms_eager"])
                tbs = nbytes / (ms * 1e-3) / 1e12
                rec = {"impl": impl, **base, "ms": ms, "tb_s": tbs,
                       "bw_fraction": tbs * 1e12 / copy_bw, **t, **extra}
                out.append(rec)
                print(f"B={batch:4d} kv={kv_len:6d} q/req={tokens} {impl:12s} {ms * 1e3:9.1f} us "
                      f"{tbs:5.2f} TB/s ({rec['bw_fraction']:.2f} of copy) "
                      f"{extra.get('knobs', '')} tiles={extra.get('tq')}/{extra.get('tkv')}/"
                      f"{extra.get('stages')}", flush=True)
            except Exception as e:  # a cell that cannot run is reported, not fatal
                print(f"B={batch} kv={kv_len} {impl} FAILED {type(e).__name__}: {str(e)[:300]}",
                      flush=True)
                out.append({"impl": impl, **base, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        del k, v, q
        torch.cuda.empty_cache()
    return out


def multi_token_table(doc: dict[str, Any]) -> list[str]:
    """Markdown lines of the multi-token decode cells (none: no lines)."""
    res = [r for r in doc["results"] if "bw_fraction" in r and r.get("q_per_request", 1) > 1]
    if not res:
        return []
    lines = ["", "Multi-token decode (Hq 64 / Hkv 8, D 128, page 16, causal; fraction of copy "
             "bandwidth (TB/s), tiles T_q/T_kv/stages):", "",
             "| batch | kv | q/request | impl | knobs | fraction (TB/s) | tiles | us |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res:
        tiles = f"{r['tq']}/{r['tkv']}/{r['stages']}" if "tq" in r else "-"
        lines.append(f"| {r['batch']} | {r['kv_len']} | {r['q_per_request']} | {r['impl']} | "
                     f"{r.get('knobs', '')} | {r['bw_fraction']:.2f} ({r['tb_s']:.2f}) | "
                     f"{tiles} | {r['ms'] * 1e3:.1f} |")
    return lines


def kv_cell_inputs(batch: int, hq: int, hkv: int, kv_len: int) -> tuple[tuple, Any, Any, Any]:
    """A KV-dtype cell's plan() arguments (`batch` requests of `kv_len` keys, pages of PAGE in a
    seeded random order) and its bf16 q, K and V on the GPU (seeded)."""
    import torch

    n_pages = -(-kv_len // PAGE)
    ids = torch.randperm(batch * n_pages, generator=torch.Generator().manual_seed(2)).numpy()
    args = (np.arange(batch + 1), np.arange(batch + 1) * n_pages, ids,
            np.full(batch, kv_len - (n_pages - 1) * PAGE))
    g = torch.Generator(device="cuda").manual_seed(batch + hkv)
    shape = (batch * n_pages, PAGE, hkv, D)
    k = torch.randn(*shape, generator=g, device="cuda").bfloat16()
    v = torch.randn(*shape, generator=g, device="cuda").bfloat16()
    q = torch.randn(batch, hq, D, generator=g, device="cuda").bfloat16()
    return args, q, k, v


def kv_cache(k: Any, v: Any, name: str, hkv: int) -> tuple[tuple[Any, Any], dict[str, float]]:
    """(cache, run()'s scale keywords) of bf16 `k`, `v` [pages, PAGE, hkv, D] as a `name`
    cache: themselves for bfloat16; else quantized with per-tensor scales, amax over the
    format's largest finite value."""
    import torch

    from attncc.runtime.kv8 import kv_scale, quantize

    if name == "bfloat16":
        return (k, v), {}
    kvdt = getattr(torch, name)
    top = torch.finfo(kvdt).max
    scales = {"k_scale": float(k.abs().max()) / top, "v_scale": float(v.abs().max()) / top}
    k8, v8 = (quantize(t, kv_scale(s, hkv, "scale").cuda(), head_axis=2, dtype=kvdt)
              for t, s in ((k, scales["k_scale"]), (v, scales["v_scale"])))
    return (k8, v8), scales


def run_kv_cell(batch: int, hq: int, hkv: int, kv_len: int, copy_bw: float,
                kv_dtypes: tuple[str, ...] = KV_DTYPES) -> list[dict[str, Any]]:
    """One KV-dtype cell (module docstring): decode of `batch` requests of `kv_len` keys over a
    paged cache in each of `kv_dtypes`, the same values quantized with a per-tensor scale;
    `vs_bf16` is each step time over the bf16 cache's, `rel_err` each output's against the
    bf16 one's."""
    import torch

    from attncc.runtime.serving.batch import BatchAttention
    from bench.timing import time_call

    args, q, k, v = kv_cell_inputs(batch, hq, hkv, kv_len)
    out: list[dict[str, Any]] = []
    base_ms, ref = None, None
    runs = [(name, None) for name in kv_dtypes]
    runs += [(name, t) for name in kv_dtypes if name != "bfloat16" for t in KV_TILE_SWEEP]
    for name, tiles in runs:
        kvdt = getattr(torch, name)
        cache, scales = kv_cache(k, v, name, hkv)
        ba = BatchAttention(None, kv_layout="NHD", max_batch=max(batch, 16),
                            max_qo_tokens=max(batch, 16), tiles=tiles)
        ba.plan(*args, num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=PAGE,
                kv_data_type=None if name == "bfloat16" else kvdt)
        res = ba.run(q, cache, **scales)
        torch.cuda.synchronize()
        t = time_call(lambda: ba.run(q, cache, **scales))
        ms = t.get("ms_graph", t["ms_eager"])
        nbytes = batch * kv_len * hkv * D * 2 * cache[0].element_size() + 2 * q.numel() * 2
        tbs = nbytes / (ms * 1e-3) / 1e12
        base_ms = ms if base_ms is None else base_ms
        rec = {"impl": "attncc", "batch": batch, "hq": hq, "hkv": hkv, "kv_len": kv_len,
               "q_per_request": 1, "kv_dtype": name, "ms": ms, "tb_s": tbs,
               "bw_fraction": tbs * 1e12 / copy_bw, "vs_bf16": ms / base_ms, **t,
               "spill": ba.kernel_record().spill_bytes, "tq": ba.tiles.tq, "tkv": ba.tiles.tkv,
               "stages": ba.tiles.stages, "kv_warps": ba.tiles.kv_warps}
        if tiles is not None:
            rec["knobs"] = json.dumps({"tiles": list(tiles)})
        if ref is None:
            ref = res.float()
        else:
            rec["rel_err"] = float((res.float() - ref).norm() / ref.norm())
        out.append(rec)
        print(f"B={batch:4d} Hq={hq} Hkv={hkv:2d} kv={kv_len} {name:14s} {ms * 1e3:9.1f} us "
              f"{tbs:6.2f} TB/s ({rec['bw_fraction']:.2f} of copy) x{rec['vs_bf16']:.3f} of "
              f"bf16 {rec.get('knobs', '')}", flush=True)
        del cache, ba
    return out


def kv_table(res: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of the KV-dtype cells (records with `kv_len`).

    Example:
        >>> r = dict(batch=128, hq=64, hkv=8, kv_len=32768, kv_dtype="float8_e4m3fn", ms=1.5,
        ...          tb_s=2.9, bw_fraction=0.6, vs_bf16=0.52)
        >>> kv_table([r])[-1]
        '| 128 | 64 | 8 | 32768 | float8_e4m3fn | 1500.0 | 0.60 (2.90) | 0.520 |'
    """
    lines = ["", "KV-dtype cells (decode, page 16, D 128; fraction of copy bandwidth of the "
             "bytes the cache holds; step time over the bf16 cache's):", "",
             "| batch | Hq | Hkv | kv | kv_dtype | us | fraction (TB/s) | vs bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['hq']} | {r['hkv']} | {r['kv_len']} | {r['kv_dtype']}"
              f"{' `' + r['knobs'] + '`' if 'knobs' in r else ''} | "
              f"{r['ms'] * 1e3:.1f} | {r['bw_fraction']:.2f} ({r['tb_s']:.2f}) | "
              f"{r['vs_bf16']:.3f} |" for r in res]
    return lines


def table(doc: dict[str, Any]) -> str:
    """Markdown: fraction of copy bandwidth per cell, and attncc against the faster of the two
    FlexAttention setups (padded cache, paged helper); sweep cells after."""
    kv_cells = [r for r in doc["results"] if "kv_len" in r and "bw_fraction" in r
                and r.get("q_per_request", 1) == 1]
    res = [r for r in doc["results"] if "bw_fraction" in r and "knobs" not in r and "dist" in r]
    by = {(r["impl"], r["batch"], r["hkv"], r["dist"]): r for r in res}
    m = doc["meta"]
    lines = [f"{m['gpu']}, torch {m['torch']}, attncc {m['attncc_commit'][:10]}, "
             f"{m['date'][:10]}; decode, bf16, Hq={HQ}, D={D}, page {PAGE}; copy bandwidth "
             f"{m['copy_tb_s']:.2f} TB/s. Cells: fraction of copy bandwidth (TB/s)."]
    if res:  # (a file of only KV-dtype or multi-token cells has no grid)
        lines += ["", "| batch | Hkv | dist | attncc | no scheduler | flex | flex paged | "
                  "sdpa+mask | read floor | attncc / best flex | plan us |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["batch"], r["hkv"], r["dist"]) for r in res},
                  key=lambda k: (k[0], -k[1], DISTS.index(k[2])))
    for b, h, dist in keys:
        cells = []
        for impl in IMPLS:
            r = by.get((impl, b, h, dist))
            cells.append(f"{r['bw_fraction']:.2f} ({r['tb_s']:.2f})" if r else "-")
        a = by.get(("attncc", b, h, dist))
        flexes = [r["ms"] for r in (by.get((i, b, h, dist)) for i in ("flex", "flex_paged")) if r]
        ratio = f"{min(flexes) / a['ms']:.2f}" if a and flexes else "-"
        plan_us = f"{a['plan_us']:.0f}" if a else "-"
        lines.append(f"| {b} | {h} | {dist} | " + " | ".join(cells) + f" | {ratio} | {plan_us} |")
    swept = [r for r in doc["results"] if "knobs" in r and "bw_fraction" in r and "dist" in r]
    if swept:
        lines += ["", "| batch | Hkv | dist | knobs | fraction (TB/s) | CTAs |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['hkv']} | {r['dist']} | `{r['knobs']}` | "
                  f"{r['bw_fraction']:.2f} ({r['tb_s']:.2f}) | {r['num_ctas']} |" for r in swept]
    if kv_cells:
        lines += kv_table(kv_cells)
    return "\n".join(lines + multi_token_table(doc)) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in doc["results"] if "bw_fraction" in r and "knobs" not in r and "dist" in r]
    hkvs = sorted({r["hkv"] for r in res}, reverse=True)
    if not hkvs:  # no grid cells to draw (the tables say the rest)
        return
    fig, axes = plt.subplots(1, len(hkvs), figsize=(5 * len(hkvs), 3.6), squeeze=False)
    for ax, h in zip(axes[0], hkvs):
        cells = sorted({(r["batch"], r["dist"]) for r in res if r["hkv"] == h},
                       key=lambda c: (c[0], DISTS.index(c[1])))
        x = np.arange(len(cells))
        for i, impl in enumerate(IMPLS):
            ys = [next((r["bw_fraction"] for r in res if r["impl"] == impl and r["hkv"] == h
                        and (r["batch"], r["dist"]) == c), 0.0) for c in cells]
            w = 0.8 / len(IMPLS)
            ax.bar(x + (i - (len(IMPLS) - 1) / 2) * w, ys, w, label=impl)
        ax.set_xticks(x, [f"B{b}\n{d[:4]}" for b, d in cells], fontsize=7)
        ax.set_title(f"Hkv={h}")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("fraction of copy bandwidth")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode, {doc['meta']['gpu']}, bf16, Hq=32, D=128, page 16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--hkv", type=int, nargs="+", default=list(HKVS))
    ap.add_argument("--dist", nargs="+", default=list(DISTS), choices=DISTS)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None)
    ap.add_argument("--multi-token", action="store_true",
                    help="also the multi-token decode cells (MT_CELLS; --sweep applies to them)")
    ap.add_argument("--multi-token-only", action="store_true",
                    help="only the multi-token decode cells")
    ap.add_argument("--sweep", type=json.loads, nargs="*", default=None,
                    help='extra attncc cells, e.g. \'{"tiles": [16, 32, 4], "min_kv_chunk": 512}\' '
                         'or \'{"pdl": false}\'')
    ap.add_argument("--kv-cells", action="store_true",
                    help="only the KV-dtype cells (KV_CELLS: bf16 / fp8 e4m3 / e5m2 caches)")
    ap.add_argument("--no-kv-cells", action="store_true", help="skip the KV-dtype cells")
    args = ap.parse_args(argv)
    from bench.prefill import _meta, report, save
    from bench.timing import TIME_CALL_TIMING

    if args.report is not None:
        report(args.report, table, plot)
        return 0

    bw = copy_bandwidth()
    meta = {**_meta(), "copy_tb_s": bw / 1e12, "page_size": PAGE, "num_qo_heads": HQ,
            "head_dim": D, "timing": TIME_CALL_TIMING + "; plan() timed separately (median of "
            "200 host calls after 20 warm-up calls)"}
    results = []

    def done(cells: list) -> None:  # saved after every cell: a run cut short keeps what it has
        results.extend(cells)
        save({"meta": meta, "results": results}, args.out, "decode-h200.json", table)

    for b in ([] if args.multi_token_only or args.kv_cells else args.batch):
        for h in args.hkv:
            for dist in args.dist:
                done(run_cell(b, h, dist, tuple(args.impls), bw, args.sweep))
    for cell in KV_CELLS if not (args.no_kv_cells or args.multi_token_only) else ():
        done(run_kv_cell(*cell, bw))
    if args.multi_token or args.multi_token_only:
        done(multi_token_cells(bw, args.sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
