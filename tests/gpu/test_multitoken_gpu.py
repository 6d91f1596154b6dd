"""Multi-token decode on the GPU (BatchAttention, kernels/fa2/fa2_batch.cuh): 2, 4, 8 and 16 query
tokens per request, causal among them after the request's KV, with and without speculative
tree masks (FlashInfer's custom_mask / packed_custom_mask), page sizes 1 and 16, GQA groups 4
and 8, against the fp64 reference (batch_attention_reference with the same mask). Outputs are
poisoned before every run and must be fully written; relative error < 2e-2. Plus CUDA-graph
replays with new plans and new masks, and a masked plan followed by an unmasked one.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

import attncc
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from tests.helpers.trees import packed, tree_batch

pytestmark = pytest.mark.gpu

D = 128


def _causal() -> attncc.Variant:
    return attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, name="mtd_causal")


def _softcap_causal() -> attncc.Variant:
    return attncc.Variant(score_mod=lambda s, b, h, q_idx, kv_idx: 30 * torch.tanh(s / 30),
                          mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                          name="mtd_softcap_causal")


def _lengths(tokens: int) -> tuple[list[int], list[int]]:
    """A multi-token decode batch: `tokens` queries per request (one request decoding a single
    token), KV from just the step's tokens to 9000 keys (split across CTAs)."""
    kv = [tokens, tokens + 3, 37, 300, 1024, 4100, 9000, 513]
    q = [tokens] * 7 + [1]
    return q, kv


def _cache(kv_lens: list[int], page: int, hkv: int, seed: int) -> dict[str, Any]:
    """A random NHD paged bf16 cache for the lengths, page ids shuffled with unused pages."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = [-(-n // page) for n in kv_lens]
    total = sum(n_pages)
    ids = torch.randperm(2 * total + 3, generator=torch.Generator().manual_seed(seed))[:total]
    shape = (2 * total + 3, page, hkv, D)
    k = torch.randn(*shape, generator=gen, device="cuda").bfloat16()
    v = torch.randn(*shape, generator=gen, device="cuda").bfloat16()
    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
    return dict(cache=(k, v), kv_indptr=indptr, kv_indices=ids, last=last)


def _plan(ba: BatchAttention, q_lens: list[int], c: dict[str, Any], hq: int, hkv: int,
          page: int, mask: dict[str, Any]) -> torch.Tensor:
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    ba.plan(qo, c["kv_indptr"], c["kv_indices"], c["last"], num_qo_heads=hq, num_kv_heads=hkv,
            head_dim=D, page_size=page, **mask)
    return qo


def _check(ba: BatchAttention, q: torch.Tensor, qo: torch.Tensor, c: dict[str, Any], page: int,
           variant: Any, mask: dict[str, Any], out: torch.Tensor | None = None,
           replay: Any = None) -> None:
    """Run (or replay the graph writing `out`) with poisoned outputs and compare with the
    reference under the same mask."""
    n = int(qo[-1])
    lse = None
    if replay is None:
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device="cuda")
        ba.run(q, c["cache"], out=out, lse=lse)
    else:
        assert out is not None
        out.fill_(float("nan"))
        replay()
    torch.cuda.synchronize()
    ref, ref_lse = batch_attention_reference(q[:n], c["cache"], qo, c["kv_indptr"],
                                             c["kv_indices"], c["last"], page_size=page,
                                             variant=variant, **mask)
    got = out[:n]
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} outputs unwritten/NaN"
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3e}"
    if lse is not None:
        assert (lse[:n].double() - ref_lse).abs().max().item() < 2e-2


def _capture(ba: BatchAttention, q: torch.Tensor, cache: Any,
             out: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `ba.run(q, cache, out=out)`, after one eager run (which compiles and
    loads the kernel: a capture cannot)."""
    ba.run(q, cache, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q, cache, out=out)
    return graph


def _mask(kind: str, q_lens: list[int], kv_lens: list[int], seed: int) -> dict[str, Any]:
    """plan()'s mask arguments: none, a random tree (custom_mask, a CUDA bool tensor as a
    serving loop has it), or the same tree bit-packed (packed_custom_mask)."""
    if kind == "none":
        return {}
    m, _ = tree_batch(q_lens, kv_lens, seed)
    if kind == "tree":
        return {"custom_mask": torch.from_numpy(m).cuda()}
    return {"packed_custom_mask": torch.from_numpy(packed(m, q_lens, kv_lens))}


CASES = [(tokens, kind, page, g)
         for tokens in (2, 4, 8, 16)
         for kind, page, g in (("none", 16, 8), ("tree", 16, 8), ("packed", 1, 4),
                               ("tree", 1, 8), ("none", 1, 4))]


@pytest.mark.parametrize("tokens,kind,page,g", CASES,
                         ids=[f"t{c[0]}-{c[1]}-p{c[2]}-g{c[3]}" for c in CASES])
def test_multi_token_decode_matches_reference(tokens: int, kind: str, page: int, g: int) -> None:
    """Every token count with and without tree masks (custom and packed forms), page sizes 1
    and 16, GQA 4 and 8: one work item's tile holds all of a KV head's rows (tokens x group up
    to 64 rows: FA2's multi-token tiles; 128: FA3, or FA2 with a mask)."""
    hkv = 2
    hq = hkv * g
    q_lens, kv_lens = _lengths(tokens)
    c = _cache(kv_lens, page, hkv, seed=tokens * 10 + g)
    variant = _causal() if tokens != 8 else _softcap_causal()
    mask = _mask(kind, q_lens, kv_lens, seed=tokens)
    ba = BatchAttention(variant, kv_layout="NHD")
    qo = _plan(ba, q_lens, c, hq, hkv, page, mask)
    rows = tokens * g
    assert ba.tiles is not None and (ba.tiles.tq >= rows or ba.tiles.kernel == "fa3")
    if mask:  # FA2, or the FA3 batch kernel's pair form (its 128-row form reads no mask)
        assert ba.tiles.kernel == "fa2" or ba.tiles.tq == 64
    gen = torch.Generator(device="cuda").manual_seed(tokens + g)
    q = torch.randn(int(qo[-1]), hq, D, generator=gen, device="cuda").bfloat16()
    _check(ba, q, qo, c, page, variant, mask)


def test_unmasked_plan_after_a_masked_one_sees_every_key() -> None:
    """The tree table keeps no stale rows: a masked plan, then the same batch unmasked (the
    causal reference), then a smaller masked batch."""
    hkv, g, page = 2, 8, 16
    q_lens, kv_lens = _lengths(8)
    c = _cache(kv_lens, page, hkv, seed=1)
    variant = _causal()
    ba = BatchAttention(variant, kv_layout="NHD")
    q = torch.randn(sum(q_lens), hkv * g, D, device="cuda").bfloat16()
    for kind in ("tree", "none", "packed"):
        mask = _mask(kind, q_lens, kv_lens, seed=7)
        qo = _plan(ba, q_lens, c, hkv * g, hkv, page, mask)
        _check(ba, q, qo, c, page, variant, mask)


@pytest.mark.parametrize("first", ["none", "tree"])
def test_cuda_graph_replays_new_plans_and_masks(first: str) -> None:
    """run() captured once -- after an unmasked or a masked plan -- then replayed after plans
    with other token counts (2-8 per request, within the captured 64-row tiles), other KV
    lengths and other masks (a tree, none, the packed form): each replay is checked."""
    hkv, g, page, cache_pages = 8, 8, 16, 4096
    hq = hkv * g
    variant = _causal()
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(cache_pages, page, hkv, D, generator=gen, device="cuda").bfloat16()
    v = torch.randn(cache_pages, page, hkv, D, generator=gen, device="cuda").bfloat16()
    rows = 128
    q_buf = torch.randn(rows, hq, D, generator=gen, device="cuda").bfloat16()
    out_buf = torch.empty_like(q_buf)
    ba = BatchAttention(variant, kv_layout="NHD", max_batch=16, max_qo_tokens=rows)

    def plan(q_lens: list[int], kv_lens: list[int], kind: str, seed: int):
        n_pages = [-(-n // page) for n in kv_lens]
        ids = torch.randperm(cache_pages, generator=torch.Generator().manual_seed(seed))
        indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
        last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
        c = dict(cache=(k, v), kv_indptr=indptr, kv_indices=ids[:int(indptr[-1])], last=last)
        mask = _mask(kind, q_lens, kv_lens, seed)
        return _plan(ba, q_lens, c, hq, hkv, page, mask), c, mask

    qo, c, mask = plan([8] * 8, [4000] * 8, first, 0)
    graph = _capture(ba, q_buf, (k, v), out_buf)
    steps = [([8] * 8, [4000] * 8, "tree"), ([4] * 12, [700 + 300 * i for i in range(12)], "none"),
             ([2, 8, 5, 8], [9000, 8, 130, 2049], "packed"), ([8] * 16, [1500] * 16, "tree")]
    for i, (q_lens, kv_lens, kind) in enumerate(steps):
        qo, c, mask = plan(q_lens, kv_lens, kind, i + 1)
        assert ba.tiles is not None and ba.tiles.tq == 64, ba.tiles
        _check(ba, q_buf, qo, c, page, variant, mask, out=out_buf, replay=graph.replay)


def test_tree_mask_hides_draft_tokens_bit_exactly() -> None:
    """A tree that hides a sibling changes that query's output; one that matches the chain
    (causal) gives bitwise the unmasked causal output (the tree path ANDs, it does not
    re-associate)."""
    hkv, g, page = 2, 8, 16
    q_lens, kv_lens = [8, 8], [200, 64]
    c = _cache(kv_lens, page, hkv, seed=3)
    variant = _causal()
    q = torch.randn(16, hkv * g, D, device="cuda").bfloat16()
    ba = BatchAttention(variant, kv_layout="NHD")
    qo = _plan(ba, q_lens, c, hkv * g, hkv, page, {})
    plain = ba.run(q, c["cache"]).clone()
    chain = np.concatenate([np.hstack([np.ones((8, n - 8), bool),
                                       np.tril(np.ones((8, 8), bool))]).ravel() for n in kv_lens])
    _plan(ba, q_lens, c, hkv * g, hkv, page, {"custom_mask": torch.from_numpy(chain)})
    assert torch.equal(ba.run(q, c["cache"]), plain)
    star = chain.copy()
    for i, n in enumerate(kv_lens):  # every draft token sees only the root and itself
        base = sum(8 * m for m in kv_lens[:i])
        for t in range(2, 8):
            star[base + t * n + n - 8 + 1: base + t * n + n - 8 + t] = False
    _plan(ba, q_lens, c, hkv * g, hkv, page, {"custom_mask": torch.from_numpy(star)})
    got = ba.run(q, c["cache"])
    assert torch.equal(got[:2], plain[:2]) and torch.equal(got[8:10], plain[8:10])
    assert not torch.equal(got[2:8], plain[2:8])
    _check(ba, q, qo, c, page, variant, {"custom_mask": torch.from_numpy(star)})


def test_masked_plan_after_capturing_the_fa3_kernel_raises() -> None:
    """16 tokens x 8 heads (128 rows) run the FA3 batch kernel on sm_90 without a mask; once a
    graph captured it, a tree-masked plan raises instead of being replayed without its mask."""
    hkv, g, page = 2, 8, 16
    q_lens, kv_lens = [16] * 4, [300, 1000, 64, 2000]
    c = _cache(kv_lens, page, hkv, seed=4)
    ba = BatchAttention(_causal(), kv_layout="NHD")
    qo = _plan(ba, q_lens, c, hkv * g, hkv, page, {})
    if ba.tiles is None or ba.tiles.kernel != "fa3":
        pytest.skip("the FA3 batch kernel does not run this batch on this GPU")
    q = torch.randn(int(qo[-1]), hkv * g, D, device="cuda").bfloat16()
    graph = _capture(ba, q, c["cache"], torch.empty_like(q))  # noqa: F841 (kept alive)
    with pytest.raises(ValueError, match="FA3 batch kernel"):
        _plan(ba, q_lens, c, hkv * g, hkv, page, _mask("tree", q_lens, kv_lens, seed=1))
