"""Attention sinks on the GPU (docs/flex-api.md and docs/serving.md, "Attention sinks"): the FA2
and FA3 flex kernels (D 64/128, causal, a mask with fully masked rows, a block mask, GQA, an
output transform, the FA3 split tail), the backward including d(sinks), BatchAttention decode
and prefill over paged and ragged caches (FA2 forced and the default, split-KV rows merged),
a CUDA graph replayed with new sink values, CascadeAttention and merge_state. Every case
against the fp64 reference with the sinks (`attention_reference(sinks=)`,
`batch_attention_reference(sinks=)`): fresh random inputs, outputs poisoned with NaN before the
run, relative Frobenius error < 2e-2, the LSE (which includes the sink) within 2e-2."""
from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

import attncc
from attncc.gym import GYM
from attncc.runtime.flex.fa3_split import tail_split
from attncc.runtime.flex.gpu_flex import gpu_flex_attention
from attncc.runtime.reference import add_sink, attention_reference, batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention

pytestmark = pytest.mark.gpu


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} NaN / unwritten values"
    den = ref.double().norm()
    num = (got.double() - ref.double()).norm()
    return float(num / den) if float(den) > 0 else float(num)


def _sinks(h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Per-head sinks around the rows' LSE scale: one dominating head (8), one negligible (-8),
    the rest random, so both the weight and the LSE move."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(h, generator=g, device="cuda") * 2 + 3
    s[0] = 8.0
    if h > 1:
        s[1] = -8.0
    return s.to(dtype)


def _needs_sm90() -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernels need an sm_90 GPU")


def _variant(name: str, d: int) -> attncc.Variant:
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    if name == "plain":
        return attncc.Variant(name="sinks_plain")
    if name == "causal":
        return attncc.Variant(mask_mod=causal, name="sinks_causal")
    if name == "masked_rows":  # rows 0..4 keep no key: output 0, LSE = the sink
        return attncc.Variant(mask_mod=lambda b, h, q, kv: (q >= 5) & (kv <= q),
                              name="sinks_masked_rows")
    if name == "softcap_output":  # the output transform sees the output with the sink applied
        return attncc.Variant(score_mod=lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0),
                              output_mod=lambda o, b, h, q, i: 2.0 * o[i] - 0.5,
                              mask_mod=causal, name="sinks_softcap_output")
    raise KeyError(name)


# (kernel, D, variant, Hq, Hkv, Sq, Skv, block mask, sinks dtype)
FLEX_CASES = [
    ("fa2", 64, "causal", 4, 4, 300, 300, None, torch.float32),
    ("fa2", 128, "masked_rows", 8, 2, 257, 257, None, torch.bfloat16),
    ("fa2", 128, "plain", 4, 2, 512, 512, "causal", torch.float32),
    ("fa2", 128, "plain", 8, 2, 3, 1500, None, torch.float32),
    ("fa2", 64, "softcap_output", 4, 1, 200, 200, None, torch.float32),
    ("fa3", 64, "causal", 4, 2, 512, 512, None, torch.float32),
    ("fa3", 128, "plain", 8, 8, 1024, 1024, None, torch.bfloat16),
    ("fa3", 128, "masked_rows", 4, 1, 384, 384, None, torch.float32),
    ("fa3", 128, "plain", 4, 4, 1024, 1024, "causal", torch.float32),
    ("fa3", 64, "softcap_output", 2, 2, 256, 256, None, torch.float32),
]


@pytest.mark.parametrize("kernel,d,var,hq,hkv,sq,skv,bm,sdt", FLEX_CASES,
                         ids=[f"{c[0]}-d{c[1]}-{c[2]}-h{c[3]}x{c[4]}-s{c[5]}x{c[6]}"
                              f"{'-bm' if c[7] else ''}" for c in FLEX_CASES])
def test_flex_kernels_with_sinks_match_reference(kernel: str, d: int, var: str, hq: int,
                                                 hkv: int, sq: int, skv: int, bm: str | None,
                                                 sdt: torch.dtype, rng: Any) -> None:
    if kernel == "fa3":
        _needs_sm90()
    q, k, v = rng.qkv(2, hq, sq, d, Hkv=hkv, Skv=skv, dtype=torch.bfloat16, device="cuda")
    sinks = _sinks(hq, sdt, seed=d + hq + sq)
    variant = _variant(var, d)
    ir, bind = variant.trace()
    block_mask = None
    if bm == "causal":
        block_mask = attncc.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, sq, skv,
                                              device="cuda")
    out = torch.full((2, hq, sq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((2, hq, sq), float("nan"), dtype=torch.float32, device="cuda")
    gpu_flex_attention(q, k, v, ir, bind, block_mask=block_mask, enable_gqa=hq != hkv,
                       return_lse=True, kernel_options={"KERNEL": kernel}, out=out,
                       lse_out=lse, sinks=sinks)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, ir, bind, block_mask=block_mask,
                                       enable_gqa=hq != hkv, sinks=sinks)
    assert _rel(out, ref) < 2e-2
    assert torch.isfinite(lse).all()  # with a sink every row's LSE is finite
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2
    _, plain_lse = attention_reference(q, k, v, ir, bind, block_mask=block_mask,
                                       enable_gqa=hq != hkv)
    moved = (ref_lse[:, 0] - plain_lse[:, 0])[torch.isfinite(plain_lse[:, 0])]
    assert float(moved.min()) > 0.1  # head 0's sink (8) moves every row: the test can fail
    if var == "masked_rows":
        assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
        want = sinks.float().view(1, hq, 1).expand(2, hq, 5)
        assert float((lse[:, :, :5] - want).abs().max()) < 1e-5


@pytest.mark.parametrize("name,d,hq,hkv,s,tkv", [("causal", 64, 6, 3, 4500, 128),
                                                 ("noop", 128, 5, 5, 4100, 128)])
def test_fa3_split_tail_joins_the_sink_once(name: str, d: int, hq: int, hkv: int, s: int,
                                            tkv: int, rng: Any) -> None:
    """The FA3 split tail merges a row's parts and then joins its sink (never per part): split
    and unsplit launches both match the reference."""
    _needs_sm90()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = hq * -(-s // 128)
    assert tail_split(items, min(items, sms), s, tkv).pieces > 0, "the case does not split"
    q, k, v = rng.qkv(1, hq, s, d, Hkv=hkv, dtype=torch.bfloat16, device="cuda")
    ir, bind = GYM[name](1, hq, s, d).trace()
    sinks = _sinks(hq, torch.float32, seed=s)
    ref, ref_lse = attention_reference(q, k, v, ir, bind, enable_gqa=hq != hkv, sinks=sinks)
    for split in (True, False):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((1, hq, s), float("nan"), device="cuda")
        gpu_flex_attention(q, k, v, ir, bind, enable_gqa=hq != hkv, return_lse=True,
                           kernel_options={"KERNEL": "fa3", "BLOCK_N": tkv, "SPLIT_TAIL": split,
                                           "PAIRED": False},
                           out=out, lse_out=lse, sinks=sinks)
        torch.cuda.synchronize()
        assert _rel(out, ref) < 2e-2, split
        assert float((lse.double() - ref_lse).abs().max()) < 2e-2, split


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("kernel,d", [("fa2", 64), ("fa2", 128), ("fa3", 128)])
def test_backward_with_sinks_matches_reference(kernel: str, d: int, with_lse: bool,
                                               rng: Any) -> None:
    """dq, dk, dv and d(sinks) through attncc's GPU forward and backward (GQA, causal) against
    autograd through the fp64 reference on the same rounded inputs."""
    if kernel == "fa3":
        _needs_sm90()
    B, hq, hkv, s = 2, 4, 2, 256
    q, k, v = (t.requires_grad_(True) for t in rng.qkv(B, hq, s, d, Hkv=hkv,
                                                       dtype=torch.bfloat16, device="cuda"))
    sinks = _sinks(hq, torch.float32, seed=d).requires_grad_(True)
    variant = _variant("causal", d)
    out, lse = attncc.flex_attention(q, k, v, score_mod=variant, enable_gqa=True,
                                     return_lse=True, sinks=sinks,
                                     kernel_options={"KERNEL": kernel})
    assert out.grad_fn is not None
    g = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, device="cuda", dtype=torch.float64)
    loss = (out.double() * dout).sum() + ((lse.double() * dlse).sum() if with_lse else 0)
    got = torch.autograd.grad(loss, [q, k, v, sinks])
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    ir, bind = variant.trace()
    ro, rl = attention_reference(*leaves[:3], ir, bind, enable_gqa=True, sinks=leaves[3])
    rloss = (ro * dout).sum() + ((rl * dlse).sum() if with_lse else 0)
    want = torch.autograd.grad(rloss, leaves)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert a.shape == b.shape, name
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


# ------------------------------------------------------------------------------------ serving
def _paged_batch(layout: str, page: int, q_lens: list[int], kv_lens: list[int], hkv: int,
                 g: int, d: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """Random q and cache for the lengths; page ids shuffled among unused pages (ragged: one
    contiguous cache)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = rnd(int(qo[-1]), hkv * g, d)
    if layout == "ragged":
        kv = torch.tensor([0] + list(itertools.accumulate(kv_lens)))
        return dict(q=q, cache=(rnd(int(kv[-1]), hkv, d), rnd(int(kv[-1]), hkv, d)), qo=qo,
                    kv_indptr=kv, kv_indices=None, last=None)
    n_pages = [-(-n // page) for n in kv_lens]
    total = sum(n_pages)
    ids = torch.randperm(2 * total + 3, generator=torch.Generator().manual_seed(seed))[:total]
    shape = (2 * total + 3, page, hkv, d) if layout == "NHD" else (2 * total + 3, hkv, page, d)
    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
    last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(kv_lens, n_pages)])
    return dict(q=q, cache=(rnd(*shape), rnd(*shape)), qo=qo, kv_indptr=indptr,
                kv_indices=ids, last=last)


def _check_batch(ba: BatchAttention, b: dict[str, Any], layout: str, page: int,
                 sinks: torch.Tensor) -> None:
    out = torch.full_like(b["q"], float("nan"))
    lse = torch.full(b["q"].shape[:2], float("nan"), device="cuda")
    ba.run(b["q"], b["cache"], out=out, lse=lse, sinks=sinks)
    torch.cuda.synchronize()
    ref, ref_lse = batch_attention_reference(b["q"], b["cache"], b["qo"], b["kv_indptr"],
                                             b["kv_indices"], b["last"], kv_layout=layout,
                                             page_size=page, variant=ba.variant, sinks=sinks)
    assert _rel(out, ref) < 2e-2
    assert torch.isfinite(lse).all()
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2


DECODE = ([1] * 12, [1, 5, 16, 17, 100, 511, 1024, 1500, 2048, 3000, 4095, 8192])
PREFILL = ([300, 1, 4096, 129, 1000, 17], [300, 5, 32768, 1000, 1000, 17])
MIXED = ([1, 4, 1, 300, 1, 64, 1000, 1], [1, 17, 4096, 300, 2000, 600, 1000, 32768])
# (layout, page, lengths, group, kernel, dtype, variant, d)
BATCH_CASES = [
    ("NHD", 16, DECODE, 8, "fa2", torch.bfloat16, "plain", 128),
    ("HND", 64, DECODE, 4, None, torch.float16, "causal", 128),
    ("NHD", 1, MIXED, 2, "fa2", torch.bfloat16, "sliding_window", 128),
    ("NHD", 16, PREFILL, 4, "fa2", torch.bfloat16, "causal", 128),
    ("NHD", 16, PREFILL, 4, None, torch.bfloat16, "causal", 128),
    ("HND", 64, PREFILL, 8, None, torch.bfloat16, "causal", 64),
    ("ragged", 1, PREFILL, 1, None, torch.bfloat16, "plain", 128),
]


@pytest.mark.parametrize("layout,page,lengths,g,kernel,dtype,var,d", BATCH_CASES,
                         ids=[f"{c[0]}-p{c[1]}-{'decode' if c[2] is DECODE else 'mixed' if c[2] is MIXED else 'prefill'}"
                              f"-g{c[3]}-{c[4] or 'default'}-{c[6]}-d{c[7]}" for c in BATCH_CASES])
def test_batch_attention_with_sinks_matches_reference(layout: str, page: int,
                                                      lengths: tuple[list[int], list[int]],
                                                      g: int, kernel: str | None,
                                                      dtype: torch.dtype, var: str,
                                                      d: int) -> None:
    hkv = 2
    b = _paged_batch(layout, page, lengths[0], lengths[1], hkv, g, d, dtype, seed=g + d + page)
    variant = None if var == "plain" else GYM[var](1, hkv * g, 4096, d, seed=5)
    ba = BatchAttention(variant, kv_layout=layout, kernel=kernel)
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page, q_data_type=dtype)
    _check_batch(ba, b, layout, page, _sinks(hkv * g, torch.float32, seed=g))


@pytest.mark.parametrize("kernel", ["fa2", None], ids=["fa2", "default"])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_batch_split_rows_join_the_sink_in_the_merge(kernel: str | None, shape: str) -> None:
    """Long requests split across CTAs: the merge kernel joins the sink once to the merged
    row (a per-part sink would count it once per part)."""
    if shape == "prefill":
        q_lens, kv_lens, g = [300, 129, 1], [9000, 4000, 12000], 4
    else:
        q_lens, kv_lens, g = [1] * 6, [30000, 9000, 1, 4000, 17, 12000], 8
    b = _paged_batch("NHD", 16, q_lens, kv_lens, 2, g, 128, torch.bfloat16, seed=3)
    ba = BatchAttention(GYM["causal"](1, 2 * g, 4096, 128, seed=5), kv_layout="NHD",
                        kernel=kernel)
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=2 * g,
            num_kv_heads=2, head_dim=128, page_size=16)
    assert ba._plan is not None and ba._plan.num_merges > 0, "no split row: the case is moot"
    _check_batch(ba, b, "NHD", 16, _sinks(2 * g, torch.bfloat16, seed=4))


def test_batch_graph_replay_reads_new_sink_values() -> None:
    """A captured run reads the sinks' memory at each replay: new values in place give the
    new result."""
    b = _paged_batch("NHD", 16, [1] * 4, [5000, 30, 700, 12000], 2, 4, 128, torch.bfloat16,
                     seed=9)
    ba = BatchAttention(None, kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=8,
            num_kv_heads=2, head_dim=128, page_size=16)
    sinks = _sinks(8, torch.float32, seed=1)
    out = torch.empty_like(b["q"])
    lse = torch.empty(b["q"].shape[:2], device="cuda")
    ba.run(b["q"], b["cache"], out=out, lse=lse, sinks=sinks)  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(b["q"], b["cache"], out=out, lse=lse, sinks=sinks)
    for seed in (2, 3):
        sinks.copy_(_sinks(8, torch.float32, seed=seed).flip(0))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = batch_attention_reference(b["q"], b["cache"], b["qo"], b["kv_indptr"],
                                                 b["kv_indices"], b["last"], page_size=16,
                                                 sinks=sinks)
        assert _rel(out, ref) < 2e-2, seed
        assert float((lse.double() - ref_lse).abs().max()) < 2e-2, seed


@pytest.mark.parametrize("prefix_pages", [0, 40])
def test_cascade_with_sinks_matches_reference(prefix_pages: int) -> None:
    """Shared prefix + suffixes with sinks: joined once (in the prefix pass, or the suffix pass
    when there is no prefix), equal to one attention over prefix + suffix with the sinks."""
    page, hkv, g, d = 16, 2, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(21)
    n_pages = 200
    k = torch.randn(n_pages, page, hkv, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(n_pages, page, hkv, d, generator=gen, device="cuda").bfloat16()
    ids = torch.randperm(n_pages, generator=torch.Generator().manual_seed(1))
    pre = ids[:prefix_pages]
    q_lens, s_pages, s_last = [1, 3, 1, 17], [2, 5, 1, 9], [7, 16, 3, 12]
    suf = ids[prefix_pages:prefix_pages + sum(s_pages)]
    sptr = torch.tensor([0] + list(itertools.accumulate(s_pages)))
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = torch.randn(int(qo[-1]), hkv * g, d, generator=gen, device="cuda").bfloat16()
    variant = GYM["causal"](1, hkv * g, 4096, d, seed=5)
    sinks = _sinks(hkv * g, torch.float32, seed=6)
    ca = attncc.CascadeAttention(variant, kv_layout="NHD")
    ca.plan(qo, prefix_indices=pre, prefix_last_page_len=page, suffix_indptr=sptr,
            suffix_indices=suf, suffix_last_page_len=s_last, num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page)
    out, lse = ca.run(q, (k, v), return_lse=True, sinks=sinks)
    torch.cuda.synchronize()
    # one request's pages: the whole prefix (full pages), then its suffix
    pages = torch.cat([torch.cat([pre, suf[int(sptr[i]):int(sptr[i + 1])]])
                       for i in range(len(q_lens))])
    indptr = torch.tensor([0] + list(itertools.accumulate(prefix_pages + n for n in s_pages)))
    ref, ref_lse = batch_attention_reference(q, (k, v), qo, indptr, pages, torch.tensor(s_last),
                                             page_size=page, variant=variant, sinks=sinks)
    assert _rel(out, ref) < 2e-2
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2


def test_merge_state_with_a_sink_on_cuda(rng: Any) -> None:
    """CUDA states (the merge kernel's path) with a sink joined once: the fp64 CPU merge."""
    tokens, h, d = 37, 8, 128
    o_a, o_b = (rng.randn(tokens, h, d, device="cuda") for _ in range(2))
    l_a, l_b = (rng.randn(tokens, h, device="cuda") * 3 for _ in range(2))
    l_b[0] = -math.inf  # an empty part
    sink = _sinks(h, torch.float32, seed=5)
    o, lse = attncc.merge_state(o_a, l_a, o_b, l_b, sink=sink)
    torch.cuda.synchronize()
    cpu = [t.double().cpu() for t in (o_a, l_a, o_b, l_b)]
    want_o, want_l = add_sink(*attncc.merge_state(*cpu), sink.double().cpu())
    assert _rel(o.cpu(), want_o) < 1e-4
    assert float((lse.double().cpu() - want_l).abs().max()) < 1e-4


def test_bad_sinks_raise_before_any_launch(rng: Any) -> None:
    """A wrong shape, device or a non-finite value: a clear error, the poisoned output
    untouched (nothing launched)."""
    from attncc.errors import InvalidArgument

    q, k, v = rng.qkv(1, 4, 128, 64, dtype=torch.bfloat16, device="cuda")
    for bad, match in ((torch.zeros(3, device="cuda"), "must be \\[4\\]"),
                       (torch.zeros(4), "sinks is on cpu"),
                       (torch.tensor([0.0, math.inf, 0.0, 0.0], device="cuda"), "finite")):
        with pytest.raises(InvalidArgument, match=match):
            attncc.flex_attention(q, k, v, sinks=bad)
    b = _paged_batch("NHD", 16, [1, 1], [40, 700], 2, 2, 128, torch.bfloat16, seed=1)
    ba = BatchAttention(None, kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=4,
            num_kv_heads=2, head_dim=128, page_size=16)
    out = torch.full_like(b["q"], float("nan"))
    with pytest.raises(InvalidArgument, match="must be \\[4\\]"):
        ba.run(b["q"], b["cache"], out=out, sinks=torch.zeros(2, device="cuda"))
    with pytest.raises(InvalidArgument, match="float32 or the queries' dtype"):
        ba.run(b["q"], b["cache"], out=out, sinks=torch.zeros(4, device="cuda",
                                                                dtype=torch.float16))
    torch.cuda.synchronize()
    assert torch.isnan(out).all()
