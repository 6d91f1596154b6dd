"""The runnable examples stay runnable: each `main()` runs on the CPU (GPU parts skip there)."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["quickstart", "serving"])
def test_example_runs(name: str, capsys: pytest.CaptureFixture) -> None:
    importlib.import_module(f"examples.{name}").main()
    assert capsys.readouterr().out.strip()
