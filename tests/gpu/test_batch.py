"""BatchAttention (serving/batch.py, kernels/fa2/fa2_batch.cuh) against the fp64 batch reference.

Paged caches (NHD and HND, page sizes 1, 16 and 64) and ragged caches; batches mixing decode
(1 query), speculative (4) and prefill chunks with KV lengths from 1 to 32K; GQA groups 1, 4, 8;
variants causal, softcap, sliding window, ALiBi and RoPE (query/key mods). Outputs are poisoned
before every run and must be fully written; relative error < 2e-2, no NaN. Plus: bitwise-equal
outputs over 20 runs, and one CUDA graph replayed with three different plans.
"""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import attncc
from attncc.runtime.serving import batch as batch_module
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from attncc.gym import GYM

pytestmark = pytest.mark.gpu

VARIANTS = ("plain", "causal", "softcap_causal", "sliding_window", "alibi_causal", "rope")
MIXED = ([1, 4, 1, 300, 1, 64, 1000, 1], [1, 17, 4096, 300, 2000, 600, 1000, 32768])
DECODE = ([1] * 12, [1, 5, 16, 17, 100, 511, 1024, 1500, 2048, 3000, 4095, 8192])


def _variant(name: str, hq: int, d: int) -> attncc.Variant | None:
    if name == "plain":
        return None
    if name == "value_output":  # the value and output hooks, reading other vector elements
        return attncc.Variant(value_mod=lambda v, b, h, kv, i: v[i] - 0.5 * v[(i + 1) % d],
                              output_mod=lambda o, b, h, q, i: 2.0 * o[i] + o[d - 1 - i],
                              name="value_output")
    return GYM[name](1, hq, 4096, d, seed=5)


def _batch(layout: str, page: int, q_lens: list[int], kv_lens: list[int], hkv: int, g: int,
           d: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """Random q and KV cache for the lengths; page ids shuffled, with unused pages between."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = rnd(int(qo[-1]), hkv * g, d)
    if layout == "ragged":
        kv = torch.tensor([0] + list(itertools.accumulate(kv_lens)))
        k, v = rnd(int(kv[-1]), hkv, d), rnd(int(kv[-1]), hkv, d)
        return dict(q=q, cache=(k, v), qo=qo, kv_indptr=kv, kv_indices=None, last=None)
    n_pages = [-(-n // page) for n in kv_lens]
    total = sum(n_pages)
    perm = torch.randperm(2 * total + 3, generator=torch.Generator().manual_seed(seed))[:total]
    shape = ((2 * total + 3, page, hkv, d) if layout == "NHD" else (2 * total + 3, hkv, page, d))
    k, v = rnd(*shape), rnd(*shape)
    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
    last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, n_pages)])
    return dict(q=q, cache=(k, v), qo=qo, kv_indptr=indptr, kv_indices=perm, last=last)


def _check(ba: BatchAttention, b: dict[str, Any], variant: Any, layout: str, page: int) -> None:
    out = torch.full_like(b["q"], float("nan"))
    lse = torch.full(b["q"].shape[:2], float("nan"), device="cuda")
    softmax = variant is None or variant.normalize == "softmax"
    ba.run(b["q"], b["cache"], out=out, lse=lse if softmax else None)
    torch.cuda.synchronize()
    ref, ref_lse = batch_attention_reference(b["q"], b["cache"], b["qo"], b["kv_indptr"],
                                             b["kv_indices"], b["last"], kv_layout=layout,
                                             page_size=page, variant=variant)
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs unwritten/NaN"
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3e}"
    if softmax:
        live = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), live)
        assert (lse[live].double() - ref_lse[live]).abs().max().item() < 2e-2


CASES = [(layout, page, var, g, dt)
         for (layout, page), var, (g, dt) in zip(
             itertools.cycle([("NHD", 16), ("HND", 16), ("NHD", 1), ("HND", 64), ("ragged", 1),
                              ("NHD", 64), ("HND", 1)]),
             VARIANTS * 2,
             itertools.cycle([(1, torch.bfloat16), (4, torch.float16), (8, torch.bfloat16)]))]


@pytest.mark.parametrize("kernel", ["fa2", None], ids=["fa2", "default"])
@pytest.mark.parametrize("lengths", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("layout,page,var,g,dtype", CASES,
                         ids=[f"{c[0]}-p{c[1]}-{c[2]}-g{c[3]}" for c in CASES])
def test_batch_matches_reference(layout: str, page: int, var: str, g: int, dtype: torch.dtype,
                                 lengths: tuple[list[int], list[int]], kernel: str | None) -> None:
    """Every case with the FA2 batch kernel forced, and with the default choice (on an sm_90
    GPU the FA3 batch kernel for the prefill-shaped cases it can run; the others repeat FA2 and
    are skipped)."""
    hkv, d = 2, 128
    b = _batch(layout, page, lengths[0], lengths[1], hkv, g, d, dtype, seed=len(var) * 7 + g)
    variant = _variant(var, hkv * g, d)
    ba = BatchAttention(variant, kv_layout=layout, kernel=kernel)
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page, q_data_type=dtype)
    assert ba.tiles is not None
    if kernel is None and ba.tiles.kernel == "fa2":
        pytest.skip("the default kernel for this case is FA2, which the 'fa2' run covers")
    _check(ba, b, variant, layout, page)


def _cache_and_queries(seed: int, cache_pages: int, page: int, hkv: int, g: int, d: int,
                       rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random bf16 NHD cache (k, v) of `cache_pages` pages and `rows` query rows, drawn in
    that order from one CUDA generator seeded `seed` (static buffers of the capture tests)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(cache_pages, page, hkv, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(cache_pages, page, hkv, d, generator=gen, device="cuda").bfloat16()
    q = torch.randn(rows, hkv * g, d, generator=gen, device="cuda").bfloat16()
    return k, v, q


def _plan_on_cache(ba: BatchAttention, q_lens: list[int], kv_lens: list[int], cache_pages: int,
                   page: int, hkv: int, g: int, d: int, seed: int) -> dict[str, Any]:
    """Plan `ba` for the lengths over random page ids of an existing NHD cache; returns the
    arrays the reference needs."""
    n_pages = [-(-n // page) for n in kv_lens]
    ids = torch.randperm(cache_pages, generator=torch.Generator().manual_seed(seed))
    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    ba.plan(qo, indptr, ids[:int(indptr[-1])], last, num_qo_heads=hkv * g, num_kv_heads=hkv,
            head_dim=d, page_size=page)
    return dict(qo=qo, kv_indptr=indptr, kv_indices=ids[:int(indptr[-1])], last=last)


# Prefill-shaped batches for the FA3 batch kernel (kernels/fa3/fa3_batch.cuh; sm_90 only): long
# chunks with odd lengths (partial query tiles, partial last KV tiles, splits merged), a decode
# row and a 1-token KV request among them.
PREFILL = ([300, 1, 4096, 129, 1000, 17], [300, 5, 32768, 1000, 1000, 17])
FA3_CASES = [("NHD", 16, "plain", 1, 128, torch.bfloat16),
             ("HND", 16, "causal", 4, 128, torch.float16),
             ("NHD", 64, "softcap_causal", 8, 128, torch.bfloat16),
             ("ragged", 1, "alibi_causal", 1, 128, torch.bfloat16),
             ("HND", 128, "sliding_window", 4, 64, torch.float16),
             ("NHD", 256, "causal", 2, 64, torch.bfloat16),
             # transforms: Q per unit, K/V per tile in shared memory, O staged (split units
             # leave it to the merge kernel)
             ("NHD", 16, "rope", 4, 128, torch.bfloat16),
             ("ragged", 1, "value_output", 2, 128, torch.float16),
             ("HND", 64, "value_output", 8, 64, torch.bfloat16)]


def _needs_sm90() -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 batch kernel needs an sm_90 GPU")


@pytest.mark.parametrize("layout,page,var,g,d,dtype", FA3_CASES,
                         ids=[f"{c[0]}-p{c[1]}-{c[2]}-g{c[3]}-d{c[4]}-{str(c[5])[6:]}"
                              for c in FA3_CASES])
def test_fa3_batch_matches_reference(layout: str, page: int, var: str, g: int, d: int,
                                     dtype: torch.dtype) -> None:
    _needs_sm90()
    hkv = 2
    b = _batch(layout, page, PREFILL[0], PREFILL[1], hkv, g, d, dtype, seed=len(var) + 3 * g + d)
    variant = _variant(var, hkv * g, d)
    ba = BatchAttention(variant, kv_layout=layout, kernel="fa3")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page, q_data_type=dtype)
    assert ba.tiles is not None and ba.tiles.kernel == "fa3"
    _check(ba, b, variant, layout, page)


# Variants whose FA3 batch kernel runs the low-pressure form (the first compile spills), against
# the reference. The hooks' b is the request, so the variants are made for the batch's 4
# requests (document ids [4, 4096]); lengths stay within the 4096 positions their tables cover.
# Every one is spill-free as used: relative_bias through the epilogue's recomputed rows, the
# document variants through the mask bits computed when a tile lands (docs/journal/2026-12-01.md,
# "document mask bits").
LOW_PRESSURE_CASES = [("relative_bias", 128), ("relative_bias", 64), ("document_causal", 64),
                      ("document_causal", 128), ("document_mask", 128)]


@pytest.mark.parametrize("var,d", LOW_PRESSURE_CASES,
                         ids=[f"{v}-d{d}" for v, d in LOW_PRESSURE_CASES])
def test_fa3_batch_low_pressure_variants_match_reference(var: str, d: int) -> None:
    _needs_sm90()
    hkv, g = 2, 4
    b = _batch("NHD", 16, [300, 1, 1000, 129], [300, 5, 4096, 1000], hkv, g, d, torch.bfloat16,
               seed=len(var) + d)
    variant = GYM[var](4, hkv * g, 4096, d, seed=5)
    ba = BatchAttention(variant, kv_layout="NHD", kernel="fa3")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=16, q_data_type=torch.bfloat16)
    assert ba.tiles is not None and ba.tiles.kernel == "fa3"
    _check(ba, b, variant, "NHD", 16)
    rec = ba.kernel_record()
    assert rec is not None and rec.spill_bytes == 0 and rec.local_bytes == 0, (var, d, rec)


def test_fa3_batch_is_the_prefill_default_and_bitwise_stable() -> None:
    """On sm_90, a bf16 prefill batch runs the FA3 batch kernel by default (decode batches stay
    on FA2), transform variants too; 20 runs give the same bits although the 32K request is
    split across CTAs and merged."""
    _needs_sm90()
    b = _batch("NHD", 16, *PREFILL, 2, 1, 128, torch.bfloat16, seed=2)
    ba = BatchAttention(_variant("causal", 2, 128), kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=2, num_kv_heads=2,
            head_dim=128, page_size=16)
    assert ba.tiles is not None and ba.tiles.kernel == "fa3"
    assert ba._plan is not None and ba._plan.num_merges > 0
    _check(ba, b, _variant("causal", 2, 128), "NHD", 16)
    first = ba.run(b["q"], b["cache"]).clone()
    for _ in range(19):
        assert torch.equal(ba.run(b["q"], b["cache"]), first)
    heads = dict(num_qo_heads=2, num_kv_heads=2, head_dim=128, page_size=16)
    rope = BatchAttention(_variant("rope", 2, 128), kv_layout="NHD")
    rope.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], **heads)
    assert rope.tiles is not None and rope.tiles.kernel == "fa3"  # query/key transforms too
    _check(rope, b, _variant("rope", 2, 128), "NHD", 16)
    with pytest.raises(ValueError, match=r"kernel='fa3'\) needs bf16 or fp16 queries"):
        BatchAttention(_variant("rope", 2, 128), kv_layout="NHD", kernel="fa3").plan(
            b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], **heads,
            q_data_type=torch.float32)


# An MHA decode batch (Hkv 32) large enough that its decode rows' units cover several KV heads
# (the scheduler's docstring, "Head spans"), with split long requests (one head per unit), 4-token
# speculative rows and a 1-token request among them.
SPAN_Q = [1] * 90 + [4] * 6
SPAN_KV = ([1 + (37 * i) % 2048 for i in range(88)] + [30000, 20000]
           + [64, 300, 1000, 1500, 2047, 4])


@pytest.mark.parametrize("var", ["plain", "alibi_causal", "value_output"])
def test_mha_decode_units_span_kv_heads(var: str) -> None:
    """The FA2 batch kernel runs a unit's KV heads one after another: every head's rows must be
    written, with the per-head hooks (ALiBi slopes, the value/output transforms) of that head."""
    hkv, g, d = 32, 1, 128
    b = _batch("NHD", 16, SPAN_Q, SPAN_KV, hkv, g, d, torch.bfloat16, seed=23)
    variant = _variant(var, hkv * g, d)
    ba = BatchAttention(variant, kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=16)
    assert ba.tiles is not None and ba.tiles.kernel == "fa2"
    units = ba._plan.units
    assert units["kv_heads"].max() > 1 and (units["slot"] >= 0).any()
    _check(ba, b, variant, "NHD", 16)


@pytest.mark.parametrize("d", [64, 256])
def test_other_head_dims(d: int) -> None:
    b = _batch("NHD", 16, MIXED[0][:6], MIXED[1][:6], 2, 4, d, torch.bfloat16, seed=d)
    variant = _variant("softcap_causal", 8, d)
    ba = BatchAttention(variant, kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=8, num_kv_heads=2,
            head_dim=d, page_size=16)
    _check(ba, b, variant, "NHD", 16)


def test_runs_are_bitwise_equal() -> None:
    """Same plan, 20 runs: split KV ranges are merged in a fixed order, so bits never change."""
    b = _batch("NHD", 16, *MIXED, 2, 4, 128, torch.bfloat16, seed=1)
    ba = BatchAttention(_variant("causal", 8, 128), kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=8, num_kv_heads=2,
            head_dim=128, page_size=16)
    assert ba._plan is not None and ba._plan.num_merges > 0  # the batch does split
    first = ba.run(b["q"], b["cache"]).clone()
    for _ in range(19):
        assert torch.equal(ba.run(b["q"], b["cache"]), first)


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_merge_kernel_waits_for_the_attention_kernel(kernel: str) -> None:
    """The merge kernel is launched with programmatic dependent launch (it may start during the
    attention kernel, runtime/jit/launcher.py `pdl`): with new queries before every run -- eager and
    graph replays -- it must merge this run's partial states, not the last run's, and give the
    bits of a plain launch."""
    if kernel == "fa3":
        _needs_sm90()
        q_lens, kv_lens, g = [300, 129, 1], [9000, 4000, 12000], 4
    else:  # GQA-8 decode of long requests: many parts per item, merged by the merge kernel
        q_lens, kv_lens, g = [1] * 6, [30000, 9000, 1, 4000, 17, 12000], 8
    b = _batch("NHD", 16, q_lens, kv_lens, 2, g, 128, torch.bfloat16, seed=3)
    ba = BatchAttention(_variant("causal", 2 * g, 128), kv_layout="NHD", kernel=kernel)
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=2 * g,
            num_kv_heads=2, head_dim=128, page_size=16)
    assert ba._plan is not None and ba._plan.num_merges > 0
    gen = torch.Generator(device="cuda").manual_seed(11)
    q_buf, out_buf = b["q"].clone(), torch.empty_like(b["q"])
    ba.run(q_buf, b["cache"], out=out_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q_buf, b["cache"], out=out_buf)
    for i in range(4):
        q_buf.copy_(torch.randn(q_buf.shape, generator=gen, device="cuda"))
        out_buf.fill_(float("nan"))
        if i % 2:
            graph.replay()
        else:
            ba.run(q_buf, b["cache"], out=out_buf)
        ba._pdl = False
        plain = ba.run(q_buf, b["cache"])
        ba._pdl = True
        torch.cuda.synchronize()
        assert torch.equal(out_buf, plain), i
        ref, _ = batch_attention_reference(q_buf, b["cache"], b["qo"], b["kv_indptr"],
                                           b["kv_indices"], b["last"], page_size=16,
                                           variant=ba.variant)
        assert float((out_buf.double() - ref).norm() / ref.norm()) < 2e-2, i


# (kernel, variant, GQA group, three batches of (q_lens, kv_lens), query rows of the buffers)
GRAPH_CASES = {
    "decode": (None, "causal", 8, [([1] * 8, [4000, 17, 300, 1, 2048, 900, 64, 5]),
                                   ([1] * 5, [33, 3000, 1, 777, 12000]),
                                   ([1] * 8, [100] * 8)], 64),
    "fa3-prefill": ("fa3", "softcap_causal", 4, [([512, 300], [4000, 300]),
                                                 ([129, 1, 700], [129, 3000, 12000]),
                                                 ([1000], [1000])], 1024),
}


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_cuda_graph_replays_new_plans(case: str) -> None:
    """run captured once (static q / out buffers with more rows than any plan), then three
    plans with different lengths, each replayed and checked."""
    kernel, var, g, batches, rows = GRAPH_CASES[case]
    if kernel == "fa3":
        _needs_sm90()
    hkv, d, page, cache_pages = 2, 128, 16, 2048
    variant = _variant(var, hkv * g, d)
    k, v, q_buf = _cache_and_queries(0, cache_pages, page, hkv, g, d, rows)
    out_buf = torch.empty_like(q_buf)
    ba = BatchAttention(variant, kv_layout="NHD", max_batch=16, max_qo_tokens=rows,
                        kernel=kernel)
    _plan_on_cache(ba, *batches[0], cache_pages, page, hkv, g, d, seed=0)
    ba.run(q_buf, (k, v), out=out_buf)  # compile, load (and encode TMA maps) before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q_buf, (k, v), out=out_buf)
    for i in range(3):
        meta = _plan_on_cache(ba, *batches[i], cache_pages, page, hkv, g, d, seed=i)
        assert ba.tiles is not None and (kernel is None or ba.tiles.kernel == kernel)
        n = int(meta["qo"][-1])
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = batch_attention_reference(q_buf[:n], (k, v), meta["qo"], meta["kv_indptr"],
                                           meta["kv_indices"], meta["last"], page_size=page,
                                           variant=variant)
        got = out_buf[:n]
        assert not torch.isnan(got).any()
        assert float((got.double() - ref).norm() / ref.norm()) < 2e-2, i


def test_replan_after_capture_needing_another_kernel_raises() -> None:
    """A graph captured on a decode plan (16-row tiles) holds the decode kernel: a multi-token
    plan (32 fused rows) and a prefill chunk raise in plan(), naming the tiles, before they
    become current; the graph still replays the last good plan correctly after both."""
    hkv, g, d, page, cache_pages = 2, 4, 128, 16, 1024
    variant = _variant("causal", hkv * g, d)
    k, v, q_buf = _cache_and_queries(2, cache_pages, page, hkv, g, d, 64)
    out_buf = torch.empty_like(q_buf)
    ba = BatchAttention(variant, kv_layout="NHD", max_batch=16, max_qo_tokens=64)
    _plan_on_cache(ba, [1] * 4, [300, 17, 4000, 64], cache_pages, page, hkv, g, d, seed=0)
    ba.run(q_buf, (k, v), out=out_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q_buf, (k, v), out=out_buf)
    meta = _plan_on_cache(ba, [1] * 6, [5, 900, 2048, 1, 77, 3000], cache_pages, page, hkv, g,
                          d, seed=1)
    tiles = ba.tiles
    for q_lens, kv_lens in (([8] * 4, [300] * 4), ([60], [2000])):
        with pytest.raises(ValueError, match="CUDA graph captured run.*tiles / form"):
            _plan_on_cache(ba, q_lens, kv_lens, cache_pages, page, hkv, g, d, seed=2)
        assert ba.tiles is tiles
    out_buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = batch_attention_reference(q_buf[:6], (k, v), meta["qo"], meta["kv_indptr"],
                                       meta["kv_indices"], meta["last"], page_size=page,
                                       variant=variant)
    got = out_buf[:6]
    assert not torch.isnan(got).any()
    assert float((got.double() - ref).norm() / ref.norm()) < 2e-2


def test_long_requests_take_three_stages_and_replay_a_short_capture() -> None:
    """Batches averaging LONG_KV_KEYS keys or more run three-stage decode tiles, correctly; a
    graph captured on a short batch keeps its two-stage kernel when the batch grows past the
    threshold, and its replay of the long plan is correct (runtime/serving/tiles.py)."""
    from attncc.runtime.serving.tiles import LONG_KV_KEYS

    hkv, g, d, page, cache_pages = 2, 4, 128, 16, 4096
    variant = _variant("causal", hkv * g, d)
    k, v, q_buf = _cache_and_queries(3, cache_pages, page, hkv, g, d, 16)
    long_lens = [LONG_KV_KEYS + 1000, LONG_KV_KEYS - 3, 2 * LONG_KV_KEYS + 17, 9000]

    def check(ba: BatchAttention, meta: dict[str, Any], got: torch.Tensor) -> None:
        n = len(meta["qo"]) - 1
        ref, _ = batch_attention_reference(q_buf[:n], (k, v), meta["qo"], meta["kv_indptr"],
                                           meta["kv_indices"], meta["last"], page_size=page,
                                           variant=variant)
        assert not torch.isnan(got[:n]).any()
        assert float((got[:n].double() - ref).norm() / ref.norm()) < 2e-2

    eager = BatchAttention(variant, kv_layout="NHD", max_batch=16, max_qo_tokens=16)
    meta = _plan_on_cache(eager, [1] * 4, long_lens, cache_pages, page, hkv, g, d, seed=0)
    assert eager.tiles.stages == 3
    out = torch.full_like(q_buf, float("nan"))
    eager.run(q_buf[:4], (k, v), out=out[:4])
    check(eager, meta, out)

    ba = BatchAttention(variant, kv_layout="NHD", max_batch=16, max_qo_tokens=16)
    _plan_on_cache(ba, [1] * 4, [300, 17, 4000, 64], cache_pages, page, hkv, g, d, seed=1)
    out_buf = torch.empty_like(q_buf)
    ba.run(q_buf[:4], (k, v), out=out_buf[:4])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q_buf[:4], (k, v), out=out_buf[:4])
    tiles = ba.tiles
    meta = _plan_on_cache(ba, [1] * 4, long_lens, cache_pages, page, hkv, g, d, seed=2)
    assert ba.tiles is tiles and tiles.stages == 2
    out_buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(ba, meta, out_buf)


def test_invalid_input_raises_before_launch() -> None:
    ba = BatchAttention(None, kv_layout="NHD")
    kw = dict(num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=16)
    with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
        ba.plan([0, 1, 2], [0, 3, 2], [0, 1, 2], [16, 16], **kw)
    with pytest.raises(ValueError, match="negative page id"):
        ba.plan([0, 1], [0, 2], [0, -1], [16], **kw)
    ba.plan([0, 1], [0, 2], [0, 9], [5], **kw)
    k = torch.zeros(4, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache has shape"):  # page 9 is past the cache
        ba.run(q, (k, k.clone()))
    with pytest.raises(ValueError, match="q must be"):
        ba.run(q[:, :2], (torch.zeros(10, 16, 2, 128, device="cuda", dtype=torch.bfloat16),) * 2)


@pytest.mark.parametrize("var,page,g", [("causal", 16, 4), ("alibi_causal", 16, 1),
                                        ("softcap_causal", 1, 8), ("rope", 64, 4),
                                        ("plain", 16, 1), ("sigmoid", 16, 2)])
def test_cascade_equals_single_format(var: str, page: int, g: int) -> None:
    """Shared prefix + suffixes, merged, == one BatchAttention over prefix+suffix page lists."""
    from attncc.runtime.serving.cascade import CascadeAttention

    hkv, d, prefix = 2, 128, 1024
    q_lens, s_lens = [1, 3, 1, 64, 1], [1, 40, 300, 64, 2000]
    variant = _variant(var, hkv * g, d)
    gen = torch.Generator(device="cuda").manual_seed(11)
    pre_pages = -(-prefix // page)
    s_pages = [-(-n // page) for n in s_lens]
    total = pre_pages + sum(s_pages)
    perm = torch.randperm(total + 5, generator=torch.Generator().manual_seed(3))[:total]
    k = torch.randn(total + 5, page, hkv, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(total + 5, page, hkv, d, generator=gen, device="cuda").bfloat16()
    if prefix % page:  # the single format needs whole prefix pages before each suffix
        pytest.skip("prefix must fill its pages for the single-format comparison")
    pre_ids, suf_ids = perm[:pre_pages], perm[pre_pages:]
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = torch.randn(int(qo[-1]), hkv * g, d, generator=gen, device="cuda").bfloat16()
    sptr = torch.tensor([0] + list(itertools.accumulate(s_pages)))
    slast = torch.tensor([n - (p - 1) * page for n, p in zip(s_lens, s_pages)])
    ca = CascadeAttention(variant, kv_layout="NHD")
    ca.plan(qo, prefix_indices=pre_ids, prefix_last_page_len=page, suffix_indptr=sptr,
            suffix_indices=suf_ids, suffix_last_page_len=slast, num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page)
    got = ca.run(q, (k, v))
    # single format: each request's page list is the prefix pages followed by its own
    lists = [torch.cat([pre_ids, suf_ids[int(sptr[i]):int(sptr[i + 1])]]) for i in range(5)]
    ind = torch.tensor([0] + list(itertools.accumulate(len(x) for x in lists)))
    ids = torch.cat(lists)
    ref, _ = batch_attention_reference(q, (k, v), qo, ind, ids, slast, page_size=page,
                                       variant=variant)
    assert not torch.isnan(got).any()
    assert float((got.double() - ref).norm() / ref.norm()) < 2e-2
