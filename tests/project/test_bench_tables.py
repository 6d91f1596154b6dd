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


def test_prefill_shapes_table_checks_the_shape_targets(tmp_path) -> None:
    """bench/prefill_shapes.py (issue 32): a row per (shape, variant) with its ratios; S >= 2048
    needs 1.0 x cuDNN and 1.3 x flex, S = 512 0.95 x cuDNN; GQA shapes are labelled Hq/Hkv;
    --report writes the .md (and .png) beside the JSON."""
    import json

    from bench.prefill_shapes import main, table

    def rec(impl: str, variant: str, D: int, S: int, tflops: float, hq: int = 0,
            hkv: int = 0) -> dict:
        return {"impl": impl, "variant": variant, "D": D, "S": S, "hq": hq or 2048 // D,
                "hkv": hkv or 2048 // D, "tflops": tflops}

    recs = [rec("attncc", "full", 256, 2048, 600.0), rec("sdpa_cudnn", "full", 256, 2048, 650.0),
            rec("flex", "full", 256, 2048, 350.0),
            rec("attncc", "causal", 128, 512, 330.0), rec("sdpa_cudnn", "causal", 128, 512, 340.0),
            rec("attncc", "causal", 128, 16384, 620.0, 64, 8),
            rec("sdpa_cudnn", "causal", 128, 16384, 580.0, 64, 8),
            rec("attncc", "softcap_causal", 256, 8192, 400.0),
            {"impl": "flex", "variant": "softcap_causal", "D": 256, "S": 8192, "hq": 8,
             "hkv": 8, "error": "x"}]
    doc = {"meta": {**META, "tokens": 16384}, "results": recs}
    rows = {" ".join(c.strip() for c in ln.split("|")[1:4]): ln
            for ln in table(doc).splitlines() if ln.startswith("| D=")}
    assert rows["D=256 H=8 full 2048"].endswith("| 600 | 350 | - | 650 | 1.71 | 0.92 | **no** |")
    assert rows["D=128 H=16 causal 512"].endswith("| 0.97 | yes |")      # 0.97 >= 0.95
    assert rows["D=128 H=64/8 causal 16384"].endswith("| - | 1.07 | yes |")
    assert rows["D=256 H=8 softcap_causal 8192"].endswith("| 400 | - | - | - | - | - | - |")
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(doc))
    assert main(["--report", str(path)]) == 0
    assert path.with_suffix(".md").read_text() == table(doc)
    assert path.with_suffix(".png").stat().st_size > 0


def test_prefill_shapes_table_adds_the_graph_replays() -> None:
    """With `--graph` records (tflops_graph) a second table rates the replays alone."""
    from bench.prefill_shapes import table

    recs = [{"impl": i, "variant": "causal", "D": 128, "S": 512, "hq": 16, "hkv": 16,
             "tflops": t, "tflops_graph": g}
            for i, t, g in (("attncc", 200.0, 400.0), ("sdpa_cudnn", 330.0, 380.0))]
    text = table({"meta": {**META, "tokens": 16384}, "results": recs})
    eager, graph = text.split("one CUDA-graph replay")
    assert "| 200 | - | - | 330 | - | 0.61 | **no** |" in eager
    assert "| 400 | - | - | 380 | - | 1.05 | yes |" in graph
    plain = [{k: v for k, v in r.items() if k != "tflops_graph"} for r in recs]
    assert "one CUDA-graph replay" not in table({"meta": {**META, "tokens": 16384},
                                                 "results": plain})
