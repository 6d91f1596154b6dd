"""The FA3 batch kernel's pair form on the GPU (kernels/fa3/fa3_batch.cuh, docs/serving.md,
"The FA3 pair form"): 64-row units whose K/V tiles the two consumer warpgroups split, consumer
1 handing its state to consumer 0 at the end of each unit. Multi-token decode batches (rows =
tokens x GQA group from 17 to 64) at head dims 64 and 128, groups 2 to 16, against the fp64
reference: softmax and sigmoid (normalize="none") variants, a score_mod reading a captured
tensor, an output transform, sinks, the LSE, KV lengths from one tile (consumer 1 gets no
tile) to many split units (the merge kernel over 64-row slots). Outputs and LSE are poisoned
with NaN first; relative error < 2e-2.
"""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from tests.gpu.test_multitoken_gpu import _cache, _capture, _mask, _plan

pytestmark = pytest.mark.gpu


def _variant(kind: str, hq: int) -> attncc.Variant:
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    if kind == "causal":
        return attncc.Variant(mask_mod=causal, name="pair_causal")
    if kind == "plain":
        return attncc.Variant(name="pair_plain")
    if kind == "alibi":  # a captured per-head slope, read at every logit
        slopes = torch.linspace(0.05, 0.5, hq, device="cuda")
        return attncc.Variant(score_mod=lambda s, b, h, q_idx, kv_idx:
                              s - slopes[h] * (q_idx - kv_idx), mask_mod=causal,
                              name="pair_alibi")
    if kind == "sigmoid":
        return attncc.Variant(score_mod=lambda s, b, h, q_idx, kv_idx: torch.sigmoid(s - 4.0),
                              normalize="none", mask_mod=causal, name="pair_sigmoid")
    if kind == "output":
        return attncc.Variant(mask_mod=causal, output_mod=lambda o, b, h, q_idx, d: o[d] * 2.0 + 1.0,
                              name="pair_output")
    raise ValueError(kind)


def _check_pair(tokens: int, g: int, d: int, kind: str, kv_lens: list[int],
                sinks: bool = False, kernel: str | None = None,
                tree: str | None = None) -> BatchAttention:
    hkv, page = 2, 16
    hq = hkv * g
    kv_lens = [max(n, tokens) for n in kv_lens]  # (a request's KV holds its step's tokens)
    q_lens = [tokens] * len(kv_lens)
    c = _cache(kv_lens, page, hkv, seed=tokens * 7 + g + d)
    if d != 128:  # _cache draws D = 128 rows: keep the first d columns
        c["cache"] = tuple(t[..., :d].contiguous() for t in c["cache"])
    variant = _variant(kind, hq)
    ba = BatchAttention(variant, kv_layout="NHD", kernel=kernel)
    qo = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)))
    mask = _mask(tree, q_lens, kv_lens, seed=tokens + g) if tree else {}
    ba.plan(qo, c["kv_indptr"], c["kv_indices"], c["last"], num_qo_heads=hq, num_kv_heads=hkv,
            head_dim=d, page_size=page, **mask)
    if ba.tiles.kernel != "fa3":
        pytest.skip("the FA3 batch kernel does not run this batch on this GPU")
    assert ba.tiles.tq == 64, ba.tiles
    gen = torch.Generator(device="cuda").manual_seed(tokens + g + d)
    q = torch.randn(int(qo[-1]), hq, d, generator=gen, device="cuda").bfloat16()
    sk = torch.linspace(-3, 3, hq, device="cuda") if sinks else None
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    ba.run(q, c["cache"], out=out, lse=None if kind == "sigmoid" else lse, sinks=sk)
    torch.cuda.synchronize()
    ref, ref_lse = batch_attention_reference(q, c["cache"], qo, c["kv_indptr"], c["kv_indices"],
                                             c["last"], page_size=page, variant=variant,
                                             sinks=sk, **mask)
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs unwritten/NaN"
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3e}"
    if kind != "sigmoid":
        assert not torch.isnan(lse).any()
        assert (lse.double() - ref_lse).abs().max().item() < 2e-2
    return ba


# KV lengths: the step's tokens only (one tile: consumer 1 has none), a partial second tile,
# odd lengths, and long requests the planner splits across CTAs (the merge kernel's slots)
KV = [8, 130, 37, 300, 1024, 4100, 9000, 513, 129, 20000]
CASES = [(tokens, g, d, kind)
         for d in (64, 128)
         for tokens, g, kind in ((8, 8, "causal"), (4, 8, "plain"), (16, 4, "alibi"),
                                 (32, 2, "sigmoid"), (4, 16, "output"), (5, 8, "causal"))]


@pytest.mark.parametrize("tokens,g,d,kind", CASES,
                         ids=[f"t{c[0]}-g{c[1]}-d{c[2]}-{c[3]}" for c in CASES])
def test_pair_form_matches_reference(tokens: int, g: int, d: int, kind: str) -> None:
    _check_pair(tokens, g, d, kind, KV)


TREES = [(8, 8, 128, "causal", "tree"), (4, 8, 64, "plain", "packed"),
         (16, 4, 128, "alibi", "packed"), (5, 8, 128, "sigmoid", "tree")]


@pytest.mark.parametrize("tokens,g,d,kind,tree", TREES,
                         ids=[f"t{c[0]}-g{c[1]}-d{c[2]}-{c[3]}-{c[4]}" for c in TREES])
def test_pair_form_reads_tree_masks(tokens: int, g: int, d: int, kind: str, tree: str) -> None:
    """Speculative tree masks (custom and bit-packed) on the pair form's checked tiles, ANDed
    with the variant's mask, against the reference under the same mask."""
    _check_pair(tokens, g, d, kind, KV, tree=tree)


def test_pair_form_graph_replays_new_trees() -> None:
    """A CUDA graph captured on a tree-masked pair-form plan replays later plans' masks (the
    device table), and a plan without a mask sees every key again."""
    hkv, g, page, tokens = 2, 8, 16, 8
    kv_lens = [700, 3000, 50]
    q_lens = [tokens] * len(kv_lens)
    c = _cache(kv_lens, page, hkv, seed=11)
    variant = _variant("causal", hkv * g)
    ba = BatchAttention(variant, kv_layout="NHD")
    qo = _plan(ba, q_lens, c, hkv * g, hkv, page, _mask("tree", q_lens, kv_lens, seed=1))
    if ba.tiles.kernel != "fa3":
        pytest.skip("the FA3 batch kernel does not run this batch on this GPU")
    q = torch.randn(int(qo[-1]), hkv * g, 128, device="cuda").bfloat16()
    out = torch.empty_like(q)
    graph = _capture(ba, q, c["cache"], out)
    for seed in (2, 3, None):
        mask = _mask("packed", q_lens, kv_lens, seed=seed) if seed is not None else {}
        _plan(ba, q_lens, c, hkv * g, hkv, page, mask)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = batch_attention_reference(q, c["cache"], qo, c["kv_indptr"], c["kv_indices"],
                                           c["last"], page_size=page, variant=variant, **mask)
        err = float((out.double() - ref).norm() / ref.norm())
        assert not torch.isnan(out).any() and err < 2e-2, (seed, err)


@pytest.mark.parametrize("d", [64, 128])
def test_pair_form_with_sinks(d: int) -> None:
    _check_pair(8, 8, d, "causal", KV, sinks=True)


@pytest.mark.parametrize("tokens,g,kernel", [(3, 8, "fa3"), (17, 1, None), (3, 8, None)])
def test_pair_form_from_17_rows(tokens: int, g: int, kernel: str | None) -> None:
    """17 to 64 fused rows take the pair form (3 tokens x 8 heads; 17 tokens of MHA), with
    kernel=None and kernel='fa3'."""
    _check_pair(tokens, g, 128, "causal", [40, 700, 5000], kernel=kernel)


def test_pair_form_is_deterministic_and_matches_fa2() -> None:
    """The same batch through the pair form twice (bitwise equal: no atomics, a fixed
    hand-over order) and through FA2's multi-token tiles (close)."""
    hkv, g, page, tokens = 2, 8, 16, 8
    kv_lens = [3000, 9000, 77]
    c = _cache(kv_lens, page, hkv, seed=3)
    variant = _variant("causal", hkv * g)
    q = torch.randn(tokens * len(kv_lens), hkv * g, 128, device="cuda").bfloat16()
    outs = []
    for kernel in (None, None, "fa2"):
        ba = BatchAttention(variant, kv_layout="NHD", kernel=kernel)
        _plan(ba, [tokens] * len(kv_lens), c, hkv * g, hkv, page, {})
        outs.append(ba.run(q, c["cache"]))
        if kernel is None and ba.tiles.kernel != "fa3":
            pytest.skip("the FA3 batch kernel does not run this batch on this GPU")
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    assert (outs[0].float() - outs[2].float()).abs().max().item() < 2e-2
