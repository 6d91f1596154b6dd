"""The `speed` marker (tests/conftest.py): tests that assert timings run with the others and the
run ends with a line of their outcomes, a failure among them named apart."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

SAMPLE = '''
import pytest


@pytest.mark.speed
def test_fast_enough():
    assert True


@pytest.mark.speed
def test_too_slow():
    assert False, "took 2 s, budget 1 s"


def test_plain():
    assert True
'''


def test_speed_tests_are_summarised_apart(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    lines = res.stdout.splitlines()
    assert res.returncode == 1, res.stdout[-3000:]  # a failed speed test fails the run
    assert "speed (timing assertions): 1 failed, 1 passed" in lines, res.stdout[-3000:]
    assert "speed FAILED test_sample.py::test_too_slow" in lines, res.stdout[-3000:]
    assert "1 failed, 2 passed" in lines[-1]


def test_speed_marker_is_registered() -> None:
    """Registered in the pytest configuration, so `-m speed` and `--strict-markers` know it."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--markers", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert any(ln.startswith("@pytest.mark.speed:") for ln in res.stdout.splitlines()), res.stdout
