"""The Python frontend: every supported op and capture form traces to IR that evaluates exactly
like the plain function on tensors; unsupported Python raises TraceError naming file and line."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.frontend import Variant, and_masks, noop_mask, or_masks
from attncc.ir.evaluator import evaluate
from tests.helpers.grid import score_grid

B, H, Q, K, D = 2, 3, 9, 11, 8


def _grid(seed: int = 0) -> dict[str, torch.Tensor]:
    return score_grid(B, H, Q, K, seed)


def _check_score_mod(fn) -> None:
    ir, bind = Variant(score_mod=fn).trace()
    env = _grid()
    got = evaluate(ir.expr("score_mod"), env, bind.tensors, bind.scalars, torch.float64)
    want = fn(env["score"], env["b"], env["h"], env["q_idx"], env["kv_idx"])
    want = torch.as_tensor(want, dtype=torch.float64).expand_as(env["score"])
    torch.testing.assert_close(got.expand_as(want), want, rtol=1e-6, atol=1e-6, equal_nan=True)


def _check_mask_mod(fn) -> None:
    ir, bind = Variant(mask_mod=fn).trace()
    env = _grid()
    got = evaluate(ir.expr("mask_mod"), env, bind.tensors, bind.scalars)
    want = fn(env["b"], env["h"], env["q_idx"], env["kv_idx"])
    shape = torch.broadcast_shapes(got.shape, torch.as_tensor(want).shape)
    assert torch.equal(got.expand(shape), torch.as_tensor(want).expand(shape))


ARITH = {
    "add": lambda s, b, h, q, k: s + 1.5 + q,
    "sub": lambda s, b, h, q, k: 2 - s - k,
    "mul": lambda s, b, h, q, k: s * 0.5 * (h + 1),
    "truediv": lambda s, b, h, q, k: s / 3 + q / (k + 1),
    "floordiv": lambda s, b, h, q, k: s + (q - k) // 3 + (k - 2 * q) // -4,
    "mod": lambda s, b, h, q, k: s + (q - k) % 5 + (k - q) % -3,
    "float_floordiv_mod": lambda s, b, h, q, k: s // 0.7 + s % 1.3,
    "pow": lambda s, b, h, q, k: s.abs() ** 0.5 + 2 ** (q / 4),
    "neg_pos_abs": lambda s, b, h, q, k: -s + (+s) + abs(s - q),
    "where": lambda s, b, h, q, k: torch.where(q >= k, s, -s * 2),
    "tanh": lambda s, b, h, q, k: torch.tanh(s / 3),
    "exp_log": lambda s, b, h, q, k: torch.log(torch.exp(s / 4) + 1),
    "exp2_log2": lambda s, b, h, q, k: torch.log2(torch.exp2(s / 4) + 1),
    "sigmoid": lambda s, b, h, q, k: torch.sigmoid(s),
    "minmax": lambda s, b, h, q, k: torch.minimum(s, q * 1.0) + torch.maximum(s, -k * 0.5),
    "clamp": lambda s, b, h, q, k: torch.clamp(s, -1, 1) + (q - k).clamp(-2, 2),
    "clamp_kw": lambda s, b, h, q, k: torch.clamp(s, min=-0.5) + s.clamp(max=0.25),
    "sqrt_rsqrt": lambda s, b, h, q, k: torch.sqrt(s.abs() + 1) + torch.rsqrt(s.abs() + 1),
    "sin_cos": lambda s, b, h, q, k: torch.sin(s) * torch.cos(q * 0.1),
    "floor": lambda s, b, h, q, k: torch.floor(s) + torch.floor(q / 2),
    "torch_pow": lambda s, b, h, q, k: torch.pow(s.abs(), 1.5),
    "methods": lambda s, b, h, q, k: s.abs().tanh() + s.exp().log() + s.sigmoid(),
    "python_math_consts": lambda s, b, h, q, k: s * math.log2(math.e) + math.pi,
    "casts": lambda s, b, h, q, k: s + (q > k).float() + (s * 2).int() + (q - k).long(),
    "bool_arith": lambda s, b, h, q, k: s + (q >= k) * 2.0,
}


@pytest.mark.parametrize("name", sorted(ARITH))
def test_score_mod_op_matches_python(name: str) -> None:
    _check_score_mod(ARITH[name])


MASKS = {
    "compare": lambda b, h, q, k: q >= k,
    "and_or_not": lambda b, h, q, k: ((q >= k) & (q - k < 4)) | ~(h < 1),
    "eq_ne": lambda b, h, q, k: (q == k) | (b != 0),
    "xor": lambda b, h, q, k: (q > k) ^ (h == 1),
    "logical": lambda b, h, q, k: torch.logical_and(q >= k, torch.logical_not(k == 0)),
    "chunked": lambda b, h, q, k: q // 4 == k // 4,
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_mod_op_matches_python(name: str) -> None:
    _check_mask_mod(MASKS[name])


def test_captured_scalars_become_params_and_new_values_keep_the_ir() -> None:
    def make(cap: float, window: int):
        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        return Variant(score_mod=softcap, mask_mod=sliding)

    ir1, bind1 = make(30.0, 256).trace()
    ir2, bind2 = make(50.0, 1024).trace()
    assert ir1.hooks["score_mod"].expr is ir2.hooks["score_mod"].expr
    assert ir1.hooks["mask_mod"].expr is ir2.hooks["mask_mod"].expr
    assert [p.name for p in ir1.scalars] == ["cap", "window"]
    assert bind1.scalars == {"cap": 30.0, "window": 256}
    assert bind2.scalars == {"cap": 50.0, "window": 1024}
    _check_score_mod(make(7.0, 3).score_mod)
    _check_mask_mod(make(7.0, 3).mask_mod)


CAP_GLOBAL = 20.0


def test_captured_global_scalar_is_a_param() -> None:
    def softcap(score, b, h, q_idx, kv_idx):
        return CAP_GLOBAL * torch.tanh(score / CAP_GLOBAL)

    ir, bind = Variant(score_mod=softcap).trace()
    assert bind.scalars == {"CAP_GLOBAL": 20.0}
    _check_score_mod(softcap)


def test_captured_tensors_1d_2d_chained_and_0d() -> None:
    slopes = torch.rand(H, dtype=torch.float64)
    table = torch.randn(H, 256)
    doc = torch.randint(0, 3, (B, max(Q, K)))
    scale0 = torch.tensor(0.25)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).clamp(-128, 127) + 128]

    def chained(score, b, h, q_idx, kv_idx):
        return score + table[h][kv_idx + 3]

    def zero_d(score, b, h, q_idx, kv_idx):
        return score * scale0 + scale0 * 2

    def document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    for fn in (alibi, rel, zero_d):
        _check_score_mod(fn)
    # chained indexing (needs vmap to run as plain torch) traces to the same load as t[h, i]
    def flat(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx + 3]

    assert Variant(score_mod=chained).trace()[0].expr("score_mod") is \
        Variant(score_mod=flat).trace()[0].expr("score_mod")
    _check_mask_mod(document)
    ir, bind = Variant(score_mod=alibi, mask_mod=document).trace()
    assert [(t.name, t.elem, t.ndim) for t in ir.tensors] == [("slopes", "float64", 1),
                                                             ("doc", "int64", 2)]
    assert bind.tensors["slopes"] is slopes


def test_tensor_captured_by_a_helper_function_and_bool_tensor() -> None:
    keep = torch.rand(H, K) > 0.3

    def lookup(h, kv_idx):
        return keep[h, kv_idx]

    def mask(b, h, q_idx, kv_idx):
        return lookup(h, kv_idx) & (q_idx >= 0)

    _check_mask_mod(mask)


def test_and_or_noop_masks_compose_and_capture_params() -> None:
    def window(w):
        return lambda b, h, q, kv: q - kv < w

    def causal(b, h, q, kv):
        return q >= kv

    both = and_masks(causal, window(3))
    either = or_masks(causal, window(2))
    _check_mask_mod(both)
    _check_mask_mod(either)
    _check_mask_mod(and_masks(noop_mask, causal))
    ir, bind = Variant(mask_mod=both).trace()
    assert bind.scalars == {"w": 3}
    assert Variant(mask_mod=noop_mask).trace()[0].expr("mask_mod").attr is True


def test_scalar_used_as_python_value_is_baked_as_constant() -> None:
    n = 3
    half = 4

    def repeated(score, b, h, q_idx, kv_idx):
        s = score
        for _ in range(n):
            s = s * 0.5
        return s + math.sqrt(half)

    ir, bind = Variant(score_mod=repeated).trace()
    assert bind.scalars == {}  # both became constants
    _check_score_mod(repeated)


def test_transform_hooks_read_vector_at_computed_positions() -> None:
    dim = D

    def rope_half(q, b, h, q_idx, d):
        theta = q_idx * torch.exp2(-(d % (dim // 2)).float() / (dim // 2) * 13.2877)
        other = q[(d + dim // 2) % dim]
        rot = torch.where(d < dim // 2, -other, other)
        return q[d] * torch.cos(theta) + rot * torch.sin(theta)

    ir, bind = Variant(query_mod=rope_half).trace()
    qt = torch.randn(B, H, Q, D, dtype=torch.float64)
    env = {"q": qt, "b": torch.arange(B).view(B, 1, 1, 1), "h": torch.arange(H).view(1, H, 1, 1),
           "q_idx": torch.arange(Q).view(1, 1, Q, 1), "d": torch.arange(D).view(1, 1, 1, D)}
    got = evaluate(ir.expr("query_mod"), env, bind.tensors, bind.scalars, torch.float64)
    pos = torch.arange(Q, dtype=torch.float64).view(Q, 1)
    freq = torch.exp2(-(torch.arange(D) % (D // 2)).double() / (D // 2) * 13.2877)
    theta = pos * freq
    rot = torch.cat([-qt[..., D // 2:], qt[..., :D // 2]], dim=-1)
    want = qt * torch.cos(theta) + rot * torch.sin(theta)
    torch.testing.assert_close(got, want)


def test_plain_functions_are_classified_by_arity() -> None:
    from attncc.frontend import as_variant

    assert as_variant(lambda s, b, h, q, k: s).score_mod is not None
    assert as_variant(lambda b, h, q, k: q >= k).mask_mod is not None
    with pytest.raises(attncc.TraceError, match="score_mod"):
        as_variant(lambda a, b: a)


# ----------------------------------------------------------------------------- errors


def _raises_at_this_file(fn_variant, match: str) -> attncc.TraceError:
    with pytest.raises(attncc.TraceError, match=match) as info:
        fn_variant.trace()
    assert "test_trace.py:" in str(info.value), str(info.value)
    assert "hint:" in str(info.value)
    return info.value


def test_error_data_dependent_if() -> None:
    def bad(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return -score

    _raises_at_this_file(Variant(score_mod=bad), "control flow")


def test_error_python_and_or() -> None:
    def bad(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx and q_idx - kv_idx < 8

    _raises_at_this_file(Variant(mask_mod=bad), "control flow")


def test_error_loop_over_traced_value() -> None:
    def bad(score, b, h, q_idx, kv_idx):
        for _ in range(q_idx):
            score = score + 1
        return score

    _raises_at_this_file(Variant(score_mod=bad), "concrete integer")


def test_error_unknown_torch_call() -> None:
    def bad(score, b, h, q_idx, kv_idx):
        return torch.digamma(score)

    _raises_at_this_file(Variant(score_mod=bad), "not supported")


def test_error_math_on_traced_value() -> None:
    def bad(score, b, h, q_idx, kv_idx):
        return math.tanh(score)

    _raises_at_this_file(Variant(score_mod=bad), "torch.tanh")


def test_error_float_used_as_index() -> None:
    table = torch.randn(4, 16)

    def bad(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx / 2]

    _raises_at_this_file(Variant(score_mod=bad), "float value is used as a tensor index")


def test_error_unreadable_tensor_dtype() -> None:
    z = torch.randn(4, dtype=torch.complex64)

    def bad(score, b, h, q_idx, kv_idx):
        return score + z[h]

    _raises_at_this_file(Variant(score_mod=bad), "cannot be read")


def test_error_tensor_used_whole_or_partially_indexed() -> None:
    t = torch.randn(4, 4)

    def whole(score, b, h, q_idx, kv_idx):
        return score + t

    def partial(score, b, h, q_idx, kv_idx):
        return score + t[h]

    _raises_at_this_file(Variant(score_mod=whole), "used as a value")
    _raises_at_this_file(Variant(score_mod=partial), "partially indexed")


def test_error_mask_returning_number_and_score_returning_bool() -> None:
    def mask_num(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    def score_bool(score, b, h, q_idx, kv_idx):
        return score > 0

    with pytest.raises(attncc.TraceError, match="not a boolean"):
        Variant(mask_mod=mask_num).trace()
    with pytest.raises(attncc.TraceError, match="returned a boolean"):
        Variant(score_mod=score_bool).trace()


def test_error_wrong_arity_and_missing_return() -> None:
    def three(score, b, h):
        return score

    def nothing(score, b, h, q_idx, kv_idx):
        score * 2

    with pytest.raises(attncc.TraceError, match="takes 3 argument"):
        Variant(score_mod=three).trace()
    with pytest.raises(attncc.TraceError, match="returned None"):
        Variant(score_mod=nothing).trace()


def test_error_python_exception_inside_mod_points_at_user_line() -> None:
    def bad(score, b, h, q_idx, kv_idx):
        return score + {}["missing"]

    _raises_at_this_file(Variant(score_mod=bad), "KeyError")


def test_error_unknown_method_and_bad_normalize() -> None:
    def bad(score, b, h, q_idx, kv_idx):
        return score.softmax(-1)

    _raises_at_this_file(Variant(score_mod=bad), "no method .softmax")
    with pytest.raises(attncc.TraceError, match="normalize"):
        Variant(normalize="relu")
