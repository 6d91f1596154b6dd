"""Backward translation units' extra members: VariantGrads_<name>, LogitsGrad, CapturedGrad
(docs/backward.md, section 2), generated from attncc.ir.autodiff's derivatives."""
from __future__ import annotations

import re

import pytest
import torch

import attncc
from attncc.codegen import CodegenError
from attncc.codegen.generate import generate_source, generate_variant
from attncc.codegen.layout import variant_grad_values
from attncc.codegen.testing import hook_test_unit
from attncc.errors import DifferentiationError
from attncc.gym import GYM
from tests.codegen.test_codegen import nvrtc_compile, nvrtc_fails
from tests.helpers.learnable import LEARNABLE


def _gym_irs():
    return {n: m(2, 4, 64, 64).trace()[0] for n, m in GYM.items()}


def _learnable_irs(Sq: int = 37, Skv: int = 53):
    out = {}
    for n, f in LEARNABLE.items():
        mod, _ = f(4, Sq, Skv)
        out[n] = attncc.Variant(score_mod=mod, name=n).trace()[0]
    return out


def test_forward_units_carry_no_backward_members() -> None:
    for ir in (*_gym_irs().values(), *_learnable_irs().values()):
        text = generate_variant(ir).text
        for word in ("Grads", "LogitsGrad", "CapturedGrad", "has_logits_grad"):
            assert word not in text
        bwd = generate_variant(ir, backward=True).text
        assert "using Grads = VariantGrads_" in bwd and "LogitsGrad(" in bwd
        # the forward part of a backward unit is the forward unit's, hook for hook
        fwd_lines = text.splitlines()
        bwd_lines = iter(bwd.splitlines())
        assert all(line in bwd_lines for line in fwd_lines)  # a subsequence


def test_grads_struct_follows_grad_tensors_in_ir_order() -> None:
    ir = _learnable_irs()["rel_table"]
    vc = generate_variant(ir, backward=True, grad_tensors=("bias",))
    assert [(f.name, f.ctype, f.count) for f in vc.grads_layout.fields] == [
        ("bias_grad", "float*", 1), ("bias_grad_stride", "attncc::i64", 2)]
    assert vc.grads_name == "VariantGrads_rel_table" and vc.grad_tensors == ("bias",)
    assert vc.has_diag_grads and not vc.has_captured_grad and not vc.has_logits_grad
    packed = vc.grads_layout.pack(variant_grad_values(vc.grads_layout, {"bias": (64, [89, 1])}))
    assert packed == (64).to_bytes(8, "little") + (89).to_bytes(8, "little") + (1).to_bytes(8, "little")
    none = generate_variant(ir, backward=True)
    assert [f.name for f in none.grads_layout.fields] == ["_unused"]
    assert not none.has_captured_grad and not none.has_diag_grads
    assert "no position-dependent read requires grad" in none.text


def test_captured_grad_adds_dlogit_times_derivative_at_the_read_index() -> None:
    ir = _learnable_irs()["head_scale"]
    vc = generate_variant(ir, backward=True, grad_tensors=("scales",))
    # scales[h] is tile-uniform: each element's term into a register, a warp's sum added once
    assert "acc[0] += dlogit * score;" in vc.text and vc.tile_grads == 1
    assert "atomicAdd(g.scales_grad + (attncc::i64)h * g.scales_grad_stride[0], acc[0]);" \
        in vc.text and not vc.has_captured_grad
    # bias[h, q_idx - kv_idx + C] moves only along diagonals: summed per diagonal
    rel = generate_variant(_learnable_irs()["rel_table"], backward=True, grad_tensors=("bias",))
    assert rel.diag_grads == 1 and rel.tile_grads == 0 and not rel.has_captured_grad
    assert "acc[0] = dlogit;" in rel.text and "atomicAdd(g.bias_grad" in rel.text
    assert re.search(r"LogitsGrad\(.*\) \{\n\s+return attncc::to_float\(p\.scales\[", vc.text)
    softcap = generate_variant(_gym_irs()["softcap"], backward=True, fast_math=False).text
    assert "return 1.0f - t0 * t0;" in softcap and "tanhf(score / p.cap)" in softcap


def test_hooks_name_the_python_line() -> None:
    ir = _learnable_irs()["alibi_slopes"]
    text = generate_variant(ir, backward=True, grad_tensors=("slopes",)).text
    assert re.search(r"// d score_mod / d score; score_mod: .*learnable\.py:\d+ \(alibi_mod\)", text)
    assert "// acc[0]: slopes[h], d/d read = f32(kv_idx - q_idx)" in text


def test_grad_tensors_are_checked() -> None:
    ir = _learnable_irs()["rel_table"]
    with pytest.raises(DifferentiationError, match="'nope', which the variant does not capture"):
        generate_variant(ir, backward=True, grad_tensors=("nope",))
    with pytest.raises(CodegenError, match="grad_tensors is for backward"):
        generate_variant(ir, grad_tensors=("bias",))
    with pytest.raises(CodegenError, match="'fa2' is a forward one"):
        generate_source(ir, head_dim=64, dtype="bfloat16", kernel="fa2", grad_tensors=("bias",))
    doc = _gym_irs()["document_mask"]
    with pytest.raises(DifferentiationError, match="holds int32, which cannot require grad"):
        generate_variant(doc, backward=True, grad_tensors=(doc.tensors[0].name,))


def test_mask_reading_a_tensor_that_requires_grad_names_its_line() -> None:
    keep = torch.rand(4, requires_grad=True)

    def soft_gate(b, h, q_idx, kv_idx):
        return keep[h] > 0.5

    ir = attncc.Variant(mask_mod=soft_gate, name="gate").trace()[0]
    with pytest.raises(DifferentiationError) as e:
        generate_variant(ir, backward=True, grad_tensors=("keep",))
    msg = str(e.value)
    assert "test_backward_hooks.py:" in msg and "(soft_gate)" in msg and ".detach()" in msg


@pytest.mark.nvrtc
@pytest.mark.parametrize("fast_math", [False, True])
def test_backward_hooks_of_every_variant_compile(fast_math: bool) -> None:
    irs = [*_gym_irs().values(), *_learnable_irs().values()]
    grads = {n: [t.name for t in ir.tensors] for n, ir in _learnable_irs().items()}
    src = hook_test_unit(irs, prefix="bw", backward=True, grad_tensors=grads, fast_math=fast_math)
    # relative table and T5 buckets read along diagonals; ALiBi slopes and head scales per tile
    assert src.count("V::DiagGradAdd(") == 2 and src.count("V::TileGradFlush(") == 2
    assert src.count("static_assert(sizeof(VariantGrads_") == len(irs)
    for arch in ("sm_80", "sm_90a"):
        nvrtc_compile(src, arch, f"backward hooks fast_math={fast_math}")


@pytest.mark.nvrtc
def test_grads_layout_static_asserts_catch_a_mismatch() -> None:
    ir = _learnable_irs()["t5_bucket"]
    src = hook_test_unit([ir], prefix="m", backward=True, grad_tensors={"t5_bucket": ["table"]})
    wrong = src.replace("ATTNCC_OFFSETOF(VariantGrads_m_0, table_grad_stride) == 8",
                        "ATTNCC_OFFSETOF(VariantGrads_m_0, table_grad_stride) == 16")
    assert wrong != src
    assert "Python layout: VariantGrads_m_0::table_grad_stride" in nvrtc_fails(wrong)


@pytest.mark.nvrtc
def test_gpu_probe_kernel_compiles() -> None:
    """tests/gpu/test_backward_hooks_gpu.py's probe, compiled here so the GPU run starts clean."""
    from tests.helpers.backward_probe import probe

    for n, ir in _learnable_irs().items():
        pr = probe(ir, [t.name for t in ir.tensors])
        assert "V::CapturedGrad(vp, g, a.dlogit[i]" in pr.source
        nvrtc_compile(pr.source, "sm_90a", f"probe {n}")


def test_a_backward_kernel_spec_generates_a_backward_unit(monkeypatch) -> None:
    """A KernelSpec with backward=True (what the "fa2bwd" entry sets) gets the gradient hooks,
    the grads layout and its static_asserts; grad_tensors flows through generate_source."""
    from dataclasses import replace as dc_replace

    from attncc.codegen import generate as gen

    spec = dc_replace(gen.KERNELS["fa2"], name="bwdtest", backward=True,
                      entry_macro="ATTNCC_BWDTEST_ENTRY")
    monkeypatch.setitem(gen.KERNELS, "bwdtest", spec)
    ir = _learnable_irs()["rel_table"]
    gk = generate_source(ir, head_dim=64, dtype="bfloat16", kernel="bwdtest",
                         grad_tensors=("bias",))
    assert gk.grads_layout is gk.variant.grads_layout and gk.grads_layout.size == 24
    assert "VariantParams_rel_table vp, VariantGrads_rel_table g)" in gk.source
    assert "captured tensors requiring grad (bias)\n" in gk.source
    assert 'static_assert(sizeof(VariantGrads_rel_table) == 24, ' in gk.source
    assert "static constexpr bool has_diag_grads = true;" in gk.source
    assert gk.source.count("ATTNCC_BWDTEST_ENTRY(") == 1
    fwd = generate_source(ir, head_dim=64, dtype="bfloat16", kernel="fa2")
    assert fwd.grads_layout is None and "VariantGrads" not in fwd.source
