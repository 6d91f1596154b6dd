"""Hoisting query/key/value transforms into a pre-pass (attncc.ir.hoist, runtime/flex/prepass.py):
the split is exact, keeps only the captures each half reads, the launch-time choice follows K/V
reuse, and the pre-pass compiles without spills. GPU runs of both paths are in
tests/gpu/test_fa2.py and test_fa3.py."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import attncc
from attncc.ir.evaluator import evaluate
from attncc.ir.hoist import (KV_HOOKS, PREPASS_HOOKS, kv_loads_per_row, split_transforms,
                             transforms_in)
from attncc.ir.simplify import simplify_variant
from attncc.runtime.reference import attention_reference
from attncc.gym import rope


def _scaled_v(D: int) -> attncc.Variant:
    """A value_mod reading a captured tensor and another element, next to a score_mod that
    reads a different captured scalar."""
    w = torch.linspace(0.5, 1.5, D)
    bias = 0.25
    return attncc.Variant(value_mod=lambda v, b, h, kv, d: v[d] * w[d] - 0.5 * v[(d + 1) % D],
                          score_mod=lambda s, b, h, q, kv: s + bias * (q - kv) / 64,
                          name="scaled_v")


def _apply(pre: Any, bind: Any, hook: str, vec: str, x: torch.Tensor, pos: str = "kv_idx"
           ) -> torch.Tensor:
    """The pre-pass's arithmetic in float64 on CPU: hook(x) for every (b, h, position, d)."""
    B, H, S, D = x.shape
    env = {vec: x, "b": torch.arange(B).view(B, 1, 1, 1), "h": torch.arange(H).view(1, H, 1, 1),
           pos: torch.arange(S).view(1, 1, S, 1), "d": torch.arange(D).view(1, 1, 1, D)}
    tensors = {k: v.to(torch.float64) if v.is_floating_point() else v
               for k, v in bind.tensors.items()}
    out = evaluate(pre.hook(hook).expr, env, tensors, dict(bind.scalars), torch.float64)
    return out.expand(B, H, S, D)


def test_split_moves_only_the_kv_hooks_and_their_captures() -> None:
    ir, bind = _scaled_v(64).trace()
    pre, rest = split_transforms(simplify_variant(ir), KV_HOOKS)
    assert pre is not None
    assert sorted(pre.hooks) == ["value_mod"] and pre.name == "scaled_v_pre"
    assert "value_mod" not in rest.hooks and "score_mod" in rest.hooks
    pre_caps = {t.name for t in pre.tensors} | {s.name for s in pre.scalars}
    rest_caps = {t.name for t in rest.tensors} | {s.name for s in rest.scalars}
    assert pre_caps == {"D", "w"} and rest_caps == {"bias"}
    assert pre.normalize == rest.normalize == ir.normalize


def test_nothing_to_hoist_returns_the_variant_itself() -> None:
    ir, _ = attncc.Variant(mask_mod=lambda b, h, q, kv: q >= kv).trace()
    assert transforms_in(ir) == ()
    assert split_transforms(ir, PREPASS_HOOKS) == (None, ir)
    with pytest.raises(ValueError, match="score_mod"):
        split_transforms(ir, ("score_mod",))


@pytest.mark.parametrize("make", [lambda D: rope(D), lambda D: rope(D, interleaved=True),
                                  _scaled_v], ids=["rope", "rope_interleaved", "scaled_v"])
def test_prepass_then_rest_equals_the_whole_variant(make: Any) -> None:
    """attention(q, k, v; variant) == attention(query_mod(q), key_mod(k), value_mod(v); rest),
    in fp64."""
    torch.manual_seed(0)
    B, Hq, Hkv, S, D = 2, 4, 2, 37, 64
    q, k, v = (torch.randn(B, h, S, D, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    ir, bind = make(D).trace()
    pre, rest = split_transforms(simplify_variant(ir), PREPASS_HOOKS)
    assert pre is not None
    q2 = _apply(pre, bind, "query_mod", "q", q, "q_idx") if "query_mod" in pre.hooks else q
    k2 = _apply(pre, bind, "key_mod", "k", k) if "key_mod" in pre.hooks else k
    v2 = _apply(pre, bind, "value_mod", "v", v) if "value_mod" in pre.hooks else v
    ref, ref_lse = attention_reference(q, k, v, ir, bind, enable_gqa=True)
    got, got_lse = attention_reference(q2, k2, v2, rest, bind, enable_gqa=True)
    assert float((got - ref).norm() / ref.norm()) < 1e-12
    assert float((got_lse - ref_lse).abs().max()) < 1e-10


def test_kv_loads_per_row_counts_query_blocks_and_sharing_heads() -> None:
    # FA3: 128-row CTAs, one per (head, block); GQA-4 shares each KV row across 4 heads
    assert kv_loads_per_row(q_len=1000, num_q_heads=8, num_kv_heads=2, rows_per_cta=128) == 32
    assert kv_loads_per_row(q_len=128, num_q_heads=2, num_kv_heads=2, rows_per_cta=128) == 1
    # FA2 head fusion: a 64-row CTA holds 4 heads x 16 positions
    assert kv_loads_per_row(q_len=16, num_q_heads=8, num_kv_heads=2, rows_per_cta=64,
                            head_fusion=4) == 1
    assert kv_loads_per_row(q_len=17, num_q_heads=8, num_kv_heads=2, rows_per_cta=64,
                            head_fusion=4) == 2


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prepass_compiles_without_spills(d: int, dtype: str) -> None:
    import re

    from attncc.runtime.jit import nvrtc
    from attncc.runtime.flex.prepass import prepass_source

    if not nvrtc.available():
        pytest.skip("NVRTC is not installed")
    ir, _ = rope(d).trace()
    pre, _ = split_transforms(simplify_variant(ir), PREPASS_HOOKS)
    gk = prepass_source(pre, head_dim=d, dtype=dtype)
    assert "PrepassParams p" in gk.source and "has_query_transform = true" in gk.source
    res = nvrtc.compile_cuda(gk.source, arch="sm_90a", verbose=True)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), res.log


def test_prepass_is_not_exported() -> None:
    from attncc.codegen.errors import CodegenError
    from attncc.codegen.generate import export_kernel

    ir, _ = rope(64).trace()
    pre, _ = split_transforms(simplify_variant(ir), KV_HOOKS)
    with pytest.raises(CodegenError, match="not exported"):
        export_kernel(pre, head_dim=64, dtype="bfloat16", kernel="prepass")


def test_prepass_choice_follows_kv_reuse_and_the_option() -> None:
    from attncc.runtime.flex.prepass import choose_prepass

    ir, _ = _scaled_v(64).trace()
    shape = dict(num_q_heads=8, num_kv_heads=2, rows_per_cta=128, head_fusion=1)
    assert choose_prepass(ir, option=None, q_len=1000, **shape) == ("value_mod",)
    assert choose_prepass(ir, option="auto", q_len=1000, **shape) == ("value_mod",)
    assert choose_prepass(ir, option="none", q_len=1000, **shape) == ()
    one = dict(num_q_heads=2, num_kv_heads=2, rows_per_cta=16, head_fusion=1)
    assert choose_prepass(ir, option=None, q_len=1, **one) == ()  # each V row loaded once
    assert choose_prepass(ir, option="kv", q_len=1, **one) == ("value_mod",)
    ir, _ = rope(64).trace()
    assert choose_prepass(ir, option="kv", q_len=1000, **shape) == ("key_mod",)
    assert choose_prepass(ir, option="qkv", q_len=1, **one) == ("query_mod", "key_mod")
    with pytest.raises(ValueError, match="PREPASS"):
        choose_prepass(ir, option="q", q_len=1, **one)
