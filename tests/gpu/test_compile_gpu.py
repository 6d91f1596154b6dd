"""torch.compile around attncc.flex_attention / BatchAttention.run on the GPU (the compiled
kernels through attncc::flex_attention and attncc::batch_attention_run): fullgraph, dynamic
lengths and mode="reduce-overhead" (CUDA graphs) x {captured tensor + scalar, block mask, GQA,
return_lse}; zero graph breaks, outputs equal to eager and within bf16 tolerance of the fp64
reference; opcheck on CUDA tensors; the backward through the op; BatchAttention.run with an fp8
cache (float and per-head scales), sinks and tree masks, compiled and under reduce-overhead
across new plans (docs/compile.md)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch._dynamo

import attncc
from attncc.runtime.flex import ops
from attncc.runtime.flex.api import EAGER_CHECKS
from attncc.runtime.kv8 import quantize
from attncc.runtime.reference import attention_reference, batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from tests.helpers.trees import tree_batch

pytestmark = pytest.mark.gpu

SOFTCAP = 30.0
SLOPES = None  # set per test on the GPU (module import must not need CUDA)


def softcap_alibi(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh((score - SLOPES[h] * (q_idx - kv_idx)) / SOFTCAP)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.fixture(autouse=True)
def _setup():
    global SLOPES
    SLOPES = torch.linspace(0.01, 0.2, 8, device="cuda")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(S, hq=8, hkv=8, D=128, B=2, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, hq, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _rel(out, ref):
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _reference(q, k, v, mod, mask, gqa):
    ir, bind = attncc.Variant(score_mod=mod, mask_mod=mask).trace()
    return attention_reference(q, k, v, ir, bind, enable_gqa=gqa)


CASES = ["captured", "block_mask", "gqa", "lse"]
MODES = {"fullgraph": dict(fullgraph=True), "dynamic": dict(fullgraph=True, dynamic=True),
         "reduce-overhead": dict(fullgraph=True, mode="reduce-overhead")}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES)
def test_matrix(case, mode):
    S = 1000
    gqa = case == "gqa"
    q, k, v = _qkv(S, hkv=2 if gqa else 8, seed=len(case) + len(mode))
    bm = None
    if case in ("block_mask", "lse"):
        bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
    kw = dict(score_mod=softcap_alibi, block_mask=bm, enable_gqa=gqa,
              return_lse=case == "lse")

    def fn(q, k, v):
        return attncc.flex_attention(q, k, v, **kw)

    assert torch._dynamo.explain(fn)(q, k, v).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(fn, **MODES[mode])
    eager = fn(q, k, v)
    for _ in range(3):  # reduce-overhead: warm-up, record, replay
        got = compiled(q, k, v)
        got = tuple(t.clone() for t in got) if isinstance(got, tuple) else got.clone()
    ref, ref_lse = _reference(q, k, v, softcap_alibi, causal if bm is not None else None, gqa)
    out = got[0] if case == "lse" else got
    # the op always asks the kernel for the LSE; the output is the same up to that
    assert _rel(out, eager[0] if case == "lse" else eager) < 1e-3
    assert _rel(out, ref) < 2e-2
    if case == "lse":
        live = torch.isfinite(ref_lse)
        assert (got[1][live].double() - ref_lse[live]).abs().max().item() < 2e-2


def test_dynamic_lengths_and_new_scalar():
    global SOFTCAP
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=softcap_alibi),
                       fullgraph=True, dynamic=True)
    old = SOFTCAP
    try:
        for S, cap in ((300, 30.0), (777, 30.0), (1024, 10.0)):
            SOFTCAP = cap
            q, k, v = _qkv(S, seed=S)
            out = fn(q, k, v)
            assert _rel(out, _reference(q, k, v, softcap_alibi, None, False)[0]) < 2e-2
    finally:
        SOFTCAP = old


def test_reduce_overhead_replays_new_inputs():
    """CUDA graph replay with new q/k/v values (copied into the static inputs) gives the new
    result, not the recorded one."""
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=softcap_alibi),
                       fullgraph=True, mode="reduce-overhead")
    for seed in range(4):
        q, k, v = _qkv(512, seed=100 + seed)
        out = fn(q, k, v).clone()
        assert _rel(out, _reference(q, k, v, softcap_alibi, None, False)[0]) < 2e-2


def test_opcheck_cuda():
    q, k, v = _qkv(256, seed=7)
    bm = attncc.create_block_mask(causal, None, None, 256, 256, device="cuda")
    plan = ops.register(*ops.hooks_of(softcap_alibi), bm.mask_mod, (),
                        tuple(bm.bindings.tensors), EAGER_CHECKS)
    key, _, freads, ireads, treads, _ = plan
    roots = (softcap_alibi, bm.mask_mod, bm)
    args = (q, k, v, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
            bm.full_kv_indices, list(bm.BLOCK_SIZE), list(bm.seq_lengths),
            [ops._read(roots, r) for r in treads],
            [float(ops._read(roots, r, x)) for r, x in freads],
            [int(ops._read(roots, r, x)) for r, x in ireads], key, None, False)
    torch.library.opcheck(torch.ops.attncc.flex_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_backward_through_the_op():
    """Gradients of the compiled forward (the op's CUDA backward, autograd.backward_of_saved)
    match the reference's within bf16 tolerance."""
    q, k, v = _qkv(256, hq=4, hkv=4, B=1, seed=3, grad=True)
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=softcap_alibi),
                       fullgraph=True)
    fn(q, k, v).float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = _reference(q2, k2, v2, softcap_alibi, None, False)[0]
    ref.square().sum().backward()
    for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
        assert _rel(got, want) < 2e-2


def _relbias(table):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 255]
    return score_mod


def test_backward_through_the_op_learnable_bias_causal():
    """The op's CUDA backward (the FA2 backward kernel, autograd.backward_of_saved) gives q, k, v
    and a learnable bias table their gradients, matching the fp64 reference's autograd."""
    q, k, v = _qkv(256, hq=4, hkv=2, B=2, seed=5, grad=True)
    table = (0.5 * torch.randn(4, 511, device="cuda")).requires_grad_(True)
    mod = _relbias(table)
    bm = attncc.create_block_mask(causal, None, None, 256, 256, device="cuda")
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=mod,
                                                             block_mask=bm, enable_gqa=True),
                       fullgraph=True)
    fn(q, k, v).float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, table)]
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    t2 = table.detach().double().requires_grad_(True)
    ref = _reference(q2, k2, v2, _relbias(t2), causal, True)[0]
    ref.square().sum().backward()
    for name, got, want in zip("qkvb", grads, (q2.grad, k2.grad, v2.grad, t2.grad)):
        assert _rel(got, want) < 2e-2, name


def test_backward_through_the_op_deterministic():
    """kernel_options={"DETERMINISTIC": True} reaches the op's backward: 10 compiled
    forward+backward runs give the same bits for q, k, v and a learnable bias table's gradients
    (exact integer sums for the table, docs/backward.md), and they match the reference."""
    q, k, v = _qkv(256, hq=4, hkv=2, B=2, seed=7, grad=True)
    table = (0.5 * torch.randn(4, 511, device="cuda")).requires_grad_(True)
    mod = _relbias(table)
    bm = attncc.create_block_mask(causal, None, None, 256, 256, device="cuda")
    opts = {"DETERMINISTIC": True}
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(
        q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True, kernel_options=opts),
        fullgraph=True)
    runs = []
    for _ in range(10):
        for t in (q, k, v, table):
            t.grad = None
        fn(q, k, v).float().square().sum().backward()
        runs.append([t.grad.clone() for t in (q, k, v, table)])
    for again in runs[1:]:
        for name, a, b in zip("qkvb", runs[0], again):
            assert torch.equal(a, b), f"d{name} differs between compiled runs"
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    t2 = table.detach().double().requires_grad_(True)
    ref = _reference(q2, k2, v2, _relbias(t2), causal, True)[0]
    ref.square().sum().backward()
    for name, got, want in zip("qkvb", runs[0], (q2.grad, k2.grad, v2.grad, t2.grad)):
        assert _rel(got, want) < 2e-2, name


def test_batch_attention_run_compiled():
    hkv, g, d, page = 2, 4, 128, 16
    kv_lens = [100, 17, 600, 2048]  # with 1, 17, 300 and 1 queries (qo below)
    gen = torch.Generator(device="cuda").manual_seed(11)
    qo = torch.tensor([0, 1, 18, 318, 319])
    n_pages = [-(-n // page) for n in kv_lens]
    indptr = torch.tensor([0] + [sum(n_pages[:i + 1]) for i in range(len(n_pages))])
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
    total = int(indptr[-1])
    cache = tuple(torch.randn(total, page, hkv, d, device="cuda", generator=gen)
                  .to(torch.bfloat16) for _ in range(2))
    q = torch.randn(int(qo[-1]), hkv * g, d, device="cuda", generator=gen).to(torch.bfloat16)
    variant = attncc.Variant(score_mod=softcap_alibi)
    ba = BatchAttention(variant, kv_layout="NHD")
    ba.plan(qo, indptr, torch.arange(total), last, num_qo_heads=hkv * g, num_kv_heads=hkv,
            head_dim=d, page_size=page, q_data_type=torch.bfloat16)

    def step(q, k_cache, v_cache):
        return ba.run(q, (k_cache, v_cache), return_lse=True)

    assert torch._dynamo.explain(step)(q, *cache).graph_break_count == 0
    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True)(q, *cache)
    ref, ref_lse = batch_attention_reference(q, cache, qo, indptr, torch.arange(total), last,
                                             kv_layout="NHD", page_size=page, variant=variant)
    assert _rel(out, ref) < 2e-2
    eager_out, _ = step(q, *cache)
    assert _rel(out, eager_out) < 1e-3
    torch.library.opcheck(torch.ops.attncc.batch_attention_run.default,
                          (q, list(cache), ba.op_handle, None),
                          test_utils=("test_schema", "test_faketensor"))



E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HKV, G, D, PAGE, POOL = 2, 4, 128, 16, 1200  # POOL: pages of the serving caches


def _serving_cache(kv8, seed=0):
    """A paged NHD cache of POOL pages: bf16, or fp8 quantized with per-head scales (returned;
    the fp8 values stand for k8 * scale whatever scale run() is given)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (torch.randn(POOL, PAGE, HKV, D, device="cuda", generator=gen) for _ in range(2))
    if kv8 is None:
        return k.bfloat16(), v.bfloat16()
    s = torch.tensor([0.03, 0.05], device="cuda")
    return quantize(k, s, head_axis=2, dtype=kv8), quantize(v, s, head_axis=2, dtype=kv8)


def _serving_plan(ba, q_lens, kv_lens, kv8=None, mask=False, seed=0):
    """Plan `ba` over random pages of the pool; the arrays (and mask) the reference needs."""
    n = [-(-x // PAGE) for x in kv_lens]
    ids = torch.randperm(POOL, generator=torch.Generator().manual_seed(seed))
    indptr = torch.tensor([0] + list(itertools.accumulate(n)))
    last = torch.tensor([x - (p - 1) * PAGE for x, p in zip(kv_lens, n)])
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    masks = {"custom_mask": torch.from_numpy(tree_batch(q_lens, kv_lens, seed)[0])} if mask else {}
    arrays = dict(qo_indptr=qo, kv_indptr=indptr, kv_indices=ids[:int(indptr[-1])],
                  kv_last_page_len=last)
    ba.plan(*arrays.values(), num_qo_heads=HKV * G, num_kv_heads=HKV, head_dim=D,
            page_size=PAGE, kv_data_type=kv8, **masks)
    return {**arrays, **masks}


# name: (kv dtype, scales, sinks dtype, tree mask, q_lens, kv_lens)
SERVING = {
    "e4m3-float": (E4M3, "float", None, False, [1, 1, 1], [700, 33, 2000]),
    "e5m2-head-sinks": (E5M2, "head", torch.bfloat16, False, [1, 3, 1], [64, 900, 5000]),
    "tree-sinks": (None, None, torch.float32, True, [4, 8, 2], [300, 1000, 17]),
}


def _serving_kw(scales, sinks):
    kw = {}
    if scales == "float":
        kw.update(k_scale=0.04, v_scale=0.05)
    elif scales == "head":
        kw.update(k_scale=torch.tensor([0.03, 0.06], device="cuda"),
                  v_scale=torch.tensor([0.05, 0.02], device="cuda"))
    if sinks is not None:
        kw["sinks"] = torch.linspace(-1.0, 2.0, HKV * G, device="cuda").to(sinks)
    return kw


@pytest.mark.parametrize("case", SERVING)
def test_batch_attention_run_compiled_serving_features(case):
    """fp8 caches (float / per-head scales), sinks and tree masks through the op: zero graph
    breaks, the compiled step equals eager bit for bit and the fp64 reference within bf16
    tolerance (out and lse); opcheck on the CUDA inputs, fp8 included (but its schema check)."""
    kv8, scales, sinks, mask, q_lens, kv_lens = SERVING[case]
    k, v = _serving_cache(kv8)
    ba = BatchAttention(None, kv_layout="NHD", max_batch=8, max_qo_tokens=64)
    arrays = _serving_plan(ba, q_lens, kv_lens, kv8, mask)
    q = torch.randn(sum(q_lens), HKV * G, D, device="cuda").bfloat16()
    kw = _serving_kw(scales, sinks)

    def step(q, k, v):
        return ba.run(q, (k, v), return_lse=True, **kw)

    assert torch._dynamo.explain(step)(q, k, v).graph_break_count == 0
    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True)(q, k, v)
    eager_out, eager_lse = step(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    ref, ref_lse = batch_attention_reference(q, (k, v), **arrays, page_size=PAGE, **kw)
    assert _rel(out, ref) < 2e-2
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2
    s32 = kw["sinks"].float() if "sinks" in kw else None
    ks, vs = kw.get("k_scale"), kw.get("v_scale")
    tensors = (ks, vs) if isinstance(ks, torch.Tensor) else (None, None)
    floats = (ks, vs) if isinstance(ks, float) else (None, None)
    # (no test_schema with an fp8 cache: its mutation check compares the inputs with
    # allclose, which torch lacks for fp8; the 16-bit cases and the CPU tests check the schema)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.attncc.batch_attention_run.default,
                          (q, [k, v], ba.op_handle, None, s32, *tensors, *floats),
                          test_utils=utils if kv8 is not None else (*utils, "test_schema"))


def test_batch_attention_reduce_overhead_fp8_new_plans():
    """mode="reduce-overhead" around run() with an e4m3 cache, a float k_scale, a per-head
    v_scale tensor and sinks: warm-up, recording, then replays after new decode plans (and an
    in-place update of v_scale) each match the reference of their plan."""
    k, v = _serving_cache(E4M3, seed=3)
    ba = BatchAttention(None, kv_layout="NHD", max_batch=8, max_qo_tokens=8)
    vs = torch.tensor([0.05, 0.02], device="cuda")
    sinks = torch.linspace(-1.0, 1.0, HKV * G, device="cuda")
    step = torch.compile(lambda q, k, v, vs, s: ba.run(q, (k, v), return_lse=True, k_scale=0.04,
                                                       v_scale=vs, sinks=s),
                         fullgraph=True, mode="reduce-overhead")
    for i, lens in enumerate([[100] * 8, [5, 3000, 17, 900, 1, 64, 2048, 333], [2000] * 8,
                              [1, 2, 3, 4, 5, 6, 7, 8000]]):
        arrays = _serving_plan(ba, [1] * 8, lens, E4M3, seed=i)
        if i == 3:
            vs.copy_(torch.tensor([0.01, 0.07], device="cuda"))
        q = torch.randn(8, HKV * G, D, device="cuda").bfloat16()
        out, lse = (t.clone() for t in step(q, k, v, vs, sinks))
        ref, ref_lse = batch_attention_reference(q, (k, v), **arrays, page_size=PAGE,
                                                 k_scale=0.04, v_scale=vs, sinks=sinks)
        assert _rel(out, ref) < 2e-2, i
        assert float((lse.double() - ref_lse).abs().max()) < 2e-2, i


def test_cascade_attention_compiled_with_sinks():
    """CascadeAttention.run compiled: the two passes are op calls and the merge traced torch
    ops; zero graph breaks, eager's result within merge rounding, the reference over prefix +
    suffix pages within bf16 tolerance (out and lse, sinks joined once)."""
    k, v = _serving_cache(None, seed=7)
    ids = torch.randperm(POOL, generator=torch.Generator().manual_seed(3))
    pre, q_lens, s_pages, s_last = ids[:40], [1, 3, 1, 17], [2, 5, 1, 9], [7, 16, 3, 12]
    suf = ids[40:40 + sum(s_pages)]
    sptr = torch.tensor([0] + list(itertools.accumulate(s_pages)))
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = torch.randn(int(qo[-1]), HKV * G, D, device="cuda").bfloat16()
    sinks = torch.linspace(-1.0, 2.0, HKV * G, device="cuda")
    ca = attncc.CascadeAttention(attncc.Variant(mask_mod=causal), kv_layout="NHD")
    ca.plan(qo, prefix_indices=pre, prefix_last_page_len=PAGE, suffix_indptr=sptr,
            suffix_indices=suf, suffix_last_page_len=s_last, num_qo_heads=HKV * G,
            num_kv_heads=HKV, head_dim=D, page_size=PAGE)

    def step(q, k, v, s):
        return ca.run(q, (k, v), return_lse=True, sinks=s)

    assert torch._dynamo.explain(step)(q, k, v, sinks).graph_break_count == 0
    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True)(q, k, v, sinks)
    eager_out, eager_lse = step(q, k, v, sinks)
    assert _rel(out, eager_out) < 1e-2 and float((lse - eager_lse).abs().max()) < 1e-4
    pages = torch.cat([torch.cat([pre, suf[int(sptr[i]):int(sptr[i + 1])]])
                       for i in range(len(q_lens))])
    indptr = torch.tensor([0] + list(itertools.accumulate(40 + n for n in s_pages)))
    ref, ref_lse = batch_attention_reference(q, (k, v), qo, indptr, pages, torch.tensor(s_last),
                                             page_size=PAGE, variant=ca.prefix.variant,
                                             sinks=sinks)
    assert _rel(out, ref) < 2e-2
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2
