"""Issue 30, op coverage: every torch function a mod can call means what torch computes.

Each `torch_ops.COVERAGE` name has cases (`tests/helpers/op_cases.py`) over edge inputs (0,
-0.0, +-inf, NaN, huge, tiny, int32 extremes, shift counts past 31). A case runs with torch on
float32 / int32 tensors, as FlexAttention runs a mod, and through attncc's trace, simplify and
CPU evaluator: the result type's kind is torch's, and the values agree bit for bit (NaN with
NaN, signed zeros by sign) in float32, and to float32 rounding in the float64 reference.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import attncc
from attncc.frontend import Variant
from attncc.frontend.torch_ops import COVERAGE, UNSUPPORTED
from attncc.ir.evaluator import evaluate
from attncc.ir.nodes import BOOL
from attncc.ir.simplify import simplify
from tests.helpers.op_cases import NK, NO_CASE, NQ, grid, make_mod, sources, tables, traced

SUPPORTED = sorted(n for n in COVERAGE if n not in UNSUPPORTED)
CASES = [(name, src) for name in SUPPORTED for src in sources(name)]


def same_bits(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Where two results agree: integers and booleans by value, floats by bits (any NaN)."""
    want, got = want.expand(NQ, NK), got.expand(NQ, NK)
    if not want.is_floating_point():
        return want.long() == got.long()
    got = got.float()
    return (want.view(torch.int32) == got.view(torch.int32)) | (want.isnan() & got.isnan())


def first_mismatch(src: str, ok: torch.Tensor, want: torch.Tensor, got: torch.Tensor) -> str:
    i, j = (int(t) for t in (~ok).nonzero()[0])
    tabs = tables()
    return (f"{src}: {int((~ok).sum())} of {ok.numel()} differ, e.g. q_idx={i} kv_idx={j} "
            f"(x={tabs['x'][i].item()}, y={tabs['y'][j].item()}, i={tabs['i'][i].item()}, "
            f"j={tabs['j'][j].item()}, k={tabs['k'][j].item()}): torch "
            f"{want.expand(NQ, NK)[i, j].item()!r}, attncc {got.expand(NQ, NK)[i, j].item()!r}")


def test_every_supported_op_has_cases() -> None:
    missing = [n for n in SUPPORTED if n not in NO_CASE and not sources(n)]
    assert not missing, f"COVERAGE names without a case in tests/helpers/op_cases.py: {missing}"
    assert len(CASES) > 300


@pytest.mark.parametrize("name,src", CASES, ids=[f"{n}:{s}" for n, s in CASES])
def test_op_matches_torch_on_cpu(name: str, src: str) -> None:
    fn = make_mod(src, tables())
    g = grid()
    want = torch.as_tensor(fn(**g))
    node, tensors = traced(fn, want)
    env = {k: v for k, v in g.items() if k != "score"}
    for expr, how in ((node, "as traced"), (simplify(node), "simplified")):
        got = evaluate(expr, env, tensors, {}, torch.float32)
        ok = same_bits(want, got)
        assert bool(ok.all()), f"{how}: {first_mismatch(src, ok, want, got)}"
    if want.is_floating_point():  # the float64 reference, rounded to float32
        ref = evaluate(simplify(node), env, tensors, {}, torch.float64).float().expand(NQ, NK)
        close = torch.isclose(ref, want.expand(NQ, NK), rtol=1e-5, atol=1e-12, equal_nan=True)
        assert bool(close.all()), f"float64: {first_mismatch(src, close, want, ref)}"


@pytest.mark.parametrize("src,what", [
    ("x[q_idx].double()", "torch.float64"), ("x[q_idx].half()", "torch.float16"),
    ("x[q_idx].to(torch.bfloat16)", "torch.bfloat16"), ("i[q_idx].short()", "torch.int16"),
    ("i[q_idx].byte()", "torch.uint8"), ("torch.float_power(x[q_idx], 2.0)", "float64"),
    ("torch.round(x[q_idx], decimals=2)", "decimals=2"),
    ("torch.add(x[q_idx], y[kv_idx], alpha=0.5)", "alpha=0.5"),
    ("torch.frac(i[q_idx])", "integer"), ("x[q_idx] & 1", "'&' on a float"),
    ("~x[q_idx]", "'~' on a float"), ("x[q_idx] << 1", "'<<' on a float"),
    ("torch.full_like(i[q_idx], float('inf'))", "cannot be converted"),
    ("i[q_idx].new_ones((2, 3))", "size (2, 3)"), ("torch.maximum(x[q_idx])", "arguments"),
    ("torch.isclose(i[q_idx], j[kv_idx])", "isclose of integer"),
    ("torch.digamma(x[q_idx])", "not supported"), ("x[q_idx].sum(0)", "sum"),
])
def test_inexact_or_unsupported_ops_raise_a_trace_error_at_the_line(src: str, what: str) -> None:
    fn = make_mod(src, tables())
    with pytest.raises(attncc.TraceError, match="op case") as info:
        Variant(score_mod=fn).trace()
    assert what in str(info.value), str(info.value)


def test_tensor_attributes_read_as_torch_reports_them() -> None:
    def mod(score, b, h, q_idx, kv_idx):
        assert score.dtype == torch.float32 and q_idx.dtype == torch.int32
        assert score.shape == () and q_idx.ndim == 0 and score.is_floating_point()
        return score + q_idx.to(score.dtype) + torch.zeros_like(score, device=score.device)

    ir, _ = Variant(score_mod=mod).trace()
    assert str(ir.expr("score_mod")) == "<score + f32(q_idx) + 0.0 : f32>"


def test_torch_mask_helpers_trace_and_run() -> None:
    """torch's and_masks / or_masks / noop_mask call b.new_ones / new_zeros: they trace, build a
    block mask, and mask an attncc.Variant exactly as torch's flex_attention masks."""
    from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 48

    def sink(b, h, q_idx, kv_idx):
        return kv_idx < 4

    mask = or_masks(and_masks(causal, window), and_masks(sink, noop_mask))
    ir, _ = Variant(mask_mod=mask).trace()
    assert ir.expr("mask_mod").dtype is BOOL
    S, H, D = 256, 2, 64
    g = torch.Generator().manual_seed(30)
    q, k, v = (torch.randn(1, H, S, D, generator=g) for _ in range(3))
    bm = attncc.create_block_mask(mask, None, None, S, S, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "flex_attention called without compile"
        want = torch_flex(q, k, v, block_mask=torch_block_mask(mask, None, None, S, S,
                                                                device="cpu"))
    assert 0.2 < bm.sparsity() / 100 < 0.9  # the block mask really skips blocks
    got = attncc.flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    got = attncc.flex_attention(q, k, v, score_mod=attncc.Variant(mask_mod=mask))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
