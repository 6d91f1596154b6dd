"""NVRTC only (no GPU): the kernels the flex path compiles stay spill-free (FA3: and keep their
wgmma pipeline; FA2: within gpu_flex's spill budget) -- FA3 single-CTA, low-pressure and
CTA-pair forms, FA2 default tiles, and the clamped captured-read variant. The GPU tests of the
same kernels are tests/gpu/test_fa3.py, test_fa3_pairs.py, test_fa2.py and test_bounds_gpu.py."""
from __future__ import annotations

import re

import pytest

from attncc.gym import GYM
from attncc.runtime.flex import gpu_flex
from attncc.runtime.flex.tile_choice import choose_tiles
from attncc.runtime.jit.kernels import FA2_SPILL_BUDGET
from attncc.runtime.jit.policy import spill_bytes, wgmma_notes
from attncc.runtime.jit.sources import fa2_source
from tests.helpers.clamped import clamped_ir
from tests.helpers.forms import PAIRED
from tests.helpers.variants import VARIANTS

FA3 = {"KERNEL": "fa3"}


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d,tkv,stages", [("causal", 128, 128, 2), ("softcap_causal", 64, 128, 2),
                                              ("alibi_causal", 128, 64, 2),
                                              ("softcap_causal", 128, 128, 3),
                                              ("rope", 128, 128, 3), ("rope", 64, 128, 4),
                                              ("value_output", 128, 128, 3),
                                              ("value_output", 256, 64, 2),
                                              ("rope", 256, 64, 2),
                                              # the split K/V ring (2 stages, 64-key tiles)
                                              # and persistent D = 256
                                              ("noop", 256, 64, 2), ("causal", 256, 64, 2),
                                              ("softcap_causal", 256, 64, 2),
                                              ("alibi_causal", 256, 64, 2),
                                              ("causal", 64, 64, 2)])
def test_fa3_compiles_without_spills(name: str, d: int, tkv: int, stages: int) -> None:
    """Zero spills, and the software pipeline intact: ptxas did not serialize the wgmmas (it
    does, with a "Potential Performance Loss" warning, when registers an in-flight wgmma uses
    are touched before its wait)."""
    from attncc.codegen.tiles import fa3_tiles
    from attncc.codegen.generate import generate_source
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.policy import wgmma_notes
    from attncc.runtime.jit.nvrtc import compile_cuda

    ir = simplify_variant(VARIANTS[name](1, 8, 1024, d).trace()[0])
    gk = generate_source(ir, head_dim=d, dtype="bfloat16", kernel="fa3",
                         tiles=fa3_tiles(stages, tkv))
    res = compile_cuda(gk.source, arch="sm_90a", verbose=True)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), res.log
    # and none of ptxas's wgmma notes (C7517, an injected wait, does not say "wgmma")
    assert "wgmma" not in res.log.lower() and not wgmma_notes(res.log), res.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d", [("document_causal", 64), ("document_causal", 128),
                                    ("relative_bias", 128), ("causal", 128),
                                    ("relative_bias", 256), ("document_causal", 256)])
def test_fa3_kernel_attncc_runs_has_no_spills(name: str, d: int) -> None:
    """The kernel cache's `compile_spec` (what attncc runs): the kernel as it is when its first
    compile is spill-free, else its low-pressure form -- spill-free in every case
    here (the first compile of document_causal and relative_bias spills 32-344 bytes with NVRTC
    12.9)."""
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.flex.tile_choice import choose_tiles
    from attncc.runtime.jit.kernels import compile_spec

    plan = choose_tiles(d, q_len=4096, kv_len=4096, group=1, heads=16, batch=1,
                        kernel_options=FA3)
    ir = simplify_variant(VARIANTS[name](1, 16, 4096, d).trace()[0])
    trail: list = []
    form = compile_spec(gpu_flex.kernel_spec(ir, d, "bfloat16", plan), "sm_90a", trail)
    assert bool(form.spec.low_pressure) == (trail[0].spill_bytes > 0)
    assert form.spill_bytes == 0, form.result.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d", [("noop", 128), ("noop", 64), ("softcap", 128),
                                    ("alibi", 128), ("rope", 64), ("document_mask", 128)])
def test_fa3_paired_kernel_attncc_runs_has_no_spills(name: str, d: int) -> None:
    """The CTA-pair form as attncc compiles it (the kernel cache's FA3 fallback: the first
    compile, or its low-pressure form if that one spills; here kept paired) is spill-free, keeps its wgmma pipeline, and its
    producer issues multicast copies."""
    import dataclasses

    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.flex.gpu_flex import kernel_spec
    from attncc.runtime.flex.tile_choice import choose_tiles
    from attncc.runtime.jit.kernels import compile_spec
    from attncc.runtime.jit.policy import spill_bytes, wgmma_notes

    plan = choose_tiles(d, q_len=2048, kv_len=2048, group=1, heads=16, batch=1,
                        kernel_options={"KERNEL": "fa3"})
    ir = simplify_variant(GYM[name](1, 16, 2048, d).trace()[0])
    form = compile_spec(kernel_spec(ir, d, "bfloat16", dataclasses.replace(plan, paired=True)),
                        "sm_90a")
    gk, res = form.gen, form.result
    assert form.spec.paired and PAIRED in gk.source  # the pair form is what runs
    assert spill_bytes(res.log) == 0, res.log
    assert "wgmma" not in res.log.lower() and not wgmma_notes(res.log), res.log
    assert ".multicast::cluster" in gk.source


@pytest.mark.nvrtc
@pytest.mark.parametrize("name", ["document_causal", "noop"])
def test_fa3_pair_form_that_spills_runs_unpaired(name: str) -> None:
    """A pair plan keeps its pairs when the pair form compiles spill-free and otherwise runs the
    single-CTA kernel (spill-free). document_causal at head dim 128 is the case that falls back
    with NVRTC 12.9 (its pair form spills 16 bytes in the tile loop); noop keeps its pairs."""
    import dataclasses

    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.flex.gpu_flex import fa3_compiled_form, kernel_spec
    from attncc.runtime.flex.tile_choice import choose_tiles
    from attncc.runtime.jit.kernels import compile_spec
    from attncc.runtime.jit.policy import spill_bytes

    plan = dataclasses.replace(choose_tiles(128, q_len=2048, kv_len=2048, group=1, heads=16,
                                            batch=1, kernel_options={"KERNEL": "fa3"}),
                               paired=True)
    ir = simplify_variant(GYM[name](1, 16, 2048, 128).trace()[0])
    trail: list = []
    compile_spec(kernel_spec(ir, 128, "bfloat16", plan), "sm_90a", trail)
    pair_forms = [f for f in trail if f.spec.paired]  # the pair form and its low-pressure form
    keeps = min(f.spill_bytes for f in pair_forms) == 0
    gk, res, used = fa3_compiled_form(ir, 128, "bfloat16", plan, "sm_90a")
    assert used.paired is keeps and (PAIRED in gk.source) is keeps
    assert spill_bytes(res.log) == 0, res.log
    if name == "noop":
        assert keeps


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,head_dim", [("softcap_causal", 128), ("rope", 64),
                                           ("alibi_causal", 256), ("sigmoid", 128)])
def test_default_tiles_compile_within_spill_budget(name: str, head_dim: int) -> None:
    """The heuristic's default tiles compile for sm_90a with zero register spills at one MMA
    fragment per warp, and within gpu_flex's small measured budget at two."""
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.kernels import FA2_SPILL_BUDGET
    from attncc.runtime.jit.nvrtc import compile_cuda

    ir, _ = VARIANTS[name](1, 8, 4096, head_dim).trace()
    plan = choose_tiles(head_dim, q_len=4096, kv_len=4096, group=1, heads=16, batch=4)
    src, kname, _, _ = fa2_source(simplify_variant(ir), head_dim=head_dim, dtype="bfloat16",
                                  tq=plan.tq, tkv=plan.tkv, stages=plan.stages,
                                  m_frags=plan.m_frags)
    res = compile_cuda(src, arch="sm_90a", verbose=True)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.log)
    assert spills, res.log
    budget = FA2_SPILL_BUDGET[plan.m_frags]
    assert all(int(a) + int(b) <= budget for a, b in spills), res.log
    assert not re.search(r"^\s*#\s*include", src, re.M) and kname in src


@pytest.mark.nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_clamped_fa3_kernel_has_no_spills(d: int) -> None:
    from attncc.ir.simplify import simplify_variant

    ir = simplify_variant(clamped_ir(4096, 16, d))
    plan = gpu_flex.choose_tiles(d, q_len=4096, kv_len=4096, group=1, heads=16, batch=1,
                                 kernel_options={"KERNEL": "fa3"}, fa3_ok=True)
    gk, res, _ = gpu_flex.fa3_compiled_form(ir, d, "bfloat16", plan, "sm_90a")
    assert "attncc::mini(q_idx - kv_idx, p.table_size1 - 1)" in gk.source
    assert spill_bytes(res.log) == 0, res.log
    assert not wgmma_notes(res.log), res.log


@pytest.mark.nvrtc
def test_clamped_fa2_kernel_attncc_runs_has_no_spills_beyond_budget() -> None:
    """What the kernel cache runs: the planned tiles if within the spill budget, else one fragment
    per warp (the clamp's two integer ops took the two-fragment D 128 form from 160 to 204
    spilled bytes with NVRTC 12.9, past the 192-byte budget: the fallback then runs)."""
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.nvrtc import compile_cuda

    ir = simplify_variant(clamped_ir(4096, 16, 128))
    plan = gpu_flex.choose_tiles(128, q_len=4096, kv_len=4096, group=1, heads=16, batch=1)
    for m_frags in sorted({plan.m_frags, 1}, reverse=True):
        src, _, _, _ = fa2_source(ir, head_dim=128, dtype="bfloat16", tq=plan.tq,
                                  tkv=plan.tkv, stages=plan.stages, m_frags=m_frags)
        res = compile_cuda(src, arch="sm_90a", verbose=True)
        if spill_bytes(res.log) <= FA2_SPILL_BUDGET[m_frags]:
            break
    assert spill_bytes(res.log) <= FA2_SPILL_BUDGET[m_frags], res.log
