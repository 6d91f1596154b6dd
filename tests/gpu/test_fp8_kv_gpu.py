"""fp8 KV caches on the GPU (kernels/fa2/fa2_kv8.cuh; docs/serving.md, "fp8 KV cache"):
BatchAttention decode and prefill, CascadeAttention, append-then-read, CUDA-graph replay and
flex_attention, each against the fp64 reference computed on the *dequantized* cache.

Caches are random values quantized with per-tensor or per-head scales (e4m3 and e5m2), page
sizes 1 / 16 / 64, NHD / HND / ragged; q is bf16 or fp16. Outputs are NaN-poisoned before every
run and must be fully written; relative Frobenius error < 2e-2 (the widening is exact, so the
error is the bf16 rounding of P and of the output, as with a 16-bit cache).
"""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import attncc
from attncc.gym import GYM
from attncc.runtime.kv8 import dequantize, quantize
from attncc.runtime.reference import attention_reference, batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MIXED = ([1, 4, 1, 300, 1, 64, 1000, 1], [1, 17, 4096, 300, 2000, 600, 1000, 32768])
DECODE = ([1] * 12, [1, 5, 16, 17, 100, 511, 1024, 1500, 2048, 3000, 4095, 8192])


def _scales(mode: str, hkv: int, base: float = 0.05) -> Any:
    """A per-tensor float or a per-head CUDA tensor (distinct values per head, base / 2 to
    2 base). With base 0.05 a standard normal value stays under e4m3's 448 up to 11 sigma."""
    if mode == "tensor":
        return base
    return base * torch.linspace(0.5, 2.0, hkv, device="cuda")


def _fp8_batch(layout: str, page: int, q_lens: list[int], kv_lens: list[int], hkv: int, g: int,
               d: int, qdt: torch.dtype, kvdt: torch.dtype, mode: str,
               seed: int) -> dict[str, Any]:
    """Random q and an fp8 cache quantized with scales (unused pages between the used ones,
    page ids shuffled)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = torch.randn(int(qo[-1]), hkv * g, d, generator=gen, device="cuda").to(qdt)
    ks, vs = _scales(mode, hkv), _scales(mode, hkv, 0.08)
    if layout == "ragged":
        kv = torch.tensor([0] + list(itertools.accumulate(kv_lens)))
        shape, axis = (int(kv[-1]), hkv, d), 1
        indptr, ids, last = kv, None, None
    else:
        n_pages = [-(-n // page) for n in kv_lens]
        total = sum(n_pages)
        ids = torch.randperm(2 * total + 3, generator=torch.Generator().manual_seed(seed))[:total]
        shape = (2 * total + 3, page, hkv, d) if layout == "NHD" else (2 * total + 3, hkv, page, d)
        axis = 2 if layout == "NHD" else 1
        indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
        last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, n_pages)])
    k = torch.randn(*shape, generator=gen, device="cuda")
    v = torch.randn(*shape, generator=gen, device="cuda")
    k8 = quantize(k, _as_tensor(ks, hkv), head_axis=axis, dtype=kvdt)
    v8 = quantize(v, _as_tensor(vs, hkv), head_axis=axis, dtype=kvdt)
    return dict(q=q, cache=(k8, v8), qo=qo, kv_indptr=indptr, kv_indices=ids, last=last,
                k_scale=ks, v_scale=vs)


def _as_tensor(s: Any, hkv: int) -> torch.Tensor:
    return s if isinstance(s, torch.Tensor) else torch.full((hkv,), float(s), device="cuda")


def _check(ba: BatchAttention, b: dict[str, Any], layout: str, page: int,
           variant: Any = None) -> None:
    out = torch.full_like(b["q"], float("nan"))
    lse = torch.full(b["q"].shape[:2], float("nan"), device="cuda")
    ba.run(b["q"], b["cache"], out=out, lse=lse, k_scale=b["k_scale"], v_scale=b["v_scale"])
    torch.cuda.synchronize()
    ref, ref_lse = batch_attention_reference(
        b["q"], b["cache"], b["qo"], b["kv_indptr"], b["kv_indices"], b["last"],
        kv_layout=layout, page_size=page, variant=variant, k_scale=b["k_scale"],
        v_scale=b["v_scale"])
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs unwritten/NaN"
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3e}"
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live)
    assert (lse[live].double() - ref_lse[live]).abs().max().item() < 2e-2


CASES = [(layout, page, kvdt, mode, g, qdt, var)
         for (layout, page), (kvdt, mode), (g, qdt), var in zip(
             [("NHD", 16), ("HND", 16), ("NHD", 1), ("HND", 64), ("ragged", 1), ("NHD", 64),
              ("HND", 1), ("NHD", 16)],
             itertools.cycle([(E4M3, "tensor"), (E5M2, "head"), (E4M3, "head"),
                              (E5M2, "tensor")]),
             itertools.cycle([(8, torch.bfloat16), (1, torch.float16), (4, torch.bfloat16)]),
             itertools.cycle(["plain", "causal", "softcap_causal"]))]


@pytest.mark.parametrize("lengths", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("layout,page,kvdt,mode,g,qdt,var", CASES,
                         ids=[f"{c[0]}-p{c[1]}-{str(c[2]).split('float8_')[1]}-{c[3]}-g{c[4]}"
                              f"-{c[6]}"
                              for c in CASES])
def test_fp8_batch_matches_dequantized_reference(layout: str, page: int, kvdt: torch.dtype,
                                                 mode: str, g: int, qdt: torch.dtype, var: str,
                                                 lengths: tuple[list[int], list[int]]) -> None:
    """Decode batches (the decode form, KV warps) and mixed prefill batches (the FA2 batch
    kernel, which plans with an fp8 cache take even where FA3 would run a 16-bit one)."""
    hkv, d = 2, 128
    b = _fp8_batch(layout, page, lengths[0], lengths[1], hkv, g, d, qdt, kvdt, mode,
                   seed=page * 3 + g)
    variant = None if var == "plain" else GYM[var](1, hkv * g, 4096, d, seed=5)
    ba = BatchAttention(variant, kv_layout=layout)
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page, q_data_type=qdt, kv_data_type=kvdt)
    assert ba.tiles is not None and ba.tiles.kernel == "fa2"
    _check(ba, b, layout, page, variant)
    rec = ba.kernel_record()
    assert rec is not None and rec.kernel_name.endswith("_kve4m3" if kvdt == E4M3 else "_kve5m2")


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("kvdt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_head_dims(d: int, kvdt: torch.dtype) -> None:
    """Head dims 64 and 256: the fp8 loader's rows per pass and the widening's chunks per row
    change with D."""
    for lengths in (DECODE, MIXED):
        b = _fp8_batch("NHD", 16, lengths[0], lengths[1], 2, 4, d, torch.bfloat16, kvdt, "head",
                       seed=d)
        ba = BatchAttention(None, kv_layout="NHD")
        ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=8,
                num_kv_heads=2, head_dim=d, page_size=16, kv_data_type=kvdt)
        _check(ba, b, "NHD", 16)


@pytest.mark.parametrize("lens", [[1000, 33, 4096, 517], [9000, 33, 20000, 8200]],
                         ids=["short", "long"])
@pytest.mark.parametrize("kvdt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_bf16_queries_of_any_magnitude(kvdt: torch.dtype, lens: list[int]) -> None:
    """bf16 queries over an fp8 cache run fp16 MMAs in the decode form, Q rescaled per unit by
    a power of two (fa2_kv8.cuh, q_bf16_to_f16): the heads of one GQA group (one tile) with
    magnitudes from 1e-30 to 1e30, beyond fp16's range both ways, match the reference row by
    row, and a NaN or an inf in one head's query leaves the group's other heads exact. Short
    and long batches (two- and three-stage decode tiles, tiles.long_kv_batch)."""
    from attncc.runtime.serving.tiles import long_kv_batch

    hkv, g, d, page = 2, 8, 128, 16
    b = _fp8_batch("NHD", page, [1] * 4, lens, hkv, g, d, torch.bfloat16, kvdt, "head", seed=21)
    mags = torch.tensor([1e-30, 1e-8, 1e-3, 1.0, 30.0, 1e4, 1e12, 1e30], device="cuda")
    q = (b["q"].float() * mags.repeat(hkv).view(1, -1, 1)).bfloat16()
    q[1, 3, 7], q[2, 12, 5] = float("nan"), float("inf")
    b["q"] = q
    ba = BatchAttention(None, kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page, kv_data_type=kvdt)
    assert ba.tiles is not None and ba.tiles.kv_warps > 1  # the decode form
    assert ba.tiles.stages == (3 if long_kv_batch(torch.tensor(lens).numpy()) else 2)
    out = torch.full_like(q, float("nan"))
    ba.run(q, b["cache"], out=out, k_scale=b["k_scale"], v_scale=b["v_scale"])
    torch.cuda.synchronize()
    ref, _ = batch_attention_reference(q, b["cache"], b["qo"], b["kv_indptr"], b["kv_indices"],
                                       b["last"], page_size=page, k_scale=b["k_scale"],
                                       v_scale=b["v_scale"])
    assert torch.isnan(ref[1, 3]).all() and torch.isnan(out[1, 3]).all()  # NaN propagates
    others = torch.ones(q.shape[:2], dtype=torch.bool)
    others[1, 3] = others[2, 12] = False
    got, want = out[others].double(), ref[others]
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert float(err.max()) < 2e-2, f"worst row's relative error {float(err.max()):.3e}"


def test_fp8_refusals_before_launch() -> None:
    """A cache of another dtype than the plan's, scales with a 16-bit plan, bad scales and
    kernel='fa3' raise before any launch, naming what to change."""
    b = _fp8_batch("NHD", 16, [1, 1], [40, 70], 2, 4, 128, torch.bfloat16, E4M3, "tensor", 1)
    ba = BatchAttention(None, kv_layout="NHD")
    plan = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], kv_data_type=E5M2, **plan)
    with pytest.raises(ValueError, match="kv_data_type"):
        ba.run(b["q"], b["cache"])
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], kv_data_type=E4M3, **plan)
    with pytest.raises(attncc.InvalidArgument, match="k_scale must be positive"):
        ba.run(b["q"], b["cache"], k_scale=float("nan"))
    with pytest.raises(attncc.InvalidArgument, match="v_scale must be a float tensor"):
        ba.run(b["q"], b["cache"], v_scale=torch.ones(3, device="cuda"))
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], **plan)
    with pytest.raises(ValueError, match="kv_data_type"):
        ba.run(b["q"], b["cache"])
    bf = tuple(t.to(torch.bfloat16) for t in b["cache"])
    with pytest.raises(attncc.InvalidArgument, match="scales of an fp8 cache"):
        ba.run(b["q"], bf, k_scale=0.5)
    with pytest.raises(ValueError, match="kernel='fa3'"):
        BatchAttention(None, kernel="fa3").plan(
            b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], kv_data_type=E4M3, **plan)


def test_fp8_cuda_graph_replays_new_plans_and_scales() -> None:
    """One capture of run() with a per-head scale tensor; replays after new plans and after an
    in-place update of the scales read the new plan and the new values."""
    hkv, g, d, page, pages = 2, 8, 128, 16, 2100
    gen = torch.Generator(device="cuda").manual_seed(4)
    k = torch.randn(pages, page, hkv, d, generator=gen, device="cuda")
    v = torch.randn(pages, page, hkv, d, generator=gen, device="cuda")
    ks = torch.tensor([0.03, 0.05], device="cuda")
    vs = torch.tensor([0.04, 0.06], device="cuda")
    k8, v8 = (quantize(t, s, head_axis=2, dtype=E4M3) for t, s in ((k, ks), (v, vs)))
    q = torch.randn(8, hkv * g, d, generator=gen, device="cuda").bfloat16()
    out = torch.full_like(q, float("nan"))
    ba = BatchAttention(None, kv_layout="NHD", max_batch=8)
    ids = torch.randperm(pages, generator=torch.Generator().manual_seed(1))

    def plan(lens: list[int]) -> tuple:
        n = [-(-x // page) for x in lens]
        indptr = torch.tensor([0] + list(itertools.accumulate(n)))
        last = torch.tensor([x - (p - 1) * page for x, p in zip(lens, n)])
        qo = torch.arange(len(lens) + 1)
        ba.plan(qo, indptr, ids[:int(indptr[-1])], last, num_qo_heads=hkv * g, num_kv_heads=hkv,
                head_dim=d, page_size=page, kv_data_type=E4M3)
        return qo, indptr, ids[:int(indptr[-1])], last

    args = plan([100] * 8)
    ba.run(q, (k8, v8), out=out, k_scale=ks, v_scale=vs)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q, (k8, v8), out=out, k_scale=ks, v_scale=vs)
    for lens, new_ks in (([5, 3000, 17, 900, 1, 64, 2048, 333], None),
                         ([4000] * 8, torch.tensor([0.05, 0.01], device="cuda"))):
        args = plan(lens)
        if new_ks is not None:
            ks.copy_(new_ks)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = batch_attention_reference(q[:len(lens)], (k8, v8), *args, page_size=page,
                                           k_scale=ks, v_scale=vs)
        got = out[:len(lens)]
        assert not torch.isnan(got).any()
        assert float((got.double() - ref).norm() / ref.norm()) < 2e-2


def test_fp8_graph_replays_its_own_float_scales() -> None:
    """Float scales captured in a graph are written by the graph itself: an eager run with other
    floats between capture and replay (the instance's scale buffer then holds those) does not
    change what the replay computes."""
    hkv, g, d, page, pages = 2, 8, 128, 16, 600
    gen = torch.Generator(device="cuda").manual_seed(6)
    k8, v8 = ((torch.randn(pages, page, hkv, d, generator=gen, device="cuda") * 8).to(E4M3)
              for _ in range(2))
    q = torch.randn(4, hkv * g, d, generator=gen, device="cuda").bfloat16()
    out = torch.empty_like(q)
    ba = BatchAttention(None, kv_layout="NHD", max_batch=8)
    lens = [100, 2000, 17, 3000]
    n = [-(-x // page) for x in lens]
    args = (torch.arange(5), torch.tensor([0] + list(itertools.accumulate(n))),
            torch.randperm(pages, generator=torch.Generator().manual_seed(2))[:sum(n)],
            torch.tensor([x - (p - 1) * page for x, p in zip(lens, n)]))
    ba.plan(*args, num_qo_heads=hkv * g, num_kv_heads=hkv, head_dim=d, page_size=page,
            kv_data_type=E4M3)
    ba.run(q, (k8, v8), out=out, k_scale=0.02, v_scale=0.05)  # the buffer holds these floats
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q, (k8, v8), out=out, k_scale=0.02, v_scale=0.05)
    other = ba.run(q, (k8, v8), k_scale=0.01, v_scale=0.5)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = batch_attention_reference(q, (k8, v8), *args, page_size=page, k_scale=0.02,
                                       v_scale=0.05)
    assert not torch.isnan(out).any()
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
    assert float((other.double() - ref).norm() / ref.norm()) > 0.5


@pytest.mark.parametrize("kvdt,mode", [(E4M3, "tensor"), (E5M2, "head")],
                         ids=["e4m3-tensor", "e5m2-head"])
def test_fp8_cascade_equals_single_format(kvdt: torch.dtype, mode: str) -> None:
    """Shared prefix + suffixes over an fp8 cache == the reference over prefix+suffix pages."""
    from attncc.runtime.serving.cascade import CascadeAttention

    hkv, g, d, page, prefix = 2, 4, 128, 16, 1024
    q_lens, s_lens = [1, 3, 1, 64, 1], [1, 40, 300, 64, 2000]
    gen = torch.Generator(device="cuda").manual_seed(11)
    pre_pages, s_pages = prefix // page, [-(-n // page) for n in s_lens]
    total = pre_pages + sum(s_pages)
    perm = torch.randperm(total + 5, generator=torch.Generator().manual_seed(3))[:total]
    ks, vs = _scales(mode, hkv), _scales(mode, hkv, 0.08)
    k8, v8 = (quantize(torch.randn(total + 5, page, hkv, d, generator=gen, device="cuda"),
                       _as_tensor(s, hkv), head_axis=2, dtype=kvdt) for s in (ks, vs))
    pre_ids, suf_ids = perm[:pre_pages], perm[pre_pages:]
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = torch.randn(int(qo[-1]), hkv * g, d, generator=gen, device="cuda").bfloat16()
    sptr = torch.tensor([0] + list(itertools.accumulate(s_pages)))
    slast = torch.tensor([n - (p - 1) * page for n, p in zip(s_lens, s_pages)])
    ca = CascadeAttention(GYM["causal"](1, hkv * g, 4096, d, seed=5), kv_layout="NHD")
    ca.plan(qo, prefix_indices=pre_ids, prefix_last_page_len=page, suffix_indptr=sptr,
            suffix_indices=suf_ids, suffix_last_page_len=slast, num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page, kv_data_type=kvdt)
    got = ca.run(q, (k8, v8), k_scale=ks, v_scale=vs)
    lists = [torch.cat([pre_ids, suf_ids[int(sptr[i]):int(sptr[i + 1])]]) for i in range(5)]
    ind = torch.tensor([0] + list(itertools.accumulate(len(x) for x in lists)))
    ref, _ = batch_attention_reference(q, (k8, v8), qo, ind, torch.cat(lists), slast,
                                       page_size=page, variant=ca.prefix.variant,
                                       k_scale=ks, v_scale=vs)
    assert not torch.isnan(got).any()
    assert float((got.double() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_fp8_append_then_decode(layout: str, page: int) -> None:
    """append_paged_kv_cache quantizes a step's tokens into an fp8 cache on write; a decode
    step then reads them back: == the reference on the dequantized cache, and the cache holds
    exactly torch's rounding of k / k_scale."""
    from attncc.runtime.serving.append import (append_paged_kv_cache,
                                               get_batch_indices_positions, get_seq_lens)

    hkv, g, d = 2, 4, 128
    lens = [1, 37, 500, 1024]
    n = [-(-x // page) for x in lens]
    pages = sum(n) + 4
    shape = (pages, page, hkv, d) if layout == "NHD" else (pages, hkv, page, d)
    k8 = torch.zeros(shape, dtype=E4M3, device="cuda")
    v8 = torch.zeros(shape, dtype=E4M3, device="cuda")
    indptr = torch.tensor([0] + list(itertools.accumulate(n)), device="cuda")
    ids = torch.randperm(pages, generator=torch.Generator().manual_seed(2))[:sum(n)].cuda()
    last = torch.tensor([x - (p - 1) * page for x, p in zip(lens, n)], device="cuda")
    ks, vs = torch.tensor([0.03, 0.05], device="cuda"), 0.05
    append_indptr = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda")
    nnz = sum(lens)
    b, pos = get_batch_indices_positions(append_indptr, get_seq_lens(indptr, last, page), nnz)
    gen = torch.Generator(device="cuda").manual_seed(9)
    k = torch.randn(nnz, hkv, d, generator=gen, device="cuda")
    v = torch.randn(nnz, hkv, d, generator=gen, device="cuda")
    append_paged_kv_cache(k, v, b, pos, (k8, v8), ids, indptr, last, layout, k_scale=ks,
                          v_scale=vs)
    first = (k8[ids[0], 0] if layout == "NHD" else k8[ids[0], :, 0])
    assert torch.equal(first.view(torch.uint8), (k[0] / ks.view(2, 1)).to(E4M3).view(torch.uint8))
    q = torch.randn(len(lens), hkv * g, d, generator=gen, device="cuda").bfloat16()
    ba = BatchAttention(None, kv_layout=layout)
    ba.plan(torch.arange(len(lens) + 1), indptr.cpu(), ids.cpu(), last.cpu(),
            num_qo_heads=hkv * g, num_kv_heads=hkv, head_dim=d, page_size=page,
            kv_data_type=E4M3)
    out = torch.full_like(q, float("nan"))
    ba.run(q, (k8, v8), out=out, k_scale=ks, v_scale=vs)
    ref, _ = batch_attention_reference(q, (k8, v8), torch.arange(len(lens) + 1), indptr.cpu(),
                                       ids.cpu(), last.cpu(), kv_layout=layout, page_size=page,
                                       k_scale=ks, v_scale=vs)
    assert not torch.isnan(out).any()
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("mode", ["tensor", "head"])
@pytest.mark.parametrize("kvdt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_flex_attention(kvdt: torch.dtype, mode: str) -> None:
    """flex_attention with bf16 q and fp8 k/v + scales (causal, GQA, return_lse) == the fp64
    reference on the dequantized k/v."""
    B, hq, hkv, S, d = 2, 8, 2, 700, 128
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(B, hq, S, d, generator=gen, device="cuda").bfloat16()
    ks, vs = _scales(mode, hkv), _scales(mode, hkv, 0.08)
    k8, v8 = (quantize(torch.randn(B, hkv, S, d, generator=gen, device="cuda"),
                       _as_tensor(s, hkv), head_axis=1, dtype=kvdt) for s in (ks, vs))
    causal = attncc.Variant(mask_mod=lambda b, h, qi, ki: qi >= ki, name="causal")
    out, lse = attncc.flex_attention(q, k8, v8, causal, enable_gqa=True, return_lse=True,
                                     k_scale=ks, v_scale=vs)
    kd = dequantize(k8, _as_tensor(ks, hkv), head_axis=1)
    vd = dequantize(v8, _as_tensor(vs, hkv), head_axis=1)
    ir, bindings = causal.trace()
    ref, ref_lse = attention_reference(q.double(), kd, vd, ir, bindings, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
    assert (lse.double() - ref_lse.double()).abs().max().item() < 2e-2
