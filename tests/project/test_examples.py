"""The runnable examples stay runnable: each `main()` runs on the CPU (GPU parts skip there)."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["quickstart", "serving", "serving_fp8"])
def test_example_runs(name: str, capsys: pytest.CaptureFixture) -> None:
    importlib.import_module(f"examples.{name}").main()
    assert capsys.readouterr().out.strip()


def test_train_relbias_runs_on_cpu(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """examples/train_relbias.py --device cpu: attncc (its differentiable fp64 reference) and the
    same model with eager attention train identically, and the learnable bias tables move (their
    gradient comes through attncc's captured tensor); --out writes the curves."""
    import json

    from examples.train_relbias import main

    out = tmp_path / "curves.json"
    runs = main(["--device", "cpu", "--steps", "3", "--batch", "1", "--out", str(out)])
    mine, ref = runs["attncc"], runs["eager"]
    assert len(mine["loss"]) == len(ref["loss"]) == 3
    assert max(abs(a - b) for a, b in zip(mine["loss"], ref["loss"])) < 1e-4
    # after two Adam steps each touched table entry moved by ~2 x lr
    assert mine["bias_abs_mean"] > 0.01
    assert abs(mine["bias_abs_mean"] - ref["bias_abs_mean"]) < 1e-3 * ref["bias_abs_mean"]
    assert json.loads(out.read_text())["runs"]["attncc"]["loss"] == mine["loss"]
    assert "attncc" in capsys.readouterr().out
