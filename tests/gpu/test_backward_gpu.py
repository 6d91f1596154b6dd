"""The GPU backward (kernels/fa2/fa2_backward.cuh and, on sm_90, kernels/fa3/fa3_backward.cuh,
through runtime/flex/autograd.py): dQ, dK, dV
and captured tensors' gradients of `attncc.flex_attention` on CUDA bf16/fp16 against torch's
autograd through the fp64 reference (runtime/reference.py) on the same inputs. Fresh random
inputs per test; relative Frobenius error < 2e-2 (bf16) and no NaN; each gradient is its own
assertion (and, in the smoke tests, its own test) so a failure names dQ, dK or dV.

Run the smoke subset first: `python -m pytest tests/gpu/test_backward_gpu.py -k smoke`.
docs/backward.md, "Kernels", is the design."""
from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

import attncc
from attncc.gym import GYM, causal
from attncc.runtime.reference import attention_reference

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
_SEED = [0]
_KERNEL = ["fa2"]  # kernel_options['BACKWARD_KERNEL'] of the running test (the fixture below)


@pytest.fixture(autouse=True, params=["fa2", "fa3"])
def backward_kernel(request: Any) -> Any:
    """Every test runs on both backward templates: "fa3" (wgmma) on an sm_90 GPU for the shapes
    it takes (head dims 64/128, block masks of 128 x 128), skipped elsewhere."""
    if request.param == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FA3-class backward runs on sm_90 only")
    _KERNEL[0] = request.param
    yield request.param
    _KERNEL[0] = "fa2"


def _options(kernel_options: dict | None, head_dim: int, block_mask: Any) -> dict:
    """The test's kernel_options with BACKWARD_KERNEL set to the fixture's template; a shape the
    FA3-class kernel does not take skips the fa3 run (the fa2 run covers it)."""
    if _KERNEL[0] == "fa3" and (head_dim not in (64, 128) or (
            block_mask is not None and (block_mask.BLOCK_SIZE[0] % 64
                                        or block_mask.BLOCK_SIZE[1] % 128))):
        pytest.skip("the FA3-class backward runs head dims 64/128, blocks of (64k, 128k)")
    return {**(kernel_options or {}), "BACKWARD_KERNEL": _KERNEL[0]}


def _gen() -> torch.Generator:
    _SEED[0] += 1
    return torch.Generator(device="cuda").manual_seed(1000 + _SEED[0])


def _rel(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in the gradient"
    den = ref.double().norm()
    num = (got.double() - ref.double()).norm()
    return float(num / den) if float(den) > 0 else float(num)


def _grads(variant: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           extra: dict[str, torch.Tensor], *, block_mask: Any = None, scale: float | None = None,
           enable_gqa: bool = False, with_lse: bool = False,
           kernel_options: dict | None = None) -> dict[str, torch.Tensor]:
    """Gradients of <out, dO> (+ <lse, dLSE>) w.r.t. q, k, v and `extra` (captured leaves),
    through attncc's GPU path; dO / dLSE fixed by the test's generator."""
    kernel_options = _options(kernel_options, q.shape[-1], block_mask)
    res = attncc.flex_attention(q, k, v, score_mod=variant, block_mask=block_mask, scale=scale,
                                enable_gqa=enable_gqa, return_lse=with_lse,
                                kernel_options=kernel_options)
    out, lse = res if with_lse else (res, None)
    assert out.grad_fn is not None, "the CUDA output has no grad_fn"
    dout, dlse = _cotangents(out, lse)
    loss = (out.double() * dout).sum()
    if lse is not None:
        loss = loss + (lse.double() * dlse).sum()
    names = ["dq", "dk", "dv", *(f"d{n}" for n in extra)]
    got = torch.autograd.grad(loss, [q, k, v, *extra.values()], allow_unused=True)
    return {"out": out.detach(), **{n: (t if t is not None else torch.zeros(()))
                                   for n, t in zip(names, got)}}


def _cotangents(out: torch.Tensor, lse: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """dO (in the output's dtype, as the kernel receives it, widened) and dLSE, fixed seed."""
    g = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype).double()
    dlse = None if lse is None else torch.randn(lse.shape, device="cuda", generator=g).double()
    return dout, dlse


def _ref_grads(variant: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               extra: dict[str, torch.Tensor], *, block_mask: Any = None,
               scale: float | None = None, enable_gqa: bool = False,
               with_lse: bool = False, delivered: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """The same gradients through the fp64 reference on the same (rounded) inputs. With
    `delivered` (the kernel's 16-bit output), delta = rowsum(dO * O) is taken from it, as
    every flash-style backward does: the kernel's dS is the exact one minus eps_i P_ij, eps_i
    = rowsum(dO * (delivered - O)), so its gradients are the exact ones minus those of
    sum_i eps_i LSE_i (docs/backward.md, "Accuracy of gradients that cancel")."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ir, bind = variant.trace()
    out, lse = attention_reference(q64, k64, v64, ir, bind, block_mask=block_mask, scale=scale,
                                   enable_gqa=enable_gqa, float_dtype=torch.float64)
    dout, dlse = _cotangents(out, lse if with_lse else None)
    loss = (out * dout).sum()
    if with_lse:
        loss = loss + (lse * dlse).sum()
    if delivered is not None:
        eps = (dout * (delivered.double() - out)).sum(-1).detach()
        loss = loss - (eps * lse).sum()
    names = ["dq", "dk", "dv", *(f"d{n}" for n in extra)]
    got = torch.autograd.grad(loss, [q64, k64, v64, *extra.values()], allow_unused=True)
    return {n: (t if t is not None else torch.zeros(())) for n, t in zip(names, got)}


def _qkv(B: int, Hq: int, Hkv: int, Sq: int, Skv: int, D: int,
         dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    g = _gen()
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", dtype=dtype, generator=g)
    return tuple(t.requires_grad_(True) for t in (q, k, v))


def _check(variant: Any, shape: tuple[int, ...], *, extra: dict[str, torch.Tensor] | None = None,
           dtype: torch.dtype = torch.bfloat16, only: tuple[str, ...] | None = None,
           delta_from_output: bool = False, **kw: Any) -> dict[str, float]:
    """Run both paths on fresh inputs of `shape` = (B, Hq, Hkv, Sq, Skv, D) and assert every
    gradient (or those in `only`) is within tolerance; returns the errors. `delta_from_output`
    holds the reference to the delivered output's delta (see _ref_grads)."""
    B, Hq, Hkv, Sq, Skv, D = shape
    q, k, v = _qkv(B, Hq, Hkv, Sq, Skv, D, dtype)
    extra = extra or {}
    kw.setdefault("enable_gqa", Hq != Hkv)
    got = _grads(variant, q, k, v, extra, **kw)
    out = got.pop("out")
    kw.pop("kernel_options", None)
    want = _ref_grads(variant, q, k, v, extra, delivered=out if delta_from_output else None, **kw)
    errs = {n: _rel(n, got[n], want[n]) for n in (only or tuple(got))}
    bad = {n: e for n, e in errs.items() if not e < TOL[dtype]}
    assert not bad, f"relative error over {TOL[dtype]}: {bad} (all: {errs})"
    return errs


def _mod(score_mod: Callable | None = None, mask_mod: Callable | None = None,
         normalize: str = "softmax") -> attncc.Variant:
    return attncc.Variant(score_mod=score_mod, mask_mod=mask_mod, normalize=normalize)


def _softcap(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return 20.0 * torch.tanh(s / 20.0)


# ------------------------------------------------------------------------------------ smoke
@pytest.mark.parametrize("grad", ["dv", "dk", "dq"])
@pytest.mark.parametrize("variant", ["noop", "causal"])
def test_smoke_tiny(grad: str, variant: str) -> None:
    """One tile each way, then a partial tile: (1, 1, 1, 64, 64, 64) and odd 100 x 100."""
    v = _mod() if variant == "noop" else _mod(mask_mod=causal)
    _check(v, (1, 1, 1, 64, 64, 64), only=(grad,))
    _check(v, (1, 1, 1, 100, 100, 64), only=(grad,))


@pytest.mark.parametrize("grad", ["dv", "dk", "dq"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_smoke_head_dims(grad: str, d: int) -> None:
    _check(_mod(mask_mod=causal), (1, 2, 2, 200, 200, d), only=(grad,))


@pytest.mark.parametrize("grad", ["dv", "dk", "dq", "dbias"])
def test_smoke_learnable_bias(grad: str) -> None:
    """A learnable relative-position table: CapturedGrad's atomics into d(bias)."""
    H, S = 2, 130
    bias = (torch.randn(H, 2 * S - 1, device="cuda", generator=_gen()) * 0.5).requires_grad_()

    def rel(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + bias[h, q - kv + S - 1]

    _check(_mod(rel), (1, H, H, S, S, 64), extra={"bias": bias}, only=(grad,))


def test_smoke_grad_fn_and_no_grad_path() -> None:
    q, k, v = _qkv(1, 2, 2, 128, 128, 64)
    out = attncc.flex_attention(q, k, v)
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert all(t.grad is not None and not torch.isnan(t.grad).any() for t in (q, k, v))
    with torch.no_grad():
        assert attncc.flex_attention(q, k, v).grad_fn is None


# ------------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("masked", [False, True])
def test_head_dims_odd_lengths(d: int, masked: bool) -> None:
    _check(_mod(mask_mod=causal if masked else None), (2, 3, 3, 333, 333, d))


@pytest.mark.parametrize("sq,skv", [(200, 517), (517, 130), (1, 300), (70, 1)])
def test_sq_differs_from_skv(sq: int, skv: int) -> None:
    _check(_mod(_softcap), (1, 2, 2, sq, skv, 128))


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1)])
def test_gqa(hq: int, hkv: int) -> None:
    """dK and dV sum the group's query heads inside one CTA (no atomics)."""
    _check(_mod(_softcap, causal), (2, hq, hkv, 300, 300, 128))


def test_scale() -> None:
    _check(_mod(_softcap), (1, 2, 2, 256, 256, 64), scale=0.3)


def test_fp16() -> None:
    _check(_mod(mask_mod=causal), (1, 2, 2, 300, 300, 128), dtype=torch.float16)


@pytest.mark.parametrize("name", sorted(GYM))
@pytest.mark.parametrize("d", [64, 128])
def test_every_gym_variant(name: str, d: int) -> None:
    """Every AttentionGym variant, including RoPE's query/key transforms (differentiated by
    torch on the evaluator) and sigmoid attention (normalize none)."""
    _check(GYM[name](2, 4, 384, d), (2, 4, 4, 384, 384, d))


def _leaf(shape: tuple[int, ...], scale: float, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda", generator=_gen()) * scale + shift).requires_grad_()


def test_learnable_relative_bias_table_gqa_block_mask() -> None:
    H, S = 8, 300
    bias = _leaf((H, 2 * S - 1), 0.5)

    def rel(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + bias[h, q - kv + S - 1]

    bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
    _check(_mod(rel), (2, H, 2, S, S, 128), extra={"bias": bias}, block_mask=bm)


def test_learnable_alibi_slopes() -> None:
    H, S = 4, 300
    slopes = _leaf((H,), 0.05, 0.1)

    def alibi(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + slopes[h] * (kv - q)

    _check(_mod(alibi, causal), (2, H, H, S, S, 64), extra={"slopes": slopes})


def test_learnable_head_scale() -> None:
    H, S = 4, 257
    scales = _leaf((H,), 0.2, 1.0)

    def head_scale(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s * scales[h]

    _check(_mod(head_scale), (1, H, H, S, S, 128), extra={"scales": scales})


def test_learnable_t5_buckets() -> None:
    H, S = 4, 300
    table = _leaf((H, 32), 0.5)

    def t5(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        rel = kv - q
        side = torch.where(rel > 0, 16, 0)
        dist = torch.abs(rel)
        far = 8 + (torch.log(dist.float() / 8) / math.log(128 / 8) * 8).int()
        bucket = side + torch.where(dist < 8, dist, torch.clamp(far, max=15))
        return s + table[h, bucket]

    _check(_mod(t5), (1, H, H, S, S, 64), extra={"table": table})


@pytest.mark.parametrize("d", [64, 128])
def test_learnable_reads_of_every_kind_in_one_mod(d: int) -> None:
    """The three ways a captured gradient is summed, in one score_mod (docs/backward.md,
    section 5): a per-key bias (at positions: an atomic per element), a relative table scaling
    the score (along diagonals, its derivative the score: paired elements and lanes) and a
    per-head slope (tile-uniform: a warp's sum). Sq != Skv, GQA, no mask, odd lengths.
    The slope's gradient cancels (diffuse rows, a slowly changing factor), so the 16-bit
    output's rounding, which reaches it through delta, alone can exceed the tolerance (3.1e-2
    measured); the reference takes delta from the delivered output."""
    H, Sq, Skv = 4, 201, 333
    kbias = _leaf((Skv,), 0.3)
    rel = _leaf((H, Sq + Skv - 1), 0.1, 1.0)
    slope = _leaf((H,), 0.02)

    def mod(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s * rel[h, q - kv + Skv - 1] + kbias[kv] + slope[h] * (kv - q)

    _check(_mod(mod), (2, H, 2, Sq, Skv, d), extra={"kbias": kbias, "rel": rel, "slope": slope},
           enable_gqa=True, delta_from_output=True)


def test_rope_key_mod_learnable_frequencies() -> None:
    """RoPE as key_mod with a learnable frequency table: the transform's gradient, including the
    table's, comes from torch's autograd on the evaluator."""
    D, S = 64, 200
    inv = _leaf((D // 2,), 0.01, 0.05)

    def rope_k(k: Any, b: Any, h: Any, kv: Any, d: Any) -> Any:
        i = d % (D // 2)
        theta = kv * inv[i]
        sign = torch.where(d < D // 2, -1, 1)
        return k[d] * torch.cos(theta) + sign * k[(d + D // 2) % D] * torch.sin(theta)

    _check(attncc.Variant(key_mod=rope_k, mask_mod=causal), (1, 2, 2, S, S, D),
           extra={"inv": inv})


def test_sigmoid_attention_normalize_none() -> None:
    def sig(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.sigmoid(s - 2.0)

    _check(_mod(sig, causal, normalize="none"), (1, 2, 2, 300, 300, 128))


@pytest.mark.parametrize("mask", ["causal", "sliding", "document"])
def test_block_masks(mask: str) -> None:
    """Partial and full blocks (the mask_mod only on partial ones) and skipped blocks, through
    the KV-major lists."""
    S = 700
    if mask == "causal":
        fn = causal
    elif mask == "sliding":
        def fn(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return (q >= kv) & (q - kv <= 200)
    else:
        doc = (torch.arange(S, device="cuda") // 233).to(torch.int32)

        def fn(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return doc[q] == doc[kv]
    bm = attncc.create_block_mask(fn, None, None, S, S, device="cuda")
    _check(_mod(_softcap), (2, 4, 4, S, S, 128), block_mask=bm)


def test_block_mask_with_variant_mask_and_gqa() -> None:
    """A variant mask_mod with a block mask: full blocks fold into partial ones (the variant's
    mask applies everywhere), as the forward does."""
    S = 512
    bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")

    def window(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return q - kv <= 300

    _check(_mod(_softcap, window), (1, 4, 2, S, S, 64), block_mask=bm)


def test_fully_masked_rows_have_zero_gradient() -> None:
    """Rows whose every key is masked (LSE -inf): zero dQ, no NaN anywhere."""
    def late(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= 40) & (kv <= q)

    q, k, v = _qkv(1, 2, 2, 200, 200, 64)
    g = _grads(_mod(mask_mod=late), q, k, v, {})
    assert all(not torch.isnan(t).any() for t in g.values())
    assert torch.count_nonzero(g["dq"][:, :, :40]) == 0
    _check(_mod(mask_mod=late), (1, 2, 2, 200, 200, 64))


def test_return_lse_gradient() -> None:
    _check(_mod(_softcap, causal), (1, 2, 2, 300, 300, 128), with_lse=True)


def test_lse_alone_reaches_the_loss() -> None:
    """Only the LSE is used: the output's gradient arrives as None (grads are not
    materialized), dV is 0 and dQ / dK are the LSE's, against the fp64 reference."""
    q, k, v = _qkv(1, 2, 2, 300, 300, 128)
    variant = _mod(_softcap, causal)
    opts = _options(None, 128, None)
    out, lse = attncc.flex_attention(q, k, v, score_mod=variant, return_lse=True,
                                     kernel_options=opts)
    dlse = torch.randn(lse.shape, device="cuda", generator=_gen()).double()
    got = torch.autograd.grad((lse.double() * dlse).sum(), [q, k, v])
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ir, bind = variant.trace()
    _, lse64 = attention_reference(q64, k64, v64, ir, bind, float_dtype=torch.float64)
    want = torch.autograd.grad((lse64 * dlse).sum(), [q64, k64, v64], allow_unused=True)
    assert torch.count_nonzero(got[2]) == 0
    errs = {n: _rel(n, g, w) for n, g, w in zip(("dq", "dk"), got, want)}
    assert all(e < TOL[torch.bfloat16] for e in errs.values()), errs


def test_deterministic_mode_20_runs_bitwise_equal() -> None:
    q, k, v = _qkv(2, 8, 2, 600, 600, 128)
    opts = {"DETERMINISTIC": True}
    first = _grads(_mod(_softcap, causal), q, k, v, {}, enable_gqa=True, kernel_options=opts)
    for _ in range(19):
        again = _grads(_mod(_softcap, causal), q, k, v, {}, enable_gqa=True,
                       kernel_options=opts)
        for n in ("dq", "dk", "dv"):
            assert torch.equal(first[n], again[n]), f"{n} differs between runs"
    want = _ref_grads(_mod(_softcap, causal), q, k, v, {}, enable_gqa=True)
    for n in ("dq", "dk", "dv"):
        assert _rel(n, first[n], want[n]) < TOL[torch.bfloat16]


def test_deterministic_mode_with_captured_grads_20_runs_bitwise_equal() -> None:
    """Learnable biases in the deterministic mode: their gradients are exact integer sums
    (runtime/flex/exact_grad.py), so 20 runs give the same bits for every gradient, a relative
    table (many terms per entry, both signs) and ALiBi slopes (S^2 terms per head) alike; and
    they match the fp64 reference. GQA 4 and odd lengths."""
    H, S = 8, 397
    bias, slopes = _leaf((H, 2 * S - 1), 0.5), _leaf((H,), 0.05, 0.1)

    def mod(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + bias[h, q - kv + S - 1] + slopes[h] * (kv - q)

    q, k, v = _qkv(2, H, 2, S, S, 128)
    extra = {"bias": bias, "slopes": slopes}
    opts = {"DETERMINISTIC": True}
    first = _grads(_mod(mod, causal), q, k, v, extra, enable_gqa=True, kernel_options=opts)
    first.pop("out")
    for _ in range(19):
        again = _grads(_mod(mod, causal), q, k, v, extra, enable_gqa=True, kernel_options=opts)
        for n in first:
            assert torch.equal(first[n], again[n]), f"{n} differs between runs"
    want = _ref_grads(_mod(mod, causal), q, k, v, extra, enable_gqa=True)
    for n in first:
        assert _rel(n, first[n], want[n]) < TOL[torch.bfloat16], n
