"""BatchAttention.run under torch.compile on the CPU, through attncc::batch_attention_run
(runtime/serving/ops.py; docs/compile.md): every feature run() takes eagerly -- fp8 e4m3 / e5m2
caches with float and per-head scales, attention sinks, tree masks (custom and packed),
return_lse, the three layouts, a variant reading a captured tensor -- traces with zero graph
breaks and gives eager's bits (a CPU plan's run is the float64 reference); opcheck passes with
every optional input. tests/gpu/test_compile_gpu.py runs the kernels so."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import attncc
from attncc.errors import InvalidArgument
from attncc.runtime.kv8 import quantize
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from tests.helpers.trees import packed, tree_batch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HKV, G, D, PAGE = 2, 2, 64, 16


def _cache(layout: str, kv_lens: list[int], kv8: torch.dtype | None, gen: torch.Generator):
    """(k, v, kv_indptr, kv_indices, kv_last_page_len) of random requests (paged caches with
    shuffled pages and a spare one; ragged: token CSR), fp8 through runtime/kv8.quantize."""
    if layout == "ragged":
        indptr = torch.tensor([0, *itertools.accumulate(kv_lens)])
        shape, pages, last, axis = (int(indptr[-1]) + 3, HKV, D), None, None, 1
    else:
        n_pages = [-(-n // PAGE) for n in kv_lens]
        indptr = torch.tensor([0, *itertools.accumulate(n_pages)])
        pages = torch.randperm(int(indptr[-1]) + 1, generator=gen)[:int(indptr[-1])]
        last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, n_pages)])
        per_page = (PAGE, HKV, D) if layout == "NHD" else (HKV, PAGE, D)
        shape, axis = (int(indptr[-1]) + 1, *per_page), 2 if layout == "NHD" else 1
    k, v = (torch.randn(shape, generator=gen) for _ in range(2))
    if kv8 is None:
        return k.bfloat16(), v.bfloat16(), indptr, pages, last
    s = torch.full((HKV,), 0.5)
    return (quantize(k, s, head_axis=axis, dtype=kv8), quantize(v, s, head_axis=axis, dtype=kv8),
            indptr, pages, last)


def _sinks(kind: str | None) -> torch.Tensor | None:
    if kind is None:
        return None
    s = torch.linspace(-1.0, 2.0, HKV * G)
    return s if kind == "f32" else s.bfloat16()


def _slopes_variant() -> attncc.Variant:
    slopes = torch.tensor([0.5 ** (h + 1) for h in range(HKV * G)])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return attncc.Variant(score_mod=alibi, mask_mod=causal, name="op_alibi")


# name: (layout, q_lens, kv_lens, kv8, scales, sinks, mask, variant)
CASES = {
    "plain-nhd": ("NHD", [1, 3, 2], [20, 5, 40], None, None, None, None, None),
    "hnd-alibi": ("HND", [1, 4], [37, 16], None, None, None, None, "alibi"),
    "ragged-sinks": ("ragged", [2, 1], [9, 30], None, None, "f32", None, None),
    "sinks-bf16": ("NHD", [1, 1, 1], [17, 1, 64], None, None, "bf16", None, "alibi"),
    "e4m3-float": ("NHD", [1, 2], [33, 18], E4M3, "float", None, None, None),
    "e4m3-head": ("HND", [1, 2], [33, 18], E4M3, "head", "f32", None, None),
    "e5m2-float": ("NHD", [3, 1], [40, 7], E5M2, "float", None, None, None),
    "e5m2-head": ("NHD", [3, 1], [40, 7], E5M2, "head", "bf16", None, None),
    "tree": ("NHD", [4, 8], [30, 21], None, None, None, "custom", "alibi"),
    "tree-packed-sinks": ("NHD", [5, 2], [19, 40], None, None, "f32", "packed", None),
}


def _setup(case: str, seed: int = 0):
    """A CPU BatchAttention planned on `case`'s batch, and run()'s arguments."""
    layout, ql, kvl, kv8, scales, sinks, mask, var = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    k, v, indptr, pages, last = _cache(layout, kvl, kv8, gen)
    qo = torch.tensor([0, *itertools.accumulate(ql)])
    variant = _slopes_variant() if var == "alibi" else None
    masks: dict = {}
    if mask is not None:
        m, _ = tree_batch(ql, kvl, seed)
        masks = ({"custom_mask": torch.from_numpy(m)} if mask == "custom"
                 else {"packed_custom_mask": torch.from_numpy(packed(m, ql, kvl))})
    ba = BatchAttention(variant, kv_layout=layout, device="cpu", max_batch=8, max_qo_tokens=64)
    ba.plan(qo, indptr, pages, last, num_qo_heads=HKV * G, num_kv_heads=HKV, head_dim=D,
            page_size=PAGE, kv_data_type=kv8, **masks)
    q = torch.randn(int(qo[-1]) + 2, HKV * G, D, generator=gen).bfloat16()  # 2 spare rows
    kw: dict = {"sinks": _sinks(sinks)}
    if scales == "float":
        kw.update(k_scale=0.5, v_scale=0.25)
    elif scales == "head":
        kw.update(k_scale=torch.tensor([0.5, 0.75]), v_scale=torch.tensor([0.25, 2.0]))
    plan = dict(qo=qo, kv_indptr=indptr, kv_indices=pages, last=last, masks=masks)
    return ba, q, (k, v), kw, plan


def _reference(ba: BatchAttention, q, cache, kw: dict, plan: dict):
    out, lse = batch_attention_reference(
        q[:int(plan["qo"][-1])], cache, plan["qo"], plan["kv_indptr"], plan["kv_indices"],
        plan["last"], kv_layout=ba.kv_layout, page_size=PAGE, variant=ba.variant,
        **plan["masks"], **kw)
    return out, lse


@pytest.mark.parametrize("return_lse", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_compiled_run_is_eager_run(case: str, return_lse: bool) -> None:
    """fullgraph with zero graph breaks; the compiled step's out (and lse) are eager run()'s
    bits, and those are the reference's (in q's dtype); spare q rows give zeros / -inf."""
    ba, q, (k, v), kw, plan = _setup(case)

    def step(q, k, v):
        return ba.run(q, (k, v), return_lse=return_lse, **kw)

    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(q, k, v).graph_break_count == 0
    got = torch.compile(step, fullgraph=True)(q, k, v)
    want = step(q, k, v)
    got, want = (got, want) if return_lse else ((got, None), (want, None))
    n = int(plan["qo"][-1])
    ref, ref_lse = _reference(ba, q, (k, v), kw, plan)
    assert got[0].dtype == q.dtype and torch.equal(got[0], want[0])
    assert torch.equal(got[0][:n], ref.to(q.dtype)) and not got[0][n:].any()
    if return_lse:
        assert got[1].dtype == torch.float32 and torch.equal(got[1], want[1])
        assert torch.equal(got[1][:n], ref_lse.float()) and bool((got[1][n:] == -math.inf).all())


def test_compiled_run_reads_each_new_plan_dynamic() -> None:
    """One dynamic=True graph serves later plans with other token counts and KV lengths (the
    op reads the latest plan), a new per-head scale tensor, and a new tree mask."""
    ba, q, (k, v), kw, plan = _setup("e4m3-head")

    @torch.compile(fullgraph=True, dynamic=True)
    def step(q, k, v, ks, vs):
        return ba.run(q, (k, v), return_lse=True, k_scale=ks, v_scale=vs)

    for i, (ql, kvl) in enumerate([([1, 2], [33, 18]), ([1, 1, 3], [5, 60, 12]), ([2], [3])]):
        gen = torch.Generator().manual_seed(10 + i)
        k, v, indptr, pages, last = _cache("HND", kvl, E4M3, gen)
        qo = torch.tensor([0, *itertools.accumulate(ql)])
        ba.plan(qo, indptr, pages, last, num_qo_heads=HKV * G, num_kv_heads=HKV, head_dim=D,
                page_size=PAGE, kv_data_type=E4M3)
        q = torch.randn(int(qo[-1]), HKV * G, D, generator=gen).bfloat16()
        ks, vs = torch.rand(HKV, generator=gen) + 0.1, torch.rand(HKV, generator=gen) + 0.1
        out, lse = step(q, k, v, ks, vs)
        ref, ref_lse = batch_attention_reference(q, (k, v), qo, indptr, pages, last,
                                                 kv_layout="HND", page_size=PAGE, k_scale=ks,
                                                 v_scale=vs)
        assert torch.equal(out, ref.to(q.dtype)) and torch.equal(lse, ref_lse.float()), i


def test_compiled_run_without_softmax() -> None:
    """A normalize='none' variant: out only (the op's lse is zeros), return_lse raises."""
    ba, q, (k, v), _, plan = _setup("plain-nhd")
    ba.variant = attncc.Variant(normalize="none", name="op_linear")
    ba._ir = None
    step = torch.compile(lambda q, k, v: ba.run(q, (k, v)), fullgraph=True)
    ref, _ = _reference(ba, q, (k, v), {}, plan)
    assert torch.equal(step(q, k, v)[:int(plan["qo"][-1])], ref.to(q.dtype))
    with pytest.raises(ValueError, match="normalize='none'"):
        ba.run(q, (k, v), return_lse=True)


@pytest.mark.parametrize("case", ["e4m3-float", "e5m2-head", "tree-packed-sinks", "sinks-bf16"])
def test_opcheck(case: str) -> None:
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) with
    the optional inputs the case passes, as compiled_run passes them."""
    ba, q, (k, v), kw, _ = _setup(case)
    s = kw["sinks"].float() if kw["sinks"] is not None else None
    ks, vs = kw.get("k_scale"), kw.get("v_scale")
    tensors = (ks, vs) if isinstance(ks, torch.Tensor) else (None, None)
    floats = (ks, vs) if isinstance(ks, float) else (None, None)
    # (test_schema's mutation check compares the inputs with allclose, which torch lacks for
    # fp8 tensors; the op's schema is the same whatever the cache's dtype, and the 16-bit
    # cases check it)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.attncc.batch_attention_run.default,
                          (q, [k, v], ba.op_handle, None, s, *tensors, *floats),
                          test_utils=utils if k.dtype in (E4M3, E5M2) else
                          (*utils, "test_schema"))


def test_bad_scales_raise_under_compile() -> None:
    """Scales on a 16-bit plan, a bad per-head scale and a bool scale raise naming the
    argument, compiled as eager."""
    ba, q, (k, v), _, _ = _setup("plain-nhd")
    for scales, match in (({"k_scale": 0.5}, "scales of an fp8 cache"),):
        with pytest.raises(InvalidArgument, match=match):
            ba.run(q, (k, v), **scales)
        torch._dynamo.reset()
        with pytest.raises(InvalidArgument, match=match):
            torch.compile(lambda q, k, v: ba.run(q, (k, v), **scales), fullgraph=True)(q, k, v)
    ba8, q8, (k8, v8), _, _ = _setup("e4m3-float")
    for scales, match in (({"v_scale": torch.tensor([1.0, -1.0])}, "v_scale must be positive"),
                          ({"k_scale": True}, "k_scale")):
        with pytest.raises(InvalidArgument, match=match):
            ba8.run(q8, (k8, v8), **scales)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=match):
            torch.compile(lambda q, k, v: ba8.run(q, (k, v), **scales),
                          fullgraph=True)(q8, k8, v8)


def test_cpu_run_checks_like_the_gpu() -> None:
    """run() on a CPU plan checks its operands as the kernels' path does."""
    ba, q, (k, v), _, plan = _setup("plain-nhd")
    with pytest.raises(ValueError, match="q must be"):
        ba.run(q[:2], (k, v))
    with pytest.raises(ValueError, match="kv_cache dtype"):
        ba.run(q, (k.half(), v.half()))
    with pytest.raises(ValueError, match="k_cache has shape"):
        ba.run(q, (k[:1], v[:1]))


@pytest.mark.parametrize("kv8", [None, E4M3])
def test_cascade_compiled_on_the_cpu(kv8) -> None:
    """CascadeAttention.run (its passes' plans carry q_positions / kv_position_offset) compiled:
    zero graph breaks, eager's result (up to the merge's float32 rounding), and within bf16 rounding of one reference over each
    request's prefix + suffix pages (sinks joined once; fp8 scales on both passes)."""
    gen = torch.Generator().manual_seed(4)
    pool = 40
    k, v = (torch.randn(pool, PAGE, HKV, D, generator=gen) for _ in range(2))
    if kv8 is None:
        k, v = k.bfloat16(), v.bfloat16()
    else:
        k, v = (quantize(t, torch.full((HKV,), 0.5), head_axis=2, dtype=kv8) for t in (k, v))
    ids = torch.randperm(pool, generator=gen)
    pre, q_lens, s_pages, s_last = ids[:3], [1, 3, 1, 5], [2, 1, 1, 3], [7, 16, 3, 12]
    suf = ids[3:3 + sum(s_pages)]
    sptr = torch.tensor([0, *itertools.accumulate(s_pages)])
    qo = torch.tensor([0, *itertools.accumulate(q_lens)])
    q = torch.randn(int(qo[-1]), HKV * G, D, generator=gen).bfloat16()
    kw = dict(sinks=_sinks("f32"), **({} if kv8 is None else dict(k_scale=0.5, v_scale=0.25)))
    variant = _slopes_variant()
    ca = attncc.CascadeAttention(variant, kv_layout="NHD", max_batch=8, max_qo_tokens=64,
                                 device="cpu")
    ca.plan(qo, prefix_indices=pre, prefix_last_page_len=11, suffix_indptr=sptr,
            suffix_indices=suf, suffix_last_page_len=s_last, num_qo_heads=HKV * G,
            num_kv_heads=HKV, head_dim=D, page_size=PAGE, kv_data_type=kv8)

    def step(q, k, v):
        return ca.run(q, (k, v), return_lse=True, **kw)

    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(q, k, v).graph_break_count == 0
    out, lse = torch.compile(step, fullgraph=True)(q, k, v)
    want, want_lse = step(q, k, v)
    # (inductor fuses the merge's float32 ops its own way: equal up to their rounding)
    assert float((out.double() - want.double()).norm() / want.double().norm()) < 1e-3
    assert float((lse - want_lse).abs().max()) < 1e-5
    # one request's keys: the prefix (its last page holds 11 tokens), then its suffix
    pre_k, pre_v = (t[pre].flatten(0, 1)[:2 * PAGE + 11] for t in (k, v))
    tot = {}
    for name, t, p in (("k", k, pre_k), ("v", v, pre_v)):
        tot[name] = torch.cat([torch.cat([p, t[suf[int(sptr[i]):int(sptr[i + 1])]]
                                          .flatten(0, 1)[:(s_pages[i] - 1) * PAGE + s_last[i]]])
                               for i in range(len(q_lens))])
    lens = [2 * PAGE + 11 + (n - 1) * PAGE + last for n, last in zip(s_pages, s_last)]
    ref, ref_lse = batch_attention_reference(q, (tot["k"], tot["v"]), qo,
                                             torch.tensor([0, *itertools.accumulate(lens)]),
                                             kv_layout="ragged", variant=variant, **kw)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    assert float((lse.double() - ref_lse).abs().max()) < 1e-5
