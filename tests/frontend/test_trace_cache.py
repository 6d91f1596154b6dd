"""The trace cache: `Variant.trace()` (and `flex_attention` with a plain function) reuses the last
trace while its `TraceGuard` vouches that a fresh trace would give exactly the same IR, with the
captures' current values; anything that could change the IR traces again."""
from __future__ import annotations

import copy
import gc
import math
import statistics
import time
from typing import Any, Callable

import pytest
import torch

import attncc
from attncc.errors import TraceError
from attncc.frontend import Variant
from attncc.frontend.trace import trace_mods, trace_mods_guarded
from attncc.ir.evaluator import evaluate
from attncc.runtime.flex import api as flex_mod
from attncc.gym import GYM, alibi, softcap
from tests.helpers.grid import score_grid

B, H, Q, K = 2, 3, 9, 11


def _grid() -> dict[str, torch.Tensor]:
    return score_grid(B, H, Q, K)


def _fresh(v: Variant) -> tuple[Any, Any]:
    """A trace that no cache can answer."""
    ir, bind, _ = trace_mods_guarded(v.mods(), normalize=v.normalize, name=v.name)
    return ir, bind


def _same_trace(got: tuple[Any, Any], want: tuple[Any, Any]) -> None:
    (ir, bind), (ir2, bind2) = got, want
    assert ir == ir2  # hooks are interned nodes: equal IR is the same expressions
    assert ir.format() == ir2.format()
    assert bind.scalars == bind2.scalars
    assert list(bind.scalars) == list(bind2.scalars)
    assert bind.tensors.keys() == bind2.tensors.keys()
    assert all(bind.tensors[n] is bind2.tensors[n] for n in bind.tensors)


def _check_score(v: Variant, fn: Callable[..., Any]) -> None:
    """The (cached) trace evaluates like the plain function, with current captured values."""
    ir, bind = v.trace()
    env = _grid()
    got = evaluate(ir.expr("score_mod"), env, bind.tensors, bind.scalars, torch.float64)
    want = fn(env["score"], env["b"], env["h"], env["q_idx"], env["kv_idx"])
    want = torch.as_tensor(want, dtype=torch.float64).expand_as(env["score"])
    torch.testing.assert_close(got.expand_as(want), want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ reuse


@pytest.mark.parametrize("name", sorted(GYM))
def test_cached_trace_equals_a_fresh_trace(name: str) -> None:
    v = GYM[name](B, H, 64, 16)
    ir, bind = v.trace()
    ir2, bind2 = v.trace()
    assert ir2 is ir
    _same_trace((ir2, bind2), _fresh(v))
    assert bind2 is not bind and bind2.scalars is not bind.scalars  # fresh dicts every call


def test_trace_mods_keeps_its_signature() -> None:
    ir, bind = trace_mods({"score_mod": softcap(30.0)})
    assert bind.scalars == {"cap": 30.0}
    assert ir.format() == trace_mods_guarded({"score_mod": softcap(30.0)})[0].format()


def _closure() -> tuple[Callable[..., Any], Callable[[Any], None]]:
    cap = 30.0

    def capped(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def set_cap(value: Any) -> None:
        nonlocal cap
        cap = value

    return capped, set_cap


def test_new_closure_float_changes_bindings_not_ir() -> None:
    mod, set_cap = _closure()
    v = Variant(score_mod=mod)
    ir, bind = v.trace()
    assert bind.scalars == {"cap": 30.0}
    set_cap(7.5)
    ir2, bind2 = v.trace()
    assert ir2 is ir and bind2.scalars == {"cap": 7.5}
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, mod)


def test_param_kind_change_traces_again() -> None:
    mod, set_cap = _closure()
    v = Variant(score_mod=mod)
    ir, _ = v.trace()
    for value, dtype in ((3, "i32"), (True, None), (4.0, "f32")):
        set_cap(value)
        ir2, bind2 = v.trace()
        assert ir2 is not ir
        _same_trace((ir2, bind2), _fresh(v))
        assert [p.dtype.value for p in ir2.scalars] == ([dtype] if dtype else [])
        _check_score(v, mod)
        ir = ir2
    assert v.trace()[0] is v.trace()[0]
    set_cap(2**40)  # an int beyond i32 is a Python constant, which cannot be traced either
    with pytest.raises(TraceError, match="32 bits"):
        v.trace()


CACHE_CAP = 20.0


def _global_softcap(score, b, h, q_idx, kv_idx):
    return CACHE_CAP * torch.tanh(score / CACHE_CAP)


def test_new_module_global_float_changes_bindings_not_ir(monkeypatch: pytest.MonkeyPatch) -> None:
    v = Variant(score_mod=_global_softcap)
    ir, bind = v.trace()
    assert bind.scalars == {"CACHE_CAP": 20.0}
    monkeypatch.setitem(_global_softcap.__globals__, "CACHE_CAP", 3.25)
    ir2, bind2 = v.trace()
    assert ir2 is ir and bind2.scalars == {"CACHE_CAP": 3.25}
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, _global_softcap)
    monkeypatch.delitem(_global_softcap.__globals__, "CACHE_CAP")  # a global that disappeared
    with pytest.raises(TraceError, match="CACHE_CAP"):  # traced again, not answered from cache
        v.trace()


# --------------------------------------------------------------------- re-tracing cases


def test_new_tensor_object_traces_again() -> None:
    slopes = torch.rand(H, dtype=torch.float64)

    def bias(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    v = Variant(score_mod=bias)
    ir, bind = v.trace()
    slopes.mul_(2)  # in-place: the same tensor, read by the kernel at run time
    assert v.trace()[0] is ir
    _check_score(v, bias)
    slopes = torch.rand(H, dtype=torch.float32)  # another object (another dtype too)
    ir2, bind2 = v.trace()
    assert ir2 is not ir and bind2.tensors["slopes"] is slopes
    assert [t.elem for t in ir2.tensors] == ["float32"]
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, bias)
    assert v.trace()[0] is ir2


def test_frozen_scalar_used_in_if_traces_again() -> None:
    n = 2

    def stepped(score, b, h, q_idx, kv_idx):
        if n > 1:  # a Python value: baked into the IR
            return score * n + q_idx
        return score - kv_idx

    v = Variant(score_mod=stepped)
    ir, bind = v.trace()
    assert bind.scalars == {}
    assert v.trace()[0] is ir
    n = 3
    ir2, bind2 = v.trace()
    assert ir2 is not ir
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, stepped)
    n = 0
    _check_score(v, stepped)
    assert v.trace()[0] is v.trace()[0]


def test_bool_capture_traces_again() -> None:
    causal = True

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) if causal else (kv_idx >= 0)

    v = Variant(mask_mod=mask)
    ir, _ = v.trace()
    assert v.trace()[0] is ir
    causal = False
    ir2, bind2 = v.trace()
    assert ir2 is not ir
    _same_trace((ir2, bind2), _fresh(v))
    assert "kv_idx >= 0" in ir2.format()


def _double(x):
    return x * 2


def _square(x):
    return x * x


def test_swapped_or_edited_helper_function_traces_again() -> None:
    helper = _double

    def mod(score, b, h, q_idx, kv_idx):
        return helper(score) + 1

    v = Variant(score_mod=mod)
    ir, _ = v.trace()
    assert v.trace()[0] is ir
    helper = _square
    ir2, bind2 = v.trace()
    assert ir2 is not ir
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, mod)

    def local_helper(x):
        return x - 1

    helper = local_helper
    ir3, _ = v.trace()
    assert v.trace()[0] is ir3
    local_helper.__code__ = _double.__code__  # same object, new code
    ir4, bind4 = v.trace()
    assert ir4 is not ir3
    _same_trace((ir4, bind4), _fresh(v))
    _check_score(v, mod)


def test_defaults_and_top_level_code_are_guarded() -> None:
    def mod(score, b, h, q_idx, kv_idx, k=2.0):
        return score * k

    v = Variant(score_mod=mod)
    ir, _ = v.trace()
    mod.__defaults__ = (5.0,)
    ir2, bind2 = v.trace()
    assert ir2 is not ir
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, mod)
    mod.__code__ = (lambda score, b, h, q_idx, kv_idx, k=1.0: score + k).__code__
    ir3, bind3 = v.trace()
    assert ir3 is not ir2
    _same_trace((ir3, bind3), _fresh(v))
    _check_score(v, mod)


def test_mutated_list_of_constants_traces_again() -> None:
    weights = [0.5, 2.0]

    def mod(score, b, h, q_idx, kv_idx):
        return score * weights[0] + weights[1]

    v = Variant(score_mod=mod)
    ir, _ = v.trace()
    assert v.trace()[0] is ir
    weights[1] = 3.0
    ir2, bind2 = v.trace()
    assert ir2 is not ir
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, mod)


def test_global_that_appears_traces_again(monkeypatch: pytest.MonkeyPatch) -> None:
    def mod(score, b, h, q_idx, kv_idx):
        return abs(score)  # the builtin, until the module defines its own `abs`

    v = Variant(score_mod=mod)
    ir, _ = v.trace()
    assert v.trace()[0] is ir
    monkeypatch.setitem(mod.__globals__, "abs", lambda x: x * 3)
    ir2, bind2 = v.trace()
    assert ir2 is not ir
    _same_trace((ir2, bind2), _fresh(v))
    _check_score(v, mod)


# ------------------------------------------------------------------- never cached


class _Config:
    def __init__(self, scale: float) -> None:
        self.scale = scale


def test_arbitrary_object_capture_never_caches() -> None:
    cfg = _Config(2.0)

    def mod(score, b, h, q_idx, kv_idx):
        return score * cfg.scale

    ir, bind, guard = trace_mods_guarded({"score_mod": mod})
    assert not guard.cacheable and "_Config object" in guard.reason
    assert guard.rebind() is None
    v = Variant(score_mod=mod)
    ir1, _ = v.trace()
    ir2, _ = v.trace()
    assert ir2 is not ir1
    cfg.scale = 5.0  # invisible to any guard: seen only because it traces again
    _check_score(v, mod)


def test_user_class_capture_never_caches() -> None:
    def mod(score, b, h, q_idx, kv_idx):
        return score + len(_Config.__name__)  # a user class: its attributes may change

    guard = trace_mods_guarded({"score_mod": mod})[2]
    assert not guard.cacheable and "class _Config" in guard.reason


def test_tensor_values_read_while_tracing_never_cache() -> None:
    table = torch.tensor([1.0, 2.0, 4.0])

    def peak(score, b, h, q_idx, kv_idx):
        return score * table.max().item()  # computed once, at trace time

    def converted(score, b, h, q_idx, kv_idx):
        return score + table.double()[h]  # a copy made at trace time

    def metadata(score, b, h, q_idx, kv_idx):
        return score + table[h % table.shape[0]] * table.dim()  # metadata only: cacheable

    for fn, cacheable in ((peak, False), (converted, False), (metadata, True)):
        guard = trace_mods_guarded({"score_mod": fn})[2]
        assert guard.cacheable is cacheable, (fn.__name__, guard.reason)
    v = Variant(score_mod=peak)
    v.trace()
    table.mul_(10)
    _check_score(v, peak)
    v = Variant(score_mod=converted)
    v.trace()
    table.add_(1)
    _check_score(v, converted)


def test_copies_do_not_share_the_cache() -> None:
    v = Variant(score_mod=softcap(30.0))
    ir, _ = v.trace()
    c = copy.copy(v)
    assert c == v and repr(c) == repr(v) and hash(c) == hash(v)
    assert "_trace_cache" not in c.__dict__
    assert c.trace()[0] is not ir and v.trace()[0] is ir


# ------------------------------------------------------------------------ flex_attention


def test_flex_attention_sees_a_new_captured_scalar() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    mod, set_cap = _closure()

    def want(cap: float) -> torch.Tensor:
        s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(8)
        return (torch.softmax(cap * torch.tanh(s / cap), -1) @ v.double()).float()

    out1 = attncc.flex_attention(q, k, v, score_mod=mod)
    ir1 = flex_mod._trace(flex_mod._as_variant(mod))[0]
    set_cap(0.5)
    out2 = attncc.flex_attention(q, k, v, score_mod=mod)
    assert flex_mod._trace(flex_mod._as_variant(mod))[0] is ir1  # simplified IR memoised too
    torch.testing.assert_close(out1, want(30.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2, want(0.5), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out1, out2, atol=1e-3)


def test_flex_attention_cache_does_not_keep_functions_alive() -> None:
    q = torch.randn(1, 1, 4, 8)
    before = len(flex_mod._FN_TRACE_CACHES)
    for cap in (1.0, 2.0, 3.0):
        attncc.flex_attention(q, q, q, score_mod=softcap(cap))
    gc.collect()
    assert len(flex_mod._FN_TRACE_CACHES) <= before


@pytest.mark.speed
def test_cached_flex_trace_is_fast() -> None:
    mod = alibi(16)

    def cached() -> None:
        flex_mod._trace(flex_mod._as_variant(mod))

    def uncached() -> None:
        flex_mod._trace(Variant(score_mod=mod))  # a new Variant has no trace yet

    def median_us(fn: Callable[[], None], n: int) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    cached(), uncached()  # warm up
    ratios = []
    for _ in range(3):  # the best of 3 rounds, so a noisy machine cannot fail it
        ratios.append(median_us(uncached, 30) / median_us(cached, 200))
        if ratios[-1] >= 5:
            break
    assert max(ratios) >= 5, ratios
