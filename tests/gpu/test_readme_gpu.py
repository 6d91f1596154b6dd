"""The README's Python blocks, GPU ones included, run as pasted on a CUDA machine (in order:
a GPU block may continue the CPU block before it)."""
from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from pathlib import Path

import pytest
import torch

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def python_blocks(text: str) -> list[str]:
    """The ```python fenced blocks of a Markdown text, in order (as
    tests/project/test_packaging.py)."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.gpu
def test_readme_blocks_run_on_a_gpu(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # a module torch.compile can find by name (as a script's __main__ is): Dynamo imports
    # the module of a compiled function's globals
    module = types.ModuleType("__readme__")
    monkeypatch.setitem(sys.modules, "__readme__", module)
    namespace: dict = module.__dict__
    for block in python_blocks(README):
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, "README.md", "exec"), namespace)
    torch.cuda.synchronize()
    out = namespace["out"]  # the serving block's, last
    assert out.is_cuda and out.shape == (25, 32, 128) and not torch.isnan(out).any()
