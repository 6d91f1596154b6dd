"""attncc.codegen.constants: the numbers Python and the kernels share come from one table, every
unit static_asserts its rows, and a mismatch fails compilation (docs/kernel-interface.md,
section 5)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from attncc.codegen import constants

# which generated unit carries which rows (kernel, head dim)
UNITS = [("fa2", 128), ("fa3", 64), ("fa3", 256), ("fa2batch", 128), ("fa3batch", 128),
         ("prepass", 64), ("simple", 64)]


def _source(kernel: str, head_dim: int) -> str:
    import attncc
    from attncc.codegen.generate import generate_source

    if kernel == "prepass":
        from attncc.ir.nodes import var, vec
        from attncc.ir.program import Hook, VariantIR

        ir = VariantIR(hooks={"value_mod": Hook("value_mod", vec("v", var("d")) * 0.5)},
                       name="half_v")
    else:
        ir = attncc.Variant(name="full").trace()[0]
    return generate_source(ir, head_dim=head_dim, dtype="bfloat16", kernel=kernel).source


@pytest.mark.parametrize("kernel,head_dim", UNITS)
def test_every_unit_asserts_the_rows_its_kernel_declares(kernel: str, head_dim: int) -> None:
    src = _source(kernel, head_dim)
    rows = [m for m in constants.MIRRORS if kernel in m.kernels]
    assert (kernel in ("simple", "fa2")) == (rows == [])  # FA2 has only its tile asserts
    assert ("attncc.codegen (tiles.py / constants.py) computed" in src) == (
        kernel.startswith("fa"))
    for m in rows:
        assert all(a in src for a in m.asserts(head_dim)), m.name


def test_the_fa3_rows_say_which_head_dims_run_persistent() -> None:
    assert "kPersistentHeadDim<64>) == true" in _source("fa3", 64)
    assert "kPersistentHeadDim<256>) == true" in _source("fa3", 256)
    assert "kSplitHeadDim<256>) == false" in _source("fa3", 256)
    assert "kSplitHeadDim<128>) == true" in _source("fa3", 128)


def test_changing_the_table_changes_the_asserts(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _source("fa3", 128)
    rows = tuple(replace(m, value=256) if m.name == "FA3_THREADS" else m
                 for m in constants.MIRRORS)
    monkeypatch.setattr(constants, "MIRRORS", rows)
    after = _source("fa3", 128)
    assert "(attncc::fa3::kThreads) == 384" in before and "== 384" not in after.split(
        "kThreads) ")[1][:8]
    assert "(attncc::fa3::kThreads) == 256" in after


def test_the_runtime_reads_its_mirrors_from_the_table() -> None:
    from attncc.runtime.flex import fa3_split, gpu_flex, prepass
    from attncc.runtime.serving import causal, launch, merge_kernel

    assert gpu_flex.FA3_PERSISTENT_HEAD_DIMS is constants.FA3_PERSISTENT_HEAD_DIMS
    assert gpu_flex.FA3_SPLIT_HEAD_DIMS is constants.FA3_SPLIT_HEAD_DIMS
    assert (fa3_split.SLOT_WARPS, fa3_split.MAX_PIECES_PER_ITEM, fa3_split.MIN_SPLIT_KEYS) == (
        constants.FA3_SLOT_WARPS, constants.MAX_PIECES_PER_ITEM, constants.MIN_SPLIT_KEYS)
    assert (launch.MERGE_THREADS, causal.L2_SECTION_BYTES) == (constants.MERGE_THREADS,
                                                                constants.L2_SECTION_BYTES)
    assert prepass.WARPS == constants.PREPASS_WARPS
    assert merge_kernel._THREADS == constants.MERGE_STATE_THREADS


@pytest.mark.nvrtc
def test_a_table_that_disagrees_with_the_kernel_fails_to_compile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from attncc.codegen.merge_state import merge_state_source
    from attncc.runtime.jit.nvrtc import CompileError, compile_cuda

    compile_cuda(merge_state_source("float32").source, arch="sm_80")  # as shipped: compiles
    rows = tuple(replace(m, value=128) if m.name == "MERGE_STATE_THREADS" else m
                 for m in constants.MIRRORS)
    monkeypatch.setattr(constants, "MIRRORS", rows)
    with pytest.raises(CompileError, match="MERGE_STATE_THREADS = 128 must equal"):
        compile_cuda(merge_state_source("float32").source, arch="sm_80")


@pytest.mark.nvrtc
def test_tiles_that_disagree_with_the_template_fail_to_compile() -> None:
    """The FA2 unit asserts KernelTiles' threads and shared memory against Config's."""
    from attncc.runtime.jit.nvrtc import CompileError, compile_cuda

    src = _source("fa2", 64)
    good = 'static_assert(attncc::fa2::Config<64, 128, 64, 2, 2, 1>::kSmemBytes == 49152,'
    assert good in src
    with pytest.raises(CompileError, match="computed 49153 for"):
        compile_cuda(src.replace(good, good.replace("49152", "49153")).replace(
            "computed 49152 for", "computed 49153 for"), arch="sm_80")
