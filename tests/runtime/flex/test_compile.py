"""torch.compile around attncc.flex_attention on the CPU (the reference op): no graph breaks,
outputs and gradients equal to eager, a new captured scalar gives the new result without a new
variant, and torch.library.opcheck passes for the ops (docs/compile.md)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import attncc
from attncc.errors import InvalidArgument
from attncc.runtime.flex import ops
from attncc.runtime.flex.api import EAGER_CHECKS

BIAS = torch.randn(4, generator=torch.Generator().manual_seed(1))
SCALE = 0.5
WINDOW = 20


def biased(score, b, h, q_idx, kv_idx):
    return score * SCALE + BIAS[h] - (q_idx - kv_idx).abs() * 0.01


def windowed(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx - kv_idx < WINDOW, score, score - 1.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _make_alibi(slopes, cap):
    def alibi(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh((score - slopes[h] * (q_idx - kv_idx)) / cap)
    return alibi


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(rng, B=2, Hq=4, Hkv=4, S=48, D=16, grad=False):
    q = rng.randn(B, Hq, S, D)
    k, v = rng.randn(B, Hkv, S, D), rng.randn(B, Hkv, S, D)
    return [t.requires_grad_(grad) for t in (q, k, v)]


CASES = {
    "captured": dict(score_mod=biased),
    "block_mask": dict(score_mod=windowed, block_mask="attncc"),
    "torch_block_mask": dict(score_mod=biased, block_mask="torch"),
    "gqa": dict(score_mod=biased, enable_gqa=True),
    "lse": dict(score_mod=biased, block_mask="attncc", return_lse=True),
}
MODES = [dict(fullgraph=True), dict(fullgraph=True, dynamic=True), dict(fullgraph=False)]


def _kwargs(case, S):
    kw = dict(CASES[case])
    if kw.get("block_mask") == "attncc":
        kw["block_mask"] = attncc.create_block_mask(causal, None, None, S, S, BLOCK_SIZE=16)
    elif kw.get("block_mask") == "torch":
        kw["block_mask"] = torch_create_block_mask(causal, None, None, S, S, device="cpu",
                                                   BLOCK_SIZE=16)
    return kw


def _same(a, b):
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        return all(_same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES, ids=["fullgraph", "dynamic", "default"])
@pytest.mark.parametrize("case", list(CASES))
def test_matrix_equals_eager_without_graph_breaks(rng, case, mode):
    q, k, v = _qkv(rng, Hkv=2 if case == "gqa" else 4)
    kw = _kwargs(case, q.shape[2])

    def fn(q, k, v):
        return attncc.flex_attention(q, k, v, **kw)

    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", **mode)
    assert _same(compiled(q, k, v), fn(q, k, v))


def test_dynamic_sequence_lengths_compile_once(rng):
    cnt = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=biased,
                                                             return_lse=True),
                       backend=cnt, fullgraph=True, dynamic=True)
    for S in (33, 48, 70):
        q, k, v = _qkv(rng, S=S)
        assert _same(fn(q, k, v), attncc.flex_attention(q, k, v, score_mod=biased,
                                                        return_lse=True))
    assert cnt.frame_count == 1


def test_inductor_fullgraph_dynamic(rng):
    q, k, v = _qkv(rng, S=40)
    bm = attncc.create_block_mask(causal, None, None, 40, 40, BLOCK_SIZE=16)

    def fn(q, k, v):
        out = attncc.flex_attention(q, k, v, score_mod=biased, block_mask=bm)
        return out * 2 + 1  # something for inductor to generate around the op

    got = torch.compile(fn, fullgraph=True, dynamic=True)(q, k, v)
    torch.testing.assert_close(got, fn(q, k, v), rtol=0, atol=1e-6)


def test_new_scalar_value_new_result_same_variant(rng):
    """A captured float: Dynamo specializes it (a float op argument), so a new value re-traces
    the graph -- but registers no new variant (the kernel is keyed by the variant's IR)."""
    global SCALE
    q, k, v = _qkv(rng)
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=biased),
                       backend="aot_eager", fullgraph=True)
    old = SCALE
    try:
        fn(q, k, v)
        n = len(ops._ENTRIES)
        for SCALE in (0.25, 2.0, -1.5):
            assert _same(fn(q, k, v), attncc.flex_attention(q, k, v, score_mod=biased))
        assert len(ops._ENTRIES) == n
    finally:
        SCALE = old


def test_new_int_scalar_same_variant(rng):
    """A captured int: Dynamo specializes ints read from closures and globals, so a new value
    re-traces the graph, with the variant (and kernel) it already has."""
    global WINDOW
    q, k, v = _qkv(rng)
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=windowed),
                       backend="aot_eager", fullgraph=True)
    old = WINDOW
    try:
        fn(q, k, v)
        n = len(ops._ENTRIES)
        for WINDOW in (5, 9, 1):
            assert _same(fn(q, k, v), attncc.flex_attention(q, k, v, score_mod=windowed))
        assert len(ops._ENTRIES) == n
    finally:
        WINDOW = old


def test_closure_from_a_factory_new_instances(rng):
    """Closures made outside the compiled function: a new instance with other captured tensors
    and scalars gives its own result."""
    q, k, v = _qkv(rng)
    box = {}
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=box["mod"]),
                       backend="aot_eager", fullgraph=True)
    for cap in (5.0, 30.0):
        box["mod"] = _make_alibi(rng.randn(4).abs(), cap)
        assert _same(fn(q, k, v), attncc.flex_attention(q, k, v, score_mod=box["mod"]))


def test_variant_and_mod_defined_inside_with_constants(rng):
    q, k, v = _qkv(rng)
    variant = attncc.Variant(score_mod=biased, mask_mod=lambda b, h, qi, ki: qi - ki < 10)

    def fn(q, k, v):
        c = 0.75

        def inner(score, b, h, q_idx, kv_idx):
            return score * c

        a = attncc.flex_attention(q, k, v, score_mod=variant, kernel_options={"BLOCK_M": 64})
        return a + attncc.flex_attention(q, k, v, score_mod=inner)

    assert torch._dynamo.explain(fn)(q, k, v).graph_break_count == 0
    assert _same(torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v), fn(q, k, v))


def test_gradients_equal_eager(rng):
    """Backward through the op (attncc::flex_attention_backward: autograd through the float64
    reference) matches eager autograd, captured float tensors included."""
    bias = rng.randn(4).requires_grad_(True)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    bm = attncc.create_block_mask(causal, None, None, 48, 48, BLOCK_SIZE=16)

    def fn(q, k, v):
        out, lse = attncc.flex_attention(q, k, v, score_mod=mod, block_mask=bm, return_lse=True)
        return (out * out).sum() + lse.sum()

    grads = []
    for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
        q, k, v = _qkv(rng, grad=True)
        for t in (q, k, v):  # the same inputs both times
            t.data.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape).sin())
        bias.grad = None
        f(q, k, v).backward()
        grads.append([q.grad, k.grad, v.grad, bias.grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _op_args(q, k, v, bm, mod):
    plan = ops.register(*ops.hooks_of(mod), bm.mask_mod, (), tuple(bm.bindings.tensors),
                        EAGER_CHECKS)
    key, _, freads, ireads, treads, _ = plan
    roots = (mod, bm.mask_mod, bm)
    tensors = [ops._read(roots, r) for r in treads]
    floats = [float(ops._read(roots, r, x)) for r, x in freads]
    ints = [int(ops._read(roots, r, x)) for r, x in ireads]
    return (q, k, v, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
            bm.full_kv_indices, list(bm.BLOCK_SIZE), list(bm.seq_lengths), tensors, floats,
            ints, key, None, False)


def test_opcheck_forward_and_backward(rng):
    q, k, v = _qkv(rng, S=40, grad=True)
    bias = rng.randn(4).requires_grad_(True)

    def mod(score, b, h, q_idx, kv_idx):
        return score * SCALE + bias[h]

    bm = attncc.create_block_mask(causal, None, None, 40, 40, BLOCK_SIZE=16)
    args = _op_args(q, k, v, bm, mod)
    assert args[9][0] is bias and args[10] == [SCALE]
    torch.library.opcheck(torch.ops.attncc.flex_attention.default, args)
    out, lse = torch.ops.attncc.flex_attention(*args)
    g = rng.randn(*out.shape)
    bargs = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), g, None,
             *args[3:])
    torch.library.opcheck(torch.ops.attncc.flex_attention_backward.default, bargs,
                          test_utils=("test_schema", "test_faketensor"))


def test_unknown_variant_key_is_a_clear_error(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(InvalidArgument, match="variant_key 12345 is not registered"):
        torch.ops.attncc.flex_attention(q, k, v, None, None, None, None, [0, 0], [0, 0], [],
                                        [], [], 12345, None, False)


def test_unguardable_capture_is_a_clear_error(rng):
    class Config:
        scale = 2.0

    cfg = Config()

    def mod(score, b, h, q_idx, kv_idx):
        return score * cfg.scale

    q, k, v = _qkv(rng)
    fn = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=mod),
                       backend="aot_eager", fullgraph=True)
    # Dynamo re-raises what register raised at trace time as InternalTorchDynamoError,
    # keeping the message
    with pytest.raises(Exception, match="TraceError: .* cannot be guarded: 'cfg' is a .*Config object"):
        fn(q, k, v)


def test_return_lse_without_softmax_is_an_error(rng):
    q, k, v = _qkv(rng)
    sig = attncc.Variant(score_mod=lambda s, b, h, qi, ki: torch.sigmoid(s), normalize="none")
    ok = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=sig),
                       backend="aot_eager", fullgraph=True)
    assert _same(ok(q, k, v), attncc.flex_attention(q, k, v, score_mod=sig))
    torch._dynamo.reset()
    bad = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=sig,
                                                              return_lse=True),
                        backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="normalize='none'"):
        bad(q, k, v)


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so flex_backward takes its kernel branch."""

    @property
    def is_cuda(self):  # noqa: D401
        return True


def test_op_backward_gets_the_forward_kernel_options(rng, monkeypatch):
    """The op's backward runs with the kernel_options the compiled call was given (the registry
    entry's), as an eager call's backward does: DETERMINISTIC inside torch.compile is honoured,
    not dropped."""
    from attncc.runtime.flex import autograd

    def mod(score, b, h, q_idx, kv_idx):
        return score * SCALE

    bm = attncc.create_block_mask(causal, None, None, 32, 32, BLOCK_SIZE=16)
    opts = (("BACKWARD_KERNEL", "fa2"), ("DETERMINISTIC", True))
    key = ops.register(*ops.hooks_of(mod), bm.mask_mod, opts, tuple(bm.bindings.tensors),
                       EAGER_CHECKS)[0]
    seen = {}

    def fake(q, k, v, out, lse, dout, dlse, ir, bindings, block_mask, scale, gqa,
             kernel_options=None):
        seen["kernel_options"] = kernel_options
        return q, k, v, {}

    monkeypatch.setattr(autograd, "backward_of_saved", fake)
    q, k, v = (t.to(torch.bfloat16).as_subclass(_CudaLooking) for t in _qkv(rng, S=32))
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3])
    dq, dk, dv, dcap, dsinks = ops.flex_backward(q, k, v, out, lse, torch.ones_like(q), None,
                                                 ops.entry_for(key), ops.Bindings(), bm, None,
                                                 False, [])
    assert seen["kernel_options"] == {"BACKWARD_KERNEL": "fa2", "DETERMINISTIC": True}
    assert dq is q and dcap == [] and dsinks is None
