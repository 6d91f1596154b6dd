"""The FA3 kernels' paired and low-pressure forms are codegen parameters, emitted as the
`attncc::form` block (docs/kernel-interface.md, section 7), not macros prepended by the runtime."""
from __future__ import annotations

from typing import Any

import pytest

from attncc.codegen.errors import CodegenError
from attncc.codegen.generate import form_text, generate_source, with_form
from attncc.ir.program import VariantIR
from tests.helpers.forms import LOW_PRESSURE, PAIRED

PLAIN = VariantIR(name="plain")


def _fa3(**form: Any) -> str:
    return generate_source(PLAIN, head_dim=128, dtype="bfloat16", kernel="fa3", **form).source


def test_forms_are_a_block_ahead_of_the_fa3_templates() -> None:
    plain, pair, low = _fa3(), _fa3(paired=True), _fa3(low_pressure=True)
    assert form_text() in plain and PAIRED not in plain and LOW_PRESSURE not in plain
    assert PAIRED in pair and LOW_PRESSURE in low
    for src in (plain, pair, low):  # no macro picks a form any more
        assert "ATTNCC_FA3_PAIRED" not in src and "ATTNCC_FA3_LOW_PRESSURE" not in src
    # the block comes before the first template that reads it
    assert plain.index("namespace form {") < plain.index("kClusterSmemAddrs")
    batch = generate_source(PLAIN, head_dim=64, dtype="bfloat16", kernel="fa3batch",
                            low_pressure=True).source
    assert LOW_PRESSURE in batch


def test_with_form_swaps_only_the_low_pressure_line() -> None:
    plain = _fa3(paired=True)
    low = with_form(plain, low_pressure=True)
    assert low == _fa3(paired=True, low_pressure=True)
    assert with_form(low, low_pressure=False) == plain


@pytest.mark.parametrize("kernel,head_dim,form", [
    ("fa2", 128, {"low_pressure": True}), ("fa2batch", 128, {"paired": True}),
    ("fa3", 256, {"paired": True}), ("fa3batch", 128, {"paired": True})])
def test_forms_a_kernel_does_not_have_are_refused(kernel: str, head_dim: int,
                                                    form: dict[str, bool]) -> None:
    with pytest.raises(CodegenError, match="paired"):
        generate_source(PLAIN, head_dim=head_dim, dtype="bfloat16", kernel=kernel, **form)


def test_the_kernel_cache_generates_each_form_with_codegen() -> None:
    """The kernel cache's spec -> source step (runtime/jit/kernels.py `generate`: the one place
    a form enters a unit; its fallback compiles the low-pressure spec) asks codegen for the
    form, and the flex path's pair plans become paired specs."""
    from dataclasses import replace

    from attncc.codegen.tiles import fa3_tiles
    from attncc.runtime.flex.gpu_flex import kernel_spec
    from attncc.runtime.flex.tile_choice import choose_tiles
    from attncc.runtime.jit.kernels import KernelSpec, generate

    spec = KernelSpec("fa3_prefill", PLAIN, 128, "bfloat16", fa3_tiles(3))
    for paired, low in ((False, False), (True, False), (False, True), (True, True)):
        got = generate(replace(spec, paired=paired, low_pressure=low)).source
        assert got == _fa3(tiles=fa3_tiles(3), paired=paired, low_pressure=low)
    plan = choose_tiles(128, q_len=2048, kv_len=2048, group=1, heads=16, batch=1,
                        kernel_options={"KERNEL": "fa3"})
    paired = generate(kernel_spec(PLAIN, 128, "bfloat16", replace(plan, paired=True))).source
    single = generate(kernel_spec(PLAIN, 128, "bfloat16", replace(plan, paired=False))).source
    assert PAIRED in paired and PAIRED not in single
