"""attncc serving with an fp8 KV cache and attention sinks: a decode loop that appends each
step's tokens into an e4m3 paged cache (quantized on write) and attends over it, with a learned
sink logit per query head (gpt-oss) joining every row's softmax denominator.

Run: `python examples/serving_fp8.py`. Three requests start from prompts of different lengths;
each of 4 decode steps appends one new key / value per request with
`attncc.append_paged_kv_cache(..., k_scale=, v_scale=)`, plans the step with
`plan(kv_data_type=torch.float8_e4m3fn)` and attends with `run(..., sinks=)`. On a CUDA GPU (sm_89+) `BatchAttention.run`
reads the fp8 bytes and is checked against the fp64 reference on the dequantized cache; on a
CPU the reference alone runs. Each step also prints the quantization error: the fp8 cache's
output against the same step over the unquantized keys and values.
"""
from __future__ import annotations

import numpy as np
import torch

import attncc
from attncc.runtime.reference import batch_attention_reference

HQ, HKV, D, PAGE = 8, 2, 64, 16
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = torch.tensor([0.01, 0.02]), 0.01   # per head / per tensor: the cache holds k / k_scale
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 3.0, 1.0])  # one sink logit per query head


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def page_table(lens: list[int], pages: list[list[int]]) -> dict:
    """kv_indptr / kv_indices / kv_last_page_len of the requests' current lengths."""
    used = [p[:-(-n // PAGE)] for n, p in zip(lens, pages)]
    return dict(kv_indptr=torch.tensor([0] + list(np.cumsum([len(u) for u in used]))),
                kv_indices=torch.tensor([i for u in used for i in u]),
                kv_last_page_len=torch.tensor([n - (-(-n // PAGE) - 1) * PAGE for n in lens]))


def append(caches: list[tuple], k: torch.Tensor, v: torch.Tensor, start: list[int],
           lens: list[int], pages: list[list[int]]) -> None:
    """Append tokens start[i]..lens[i] of each request (k, v: [tokens, HKV, D], in request
    order) to the fp8 cache (quantized) and to the float32 twin used for the error figure."""
    table = page_table(lens, pages)
    counts = [n - s for n, s in zip(lens, start)]
    b, pos = attncc.get_batch_indices_positions(
        torch.tensor([0] + list(np.cumsum(counts))),
        attncc.get_seq_lens(table["kv_indptr"], table["kv_last_page_len"], PAGE), sum(counts))
    dev = caches[0][0].device
    for cache, scales in zip(caches, ({"k_scale": K_SCALE.to(dev), "v_scale": V_SCALE}, {})):
        attncc.append_paged_kv_cache(k, v, b.to(dev), pos.to(dev), cache,
                                     table["kv_indices"].to(dev), table["kv_indptr"].to(dev),
                                     table["kv_last_page_len"].to(dev), **scales)


def main() -> None:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    dev = "cuda" if cuda else "cpu"
    num_pages, lens = 48, [300, 40, 129]
    cache8 = tuple(torch.zeros(num_pages, PAGE, HKV, D, dtype=FP8, device=dev) for _ in "kv")
    cache32 = tuple(torch.zeros(num_pages, PAGE, HKV, D, device=dev) for _ in "kv")
    perm = torch.randperm(num_pages).tolist()
    pages = [perm[0:20], perm[20:32], perm[32:48]]         # each request's page pool, in order
    prompt = sum(lens)
    append([cache8, cache32], torch.randn(prompt, HKV, D, device=dev),
           torch.randn(prompt, HKV, D, device=dev), [0, 0, 0], lens, pages)
    ba = attncc.BatchAttention(None, kv_layout="NHD", max_batch=8, max_qo_tokens=8, device=dev)
    for step in range(4):
        start, lens = lens, [n + 1 for n in lens]
        append([cache8, cache32], torch.randn(3, HKV, D, device=dev),
               torch.randn(3, HKV, D, device=dev), start, lens, pages)
        table = page_table(lens, pages)
        ba.plan(torch.arange(4), **table, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                page_size=PAGE, kv_data_type=FP8)
        q = torch.randn(3, HQ, D, device=dev, dtype=torch.bfloat16)
        ref, _ = batch_attention_reference(q, cache8, torch.arange(4), **table, page_size=PAGE,
                                           k_scale=K_SCALE, v_scale=V_SCALE,
                                           sinks=SINKS.to(dev))
        exact, _ = batch_attention_reference(q.float(), cache32, torch.arange(4), **table,
                                             page_size=PAGE, sinks=SINKS.to(dev))
        line = f"step {step}: lengths {lens}, fp8 quantization error {rel_err(ref, exact):.1e}"
        if cuda:
            out = ba.run(q, cache8, k_scale=K_SCALE.to(dev), v_scale=V_SCALE, sinks=SINKS.to(dev))
            err = rel_err(out, ref)
            line += f", BatchAttention.run vs reference {err:.1e}"
            assert err < 2e-2, f"BatchAttention.run differs from the reference: {err:.1e}"
        print(line)


if __name__ == "__main__":
    main()
