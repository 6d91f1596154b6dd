"""Shared test fixtures and the `gpu` / `nvrtc` skip markers.

- `@pytest.mark.gpu`: skipped when torch sees no CUDA device.
- `@pytest.mark.nvrtc`: skipped when NVRTC (cuda-bindings) cannot be loaded.
  (`requires_gpu` / `requires_nvrtc` below are the same marks under descriptive names.)
- `@pytest.mark.speed`: the test asserts a time (a host-time bound, a ratio of timings, a time
  budget). It runs with the rest; the run ends with one line of these tests' outcomes, so a
  failure there reads as a slow or loaded machine first (`-m "not speed"` leaves them out).
- `ATTNCC_TEST_SHARD=i/n` keeps every n-th collected test starting at the i-th (0-based), so n
  pytest processes can share one machine (scripts/gpu_check.sh runs the GPU matrix that way).
- ATTNCC_STRICT_RESOURCES=1 (unless set): a kernel loaded with unexpected spills or local
  memory raises ResourceError.
- `rng` fixture: `rng.randn(*shape)` gives fresh random tensors from a generator seeded by the
  test's id, so every test is deterministic and independent of test order.
"""
from __future__ import annotations

import functools
import os
import zlib
from typing import Any

import pytest
import torch

from attncc.integrations.transformers import hub_kernels_first

# A kernel loaded with spills or local memory its form is expected to run without is an error
# in tests (runtime/jit/kernels.py check_resources), not a warning.
os.environ.setdefault("ATTNCC_STRICT_RESOURCES", "1")

# transformers >= 5.25 imports Hugging Face's `kernels` at import time; pytest's rootdir on
# sys.path would hand it this checkout's kernels/ instead (attncc.integrations.transformers)
hub_kernels_first()

requires_gpu = pytest.mark.gpu
requires_nvrtc = pytest.mark.nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_available() -> bool:
    """True when NVRTC loads (no GPU needed)."""
    try:
        from attncc.runtime.jit.nvrtc import available
    except ImportError:
        try:
            from cuda.bindings import nvrtc
        except ImportError:
            return False
        try:
            return int(nvrtc.nvrtcVersion()[0]) == 0
        except Exception:
            return False
    return available()


_SPEED_IDS: set[str] = set()
_SPEED_OUTCOMES: dict[str, str] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    no_nvrtc = pytest.mark.skip(reason="needs NVRTC from cuda-bindings, which cannot load here")
    has_gpu = torch.cuda.is_available()
    shard = os.environ.get("ATTNCC_TEST_SHARD")
    if shard:
        index, count = (int(part) for part in shard.split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"ATTNCC_TEST_SHARD={shard!r}: want i/n with 0 <= i < n")
        config.hook.pytest_deselected(
            items=[item for position, item in enumerate(items) if position % count != index])
        items[:] = [item for position, item in enumerate(items) if position % count == index]
    for item in items:
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(no_gpu)
        if item.get_closest_marker("nvrtc") and not nvrtc_available():
            item.add_marker(no_nvrtc)
        if item.get_closest_marker("speed"):
            _SPEED_IDS.add(item.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep each speed test's outcome: its first failed or skipped phase, else passed."""
    if report.nodeid not in _SPEED_IDS or _SPEED_OUTCOMES.get(report.nodeid, "passed") != "passed":
        return
    if report.failed or report.skipped or report.when == "call":
        _SPEED_OUTCOMES[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line for the tests that assert timings (`speed`), apart from the others'."""
    if not _SPEED_OUTCOMES:
        return
    counts: dict[str, int] = {}
    for outcome in _SPEED_OUTCOMES.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    line = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    terminalreporter.write_line(f"speed (timing assertions): {line}")
    for nodeid, outcome in sorted(_SPEED_OUTCOMES.items()):
        if outcome == "failed":
            terminalreporter.write_line(f"speed FAILED {nodeid}")


class RandomTensors:
    """Fresh random tensors from one seeded generator (CPU generation, then moved)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32,
              device: Any = "cpu") -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32).to(dtype=dtype,
                                                                               device=device)

    def randint(self, low: int, high: int, *shape: int, device: Any = "cpu") -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen).to(device)

    def qkv(self, B: int, Hq: int, Sq: int, D: int, Hkv: int | None = None,
            Skv: int | None = None, Dv: int | None = None, dtype: torch.dtype = torch.float32,
            device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B,Hq,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv] (defaults: Hkv=Hq, Skv=Sq, Dv=D)."""
        Hkv = Hq if Hkv is None else Hkv
        Skv = Sq if Skv is None else Skv
        Dv = D if Dv is None else Dv
        return (self.randn(B, Hq, Sq, D, dtype=dtype, device=device),
                self.randn(B, Hkv, Skv, D, dtype=dtype, device=device),
                self.randn(B, Hkv, Skv, Dv, dtype=dtype, device=device))


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> RandomTensors:
    return RandomTensors(zlib.crc32(request.node.nodeid.encode()))
