"""Attention sinks on the CPU (docs/flex-api.md, "Attention sinks"): the fp64 reference against
the written-out formula, its gradcheck, `attncc.flex_attention(sinks=)` (eager, autograd and
under torch.compile, opcheck), the d(sinks) formula the GPU backward uses, `merge_state` /
`merge_states` with a sink, the batch reference, and the argument checks."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import InvalidArgument, InvalidArgumentType
from attncc.frontend import Variant
from attncc.runtime.flex.autograd import sinks_grad
from attncc.runtime.reference import (add_sink, attention_reference,
                                      batch_attention_reference)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def naive(q, k, v, sinks, keep=None, scale=None, score=None):
    """out = sum_j exp(s_j - M) v_j / (exp(sink_h - M) + sum_j exp(s_j - M)), M the row max
    over the kept scores and the sink; lse = M + log(denominator). GQA by repeating k/v."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if score is not None:
        s = score(s)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    sk = sinks.view(1, -1, 1, 1).to(s.dtype)
    m = torch.maximum(s.amax(-1, keepdim=True), sk)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True) + torch.exp(sk - m)
    return e @ v / den, (m + den.log()).squeeze(-1)


def _f64(*ts):
    return [t.double() for t in ts]


@pytest.mark.parametrize("gqa", [False, True])
def test_reference_matches_naive_formula(rng, gqa):
    Hq, Hkv = 4, (2 if gqa else 4)
    q, k, v = _f64(*rng.qkv(2, Hq, 7, 8, Hkv=Hkv, Skv=9))
    sinks = rng.randn(Hq, dtype=torch.float64) * 3
    ir, bind = Variant(score_mod=lambda s, b, h, qi, ki: 5 * torch.tanh(s / 5),
                       mask_mod=lambda b, h, qi, ki: qi + 2 >= ki).trace()
    out, lse = attention_reference(q, k, v, ir, bind, sinks=sinks, enable_gqa=gqa)
    keep = (torch.arange(7)[:, None] + 2 >= torch.arange(9)[None, :])
    want_o, want_l = naive(q, k, v, sinks, keep, score=lambda s: 5 * torch.tanh(s / 5))
    torch.testing.assert_close(out, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_l, rtol=1e-12, atol=1e-12)


def test_reference_fully_masked_rows_give_zero_and_the_sink(rng):
    """No kept key: the sink is the whole denominator, so output 0 and LSE = the sink; a row
    whose scores are far below the sink gives nearly 0 without overflow."""
    q, k, v = _f64(*rng.qkv(1, 2, 4, 8))
    sinks = torch.tensor([0.5, -2.0], dtype=torch.float64)
    ir, bind = Variant(mask_mod=lambda b, h, qi, ki: qi >= 2).trace()  # rows 0, 1: nothing
    out, lse = attention_reference(q, k, v, ir, bind, sinks=sinks)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.equal(lse[0, :, :2], sinks[:, None].expand(2, 2))
    big = torch.tensor([300.0, -300.0], dtype=torch.float64)
    o2, l2 = attention_reference(q, k, v, Variant().trace()[0], sinks=big)
    assert torch.isfinite(o2).all() and torch.isfinite(l2).all()
    assert float(o2[0, 0].abs().max()) < 1e-100  # the 300 sink takes all the weight
    torch.testing.assert_close(l2[0, 0], torch.full((4,), 300.0, dtype=torch.float64))


def test_reference_without_keys_gives_the_sink(rng):
    q = rng.randn(1, 2, 3, 8, dtype=torch.float64)
    kv = torch.empty(1, 2, 0, 8, dtype=torch.float64)
    sinks = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out, lse = attention_reference(q, kv, kv, Variant().trace()[0], sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse[0], sinks[:, None].expand(2, 3))


def test_add_sink_equals_the_sink_in_the_softmax(rng):
    """A finished state joined with its sink afterwards (what the merges do) is the state
    computed with the sink inside the softmax."""
    q, k, v = _f64(*rng.qkv(2, 3, 5, 8))
    sinks = rng.randn(3, dtype=torch.float64)
    ir, bind = Variant(mask_mod=causal).trace()
    o, l = attention_reference(q, k, v, ir, bind)
    o2, l2 = add_sink(o, l, sinks.view(1, 3, 1))
    want_o, want_l = attention_reference(q, k, v, ir, bind, sinks=sinks)
    torch.testing.assert_close(o2, want_o, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(l2, want_l, rtol=1e-12, atol=1e-13)
    nan = add_sink(torch.ones(1, 1), torch.tensor([math.nan]), torch.tensor([0.0]))
    assert nan[0].isnan().all() and nan[1].isnan().all()


def test_reference_gradcheck_including_sinks(rng):
    q, k, v = (t.requires_grad_(True) for t in _f64(*rng.qkv(1, 2, 4, 4, Skv=5)))
    sinks = rng.randn(2, dtype=torch.float64).requires_grad_(True)
    ir, bind = Variant(mask_mod=lambda b, h, qi, ki: ki <= qi + 1).trace()

    def f(q, k, v, sinks):
        return attention_reference(q, k, v, ir, bind, sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


@pytest.mark.parametrize("with_dlse", [False, True])
def test_sinks_grad_formula_matches_autograd(rng, with_dlse):
    """The GPU backward's d(sinks) (autograd.sinks_grad: -sum over rows of exp(sink - LSE) *
    (rowsum(dO * O) - dLSE)) equals autograd through the fp64 reference, a fully masked row
    included."""
    q, k, v = _f64(*rng.qkv(2, 4, 6, 8, Hkv=2))
    sinks = rng.randn(4, dtype=torch.float64).requires_grad_(True)
    ir, bind = Variant(mask_mod=lambda b, h, qi, ki: (qi >= ki) & (qi > 0)).trace()
    out, lse = attention_reference(q, k, v, ir, bind, sinks=sinks, enable_gqa=True)
    dout = rng.randn(*out.shape, dtype=torch.float64)
    dlse = rng.randn(*lse.shape, dtype=torch.float64) if with_dlse else None
    outs, grads = [out], [dout]
    if dlse is not None:
        outs, grads = [out, lse], [dout, dlse]
    (want,) = torch.autograd.grad(outs, [sinks], grads)
    got = sinks_grad(sinks.detach(), out.detach(), lse.detach(), dout, dlse)
    torch.testing.assert_close(got, want.float().to(got.dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_cpu_path_with_sinks(rng, dtype):
    q, k, v = rng.qkv(2, 4, 16, 8, Hkv=2, dtype=dtype)
    sinks = rng.randn(4)
    bm = attncc.create_block_mask(causal, None, None, 16, 16, BLOCK_SIZE=8)
    out, lse = attncc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True,
                                     sinks=sinks)
    keep = torch.ones(16, 16, dtype=torch.bool).tril()
    want_o, want_l = naive(*_f64(q, k, v), sinks.double(), keep)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_o, rtol=0, atol=1e-2 if dtype != torch.float32
                               else 1e-6)
    torch.testing.assert_close(lse.double(), want_l, rtol=1e-6, atol=1e-6)
    plain = attncc.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert not torch.allclose(plain.float(), out.float())  # the sink changed something


def test_flex_cpu_autograd_reaches_sinks(rng):
    q, k, v = (t.requires_grad_(True) for t in rng.qkv(1, 2, 8, 8))
    sinks = rng.randn(2).requires_grad_(True)
    out, lse = attncc.flex_attention(q, k, v, return_lse=True, sinks=sinks)
    (out.square().sum() + lse.sum()).backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    assert float(sinks.grad.abs().sum()) > 0


def test_flex_sinks_under_torch_compile_and_opcheck(rng):
    import torch._dynamo

    from attncc.runtime.flex import ops
    from attncc.runtime.flex.api import EAGER_CHECKS

    torch._dynamo.reset()
    try:
        q, k, v = rng.qkv(1, 2, 16, 8)
        sinks = rng.randn(2)

        def fn(q, k, v, sinks):
            return attncc.flex_attention(q, k, v, return_lse=True, sinks=sinks)

        got = torch.compile(fn, backend="eager", fullgraph=True)(q, k, v, sinks)
        want = fn(q, k, v, sinks)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # gradients through the op (the reference recomputed) equal eager ones, sinks included
        grads = []
        for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
            args = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
            o, l = f(*args)
            (o.square().sum() + l.sum()).backward()
            grads.append([a.grad for a in args])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        key = ops.register(*ops.hooks_of(None), None, (), (), EAGER_CHECKS)[0]
        args = (q, k, v, None, None, None, None, [0, 0], [0, 0], [], [], [], key, None, False,
                sinks.requires_grad_(True))
        torch.library.opcheck(torch.ops.attncc.flex_attention.default, args)
        out, lse = torch.ops.attncc.flex_attention(*args)
        bargs = (q, k, v, out.detach(), lse.detach(), torch.ones_like(out), None,
                 *args[3:15], sinks.detach())
        torch.library.opcheck(torch.ops.attncc.flex_attention_backward.default, bargs,
                              test_utils=("test_schema", "test_faketensor"))
    finally:
        torch._dynamo.reset()


def test_merge_with_a_sink_equals_whole_attention_with_it(rng):
    """Partial states over two KV halves (no sink) merged with the sink once: the whole-row
    state with the sink, for merge_state and merge_states, [tokens, H] states with [H] sinks."""
    q, k, v = _f64(*rng.qkv(1, 3, 5, 8, Skv=12))
    sinks = rng.randn(3, dtype=torch.float64)
    ir = Variant().trace()[0]
    parts = [attention_reference(q, k[:, :, a:b], v[:, :, a:b], ir) for a, b in ((0, 7), (7, 12))]
    want_o, want_l = attention_reference(q, k, v, ir, sinks=sinks)
    t = lambda x: x[0].transpose(0, 1)  # [B=1, H, S, ...] -> [S, H, ...]
    o, l = attncc.merge_state(t(parts[0][0]), t(parts[0][1]), t(parts[1][0]), t(parts[1][1]),
                              sink=sinks)
    torch.testing.assert_close(o, t(want_o), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(l, t(want_l), rtol=1e-12, atol=1e-13)
    o2, l2 = attncc.merge_states(torch.stack([t(p[0]) for p in parts]),
                                 torch.stack([t(p[1]) for p in parts]), sink=sinks)
    torch.testing.assert_close(o2, t(want_o), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(l2, t(want_l), rtol=1e-12, atol=1e-13)
    ninf = torch.full((2, 3), -math.inf, dtype=torch.float64)
    nan = torch.full((2, 3, 4), math.nan, dtype=torch.float64)
    o3, l3 = attncc.merge_state(nan, ninf, nan, ninf, sink=sinks)  # two empty states
    assert torch.equal(o3, torch.zeros_like(o3)) and torch.equal(l3, sinks.expand(2, 3))


def test_merge_sink_errors():
    o, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(InvalidArgument, match="does not broadcast"):
        attncc.merge_state(o, lse, o, lse, sink=torch.zeros(2))
    with pytest.raises(InvalidArgument, match="finite"):
        attncc.merge_state(o, lse, o, lse, sink=torch.tensor([0.0, math.inf, 0.0]))
    with pytest.raises(InvalidArgumentType, match="sink must be a torch.Tensor"):
        attncc.merge_states(o[None], lse[None], sink=1.0)


def test_batch_reference_with_sinks_is_per_request_attention(rng):
    q = rng.randn(5, 4, 16, dtype=torch.float64)
    k, v = rng.randn(3, 8, 2, 16, dtype=torch.float64), rng.randn(3, 8, 2, 16, dtype=torch.float64)
    sinks = rng.randn(4, dtype=torch.float64)
    out, lse = batch_attention_reference(q, (k, v), [0, 2, 5], [0, 1, 3], [2, 0, 1], [5, 8],
                                         page_size=8, sinks=sinks)
    # request 0: page 2, 5 tokens, 2 queries; request 1: pages 0, 1 (16 tokens), 3 queries
    for (t0, t1), ks, vs, n in (((0, 2), k[2], v[2], 5),
                                ((2, 5), torch.cat([k[0], k[1]]), torch.cat([v[0], v[1]]), 16)):
        qi = q[t0:t1].transpose(0, 1)[None]
        kk, vv = ks[:n].transpose(0, 1)[None], vs[:n].transpose(0, 1)[None]
        want_o, want_l = naive(qi, kk, vv, sinks)  # the plain variant: every key kept
        torch.testing.assert_close(out[t0:t1], want_o[0].transpose(0, 1), rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(lse[t0:t1], want_l[0].transpose(0, 1), rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("bad,err,match", [
    (torch.zeros(3), InvalidArgument, r"sinks has shape \(3,\); it must be \[4\]"),
    (torch.zeros(1, 4), InvalidArgument, r"it must be \[4\]"),
    (torch.zeros(4, dtype=torch.float16), InvalidArgument, "use float32 or the queries' dtype"),
    (torch.tensor([0.0, math.nan, 0.0, 0.0]), InvalidArgument, "NaN or an infinity"),
    (torch.tensor([0.0, -math.inf, 0.0, 0.0]), InvalidArgument, "NaN or an infinity"),
    ([0.0] * 4, InvalidArgumentType, "sinks must be a torch.Tensor"),
    (torch.zeros(4, device="meta"), InvalidArgument, "sinks is on meta"),
])
def test_bad_sinks_are_clear_errors(rng, bad, err, match):
    q, k, v = rng.qkv(1, 4, 8, 8)
    with pytest.raises(err, match=match):
        attncc.flex_attention(q, k, v, sinks=bad)


def test_sinks_without_softmax_is_an_error(rng):
    q, k, v = rng.qkv(1, 2, 4, 8)
    lin = Variant(score_mod=lambda s, b, h, qi, ki: torch.sigmoid(s), normalize="none")
    with pytest.raises(InvalidArgument, match="normalize='none'"):
        attncc.flex_attention(q, k, v, score_mod=lin, sinks=torch.zeros(2))
    with pytest.raises(InvalidArgument, match="normalize='none'"):
        attention_reference(q, k, v, lin.trace()[0], sinks=torch.zeros(2))
