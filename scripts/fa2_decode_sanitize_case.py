"""Small FA2 decode-form launches over fp8 caches for compute-sanitizer (memcheck, racecheck),
each checked against the fp64 reference, so a clean log comes from launches that also computed
the right thing:

    compute-sanitizer --tool racecheck python -m scripts.fa2_decode_sanitize_case
    compute-sanitizer --tool memcheck --report-api-errors no python -m scripts.fa2_decode_sanitize_case

bf16 queries (the register path's fp16 MMAs and the per-row Q rescaling, kernels/fa2/fa2_kv8.cuh)
and fp16 queries, e4m3 and e5m2 caches, two- and three-stage decode tiles (16 x 32, 2 KV warps),
odd lengths with one request split across CTAs (so the merge kernel runs), GQA 8. The last
cases let the planner choose the tiles: one token of a GQA group of 8 plans the 8-row form
(BatchTiles.half_rows), over an fp8 and a bf16 cache.
"""
from __future__ import annotations

import itertools

import torch

from attncc.runtime.kv8 import quantize
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention


def case(qdt: torch.dtype, kvdt: torch.dtype, stages: int | None) -> float:
    """One decode step; its relative error against the reference. stages=None: the planner's
    tiles (the 8-row form); a cache of q's dtype is stored unscaled."""
    hkv, g, d, page = 2, 8, 128, 16
    lens = [33, 300, 1100]
    n = [-(-x // page) for x in lens]
    gen = torch.Generator(device="cuda").manual_seed(stages or 4)
    pages = sum(n) + 2
    scale = None if kvdt == qdt else 0.05
    k8, v8 = (torch.randn(pages, page, hkv, d, generator=gen, device="cuda").to(kvdt)
              if kvdt == qdt else
              quantize(torch.randn(pages, page, hkv, d, generator=gen, device="cuda"),
                       torch.full((hkv,), scale, device="cuda"), head_axis=2, dtype=kvdt)
              for _ in range(2))
    args = (torch.arange(len(lens) + 1), torch.tensor([0] + list(itertools.accumulate(n))),
            torch.randperm(pages, generator=torch.Generator().manual_seed(1))[:sum(n)],
            torch.tensor([x - (p - 1) * page for x, p in zip(lens, n)]))
    q = torch.randn(len(lens), hkv * g, d, generator=gen, device="cuda").to(qdt)
    # one request's heads far outside fp16's range (bf16 q: the per-row rescaling to fp16)
    q[1] *= 1e6 if qdt == torch.bfloat16 else 100.0
    tiles = None if stages is None else (16, 32, stages, 2)
    ba = BatchAttention(None, kv_layout="NHD", tiles=tiles, min_kv_chunk=256)
    ba.plan(*args, num_qo_heads=hkv * g, num_kv_heads=hkv, head_dim=d, page_size=page,
            q_data_type=qdt, kv_data_type=kvdt)
    out = torch.full_like(q, float("nan"))
    if stages is None:
        assert ba.tiles.half_rows, ba.tiles  # the case exists to run the 8-row form
    ba.run(q, (k8, v8), out=out, k_scale=scale, v_scale=scale)
    torch.cuda.synchronize()
    ref, _ = batch_attention_reference(q, (k8, v8), *args, page_size=page, k_scale=scale,
                                       v_scale=scale)
    return float((out.double() - ref).norm() / ref.norm())


def main() -> None:
    cases = list(itertools.product((torch.bfloat16, torch.float16),
                                   (torch.float8_e4m3fn, torch.float8_e5m2), (2, 3)))
    cases += [(torch.bfloat16, torch.float8_e4m3fn, None), (torch.bfloat16, torch.bfloat16, None)]
    for qdt, kvdt, stages in cases:
        err = case(qdt, kvdt, stages)
        print(f"{str(qdt)[6:]:8s} {str(kvdt)[6:]:14s} stages {stages or 'auto'}: rel err {err:.2e}",
              flush=True)
        assert err < 2e-2, err  # (NaN fails too)
    print("ok")


if __name__ == "__main__":
    main()
