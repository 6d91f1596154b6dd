"""The markdown tables the prefill benchmarks commit: prefill.py's against issue 5's targets (and
its FA2 column), paged_prefill.py's paged / dense ratio. Built from hand-written records."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

META = {"gpu": "H200", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "attncc_commit": "abc",
        "date": "2026-11-30T00:00", "heads": 16, "head_dim": 128, "tokens": 16384}


def test_prefill_table_checks_every_target() -> None:
    from prefill import table

    rec = [{"impl": "attncc", "variant": "causal", "S": 8192, "tflops": 520.0},
           {"impl": "flex", "variant": "causal", "S": 8192, "tflops": 400.0},
           {"impl": "sdpa_cudnn", "variant": "causal", "S": 8192, "tflops": 500.0},
           {"impl": "attncc", "variant": "causal", "S": 8192, "tflops": 300.0,
            "kernel_options": {"KERNEL": "fa2"}},
           {"impl": "attncc", "variant": "full", "S": 8192, "tflops": 520.0},
           {"impl": "flex", "variant": "full", "S": 8192, "tflops": 500.0},
           {"impl": "attncc", "variant": "full", "S": 512, "tflops": 100.0},
           {"impl": "flex", "variant": "full", "S": 512, "tflops": 500.0}]
    rows = {ln.split("|")[1].strip() + ln.split("|")[2].strip(): ln
            for ln in table({"meta": META, "results": rec}).splitlines() if ln.startswith("| ")}
    assert rows["causal8192"].endswith("| 520 | 300 | 400 | - | 500 | 1.30 | 1.04 | yes |")
    assert rows["full8192"].endswith("| 1.04 | - | **no** |")   # 1.04 < 1.3 x flex
    assert rows["full512"].endswith("| - |")                   # below S = 2048: no target


def test_paged_prefill_table_ratio() -> None:
    from paged_prefill import table

    rec = [{"impl": "dense", "S": 2048, "hkv": 4, "variant": "full", "tflops": 500.0},
           {"impl": "paged_fa3", "S": 2048, "hkv": 4, "variant": "full", "tflops": 450.0},
           {"impl": "paged_fa2", "S": 2048, "hkv": 4, "variant": "full", "error": "x"},
           {"impl": "ragged_fa3", "S": 2048, "hkv": 4, "variant": "full", "tflops": 530.0}]
    text = table({"meta": META, "results": rec})
    assert "| full | 2048 | 4 | 500 | 450 | - | 530 | 0.90 |" in text
