"""attncc.append_paged_kv_cache on CUDA tensors feeding BatchAttention: decode steps append one
token per request into a bf16 paged cache (page ids on the GPU, positions from
get_batch_indices_positions), then run reads the cache; every step matches the fp64 reference."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc.runtime.reference import batch_attention_reference

pytestmark = pytest.mark.gpu


def test_decode_loop_appends_and_reads_back() -> None:
    hkv, g, d, page = 2, 4, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(7)
    lens = [30, 1, 200]
    max_pages = [-(-(n + 4) // page) for n in lens]  # room for 4 more tokens each
    ids = torch.randperm(sum(max_pages) * 2, device="cuda", generator=gen)[:sum(max_pages)]
    start = [sum(max_pages[:i]) for i in range(len(lens))]
    shape = (sum(max_pages) * 2, page, hkv, d)
    kc = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    vc = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    ba = attncc.BatchAttention(None, kv_layout="NHD")
    for _ in range(4):
        lens = [n + 1 for n in lens]
        n_pages = [-(-n // page) for n in lens]
        indptr = torch.tensor([0] + [sum(n_pages[:i + 1]) for i in range(len(lens))],
                              device="cuda")
        kv_ids = torch.cat([ids[s:s + p] for s, p in zip(start, n_pages)])
        last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, n_pages)], device="cuda")
        b, pos = attncc.get_batch_indices_positions(
            torch.arange(len(lens) + 1, device="cuda"),
            attncc.get_seq_lens(indptr, last, page), len(lens))
        k_new = torch.randn(len(lens), hkv, d, device="cuda", generator=gen).bfloat16()
        v_new = torch.randn(len(lens), hkv, d, device="cuda", generator=gen).bfloat16()
        attncc.append_paged_kv_cache(k_new, v_new, b, pos, (kc, vc), kv_ids, indptr, last)
        qo = torch.arange(len(lens) + 1)
        ba.plan(qo, indptr.cpu(), kv_ids.cpu(), last.cpu(), num_qo_heads=hkv * g,
                num_kv_heads=hkv, head_dim=d, page_size=page)
        q = torch.randn(len(lens), hkv * g, d, device="cuda", generator=gen).bfloat16()
        out = ba.run(q, (kc, vc))
        ref, _ = batch_attention_reference(q.cpu(), (kc.cpu(), vc.cpu()), qo, indptr.cpu(),
                                           kv_ids.cpu(), last.cpu(), page_size=page)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert not torch.isnan(out).any() and err < 2e-2
