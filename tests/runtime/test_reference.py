"""The exact reference path (`attention_reference`, `attncc.flex_attention` on CPU): argument
validation names the argument, hooks and masks follow the documented semantics (checked against
plain dense torch), captured values are read per call, and query-row chunking does not change
results."""
from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import attncc
from attncc.errors import TraceError
from attncc.runtime.flex.api import flex_attention
from attncc.runtime.reference import attention_reference


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    keep: torch.Tensor | None = None,
                    score_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook softmax attention in float64 (GQA by repeating k/v); keep broadcasts to scores."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if score_fn is not None:
        s = score_fn(s)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None])
    return p @ v, lse


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------- validation
def _qkv(B: int = 1, Hq: int = 2, Sq: int = 8, D: int = 16, Hkv: int | None = None,
         Skv: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    Hkv, Skv = Hkv or Hq, Skv or Sq
    return torch.randn(B, Hq, Sq, D), torch.randn(B, Hkv, Skv, D), torch.randn(B, Hkv, Skv, D)


def _bad_calls() -> list[tuple[str, Callable[[Callable], Any], type, str]]:
    q, k, v = _qkv()
    return [
        ("query_not_tensor", lambda m: flex_attention(q.tolist(), k, v, m), TypeError,
         "query must be a torch.Tensor"),
        ("query_3d", lambda m: flex_attention(q[0], k, v, m), ValueError, "query must be 4-D"),
        ("value_5d", lambda m: flex_attention(q, k, v[None], m), ValueError, "value must be 4-D"),
        ("int_dtype", lambda m: flex_attention(q, k.long(), v, m), ValueError, "key has dtype"),
        ("dtype_mismatch", lambda m: flex_attention(q, k.double(), v, m), ValueError,
         "key=torch.float64"),
        ("device_mismatch", lambda m: flex_attention(q, k.to("meta"), v, m), ValueError,
         "key=meta"),
        ("batch_mismatch", lambda m: flex_attention(q, k.expand(2, -1, -1, -1), v, m),
         ValueError, "key 2"),
        ("head_dim_mismatch", lambda m: flex_attention(q, k[..., :8], v, m), ValueError,
         "key head_dim 8"),
        ("value_len_mismatch", lambda m: flex_attention(q, k, v[:, :, :5], m), ValueError,
         "value has"),
        ("heads_without_gqa", lambda m: flex_attention(q, k[:, :1], v[:, :1], m), ValueError,
         "enable_gqa=True"),
        ("gqa_not_divisible", lambda m: flex_attention(torch.randn(1, 3, 8, 16), k, v, m,
                                                       enable_gqa=True), ValueError,
         "multiple of key/value heads (2)"),
        ("block_mask_lengths", lambda m: flex_attention(
            q, k, v, m, block_mask=torch_create_block_mask(causal, None, None, 64, 64, device="cpu")),
         ValueError, "block_mask was created for"),
        ("block_mask_heads", lambda m: flex_attention(
            q, k, v, m, block_mask=torch_create_block_mask(causal, None, 3, 8, 8, device="cpu")),
         ValueError, "block_mask has 3 heads"),
        ("block_mask_type", lambda m: flex_attention(q, k, v, m, block_mask=torch.ones(8, 8)),
         TypeError, "block_mask must be a BlockMask"),
        ("kernel_options_key", lambda m: flex_attention(q, k, v, m, kernel_options={"FOO": 1}),
         ValueError, "kernel_options['FOO']"),
        ("kernel_options_value", lambda m: flex_attention(q, k, v, m,
                                                         kernel_options={"BLOCK_M": 0}),
         ValueError, "kernel_options['BLOCK_M']"),
        ("scale", lambda m: flex_attention(q, k, v, m, scale="0.1"), ValueError, "scale"),
        ("scale_nan", lambda m: flex_attention(q, k, v, m, scale=float("nan")), ValueError,
         "scale"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_validation_error_names_the_argument_before_any_work(case: tuple) -> None:
    _, call, exc, needle = case
    calls = []

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        calls.append(1)  # tracing would call it: validation must come first
        return score

    with pytest.raises(exc) as info:
        call(score_mod)
    assert needle in str(info.value)
    assert calls == []


def test_return_lse_with_normalize_none_is_an_error() -> None:
    q, k, v = _qkv()
    sig = attncc.Variant(score_mod=lambda s, b, h, qi, ki: torch.sigmoid(s), normalize="none")
    with pytest.raises(ValueError, match="return_lse"):
        flex_attention(q, k, v, score_mod=sig, return_lse=True)
    out, lse = attention_reference(q, k, v, *sig.trace())
    assert lse is None and out.shape == q.shape


def test_score_mod_argument_must_be_a_score_mod() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="score_mod must be"):
        flex_attention(q, k, v, score_mod=3)
    with pytest.raises(TraceError, match="score_mod"):  # a mask_mod passed as score_mod
        flex_attention(q, k, v, score_mod=causal)


def test_captured_tensor_on_another_device_is_named() -> None:
    q, k, v = _qkv()
    far_bias = torch.zeros(2, device="meta")

    def head_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + far_bias[h]

    with pytest.raises(TraceError, match="far_bias"):
        flex_attention(q, k, v, score_mod=head_bias)


# ------------------------------------------------------------------------------- semantics
def test_matches_dense_softmax_attention_with_scale_and_lse(rng: Any) -> None:
    q, k, v = rng.qkv(2, 3, 20, 16, Skv=33)
    out, lse = flex_attention(q, k, v, scale=0.3, return_lse=True)
    ref, ref_lse = dense_attention(q, k, v, scale=0.3)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel_err(out, ref) < 1e-6 and rel_err(lse, ref_lse) < 1e-6


def test_value_head_dim_may_differ_from_query_head_dim(rng: Any) -> None:
    q, k, _ = rng.qkv(1, 4, 25, 16, Hkv=2)
    v = rng.randn(1, 2, 25, 40)
    out, lse = flex_attention(q, k, v, score_mod=attncc.Variant(mask_mod=causal),
                              enable_gqa=True, return_lse=True)
    ref, ref_lse = dense_attention(q, k, v, keep=torch.ones(25, 25, dtype=torch.bool).tril())
    assert out.shape == (1, 4, 25, 40)
    assert rel_err(out, ref) < 1e-6 and rel_err(lse, ref_lse) < 1e-6


def test_half_precision_inputs_return_their_dtype_and_float32_lse(rng: Any) -> None:
    for dt in (torch.float16, torch.bfloat16):
        q, k, v = rng.qkv(1, 2, 9, 16, dtype=dt)
        out, lse = flex_attention(q, k, v, return_lse=True)
        assert out.dtype == dt and lse.dtype == torch.float32
        ref, _ = dense_attention(q, k, v)
        assert rel_err(out, ref) < 1e-2


def test_transform_hooks_follow_documented_semantics(rng: Any) -> None:
    B, H, S, D, Dv = 1, 2, 10, 8, 6
    q, k, _ = rng.qkv(B, H, S, D)
    v = rng.randn(B, H, S, Dv)

    def double_q(q: Any, b: Any, h: Any, q_idx: Any, d: Any) -> Any:
        return q[d] * 2

    def shift_k(k: Any, b: Any, h: Any, kv_idx: Any, d: Any) -> Any:
        return k[(d + 1) % D]  # reads another element of the head vector

    def v_plus(v: Any, b: Any, h: Any, kv_idx: Any, d: Any) -> Any:
        return v[d] + 0.1 * d - 0.01 * kv_idx

    def out_affine(o: Any, b: Any, h: Any, q_idx: Any, d: Any) -> Any:
        return o[d] * (h + 1) + q_idx

    def skip_row_3(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx != 3)

    variant = attncc.Variant(query_mod=double_q, key_mod=shift_k, value_mod=v_plus,
                             output_mod=out_affine, mask_mod=skip_row_3)
    out, lse = flex_attention(q, k, v, score_mod=variant, return_lse=True)

    d_idx = torch.arange(Dv, dtype=torch.float64)
    kv_pos = torch.arange(S, dtype=torch.float64)[:, None]
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    keep[3] = False
    ref, ref_lse = dense_attention(q * 2, k.roll(-1, dims=-1), v.double() + 0.1 * d_idx - 0.01 * kv_pos,
                                   keep=keep)
    ref = torch.nan_to_num(ref)  # row 3 has no key: its output is 0 before output_mod
    ref = ref * torch.arange(1, H + 1, dtype=torch.float64).view(1, H, 1, 1) + \
        torch.arange(S, dtype=torch.float64).view(1, 1, S, 1)
    assert rel_err(out, ref) < 1e-6
    assert torch.isneginf(lse[:, :, 3]).all() and torch.isinf(ref_lse[:, :, 3]).all()
    assert torch.equal(out[0, 1, 3], torch.full((Dv,), 3.0))  # output_mod(0) = 0 * 2 + 3


def test_variant_mask_and_block_mask_are_anded(rng: Any) -> None:
    S = 40
    q, k, v = rng.qkv(1, 2, S, 16)
    bm = torch_create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    even = attncc.Variant(mask_mod=lambda b, h, qi, ki: ki % 2 == 0)
    out = flex_attention(q, k, v, score_mod=even, block_mask=bm)
    idx = torch.arange(S)
    keep = (idx[:, None] >= idx[None, :]) & (idx[None, :] % 2 == 0)
    ref, _ = dense_attention(q, k, v, keep=keep)
    assert rel_err(out, ref) < 1e-6


def test_block_mask_full_blocks_skip_mask_mod_and_absent_blocks_are_masked(rng: Any) -> None:
    # 3x3 blocks of 16: q block 0 lists kv block 0 as partial and kv block 2 as FULL (causal
    # would mask it); q block 1 lists nothing (fully masked rows); q block 2 lists all partial
    S, BS = 48, 16
    num = torch.tensor([[[1, 0, 3]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 0, 0], [0, 0, 0], [0, 1, 2]]]], dtype=torch.int32)
    full_num = torch.tensor([[[1, 0, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[2, 0, 0], [0, 0, 0], [0, 0, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=BS, mask_mod=causal,
                                  seq_lengths=(S, S))
    q, k, v = rng.qkv(1, 2, S, 16)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)

    i = torch.arange(S)
    is_causal = i[:, None] >= i[None, :]
    keep = torch.zeros(S, S, dtype=torch.bool)
    keep[:16, :16] = is_causal[:16, :16]
    keep[:16, 32:] = True
    keep[32:] = is_causal[32:]
    ref, ref_lse = dense_attention(q, k, v, keep=keep)
    ref = torch.nan_to_num(ref)
    assert rel_err(out, ref) < 1e-6
    assert torch.isneginf(lse[:, :, 16:32]).all() and (out[:, :, 16:32] == 0).all()
    # (torch's eager FlexAttention cannot check this one: its math path ignores the block
    # structure and applies mask_mod everywhere; its compiled kernels follow the rules above)


def test_block_mask_without_mask_mod_keeps_partial_blocks(rng: Any) -> None:
    S = 32
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(S, S))  # torch noop_mask
    q, k, v = rng.qkv(1, 1, S, 8)
    keep = torch.ones(S, S, dtype=torch.bool)
    keep[:16, :16] = False
    ref, _ = dense_attention(q, k, v, keep=keep)
    assert rel_err(flex_attention(q, k, v, block_mask=bm), ref) < 1e-6


def test_empty_key_sequence_gives_zero_output_and_neg_inf_lse() -> None:
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8)
    out, lse = flex_attention(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


# ------------------------------------------------------------------------ captured values
def test_captured_scalar_change_changes_the_result(rng: Any) -> None:
    q, k, v = rng.qkv(1, 2, 12, 16)
    cap = 1.5

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)

    results = []
    for value in (1.5, 0.2, 7.0):
        cap = value
        out = flex_attention(q, k, v, score_mod=softcap)
        ref, _ = dense_attention(q, k, v, score_fn=lambda s: value * torch.tanh(s / value))
        assert rel_err(out, ref) < 1e-6
        results.append(out)
    assert not torch.allclose(results[0], results[1])


def test_captured_tensor_contents_are_read_per_call(rng: Any) -> None:
    q, k, v = rng.qkv(1, 2, 12, 16)
    bias = torch.zeros(2)

    def head_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + bias[h] * kv_idx

    before = flex_attention(q, k, v, score_mod=head_bias)
    bias[1] = 0.5
    after = flex_attention(q, k, v, score_mod=head_bias)
    assert torch.equal(before[:, 0], after[:, 0]) and not torch.allclose(before[:, 1], after[:, 1])
    ref, _ = dense_attention(q, k, v, score_fn=lambda s: s + bias.double().view(1, 2, 1, 1)
                             * torch.arange(12, dtype=torch.float64))
    assert rel_err(after, ref) < 1e-6


# ------------------------------------------------------------------------------- chunking
def test_query_row_chunking_does_not_change_results(rng: Any) -> None:
    B, Hq, Hkv, S = 2, 4, 2, 70
    q, k, v = rng.qkv(B, Hq, S, 16, Hkv=Hkv)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + slopes[h] * (kv_idx - q_idx)

    def out_mod(o: Any, b: Any, h: Any, q_idx: Any, d: Any) -> Any:
        return o[d] + 0.001 * q_idx

    window = attncc.Variant(score_mod=alibi, output_mod=out_mod,
                            mask_mod=lambda b, h, qi, ki: qi - ki < 20)
    bm = torch_create_block_mask(causal, B, None, S, S, device="cpu", BLOCK_SIZE=32)
    ir, bind = window.trace()
    ref_out, ref_lse = attention_reference(q, k, v, ir, bind, block_mask=bm, enable_gqa=True)
    for chunk in (1, 3, 32, 69, 1000):
        out, lse = attention_reference(q, k, v, ir, bind, block_mask=bm, enable_gqa=True,
                                       q_chunk=chunk)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="q_chunk"):
        attention_reference(q, k, v, ir, bind, enable_gqa=True, q_chunk=0)


def test_long_sequence_runs_in_bounded_memory() -> None:
    # a 4096 x 4096 causal problem: chunked, so the full score matrix never exists at once
    g = torch.Generator().manual_seed(0)
    S = 4096
    q, k, v = (torch.randn(1, 1, S, 8, generator=g) for _ in range(3))
    out, lse = flex_attention(q, k, v, score_mod=attncc.Variant(mask_mod=causal),
                              return_lse=True)
    rows = torch.tensor([0, 1, 2047, 4095])
    s = (q[0, 0, rows].double() @ k[0, 0].double().T) / math.sqrt(8)
    s = s.masked_fill(torch.arange(S)[None, :] > rows[:, None], -math.inf)
    ref = torch.softmax(s, -1) @ v[0, 0].double()
    assert rel_err(out[0, 0, rows], ref) < 1e-6
    assert rel_err(lse[0, 0, rows], torch.logsumexp(s, -1)) < 1e-6


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_inputs_run_the_reference_on_the_gpu_with_a_warning(rng: Any) -> None:
    import attncc.runtime.flex.api as flex_mod

    q, k, v = rng.qkv(1, 2, 33, 16)
    variant = attncc.Variant(mask_mod=causal, score_mod=lambda s, b, h, qi, ki: s * 0.5)
    cpu_out, cpu_lse = flex_attention(q, k, v, score_mod=variant, return_lse=True)
    flex_mod._warned_no_gpu_kernel = False
    with pytest.warns(RuntimeWarning, match="no compiled GPU kernel"):
        out, lse = flex_attention(q.cuda(), k.cuda(), v.cuda(), score_mod=variant,
                                  return_lse=True)
    assert out.device.type == "cuda"
    assert rel_err(out.cpu(), cpu_out) < 1e-6
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(cpu_lse))
    # a block mask on the GPU, and a captured CPU tensor (copied to the inputs' device)
    slopes = torch.tensor([0.5, 0.25])

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + slopes[h] * (kv_idx - q_idx)

    bm = torch_create_block_mask(causal, None, None, 33, 33, device="cuda", BLOCK_SIZE=16)
    out = flex_attention(q.cuda(), k.cuda(), v.cuda(), score_mod=alibi, block_mask=bm)
    i = torch.arange(33)
    ref, _ = dense_attention(q, k, v, keep=i[:, None] >= i[None, :],
                             score_fn=lambda s: s + slopes.double().view(1, 2, 1, 1)
                             * (i[None, :] - i[:, None]))
    assert rel_err(out.cpu(), ref) < 1e-6
