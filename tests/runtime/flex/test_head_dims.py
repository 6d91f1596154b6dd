"""Head dims other than 64/128/256, and a value head dim other than the query's (issue 31): the
padding rule (attncc.codegen.tiles.padded_head_dim), the FA2 padded form codegen emits, what
the flex path plans for them, the fp64 reference with Dv != Dqk, and (NVRTC) the padded forms'
spills. The GPU runs are tests/gpu/test_head_dims_gpu.py."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.codegen.errors import CodegenError
from attncc.codegen.generate import generate_source
from attncc.codegen.tiles import KernelTiles, fa3_tiles, padded_head_dim
from attncc.gym import GYM
from attncc.ir.program import Bindings, VariantIR
from attncc.runtime.flex import gpu_flex
from attncc.runtime.jit.kernels import FA2_SPILL_BUDGET, KernelSpec, compile_spec
from attncc.runtime.jit.policy import spill_bytes


@pytest.mark.parametrize("dqk,dv,want", [(32, None, (64, True)), (64, None, (64, False)),
                                         (80, None, (128, True)), (128, 128, (128, False)),
                                         (192, 128, (256, True)), (128, 64, (128, True)),
                                         (64, 128, (128, True)), (256, 32, (256, True)),
                                         (136, None, (256, True))])
def test_padded_head_dim(dqk: int, dv: int | None, want: tuple[int, bool]) -> None:
    assert padded_head_dim(dqk, dv) == want


@pytest.mark.parametrize("dqk,dv,bad", [(100, None, "query head_dim 100"),
                                        (24, None, "query head_dim 24"),
                                        (264, None, "query head_dim 264"),
                                        (128, 260, "value head_dim 260"),
                                        (128, 12, "value head_dim 12"),
                                        (True, None, "query head_dim True")])
def test_bad_head_dims_name_the_argument(dqk: int, dv: int | None, bad: str) -> None:
    with pytest.raises(ValueError, match=bad) as e:
        padded_head_dim(dqk, dv)
    assert "multiples of 8 from 32 to 256" in str(e.value)


def _plan(ir: VariantIR, d: int, dv: int | None = None, **kw) -> gpu_flex.LaunchPlan:
    return gpu_flex.plan_shapes(ir, Bindings(), batch=1, num_q_heads=16, num_kv_heads=4,
                                q_len=4096, kv_len=4096, head_dim=d, head_dim_vo=dv,
                                dtype="bfloat16", num_sms=132, fa3_ok=True, **kw)


def test_padded_dims_plan_at_the_padded_width() -> None:
    """On sm_90 a native dim runs FA3; a padded one runs FA3's padded form when both real dims
    are FA3_PADDED_MIN_DIM (64) or more, else FA2's, at its padded width, its real dims in the
    tiles and the kernel spec."""
    ir = GYM["causal"](1, 16, 4096, 128).trace()[0]
    native = _plan(ir, 128)
    assert native.tiles.kernel == "fa3" and native.tiles.head_dims is None
    for d, dv, width, kernel in ((80, None, 128, "fa3"), (192, 128, 256, "fa3"),
                                 (128, 64, 128, "fa3"), (64, 128, 128, "fa3"),
                                 (72, 72, 128, "fa3"), (128, 56, 128, "fa2"),
                                 (32, None, 64, "fa2"), (48, 128, 128, "fa2")):
        pl = _plan(ir, d, dv)
        assert pl.tiles.kernel == kernel and pl.head_dim == width, (d, dv)
        assert pl.tiles.head_dims == (d, d if dv is None else dv)
        (spec,) = gpu_flex.plan_specs(pl)
        assert spec.kind == f"{kernel}_prefill" and spec.head_dim == width
        assert spec.head_dims == pl.tiles.head_dims
        fa2 = _plan(ir, d, dv, kernel_options={"KERNEL": "fa2"})
        assert fa2.tiles.kernel == "fa2" and fa2.tiles.head_dims == pl.tiles.head_dims


def test_padded_dims_refuse_narrow_fa3_and_row_hooks() -> None:
    ir = GYM["causal"](1, 16, 4096, 128).trace()[0]
    assert _plan(ir, 96, kernel_options={"KERNEL": "fa3"}).tiles.kernel == "fa3"
    with pytest.raises(ValueError, match="KERNEL'\\]='fa3' runs padded head dims of 64 or more; "
                                         "head dims 48/48"):
        _plan(ir, 48, kernel_options={"KERNEL": "fa3"})
    rope = GYM["rope"](1, 16, 4096, 96).trace()[0]
    with pytest.raises(ValueError, match="query_mod, key_mod.*padded head dim"):
        _plan(rope, 96)
    _plan(GYM["rope"](1, 16, 4096, 128).trace()[0], 128)  # native: the hooks run


def test_codegen_padded_form() -> None:
    """The padded form is the same template at the padded width with the real dims as template
    arguments (its name says them); the native form passes its own dim twice."""
    ir = GYM["softcap"](1, 8, 1024, 128).trace()[0]
    t = KernelTiles(64, 64, 2, 1)
    pad = generate_source(ir, head_dim=256, dtype="bfloat16", kernel="fa2", tiles=t,
                          head_dims=(192, 128))
    assert pad.kernel_name.endswith("_q64_k64_s2_dqk192_dv128")
    assert f"({pad.kernel_name}, " in pad.source and ", 256, 64, 64, 2, 1, 1, 192, 128)" in \
        pad.source
    nat = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2", tiles=t)
    assert nat.kernel_name.endswith("_q64_k64_s2") and ", 128, 64, 64, 2, 1, 1, 128, 128)" in \
        nat.source
    same = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2", tiles=t,
                           head_dims=(128, 128))
    assert same.source == nat.source
    batch = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2batch",
                            tiles=KernelTiles(16, 64, 2, 1, 4), head_dims=(96, 96))
    assert batch.kernel_name.endswith("_w4_dqk96_dv96") and "attncc::bf16, 96, 96, false)" in \
        batch.source
    fa3 = generate_source(ir, head_dim=256, dtype="bfloat16", kernel="fa3",
                          tiles=fa3_tiles(2, 64), head_dims=(192, 128))
    assert fa3.kernel_name.endswith("_q128_k64_s2_dqk192_dv128") and \
        ", 256, 128, 64, 2, 1, 1, 192, 128)" in fa3.source
    fa3_nat = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa3",
                              tiles=fa3_tiles(3, 128))
    assert ", 128, 128, 128, 3, 1, 1, 128, 128)" in fa3_nat.source


@pytest.mark.parametrize("kw,msg", [
    (dict(kernel="fa3batch", head_dim=128, head_dims=(96, 96)), "no padded form"),
    (dict(kernel="fa3", head_dim=64, head_dims=(48, 48)), "real head dims of 64 or more"),
    (dict(kernel="fa2", head_dim=256, head_dims=(96, 96)), "pad to 128, not head_dim=256"),
    (dict(kernel="fa2", head_dim=128, head_dims=(96, 96), kv_dtype=None, ir="rope"),
     "no query_mod, key_mod"),
])
def test_codegen_refuses_bad_padded_forms(kw: dict, msg: str) -> None:
    name = kw.pop("ir", "causal")
    ir = GYM[name](1, 8, 1024, 96).trace()[0]
    with pytest.raises(CodegenError, match=msg):
        generate_source(ir, dtype="bfloat16", **kw)


@pytest.mark.parametrize("dqk,dv,hkv", [(192, 128, 2), (64, 128, 4), (80, 80, 1), (40, 96, 2)])
def test_reference_value_head_dim(dqk: int, dv: int, hkv: int) -> None:
    """The CPU path (fp64 reference) with Dv != Dqk: out has Dv columns, the LSE is the scores'
    alone; against the attention written out in torch, GQA, a score_mod and a causal mask."""
    g = torch.Generator().manual_seed(dqk + dv)
    q = torch.randn(2, 4, 33, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, 45, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, 45, dv, generator=g, dtype=torch.float64)
    variant = attncc.Variant(score_mod=lambda s, b, h, qi, ki: s - 0.05 * (qi - ki).abs(),
                             mask_mod=lambda b, h, qi, ki: ki <= qi + 12, name="band")
    out, lse = attncc.flex_attention(q, k, v, variant, enable_gqa=hkv != 4, return_lse=True)
    rep = 4 // hkv
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    qi, ki = torch.arange(33)[:, None], torch.arange(45)[None]
    s = q @ kk.transpose(-1, -2) / math.sqrt(dqk) - 0.05 * (qi - ki).abs()
    s = s.masked_fill(ki > qi + 12, -math.inf)
    assert out.shape == (2, 4, 33, dv)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ vv, rtol=1e-6, atol=1e-6)
    # (the LSE is float32, as FlexAttention's)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-6, atol=1e-5)


_SPILL_CASES = [("causal", 80, None), ("softcap_causal", 96, None), ("alibi_causal", 192, None),
                ("causal", 192, 128), ("relative_bias", 112, None)]


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d,dv", _SPILL_CASES)
def test_padded_flex_kernels_compile_without_spills(name: str, d: int, dv: int | None) -> None:
    """The padded forms a flex call plans (long prefill -- FA3's padded form by default, FA2's
    when forced -- and a short one on 16-row tiles) compile as the kernel cache compiles them:
    zero spills at one fragment per warp, within the two-fragment budget otherwise (as the
    native forms)."""
    from attncc.ir.simplify import simplify_variant

    ir = GYM[name](1, 16, 4096, d).trace()[0]
    for q_len, opts in ((4096, None), (4096, {"KERNEL": "fa2"}), (7, None)):
        pl = gpu_flex.plan_shapes(ir, Bindings(), batch=1, num_q_heads=16, num_kv_heads=16,
                                  q_len=q_len, kv_len=4096, head_dim=d, head_dim_vo=dv,
                                  dtype="bfloat16", num_sms=132, fa3_ok=True,
                                  kernel_options=opts)
        assert pl.tiles.head_dims is not None
        spec = gpu_flex.kernel_spec(simplify_variant(pl.ir), pl.head_dim, pl.dtype, pl.tiles)
        form = compile_spec(spec, "sm_90a")
        assert form.gen.kernel_name.endswith(f"_dqk{d}_dv{dv or d}")
        assert spill_bytes(form.result.log) <= FA2_SPILL_BUDGET[form.spec.tiles.m_frags], \
            form.result.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d,dv", [("causal", 80, 80), ("softcap_causal", 192, 128),
                                       ("causal", 96, 96), ("alibi_causal", 64, 128)])
def test_padded_batch_kernels_compile_without_spills(name: str, d: int, dv: int) -> None:
    """The padded batch forms (prefill tiles and the decode form with KV warps; the merge kernel
    stores Dv columns) compile with zero spills."""
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.serving.tiles import choose_batch_tiles

    ir = simplify_variant(GYM[name](1, 8, 4096, d).trace()[0])
    width, _ = padded_head_dim(d, dv)
    for rows in (8, 512):
        t = choose_batch_tiles(width, rows, 132)
        kind = "decode" if t.kv_warps > 1 else "fa2_batch"
        spec = KernelSpec(kind, ir, width, "bfloat16",
                          KernelTiles(t.tq, t.tkv, t.stages, t.m_frags, t.kv_warps),
                          head_dims=(d, dv))
        form = compile_spec(spec, "sm_90a")
        assert spill_bytes(form.result.log) <= FA2_SPILL_BUDGET[form.spec.tiles.m_frags], \
            form.result.log
