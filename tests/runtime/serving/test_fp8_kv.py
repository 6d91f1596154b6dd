"""fp8 KV caches without a GPU (docs/serving.md, "fp8 KV cache"): the scales' checks,
quantize-on-append, the fp64 references on the dequantized cache, plan()'s kv_data_type, run()'s
operand and scale checks, codegen's fp8 entry, flex_attention's exact path, and (NVRTC) every
fp8 form of the batch kernels compiling within its spill budget. tests/gpu/test_fp8_kv_gpu.py
runs the kernels."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc.codegen.generate import generate_source
from attncc.errors import CodegenError, InvalidArgument
from attncc.ir.program import VariantIR
from attncc.runtime.kv8 import dequantize, kv_scale, quantize
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.append import append_paged_kv_cache
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.serving.operands import check_kv_dtype
from attncc.runtime.serving.scales import KvScales

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("bad,match", [
    (0.0, "positive and finite"), (-1.0, "positive and finite"),
    (float("inf"), "positive and finite"), (float("nan"), "positive and finite"),
    (torch.tensor([1.0, -2.0]), "positive and finite"), (torch.ones(3), "float tensor"),
    (torch.ones(2, dtype=torch.int32), "float tensor"), ("2", "float or a tensor"),
    (True, "float or a tensor")])
def test_kv_scale_refuses_bad_scales(bad, match: str) -> None:
    with pytest.raises(InvalidArgument, match=f"k_scale must be.*{match}|k_scale.*{match}"):
        kv_scale(bad, 2, "k_scale")


def test_kv_scale_forms() -> None:
    assert kv_scale(0.5, 3, "k").tolist() == [0.5] * 3
    assert kv_scale(torch.tensor(2.0), 2, "k").tolist() == [2.0, 2.0]
    assert kv_scale(torch.tensor([1.0, 4.0], dtype=torch.float64), 2, "k").dtype == torch.float32


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_is_torchs_rounding_and_dequantize_exact(dtype: torch.dtype) -> None:
    """quantize == (t / scale per head).to(fp8) bit for bit; dequantize == fp8 value * scale in
    float64, exactly."""
    t = torch.randn(5, 3, 16) * 7
    s = torch.tensor([0.5, 0.03, 3.0])
    q8 = quantize(t, s, head_axis=1, dtype=dtype)
    want = (t / s.view(1, 3, 1)).to(dtype)
    assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8))
    d = dequantize(q8, s, head_axis=1)
    assert d.dtype == torch.float64
    assert torch.equal(d, q8.double() * s.double().view(1, 3, 1))


def _paged(layout: str, dtype: torch.dtype = E4M3) -> tuple:
    shape = (4, 16, 2, 32) if layout == "NHD" else (4, 2, 16, 32)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_append_quantizes_on_write(layout: str, dtype: torch.dtype) -> None:
    """An fp8 cache gets (k / k_scale).to(fp8) per head, v likewise, at each token's slot."""
    kc, vc = _paged(layout, dtype)
    indptr, ids, last = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 3]), torch.tensor([5, 3])
    b, pos = torch.tensor([0, 1, 1]), torch.tensor([4, 17, 18])
    k, v = torch.randn(3, 2, 32) * 5, torch.randn(3, 2, 32)
    ks, vs = torch.tensor([0.1, 0.4]), 0.05
    append_paged_kv_cache(k, v, b, pos, (kc, vc), ids, indptr, last, layout, k_scale=ks,
                          v_scale=vs)
    got_k = kc[3, 1] if layout == "NHD" else kc[3, :, 1]     # request 1, position 17
    got_v = vc[3, 1] if layout == "NHD" else vc[3, :, 1]
    assert torch.equal(got_k.view(torch.uint8),
                       (k[1] / ks.view(2, 1)).to(dtype).view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), (v[1] / vs).to(dtype).view(torch.uint8))


def test_append_scale_refusals_write_nothing() -> None:
    kc, vc = _paged("NHD")
    args = (torch.tensor([0]), torch.tensor([4]), (kc, vc), torch.tensor([2, 0, 3]),
            torch.tensor([0, 1, 3]), torch.tensor([5, 3]))
    k = torch.ones(1, 2, 32)
    with pytest.raises(InvalidArgument, match="v_scale must be positive"):
        append_paged_kv_cache(k, k, *args, k_scale=1.0, v_scale=0.0)
    assert not kc.view(torch.uint8).any() and not vc.view(torch.uint8).any()
    bf = (torch.zeros(4, 16, 2, 32), torch.zeros(4, 16, 2, 32))
    with pytest.raises(InvalidArgument, match="quantize an fp8 cache"):
        append_paged_kv_cache(k, k, args[0], args[1], bf, *args[3:], k_scale=2.0)


@pytest.mark.parametrize("layout", ["NHD", "HND", "ragged"])
def test_reference_computes_on_the_dequantized_cache(layout: str) -> None:
    """batch_attention_reference on an fp8 cache with per-head scales == on the float64
    dequantized cache (with a float64 q): bit for bit."""
    torch.manual_seed(0)
    if layout == "ragged":
        k8 = (torch.randn(40, 2, 32) * 4).to(E5M2)
        v8 = torch.randn(40, 2, 32).to(E5M2)
        idx = dict(kv_indptr=[0, 10, 40], kv_indices=None, kv_last_page_len=None)
        axis = 1
    else:
        k8, v8 = (x.to(E4M3) for x in (torch.randn(*_paged(layout)[0].shape) * 4,
                                       torch.randn(*_paged(layout)[0].shape)))
        idx = dict(kv_indptr=[0, 1, 3], kv_indices=[2, 0, 3], kv_last_page_len=[5, 3])
        axis = 2 if layout == "NHD" else 1
    ks, vs = torch.tensor([0.25, 2.0]), torch.tensor([0.5, 0.125])
    q = torch.randn(3, 4, 32).bfloat16()
    out, lse = batch_attention_reference(q, (k8, v8), [0, 1, 3], **idx, kv_layout=layout,
                                         page_size=16, k_scale=ks, v_scale=vs)
    kd, vd = dequantize(k8, ks, head_axis=axis), dequantize(v8, vs, head_axis=axis)
    ref, ref_lse = batch_attention_reference(q.double(), (kd, vd), [0, 1, 3], **idx,
                                             kv_layout=layout, page_size=16)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_reference_refusals() -> None:
    k = torch.zeros(4, 16, 2, 32)
    args = ([0, 1], [0, 1], [0], [3])
    with pytest.raises(InvalidArgument, match="scales of an fp8 cache"):
        batch_attention_reference(torch.zeros(1, 2, 32), (k, k), *args, page_size=16,
                                  k_scale=0.5)
    with pytest.raises(InvalidArgument, match="one of"):
        batch_attention_reference(torch.zeros(1, 2, 32), (k.to(E4M3), k.to(E5M2)), *args,
                                  page_size=16)


def test_plan_kv_data_type() -> None:
    """plan(kv_data_type=) takes the fp8 dtypes (kept on the instance), None or q's dtype
    (a 16-bit cache); anything else raises naming the argument."""
    ba = BatchAttention(None, device="cpu")
    plan = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    args = ([0, 1, 2], [0, 1, 3], [0, 1, 2], [5, 16])
    ba.plan(*args, **plan, kv_data_type=E5M2)
    assert ba.kv_data_type == E5M2
    ba.plan(*args, **plan, kv_data_type=torch.bfloat16)
    assert ba.kv_data_type is None
    with pytest.raises(InvalidArgument, match="kv_data_type=torch.int8"):
        ba.plan(*args, **plan, kv_data_type=torch.int8)
    with pytest.raises(InvalidArgument, match="q_data_type=torch.float8_e4m3fn: queries"):
        ba.plan(*args, **plan, q_data_type=E4M3)
    assert ba.kv_data_type is None  # a plan that raised keeps the last plan's


def test_run_operand_checks() -> None:
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    k8 = torch.zeros(3, 16, 2, 64, dtype=E4M3)
    check_kv_dtype(q, k8, k8, E4M3)
    with pytest.raises(ValueError, match="kv_data_type float8_e4m3fn|kv_data_type torch"):
        check_kv_dtype(q, k8.to(E5M2), k8.to(E5M2), E4M3)
    with pytest.raises(ValueError, match=r"plan\(..., kv_data_type="):
        check_kv_dtype(q, k8, k8)
    odd = torch.zeros(3, 16, 2, 72, dtype=E4M3)[..., :64]  # rows 72 bytes apart
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_kv_dtype(q, odd, odd, E4M3)


def test_kv_scales_pointers() -> None:
    """Floats land in the instance's buffer (written only when they change), a float32
    tensor [Hkv] on the device is read where it is, anything else is copied; a 16-bit plan
    takes no scales."""
    s, cpu = KvScales(), torch.device("cpu")
    with pytest.raises(InvalidArgument, match="scales of an fp8 cache"):
        s.pointers(0.5, None, 2, None, cpu)
    assert s.pointers(None, None, 2, None, cpu) == (0, 0)
    kp, vp = s.pointers(0.5, None, 2, E4M3, cpu)
    assert s._buf is not None and s._buf.tolist() == [[0.5, 0.5], [1.0, 1.0]]
    assert (kp, vp) == (s._buf[0].data_ptr(), s._buf[1].data_ptr())
    t = torch.tensor([2.0, 3.0])
    assert s.pointers(0.5, t, 2, E4M3, cpu)[1] == t.data_ptr()
    kp2, _ = s.pointers(torch.tensor([4.0, 5.0], dtype=torch.float64), t, 2, E4M3, cpu)
    assert kp2 == s._buf[0].data_ptr() and s._buf[0].tolist() == [4.0, 5.0]
    s.pointers(0.5, t, 2, E4M3, cpu)  # the float is written again after the tensor
    assert s._buf[0].tolist() == [0.5, 0.5]
    t.fill_(-1.0)  # an in-place change is checked again
    with pytest.raises(InvalidArgument, match="v_scale must be positive"):
        s.pointers(0.5, t, 2, E4M3, cpu)


def test_codegen_fp8_entry() -> None:
    """The batch entry names the cache's element type; an fp8 kv_dtype is the fa2batch
    kernel's, for variants without key / value mods."""
    ir = VariantIR(name="plain")
    from attncc.codegen.tiles import KernelTiles

    tiles = KernelTiles(16, 32, 2, 1, 2)
    g = generate_source(ir, head_dim=128, dtype="float16", kernel="fa2batch", tiles=tiles,
                        kv_dtype="float8_e5m2")
    assert g.kernel_name.endswith("_w2_kve5m2")
    assert f"ATTNCC_FA2_BATCH_ENTRY({g.kernel_name}, " in g.source
    assert "attncc::fa2::kv_e5m2, 128, 128, false)" in g.source
    plain = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2batch", tiles=tiles)
    assert plain.kernel_name.endswith("_w2") and "1, 2, attncc::bf16, 128, 128, false)" in plain.source
    with pytest.raises(CodegenError, match="runs on the 'fa2batch' kernel"):
        generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2",
                        tiles=KernelTiles(64, 64, 2, 1), kv_dtype="float8_e4m3fn")
    with pytest.raises(CodegenError, match="kv_dtype='int8'"):
        generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2batch", tiles=tiles,
                        kv_dtype="int8")
    rope_k = attncc.Variant(key_mod=lambda k, b, h, kv, d: 2.0 * k[d], name="k2").trace()[0]
    with pytest.raises(CodegenError, match="key_mod"):
        generate_source(rope_k, head_dim=128, dtype="bfloat16", kernel="fa2batch", tiles=tiles,
                        kv_dtype="float8_e4m3fn")
    from attncc.runtime.jit.kernels import KernelSpec

    with pytest.raises(ValueError, match="fa2_batch and decode"):
        KernelSpec("fa3_batch", kv_dtype="float8_e4m3fn")


@pytest.mark.parametrize("mode", ["tensor", "head"])
def test_flex_fp8_exact_path(mode: str) -> None:
    """flex_attention on the CPU with fp8 k/v == on the float64 dequantized k/v (then q's
    dtype), lse included; a scale without an fp8 key raises."""
    torch.manual_seed(1)
    q = torch.randn(1, 4, 9, 32).bfloat16()
    ks = 0.5 if mode == "tensor" else torch.tensor([0.5, 2.0])
    k8 = (torch.randn(1, 2, 11, 32) * 3).to(E4M3)
    v8 = torch.randn(1, 2, 11, 32).to(E4M3)
    out, lse = attncc.flex_attention(q, k8, v8, enable_gqa=True, return_lse=True, k_scale=ks,
                                     v_scale=0.25)
    kd = dequantize(k8, kv_scale(ks, 2, "k"), head_axis=1)
    vd = dequantize(v8, kv_scale(0.25, 2, "v"), head_axis=1)
    ref, ref_lse = attncc.flex_attention(q.double(), kd, vd, enable_gqa=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
    assert torch.equal(lse, ref_lse.float())
    with pytest.raises(InvalidArgument, match="fp8 key and value"):
        attncc.flex_attention(q, kd.float(), vd.float(), enable_gqa=True, k_scale=0.5)


# every fp8 form BatchAttention compiles: decode and prefill tiles at each head dim
def _fp8_forms() -> list[tuple[str, str, int, tuple]]:
    from attncc.runtime.serving.tiles import choose_batch_tiles

    forms = []
    for d in (64, 128, 256):
        for rows, long_kv in ((8, False), (8, True), (4096, False)):
            t = choose_batch_tiles(d, rows, 132, long_kv=long_kv)
            if long_kv and t.stages == 2:
                continue  # (no deeper decode ring at this head dim)
            tiles = (t.tq, t.tkv, t.stages, t.m_frags, t.kv_warps)
            pairs = [("float8_e4m3fn", "bfloat16"), ("float8_e5m2", "float16")]
            if d == 128:
                pairs += [("float8_e4m3fn", "float16"), ("float8_e5m2", "bfloat16")]
            forms += [(kv, dt, d, tiles) for kv, dt in pairs]
    from bench.decode import KV_TILE_SWEEP  # the deeper fp8 decode rings the bench times

    forms += [("float8_e4m3fn", "bfloat16", 128, (tq, tkv, st, 1, w))
              for tq, tkv, st, w in KV_TILE_SWEEP]
    return list(dict.fromkeys(forms))


@pytest.mark.nvrtc
@pytest.mark.parametrize("kv,dtype,d,tiles", _fp8_forms(),
                         ids=[f"{f[0][7:]}-{f[1]}-d{f[2]}-q{f[3][0]}-kv{f[3][1]}-s{f[3][2]}" for f in _fp8_forms()])
def test_fp8_batch_forms_compile_within_budget(kv: str, dtype: str, d: int, tiles: tuple) -> None:
    """Decode and one-fragment forms compile spill-free; a two-fragment prefill form (spills
    allowed up to FA2_SPILL_BUDGET, as its 16-bit twin) stays within the budget."""
    from attncc.codegen.tiles import KernelTiles
    from attncc.runtime.jit.kernels import FA2_SPILL_BUDGET, KernelSpec, compile_spec

    kind = "decode" if tiles[4] > 1 else "fa2_batch"
    form = compile_spec(KernelSpec(kind, VariantIR(name="plain"), d, dtype,
                                   KernelTiles(*tiles), kv_dtype=kv), "sm_90a")
    assert form.gen.kernel_name.endswith("_kve4m3" if "e4m3" in kv else "_kve5m2")
    assert form.spill_bytes <= FA2_SPILL_BUDGET[tiles[3]], form.result.log


def test_fp8_needs_two_stages() -> None:
    """Forced one-stage tiles have no room for the fp8 ring: refused before any compile."""
    from attncc.runtime.serving.batch import _kernels_for
    from attncc.runtime.serving.tiles import BatchTiles

    tiles = BatchTiles(16, 32, 1, 1, 6, 792, 2, "fa2")
    with pytest.raises(ValueError, match="needs stages >= 2"):
        _kernels_for(VariantIR(name="plain"), 128, "bfloat16", tiles, 0, E4M3)


@pytest.mark.nvrtc
@pytest.mark.parametrize("tiles", [(16, 32, 2, 1, 2), (128, 64, 2, 2, 1)], ids=["decode", "q128"])
def test_fp8_forms_with_hooks_compile_within_budget(tiles: tuple) -> None:
    """A variant with a LogitsTransform and a mask (softcap, causal): the logits' scale carries
    k_scale; the decode form stays spill-free, the two-fragment form within its budget."""
    from attncc.codegen.tiles import KernelTiles
    from attncc.gym import GYM
    from attncc.ir.simplified import simplify_variant
    from attncc.runtime.jit.kernels import FA2_SPILL_BUDGET, KernelSpec, compile_spec

    ir = simplify_variant(GYM["softcap_causal"](1, 8, 4096, 128, seed=5).trace()[0])
    kind = "decode" if tiles[4] > 1 else "fa2_batch"
    form = compile_spec(KernelSpec(kind, ir, 128, "bfloat16", KernelTiles(*tiles),
                                   kv_dtype="float8_e4m3fn"), "sm_90a")
    assert form.spill_bytes <= FA2_SPILL_BUDGET[tiles[3]], form.result.log
