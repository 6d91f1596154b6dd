"""The FA3 kernels' paired and low-pressure forms are codegen parameters, emitted as the
`attncc::form` block (docs/kernel-interface.md, section 7), not macros prepended by the runtime."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from attncc.codegen.errors import CodegenError
from attncc.codegen.generate import form_text, generate_source, with_form
from attncc.ir.program import VariantIR

PLAIN = VariantIR(name="plain")
LOW = "constexpr bool low_pressure() { return true; }"
PAIRED = "constexpr bool paired() { return true; }"


def _fa3(**form: Any) -> str:
    return generate_source(PLAIN, head_dim=128, dtype="bfloat16", kernel="fa3", **form).source


def test_forms_are_a_block_ahead_of_the_fa3_templates() -> None:
    plain, pair, low = _fa3(), _fa3(paired=True), _fa3(low_pressure=True)
    assert form_text() in plain and PAIRED not in plain and LOW not in plain
    assert PAIRED in pair and LOW in low
    for src in (plain, pair, low):  # no macro picks a form any more
        assert "ATTNCC_FA3_PAIRED" not in src and "ATTNCC_FA3_LOW_PRESSURE" not in src
    # the block comes before the first template that reads it
    assert plain.index("namespace form {") < plain.index("kClusterSmemAddrs")
    batch = generate_source(PLAIN, head_dim=64, dtype="bfloat16", kernel="fa3batch",
                            low_pressure=True).source
    assert LOW in batch


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


def test_the_spill_fallback_compiles_the_low_pressure_form(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    from attncc.runtime.jit import cache, policy

    seen: list[str] = []

    def fake(source: str, **_: Any) -> tuple[Any, bool]:
        seen.append(source)
        spills = 8 if len(seen) == 1 else 0
        return SimpleNamespace(log=f"{spills} bytes spill stores, 0 bytes spill loads"), False

    monkeypatch.setattr(cache, "cached_compile", fake)
    res, low = policy.compile_fa3(_fa3(), arch="sm_90a", name="x.cu")
    assert low and seen == [_fa3(), _fa3(low_pressure=True)]


def test_the_flex_path_generates_the_paired_form() -> None:
    from dataclasses import replace

    from attncc.runtime.flex.gpu_flex import _fa3_generated
    from attncc.runtime.flex.tile_choice import choose_tiles

    plan = choose_tiles(128, q_len=2048, kv_len=2048, group=1, heads=16, batch=1,
                        kernel_options={"KERNEL": "fa3"})
    assert PAIRED in _fa3_generated(PLAIN, 128, "bfloat16", replace(plan, paired=True)).source
    assert PAIRED not in _fa3_generated(PLAIN, 128, "bfloat16", replace(plan, paired=False)).source
