"""The markdown tables the prefill benchmarks commit: prefill.py's against issue 5's targets (and
its FA2 column), paged_prefill.py's paged / dense ratio. Built from hand-written records."""
from __future__ import annotations

META = {"gpu": "H200", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "attncc_commit": "abc",
        "date": "2026-11-30T00:00", "heads": 16, "head_dim": 128, "tokens": 16384}


def test_prefill_table_checks_every_target() -> None:
    from bench.prefill import table

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
    from bench.paged_prefill import table

    rec = [{"impl": "dense", "S": 2048, "hkv": 4, "variant": "full", "tflops": 500.0},
           {"impl": "paged_fa3", "S": 2048, "hkv": 4, "variant": "full", "tflops": 450.0},
           {"impl": "paged_fa2", "S": 2048, "hkv": 4, "variant": "full", "error": "x"},
           {"impl": "ragged_fa3", "S": 2048, "hkv": 4, "variant": "full", "tflops": 530.0}]
    text = table({"meta": META, "results": rec})
    assert "| full | 2048 | 4 | 500 | 450 | - | 530 | 0.90 |" in text


def test_fa3_experiment_pair_summary_ratios_per_round() -> None:
    """scripts/experiments/fa3_experiment.py --repeat: each configuration against the first one
    of the same round (not the first round's), per cell, with the median and the rounds it was faster."""
    from scripts.experiments.fa3_experiment import pair_summary

    runs = {(2048, "full"): [("shipped", 500.0), ("A=1", 510.0), ("B=1", 450.0),
                             ("shipped", 400.0), ("A=1", 396.0), ("B=1", 420.0),
                             ("shipped", 500.0), ("A=1", 515.0), ("B=1", 490.0)],
            (8192, "causal"): [("shipped", 600.0), ("A=1", 540.0)]}
    recs = [{"S": S, "variant": v, "config": c, "tflops": t}
            for (S, v), rows in runs.items() for c, t in rows]
    assert pair_summary(recs) == [
        "S=2048 full A=1: 1.020 0.990 1.030 median 1.020, faster in 2 of 3",
        "S=2048 full B=1: 0.900 1.050 0.980 median 0.980, faster in 1 of 3",
        "S=8192 causal A=1: 0.900 median 0.900, faster in 0 of 1"]
