"""Codegen: IR -> CUDA text that is exact, deterministic, readable, and compiles with NVRTC / nvcc.

NVRTC tests batch several generated translation units into ONE compile (the shipped headers have
include guards, so units concatenate) to keep the file fast on a 2-core CI machine.
"""
from __future__ import annotations

import math
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch

from attncc import Variant
from attncc.codegen import (ATTENTION_PARAMS, CodegenError, export_source, generate_source,
                            generate_variant, variant_param_values)
from attncc.codegen.cuda_expr import ExprNames, emit, float_literal, int_literal
from attncc.codegen.layout import c_identifier, struct_layout
from attncc.codegen.testing import hook_test_unit
from attncc.ir.nodes import BOOL, F32, I32, binary, const, load, unary, var, vec, where
from attncc.ir.program import Hook, ScalarParam, TensorParam, VariantIR, ir_dtype_for_elem

ENTRY_MARK = "// ============================================================================ entry point"


# ------------------------------------------------------------------------------- NVRTC helper

def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    try:
        return nvrtc if int(nvrtc.nvrtcVersion()[0]) == 0 else None
    except Exception:  # the shared library is missing
        return None


needs_nvrtc = pytest.mark.skipif(_nvrtc() is None, reason="cuda.bindings.nvrtc cannot load")
COMPILE_TIMES: dict[str, float] = {}


def nvrtc_compile(source: str, arch: str, label: str) -> None:
    """Compile with NVRTC (no include paths at all); fail the test with the log on error."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{label}.cu".encode(), 0, [], [])
    assert int(err) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    t0 = time.perf_counter()
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    COMPILE_TIMES[f"{label} {arch}"] = time.perf_counter() - t0
    print(f"NVRTC {arch} {label}: {COMPILE_TIMES[f'{label} {arch}']:.2f}s")  # shown with -s
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    if int(err) != 0:
        pytest.fail(f"NVRTC ({arch}) rejected {label}:\n{log.decode(errors='replace')[:6000]}")


def nvrtc_fails(source: str, arch: str = "sm_80") -> str:
    """The NVRTC log of a source that must NOT compile."""
    nvrtc = _nvrtc()
    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"bad.cu", 0, [], [])
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    assert int(err) != 0, "expected a compile error"
    return log.decode(errors="replace")


# ------------------------------------------------------------------------------- the variants

def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


SLOPES = torch.rand(8)
TABLE = torch.randn(8, 33)
DOC_IDS = torch.arange(300, dtype=torch.int64) // 70


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + TABLE[h, torch.clamp(kv_idx - q_idx, -16, 16) + 16]


def document(b, h, q_idx, kv_idx):
    return DOC_IDS[q_idx] == DOC_IDS[kv_idx]


def prefix_lm_variant(prefix: int) -> Variant:
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    return Variant(mask_mod=prefix_lm, name="prefix_lm")


def sigmoid_variant(bias: float) -> Variant:
    def sigmoid_score(score, b, h, q_idx, kv_idx):
        return torch.sigmoid(score + bias)

    return Variant(score_mod=sigmoid_score, normalize="none", name="sigmoid_attn")


def rope(D: int, interleaved: bool):
    base = 10000.0

    def rotate(x, b, h, pos, d):
        if interleaved:  # pairs (2i, 2i+1)
            i = d // 2
            partner = torch.where(d % 2 == 0, -1.0, 1.0) * x[d + 1 - 2 * (d % 2)]
        else:  # pairs (i, i + D/2)
            i = d % (D // 2)
            partner = torch.where(d < D // 2, -1.0, 1.0) * x[(d + D // 2) % D]
        theta = pos * base ** (-2.0 * i / D)
        return x[d] * torch.cos(theta) + partner * torch.sin(theta)

    return rotate


def scaled_output(o, b, h, q_idx, d):
    return o[d] * (1.0 + 0.5 * torch.tanh(o[(d + 1) % 64]))


def variants(D: int = 128) -> dict[str, Variant]:
    return {
        "identity": Variant(name="identity"),
        "causal": Variant(mask_mod=causal, name="causal"),
        "softcap": Variant(score_mod=softcap, name="softcap"),
        "softcap_causal": Variant(score_mod=softcap, mask_mod=causal, name="softcap_causal"),
        "alibi": Variant(score_mod=alibi, name="alibi"),
        "relative_bias": Variant(score_mod=relative_bias, name="relative_bias"),
        "document": Variant(mask_mod=document, name="document"),
        "prefix_lm": prefix_lm_variant(9),
        "sigmoid": sigmoid_variant(-1.5),
        "rope_interleaved": Variant(query_mod=rope(D, True), key_mod=rope(D, True),
                                    name="rope_interleaved"),
        "rope_half": Variant(query_mod=rope(D, False), key_mod=rope(D, False), name="rope_half"),
        "output_mod": Variant(output_mod=scaled_output, mask_mod=causal, name="output_mod"),
    }


def traced(D: int = 128) -> dict[str, VariantIR]:
    return {k: v.trace()[0] for k, v in variants(D).items()}


# ------------------------------------------------------------------------------- NVRTC compiles

@pytest.mark.nvrtc
@needs_nvrtc
def test_every_variant_compiles_on_the_simple_kernel_sm90a_bf16_d128() -> None:
    units = [generate_source(ir, head_dim=128, dtype="bfloat16").source
             for ir in traced(128).values()]
    nvrtc_compile("\n".join(units), "sm_90a", "all variants d128 bf16")


@pytest.mark.nvrtc
@needs_nvrtc
def test_head_dims_64_and_256_f16_bf16_f32_compile_for_sm80() -> None:
    irs64, irs256 = traced(64), traced(256)
    units = [generate_source(irs64["softcap_causal"], head_dim=64, dtype="float16"),
             generate_source(irs64["rope_half"], head_dim=64, dtype="float16"),
             generate_source(irs64["sigmoid"], head_dim=64, dtype="float32"),
             generate_source(irs256["alibi"], head_dim=256, dtype="bfloat16"),
             generate_source(irs256["document"], head_dim=256, dtype="float16")]
    assert len({u.kernel_name for u in units}) == len(units)
    nvrtc_compile("\n".join(u.source for u in units), "sm_80", "d64/d256 mix")


@pytest.mark.nvrtc
@needs_nvrtc
def test_every_hook_compiles_for_both_arches_in_one_hook_unit() -> None:
    irs = list(traced(128).values()) + list(traced(64).values())
    src = hook_test_unit(irs, prefix="h")
    for arch in ("sm_80", "sm_90a"):
        nvrtc_compile(src, arch, "hook unit")


@pytest.mark.nvrtc
@needs_nvrtc
def test_every_captured_tensor_dtype_loads() -> None:
    elems = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
             "int64", "bool")
    tensors = tuple(TensorParam(f"t_{e}", e, 1, ir_dtype_for_elem(e)) for e in elems)
    expr = var("score")
    for t in tensors:
        x = load(t.name, (var("h"),), t.dtype)
        expr = binary("add", expr, where(x, const(1.0), const(0.0)) if t.dtype is BOOL else x)
    ir = VariantIR(hooks={"score_mod": Hook("score_mod", expr)}, name="elems", tensors=tensors)
    text = generate_variant(ir).text
    assert "const attncc::bf16* t_bfloat16;" in text and "const bool* t_bool;" in text
    assert "attncc::to_bool(p.t_bool[" in text and "attncc::to_int(p.t_int8[" in text
    nvrtc_compile(hook_test_unit([ir], prefix="e"), "sm_80", "tensor dtypes")


@pytest.mark.nvrtc
@needs_nvrtc
def test_layout_static_asserts_catch_a_python_c_mismatch() -> None:
    ir = traced()["relative_bias"]
    head = generate_source(ir, head_dim=64, dtype="bfloat16").source.split(ENTRY_MARK)[0]
    nvrtc_compile(head, "sm_80", "layout asserts")  # the real layout passes
    off = ATTENTION_PARAMS.field("sm_scale").offset
    wrong = head.replace(f"AttentionParams, sm_scale) == {off}",
                         f"AttentionParams, sm_scale) == {off + 4}")
    assert wrong != head
    assert "Python layout: attncc::AttentionParams::sm_scale" in nvrtc_fails(wrong)
    size = generate_variant(ir).params_layout.size
    wrong = head.replace(f"sizeof(VariantParams_relative_bias) == {size}",
                         f"sizeof(VariantParams_relative_bias) == {size + 8}")
    assert wrong != head and "Python layout" in nvrtc_fails(wrong)


# ------------------------------------------------------------------------------- export + nvcc

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_export_compiles_with_nvcc(tmp_path: Path) -> None:
    ir = traced()["softcap_causal"]
    text = export_source(ir, head_dim=128, dtype="bfloat16")
    assert "nvcc -gencode=arch=compute_90a,code=sm_90a -c" in text
    assert ("extern \"C\" int attncc_softcap_causal_simple_d128_bf16_launch("
            "const attncc::AttentionParams* p,") in text
    path = tmp_path / "softcap_causal.cu"
    path.write_text(text)
    res = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a",
                          "-gencode=arch=compute_80,code=sm_80", "-c", str(path), "-o",
                          str(tmp_path / "x.o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    syms = subprocess.run(["nm", str(tmp_path / "x.o")], capture_output=True, text=True).stdout
    assert "attncc_softcap_causal_simple_d128_bf16_launch" in syms


def test_export_is_the_generated_unit_plus_docs_and_launcher() -> None:
    ir = traced()["alibi"]
    gen = generate_source(ir, head_dim=64, dtype="float16").source
    exp = export_source(ir, head_dim=64, dtype="float16")
    body = gen[gen.index("// ===="):]
    assert body.rstrip() in exp
    launcher = exp[exp.index("#ifndef __CUDACC_RTC__"):]
    assert "<<<grid, dim3(128), 0, (cudaStream_t)stream>>>(*p, *vp)" in launcher
    assert "(captured tensor `SLOPES`)" in exp  # the layout table documents each member
    assert "#include" not in exp


# ------------------------------------------------------------------------------- determinism

def test_regeneration_is_byte_identical() -> None:
    first = {k: generate_source(ir, head_dim=128, dtype="bfloat16").source
             for k, ir in traced().items()}
    second = {k: generate_source(ir, head_dim=128, dtype="bfloat16").source
              for k, ir in traced().items()}
    assert first == second
    for src in first.values():
        assert "/work" not in src and "/tmp" not in src  # no absolute paths


def test_new_captured_values_do_not_change_the_source() -> None:
    a = generate_source(prefix_lm_variant(9).trace()[0], head_dim=64, dtype="bfloat16").source
    b = generate_source(prefix_lm_variant(200).trace()[0], head_dim=64, dtype="bfloat16").source
    assert a == b and "p.prefix" in a
    c = generate_source(sigmoid_variant(-1.5).trace()[0], head_dim=64, dtype="float16").source
    d = generate_source(sigmoid_variant(3.25).trace()[0], head_dim=64, dtype="float16").source
    assert c == d and "p.bias" in c


def test_kernel_names_are_deterministic() -> None:
    gk = generate_source(traced()["softcap_causal"], head_dim=256, dtype="float16")
    assert gk.kernel_name == "attncc_softcap_causal_simple_d256_f16"
    assert f'extern "C" __global__ void __launch_bounds__(128)\n{gk.kernel_name}(' in gk.source
    assert gk.source.count(ENTRY_MARK) == 1  # flex/gpu_flex.py splices the FA2 entry here
    assert gk.grid(q_len=9, num_q_heads=3, batch=2) == (3, 3, 2) and gk.block == (128, 1, 1)


# ------------------------------------------------------------------------------- hooks

def test_identity_score_mod_has_no_logits_transform() -> None:
    vc = generate_variant(Variant(score_mod=lambda s, b, h, q, kv: s, name="ident").trace()[0])
    assert not vc.has_logits_transform
    assert "static constexpr bool has_logits_transform = false;" in vc.variant_struct
    body = vc.variant_struct.split("LogitsTransform(")[1].split("}")[0]
    assert body.strip().endswith("return score;")
    vc2 = generate_variant(traced()["identity"])
    assert not any([vc2.has_query_transform, vc2.has_key_transform, vc2.has_value_transform,
                    vc2.has_logits_transform, vc2.has_logits_mask, vc2.has_output_transform])
    assert "return true;" in vc2.variant_struct and "return q[d];" in vc2.variant_struct


def test_flags_and_normalize() -> None:
    irs = traced()
    sig = generate_variant(irs["sigmoid"])
    assert not sig.use_softmax and "use_softmax = false;" in sig.variant_struct
    rope_i = generate_variant(irs["rope_interleaved"])
    assert rope_i.has_query_transform and rope_i.has_key_transform
    assert not rope_i.has_value_transform and rope_i.use_softmax


def test_band_masks_carry_their_kv_window() -> None:
    """A mask that is exactly a band (causal) gives the kernels has_kv_window and its bounds
    (unbounded sides as -+2^62); other masks and no mask give has_kv_window = false."""
    causal = generate_variant(Variant(mask_mod=lambda b, h, q, kv: q >= kv,
                                      name="causal").trace()[0])
    assert causal.kv_window == (None, 0)
    assert "static constexpr bool has_kv_window = true;" in causal.variant_struct
    assert f"kv_window_lo = {-(1 << 62)}LL;" in causal.variant_struct
    assert "kv_window_hi = 0LL;" in causal.variant_struct
    band = generate_variant(Variant(mask_mod=lambda b, h, q, kv: (q >= kv) & (q - kv <= 63),
                                    name="band").trace()[0])
    assert band.kv_window == (-63, 0) and "kv_window_lo = -63LL;" in band.variant_struct
    for vc in (generate_variant(Variant(mask_mod=lambda b, h, q, kv: (q >= kv) | (kv < 4),
                                        name="prefix").trace()[0]),
               generate_variant(traced()["identity"])):
        assert vc.kv_window is None
        assert "static constexpr bool has_kv_window = false;" in vc.variant_struct


def test_hooks_carry_source_and_ir_comments() -> None:
    vc = generate_variant(traced()["softcap_causal"])
    assert re.search(r"// score_mod: codegen/test_codegen\.py:\d+ \(softcap\)\n", vc.variant_struct)
    assert "    // IR: 30.0 * tanh(score / 30.0)\n" in vc.variant_struct
    assert "        return 30.0f * tanhf(score / 30.0f);\n" in vc.variant_struct


def test_key_and_value_hooks_read_the_kv_head() -> None:
    ir = Variant(key_mod=lambda k, b, h, kv, d: k[d] * (h + 1)).trace()[0]
    vc = generate_variant(ir)
    assert "int h_kv, int kv_idx, int d)" in vc.variant_struct
    assert "return k[d] * (float)(h_kv + 1);" in vc.variant_struct


def test_loads_use_64_bit_strided_offsets_and_typed_conversions() -> None:
    text = generate_variant(traced()["relative_bias"]).variant_struct
    assert ("attncc::to_float(p.TABLE[(attncc::i64)h * p.TABLE_stride[0] + "
            "(attncc::i64)(attncc::mini(attncc::maxi(kv_idx - q_idx, -16), 16) + 16) * "
            "p.TABLE_stride[1]])") in text
    doc = generate_variant(traced()["document"]).variant_struct
    assert "attncc::to_int(p.DOC_IDS[(attncc::i64)q_idx * p.DOC_IDS_stride[0]])" in doc


def test_codegen_rejects_ir_a_hook_cannot_compute() -> None:
    bad = VariantIR(hooks={"mask_mod": Hook("mask_mod", var("d") >= 0)})
    with pytest.raises(CodegenError, match="mask_mod reads 'd'"):
        generate_variant(bad)
    bad = VariantIR(hooks={"query_mod": Hook("query_mod", vec("k", var("d")))})
    with pytest.raises(CodegenError, match=r"query_mod reads k\[...\]"):
        generate_variant(bad)
    bad = VariantIR(hooks={"score_mod": Hook("score_mod", var("score") + load("t", (), F32))})
    with pytest.raises(CodegenError, match="captured tensor 't'"):
        generate_variant(bad)
    with pytest.raises(CodegenError, match="head dims"):
        generate_source(VariantIR(), head_dim=100, dtype="bfloat16")
    with pytest.raises(CodegenError, match="dtype"):
        generate_source(VariantIR(), head_dim=64, dtype="fp8")


# ------------------------------------------------------------------------------- expressions

def test_float_constants_are_exact_float32() -> None:
    for v in (30.0, 1 / 30, 0.1, -2.5, 1e-30, 3.0e38, 2.0**-149, 123456.789, -0.0):
        lit = float_literal(v)
        want = struct.unpack("<f", struct.pack("<f", v))[0]
        got = float.fromhex(lit[:-1]) if "0x" in lit else float(lit[:-1])
        assert got == want and math.copysign(1, got) == math.copysign(1, want), (v, lit)
    assert float_literal(float("inf")) == "__uint_as_float(0x7f800000u)"
    assert float_literal(float("-inf")) == "__uint_as_float(0xff800000u)"
    assert float_literal(float("nan")) == "__uint_as_float(0x7fc00000u)"
    assert float_literal(1e39) == "__uint_as_float(0x7f800000u)"  # rounds to inf in float32
    assert int_literal(-(2**31)) == "(-2147483647 - 1)" and int_literal(7) == "7"


def test_neg_inf_where_prints_as_bits() -> None:
    e = where(var("q_idx") >= var("kv_idx"), var("score"), const(float("-inf")))
    assert emit(e).value == "q_idx >= kv_idx ? score : __uint_as_float(0xff800000u)"


def test_shared_subexpressions_become_numbered_temporaries() -> None:
    dist = var("q_idx") - var("kv_idx")
    e = where((dist >= 0) & (dist < 8), binary("mul", var("score"), unary("to_f32", dist)),
              var("score"))
    code = emit(e)
    assert code.temps == ("const int t0 = q_idx - kv_idx;",)
    assert code.value == "t0 >= 0 && t0 < 8 ? score * (float)t0 : score"


def test_guarded_loads_stay_inside_the_guard() -> None:
    n = var("kv_idx")
    ld = load("tab", (n,), F32)
    e = where(n < 10, ld * ld, const(0.0))  # the load is shared but only valid when n < 10
    code = emit(e, ExprNames(tensors={"tab": "tab"}))
    assert code.temps == ()  # hoisting would read tab[n] for n >= 10
    assert code.value.startswith("kv_idx < 10 ? ")
    m = (n < 10) & binary("eq", load("ids", (n,), I32), const(3))  # && guards its right side
    assert emit(m, ExprNames(tensors={"ids": "ids"})).value == \
        "kv_idx < 10 && attncc::to_int(p.ids[(attncc::i64)kv_idx * p.ids_stride[0]]) == 3"


def test_python_semantics_helpers_and_precedence() -> None:
    d = var("d")
    assert emit(binary("floordiv", d, const(-3))).value == "attncc::floordiv(d, -3)"
    assert emit(binary("mod", d, const(4))).value == "attncc::pymod(d, 4)"
    assert emit(unary("sigmoid", var("score"))).value == "attncc::sigmoid(score)"
    s = var("score")
    assert emit(binary("sub", s, binary("sub", s, const(1.0)))).value == "score - (score - 1.0f)"
    assert emit(binary("sub", s, const(-1.0))).value == "score - (-1.0f)"
    assert emit(unary("neg", unary("neg", s))).value == "-(-score)"
    a, b, c = (var(x) >= 0 for x in ("b", "h", "d"))
    assert emit((a | b) & c).value == "(b >= 0 || h >= 0) && d >= 0"
    assert emit(binary("eq", a, b)).value == "(int)(b >= 0) == (int)(h >= 0)"  # IR promotes


# ------------------------------------------------------------------------------- layouts

def test_attention_params_layout() -> None:
    assert ATTENTION_PARAMS.size == 288 and ATTENTION_PARAMS.align == 8
    assert ATTENTION_PARAMS.field("item_counter").offset == 264
    assert ATTENTION_PARAMS.field("split_partials").offset == 272
    assert ATTENTION_PARAMS.field("sinks").offset == 280
    assert ATTENTION_PARAMS.field("lse_stride_h").offset == 144
    assert ATTENTION_PARAMS.field("sm_scale").offset == 172
    assert ATTENTION_PARAMS.field("kv_num_blocks").offset == 176
    assert ATTENTION_PARAMS.field("block_kv").offset == 252


def test_variant_params_layout_and_packing() -> None:
    ir = VariantIR(name="mix", scalars=(ScalarParam("n", I32), ScalarParam("cap", F32)),
                   tensors=(TensorParam("bias", "bfloat16", 2, F32),
                            TensorParam("ids", "int64", 1, I32)))
    lay = generate_variant(ir).params_layout
    assert [(f.declaration, f.offset) for f in lay.fields] == [
        ("const attncc::bf16* bias;", 0), ("attncc::i64 bias_stride[2];", 8),
        ("attncc::i64 bias_size[2];", 24), ("const attncc::i64* ids;", 40),
        ("attncc::i64 ids_stride[1];", 48), ("attncc::i64 ids_size[1];", 56),
        ("int n;", 64), ("float cap;", 68)]
    assert lay.size == 72 and lay.align == 8
    vals = variant_param_values(lay, {"n": 5, "cap": 0.5},
                                {"bias": (0x1000, (33, 1), (8, 33)), "ids": (0x2000, (1,), (300,))})
    raw = lay.pack(vals)
    assert len(raw) == 72
    assert struct.unpack_from("<Qqq", raw, 0) == (0x1000, 33, 1)
    assert struct.unpack_from("<if", raw, 64) == (5, 0.5)


def test_c_names_are_safe_and_unique() -> None:
    assert c_identifier("new") == "new_" and c_identifier("NULL") == "NULL_"
    assert c_identifier("__x") == "_2_x" and c_identifier("_Foo") == "p_Foo"
    ir = VariantIR(name="kw", scalars=(ScalarParam("x_stride", I32), ScalarParam("new", F32)),
                   tensors=(TensorParam("x", "float32", 1, F32),))
    names = [f.name for f in generate_variant(ir).params_layout.fields]
    assert names == ["x", "x_stride", "x_size", "x_stride_", "new_"]
    assert len(set(names)) == len(names)


def test_empty_params_struct_is_never_empty() -> None:
    lay = struct_layout("E", [("_unused", "int", None, "unused")])
    assert lay.size == 4 and lay.pack({}) == b"\0\0\0\0"
    assert generate_variant(VariantIR()).params_layout.fields[0].name == "_unused"


# ------------------------------------------------------------------------------------ fa2 kernels
def test_fa2_translation_unit_and_export() -> None:
    """kernel="fa2": the FA2 templates, one entry macro line, tiles in the name; the export adds
    a launcher that opts into the dynamic shared memory it needs."""
    from attncc.codegen.tiles import KernelTiles

    ir = Variant(score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30),
                 mask_mod=lambda b, h, q, kv: q >= kv, name="sc").trace()[0]
    gk = generate_source(ir, head_dim=64, dtype="float16", kernel="fa2",
                         tiles=KernelTiles(64, 64, 3, 1))
    assert gk.kernel_name == "attncc_sc_fa2_d64_f16_q64_k64_s3"
    assert gk.source.count("ATTNCC_FA2_ENTRY(attncc_sc_fa2_d64_f16_q64_k64_s3,") == 1
    assert "attncc::fast_tanh" in gk.source  # the FA2 templates default to fast math
    assert gk.block == (128, 1, 1) and gk.shared_mem_bytes == 2 * 64 * (64 + 2 * 3 * 64)
    ex = export_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2")
    assert "cudaFuncSetAttribute(attncc_sc_fa2_d128_bf16_q128_k64_s2_m2," in ex
    assert "<<<grid, dim3(128), 98304, (cudaStream_t)stream>>>" in ex
    with pytest.raises(CodegenError, match="bfloat16 or float16"):
        generate_source(ir, head_dim=64, dtype="float32", kernel="fa2")
    with pytest.raises(CodegenError, match="not exported"):
        export_source(ir, head_dim=64, dtype="bfloat16", kernel="fa2batch")
    with pytest.raises(CodegenError, match="tiles are for"):
        generate_source(ir, head_dim=64, dtype="float16", tiles=KernelTiles())
    with pytest.raises(CodegenError, match="head dims"):
        generate_source(ir, head_dim=96, dtype="float16", kernel="fa2")


def test_fa2_tiles_kv_warps() -> None:
    """kv_warps > 1 (decode): warps split each KV tile; only with 16-row tiles, one fragment and
    KV slices of 16 rows or more; the name and the entry macro carry it."""
    from attncc.codegen.tiles import KernelTiles

    t = KernelTiles(16, 64, 2, 1, kv_warps=4)
    assert (t.warps, t.threads, t.suffix) == (4, 128, "_q16_k64_s2_w4")
    for bad in (dict(tq=32, kv_warps=2), dict(tq=16, tkv=32, kv_warps=4),
                dict(tq=16, kv_warps=3)):
        with pytest.raises(CodegenError, match="kv_warps"):
            KernelTiles(**{"tkv": 64, "stages": 2, "m_frags": 1, **bad})
    gk = generate_source(VariantIR(name="plain"), head_dim=128, dtype="bfloat16",
                         kernel="fa2batch", tiles=t)
    assert "ATTNCC_FA2_BATCH_ENTRY(attncc_plain_fa2batch_d128_bf16_q16_k64_s2_w4," in gk.source
    assert gk.source.count(", 16, 64, 2, 1, 4, attncc::bf16, 128, 128, false)") == 1 and gk.block == (128, 1, 1)


def test_fa3_translation_unit() -> None:
    """kernel="fa3": 128 x 128 tiles by default (128 x 64 on request), a producer and two
    consumer warpgroups (384 threads), shared memory for Q, the K/V ring, 2 * stages + 1
    mbarriers and the 1 KB alignment slack."""
    from attncc.codegen.tiles import KernelTiles

    ir = VariantIR(name="plain")
    gk = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa3")
    assert gk.block == (384, 1, 1)
    # the ring's 2 stages x (full, empty) mbarriers, then q_full and q_empty, the split ring's
    # 2 stages x (V full, K empty), the work item slot (item and tile range, 32 bytes), the
    # split tail's record (16) and each stage's TileMeta (8 bytes a stage)
    assert gk.shared_mem_bytes == (2 * 128 * (128 + 2 * 2 * 128) + 8 * 6 + 8 * 4 + 32 + 16
                                   + 8 * 2 + 1024)
    assert "ATTNCC_FA3_ENTRY(attncc_plain_fa3_d128_bf16_q128_k128_s2, " in gk.source
    gk = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa3",
                         tiles=KernelTiles(128, 64, 2, 1))
    assert "ATTNCC_FA3_ENTRY(attncc_plain_fa3_d128_bf16_q128_k64_s2, " in gk.source
    with pytest.raises(CodegenError, match="128-row tiles"):
        generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa3",
                        tiles=KernelTiles(64, 64, 2, 1))


@pytest.mark.nvrtc
def test_decode_batch_kernels_compile_without_spills() -> None:
    """The KV-splitting decode kernels stay under their register cap with no spills."""
    from attncc.codegen.tiles import KernelTiles
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.nvrtc import compile_cuda
    from attncc.gym import GYM

    for name, d in (("noop", 64), ("softcap_causal", 128), ("alibi_causal", 128)):
        ir = simplify_variant(GYM[name](1, 8, 1024, d).trace()[0])
        src = generate_source(ir, head_dim=d, dtype="bfloat16", kernel="fa2batch",
                              tiles=KernelTiles(16, 32, 2, 1, kv_warps=2)).source
        log = compile_cuda(src, arch="sm_90a", verbose=True).log
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert spills and all(a == "0" and b == "0" for a, b in spills), log


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d", [("noop", 64), ("softcap_causal", 128), ("alibi_causal", 128),
                                    ("sliding_window", 64), ("document_causal", 128)])
def test_fa3_batch_kernels_compile_without_spills(name: str, d: int) -> None:
    """kernel="fa3batch" (kernels/fa3/fa3_batch.cuh): the attention kernel (384 threads, setmaxnreg)
    and its merge kernel, as attncc compiles them (the kernel cache's `compile_spec`: the
    low-pressure form where the first spills), have no spills and no wgmma serialization, in the shared memory the tile
    choice allows."""
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.serving.fa3_batch import fa3_batch_source, fa3_batch_tiles
    from attncc.runtime.jit.tiles import SMEM_PER_CTA
    from attncc.gym import GYM

    ir = simplify_variant(GYM[name](1, 8, 1024, d).trace()[0])
    gk = fa3_batch_source(ir, d, "bfloat16")
    assert gk.threads == 384 and gk.shared_mem_bytes <= SMEM_PER_CTA
    assert f"ATTNCC_FA3_BATCH_ENTRY({gk.kernel_name}, " in gk.source
    form = compile_spec(KernelSpec("fa3_batch", ir, d, "bfloat16", fa3_batch_tiles(d)), "sm_90a")
    from attncc.codegen.generate import with_form

    assert form.gen.source == with_form(gk.source, low_pressure=form.spec.low_pressure)
    log = form.result.log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(spills) == 2 and all(a == "0" and b == "0" for a, b in spills), log
    assert "wgmma" not in log.lower(), log


@pytest.mark.nvrtc
def test_exported_fa2_compiles_with_nvrtc() -> None:
    from attncc.runtime.jit.nvrtc import compile_cuda
    from attncc.gym import GYM

    ir = GYM["alibi_causal"](1, 8, 256, 128).trace()[0]
    res = compile_cuda(export_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2"),
                       arch="sm_90a")
    assert res.cubin[:4] == b"\x7fELF"
