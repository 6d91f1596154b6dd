"""preload_driver: `import attncc` starts importing the CUDA driver bindings on a thread when
torch is a CUDA build, never on a CPU build, and once per process."""
from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = """
import sys, torch
torch.version.cuda = sys.argv[1] if sys.argv[1] != "none" else None
import attncc
from attncc.runtime.jit import launcher
t = launcher._PRELOAD[0] if launcher._PRELOAD else None
if t is not None:
    t.join()
print(t is not None, "cuda.bindings.driver" in sys.modules, launcher.preload_driver() is None)
"""


def _child(cuda: str) -> list[str]:
    p = subprocess.run([sys.executable, "-c", _CHILD, cuda], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def test_a_cpu_build_starts_nothing() -> None:
    started, _, again_none = _child("none")  # (torch 2.13 itself may import the bindings)
    assert (started, again_none) == ("False", "True")


def test_a_cuda_build_imports_the_driver_bindings_once() -> None:
    pytest.importorskip("cuda.bindings")
    assert _child("13.0") == ["True", "True", "True"]
