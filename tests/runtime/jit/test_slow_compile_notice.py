"""A compile still running after SLOW_COMPILE_S says so once, naming the kernel and variant
(runtime/jit/kernels.py `_announced`); a fast one says nothing."""
from __future__ import annotations

import logging
import time

import pytest

from attncc.codegen.tiles import fa3_tiles
from attncc.ir.program import VariantIR
from attncc.runtime.jit import kernels

SPEC = kernels.KernelSpec("fa3_prefill", ir=VariantIR(name="slowpoke"), head_dim=128,
                          tiles=fa3_tiles(3))


@pytest.mark.parametrize("threshold,expect", [(0.05, 1), (30.0, 0)])
def test_slow_compile_is_announced_once(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture,
                                        threshold: float, expect: int) -> None:
    monkeypatch.setattr(kernels, "SLOW_COMPILE_S", threshold)
    monkeypatch.setattr(kernels, "_compile_generated",
                        lambda spec, arch, gen: time.sleep(0.4) or gen.kernel_name)
    with caplog.at_level(logging.WARNING, logger="attncc"):
        assert kernels.compile_form(SPEC, "sm_90a") == "attncc_slowpoke_fa3_d128_bf16_q128_k128_s3"
        time.sleep(0.1)  # a timer that was not cancelled would fire by now
    lines = [r.getMessage() for r in caplog.records if r.name == "attncc"]
    assert len(lines) == expect
    if expect:
        assert "attncc_slowpoke_fa3_d128" in lines[0] and "variant slowpoke" in lines[0]
        assert "sm_90a" in lines[0]
