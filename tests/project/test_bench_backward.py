"""bench/backward.py on the CPU: its report (table against issue 29's targets, PNG) from a
hand-written results JSON, its timing arithmetic, and its command line. The measurement itself
needs the GPU (the lead runs `python -m bench.backward` on the H200)."""
from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

META = {"gpu": "H200", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "attncc_commit": "abc",
        "date": "2026-12-02T00:00", "heads": 16, "head_dim": 128, "tokens": 16384}


def _rec(impl: str, variant: str, S: int, bwd: float, **kw: object) -> dict:
    return {"impl": impl, "variant": variant, "S": S, "B": 16384 // S, "bwd_tflops": bwd,
            "fwd_ms": 1.0, "fwdbwd_ms": 3.5, "bwd_ms": 2.5, **kw}


RECORDS = [
    _rec("attncc", "causal", 8192, 500.0, rel_err=3e-3, rel_err_vs="flex",
         rel_err_grads={"dq": 3e-3, "dk": 2e-3, "dv": 1e-3}, bwd_kernel_tflops=520.0),
    _rec("flex", "causal", 8192, 349.0, bwd_kernel_tflops=360.4),
    _rec("sdpa_flash", "causal", 8192, 275.0),
    _rec("sdpa_cudnn", "causal", 8192, 462.0),
    _rec("attncc", "full", 8192, 500.0),
    _rec("flex", "full", 8192, 393.0),
    _rec("sdpa_cudnn", "full", 8192, 515.0),           # 500 < 1.0 x cuDNN: target missed
    _rec("attncc", "full", 512, 100.0),
    _rec("flex", "full", 512, 300.0),                  # below S = 2048: no target
    {"impl": "attncc", "variant": "relbias_causal", "S": 2048,
     "error": "RuntimeError: the output has no grad_fn"},
    _rec("flex", "relbias_causal", 2048, 200.0),
    _rec("attncc", "causal", 8192, 450.0, kernel_options={"DETERMINISTIC": True}),
]


def _rows(text: str) -> dict[str, str]:
    """The main table's rows by variant + S (the kernel_options table follows its heading)."""
    main = text.split("attncc with kernel_options")[0]
    return {ln.split("|")[1].strip() + ln.split("|")[2].strip(): ln
            for ln in main.splitlines() if ln.startswith("| ")}


def test_table_checks_every_target() -> None:
    from bench.backward import table

    text = table({"meta": META, "results": RECORDS})
    rows = _rows(text)
    assert rows["causal8192"] == ("| causal | 8192 | 500 | 349 | 275 | 462 | 1.43 | 1.08 | "
                                  "520 / 360 / - | 3.50 / 3.50 | 3.0e-03 vs flex | yes |")
    assert rows["full8192"].endswith("| 1.27 | 0.97 | - / - / - | 3.50 / 3.50 | - | **no** |")
    assert rows["full512"].endswith("| 0.33 | - | - / - / - | 3.50 / 3.50 | - | - |")
    # attncc failed: its cell says so and the target against Flex counts as missed
    assert rows["relbias_causal2048"].startswith("| relbias_causal | 2048 | err | 200 | - | - |")
    assert rows["relbias_causal2048"].endswith("| **no** |")
    # the kernel_options cell is in its own table, against attncc's default
    assert '| causal | 8192 | `{"DETERMINISTIC": true}` | 450 | 0.90 | 3.50 | - |' in text


def test_report_writes_table_and_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    from bench.backward import main

    path = tmp_path / "backward-h200.json"
    path.write_text(json.dumps({"meta": META, "results": RECORDS}))
    assert main(["--report", str(path)]) == 0
    assert "| causal | 8192 | 500 |" in path.with_suffix(".md").read_text()
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "targets met" in capsys.readouterr().out


def test_report_merges_runs(tmp_path: Path) -> None:
    """Runs of a few S each merge into one document; a cell measured twice keeps the later."""
    from bench.backward import main

    first = {"meta": {**META, "attncc_commit": "aaa"}, "results": RECORDS[:4]}
    redo = _rec("flex", "causal", 8192, 350.0)
    second = {"meta": {**META, "attncc_commit": "bbb"},
              "results": [redo, _rec("attncc", "causal", 2048, 400.0)]}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p, doc in zip(paths, (first, second)):
        p.write_text(json.dumps(doc))
    out = tmp_path / "merged.json"
    pytest.importorskip("matplotlib")
    assert main(["--report", *map(str, paths), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["attncc_commit"] for r in doc["meta"]["runs"]] == ["aaa", "bbb"]
    assert len(doc["results"]) == 5 and redo in doc["results"]
    assert "| causal | 2048 | 400 |" in out.with_suffix(".md").read_text()
    # a merged document merged again keeps its runs
    third = {"meta": {**META, "attncc_commit": "ccc"}, "results": [redo]}
    paths.append(tmp_path / "c.json")
    paths[-1].write_text(json.dumps(third))
    assert main(["--report", str(out), str(paths[-1]), "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["meta"]["runs"]
    assert [r["attncc_commit"] for r in runs] == ["aaa", "bbb", "ccc"]


def test_times_and_flops() -> None:
    """backward-only = fwd+bwd - fwd, counted at 2.5x the forward's FLOPs (causal: half)."""
    from bench.backward import _set_times, bwd_flops, fwd_flops

    rec = {"variant": "causal", "S": 2048, "B": 8}
    _set_times(rec, fwd_ms=2.0, fwdbwd_ms=7.0)
    assert rec["bwd_ms"] == 5.0
    assert rec["bwd_tflops"] == pytest.approx(bwd_flops("causal", 2048, 8) / 5e-3 / 1e12)
    assert bwd_flops("full", 2048, 8) == 2 * bwd_flops("causal", 2048, 8)
    assert rec["fwd_tflops"] == pytest.approx(fwd_flops("causal", 2048, 8) / 2e-3 / 1e12)
    _set_times(rec, fwd_ms=2.0, fwdbwd_ms=1.9)   # noise larger than the backward: no figure
    assert rec["bwd_tflops"] is None


def test_grad_errors_name_each_gradient() -> None:
    import torch

    from bench.backward import grad_errors

    ref = [torch.ones(4), torch.ones(4), torch.ones(4), torch.ones(2)]
    mine = [torch.ones(4), 1.5 * torch.ones(4), torch.full((4,), float("nan")), torch.ones(2)]
    assert grad_errors(mine, ref) == {"dq": 0.0, "dk": 0.5, "dv": float("inf"), "dbias": 0.0}


def test_cli_parses() -> None:
    from bench.backward import IMPLS, VARIANTS, parse_args

    args = parse_args([])
    assert args.S == [512, 2048, 8192, 16384] and args.rounds == 3
    assert tuple(args.variants) == VARIANTS and "relbias_causal" in VARIANTS
    assert tuple(args.impls) == IMPLS == ("attncc", "flex", "sdpa_flash", "sdpa_cudnn")
    args = parse_args(["--S", "2048", "--variants", "causal", "relbias_causal", "--impls",
                       "attncc", "flex", "--rounds", "1", "--sweep", '{"DETERMINISTIC": true}',
                       "--out", "x.json"])
    assert (args.S, args.variants, args.impls, args.rounds) == (
        [2048], ["causal", "relbias_causal"], ["attncc", "flex"], 1)
    assert args.sweep == [{"DETERMINISTIC": True}] and args.out == Path("x.json")
    for bad in (["--S", "3000"], ["--variants", "nope"], ["--rounds", "0"],
                ["--report", "a.json", "b.json"]):   # merging needs --out
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_measuring_without_a_gpu_says_so(capsys: pytest.CaptureFixture) -> None:
    import torch

    from bench.backward import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: main() would measure")
    assert main(["--S", "2048", "--rounds", "1"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_module_doctests() -> None:
    import bench.backward

    assert doctest.testmod(bench.backward).failed == 0


class _CpuBench:
    """What `run_cell_group` needs of `BackwardBench`, on the CPU: attncc's reference against an
    eager PyTorch composition of the same relative-bias causal attention (in the role of
    "flex"), an implementation without a backward, and one that raises."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.S, self.B, H, D = 32, 2, 2, 16
        self.q, self.k, self.v = (torch.randn(self.B, H, self.S, D, generator=g).requires_grad_()
                                  for _ in range(3))
        self.bias = (0.5 * torch.randn(H, 2 * self.S - 1, generator=g)).requires_grad_()
        self.dout = torch.randn(self.B, H, self.S, D, generator=g)

    def _eager(self):
        import torch

        S = self.S
        i = torch.arange(S)
        scores = self.q @ self.k.transpose(-1, -2) / self.q.shape[-1] ** 0.5
        scores = scores + self.bias[:, i[:, None] - i[None, :] + S - 1][None]
        scores = scores.masked_fill(i[:, None] < i[None, :], float("-inf"))
        return scores.softmax(-1) @ self.v

    def fn(self, impl: str, variant: str, opts: dict | None):
        import attncc

        S, bias = self.S, self.bias
        if impl == "attncc":
            bm = attncc.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S,
                                          device="cpu")
            return lambda: attncc.flex_attention(
                self.q, self.k, self.v, block_mask=bm,
                score_mod=lambda s, b, h, qi, ki: s + bias[h, qi - ki + S - 1])
        if impl == "flex":
            return self._eager
        if impl == "sdpa_flash":
            return lambda: self._eager().detach()     # no grad_fn: an error record
        if impl == "sdpa_cudnn":
            return None                                # does not run this variant
        raise AssertionError(impl)

    def fwdbwd(self, fwd, variant: str):
        from bench.backward import fwd_bwd

        return fwd_bwd(fwd, [self.q, self.k, self.v, self.bias], self.dout)


def test_run_cell_group_times_rounds_and_checks_grads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement loop on the CPU (timer stubbed with a counter): interleaved rounds give
    medians, a call without a backward is an error record, attncc's four gradients are compared
    with the reference's."""
    import torch

    from bench import backward as bb

    ticks = iter(range(1, 100))

    def fake_time(fn):
        fn()
        return float(next(ticks))

    monkeypatch.setattr(bb, "_time", fake_time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr("bench.timing.spin_gpu", lambda seconds=0.3: None)
    kernel_ms = iter([1.0, 3.0] * 10)  # each cell's forward, then its forward + backward
    monkeypatch.setattr("bench.timing.device_ms", lambda fn, calls=5: next(kernel_ms))
    cells = [(i, None) for i in bb.IMPLS]
    recs = bb.run_cell_group(_CpuBench(), "relbias_causal", cells, rounds=3)
    by = {r["impl"]: r for r in recs}
    assert set(by) == {"attncc", "flex", "sdpa_flash"}
    assert "no grad_fn" in by["sdpa_flash"]["error"]
    # round 0: attncc fwd 1, fwd+bwd 2, flex 3, 4; round 1 reversed: flex 5, 6, attncc 7, 8;
    # round 2: attncc 9, 10, flex 11, 12
    assert by["attncc"]["fwd_ms_rounds"] == [1.0, 7.0, 9.0]
    assert (by["attncc"]["fwd_ms"], by["attncc"]["fwdbwd_ms"], by["attncc"]["bwd_ms"]) == (
        7.0, 8.0, 1.0)
    assert (by["flex"]["fwd_ms"], by["flex"]["fwdbwd_ms"]) == (5.0, 6.0)
    assert by["attncc"]["bwd_kernel_ms"] == 2.0
    assert by["attncc"]["bwd_kernel_tflops"] == pytest.approx(
        bb.bwd_flops("relbias_causal", 32, 2) / 2e-3 / 1e12)
    assert by["attncc"]["rel_err_vs"] == "flex"
    assert set(by["attncc"]["rel_err_grads"]) == {"dq", "dk", "dv", "dbias"}
    assert 0 <= by["attncc"]["rel_err"] < 1e-5


def test_a_cell_that_recompiles_every_call_is_timed_by_one_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward + backward slower than SLOW_CALL_S after its first call (Flex recompiling for a
    captured tensor that requires grad) is timed by one call of each: no do_bench, no profiled
    kernel times, no extra rounds; it is marked and still gets a backward figure."""
    import torch

    from bench import backward as bb

    def no_time(fn):
        raise AssertionError("do_bench on a recompiling cell")

    monkeypatch.setattr(bb, "SLOW_CALL_S", -1.0)
    monkeypatch.setattr(bb, "_time", no_time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr("bench.timing.device_ms", no_time)
    recs = bb.run_cell_group(_CpuBench(), "relbias_causal", [("attncc", None), ("flex", None)],
                             rounds=3)
    for rec in recs:
        assert rec["recompiles_per_call"] and "fwd_ms_rounds" not in rec
        assert rec["fwdbwd_ms"] > 0 and "bwd_kernel_ms" not in rec
    assert "rel_err" in {r["impl"]: r for r in recs}["attncc"]
