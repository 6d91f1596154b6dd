"""Packaging matches the README (issue 27, point 7): the dependency ranges admit every torch
the README names and both cuda-bindings majors, the README says what to install first before
the commands, and its Python blocks not marked as needing a GPU run as pasted on a CPU machine.

Whether pip can resolve the project with torch 2.11, 2.13 and 2.14 needs the package index:
`.ci/run` runs those resolver dry runs before the tests (checked below to stay there).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import types

import pytest

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
GPU_MARK = "# needs a CUDA GPU"
# the torch releases the README and CI promise to resolve with
TORCH_VERSIONS = ("2.11", "2.13", "2.14")


def python_blocks(text: str) -> list[str]:
    """The ```python fenced blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _needs_gpu(block: str) -> bool:
    return block.lstrip().startswith(GPU_MARK)


def _requirements() -> dict[str, str]:
    """pyproject's [project] dependencies as {name: the requirement line}."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M)
    assert deps is not None, "pyproject.toml has no [project] dependencies list"
    lines = re.findall(r'^\s*"([^"]+)"', deps.group(1), flags=re.M)
    return {re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower(): line for line in lines}


def _admits(requirement: str, version: str) -> bool:
    from packaging.requirements import Requirement

    return Requirement(requirement).specifier.contains(version, prereleases=False)


def test_dependencies_admit_both_cuda_bindings_majors_and_the_readmes_torch() -> None:
    reqs = _requirements()
    # torch 2.11 / 2.14 from PyPI require cuda-bindings >= 13.0.3; CI and older setups have 12
    for version in ("12.9.10", "13.0.3", "13.5.0"):
        assert _admits(reqs["cuda-bindings"], version), (reqs["cuda-bindings"], version)
    for version in ("2.11.0", "2.13.0", "2.14.1"):
        assert _admits(reqs["torch"], version), (reqs["torch"], version)
    # the NVRTC wheel attncc brings loads under either bindings major (no -cu13 pin)
    assert "nvidia-cuda-nvrtc-cu12" in reqs
    match = re.search(r"torch `>=(\d+\.\d+),<(\d+\.\d+)`", README)
    assert match is not None, "README no longer states the accepted torch range"
    assert reqs["torch"].replace(" ", "").startswith(f"torch>={match[1]},<{match[2]}")


def test_readme_says_what_to_install_first_before_the_commands() -> None:
    setup = README[README.index("## Set up"):README.index("## Use it")]
    torch_first = setup.find("pip install torch")
    project = setup.find('pip install -e ".[dev]"')
    assert 0 <= torch_first < project, "install torch (the CPU hint) before the project"
    assert setup.find("CPU") < project


def test_readme_gpu_lines_are_in_blocks_marked_gpu() -> None:
    blocks = python_blocks(README)
    assert any(not _needs_gpu(b) for b in blocks) and any(_needs_gpu(b) for b in blocks)
    for block in blocks:
        if not _needs_gpu(block):
            assert ".cuda()" not in block and '"cuda"' not in block, block


@pytest.mark.nvrtc
def test_readme_cpu_blocks_run_as_pasted(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the blocks write softcap.cu and softcap_fa2.cu
    # a module torch.compile can find by name (as a script's __main__ is): Dynamo imports
    # the module of a compiled function's globals
    module = types.ModuleType("__readme__")
    monkeypatch.setitem(sys.modules, "__readme__", module)
    namespace: dict = module.__dict__
    ran = 0
    for block in python_blocks(README):
        if _needs_gpu(block):
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, "README.md", "exec"), namespace)
        ran += 1
    assert ran >= 1
    assert (tmp_path / "softcap.cu").exists() and (tmp_path / "softcap_fa2.cu").exists()
    assert "-c softcap.cu" in (tmp_path / "softcap.cu").read_text()


def test_ci_resolves_the_project_with_each_torch_before_the_tests() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    dry = ci.find("--dry-run")
    tests = ci.find("python3 -m pytest")
    assert 0 <= dry < tests, ".ci/run must run the resolver dry runs before the tests"
    loop = re.search(r"for torch_version in ([\d. ]+); do", ci)
    assert loop is not None and tuple(loop.group(1).split()) == TORCH_VERSIONS
    assert '"torch==${torch_version}.*"' in ci and '".[dev]"' in ci[dry - 200:dry + 200]


@pytest.mark.skipif(os.environ.get("ATTNCC_RESOLVE_CHECK") != "1",
                    reason="needs the package index; .ci/run runs the same dry runs")
@pytest.mark.parametrize("torch_version", TORCH_VERSIONS)
def test_project_resolves_with_torch(torch_version: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                           "--use-feature=fast-deps",
                           "--ignore-installed", ".[dev]", f"torch=={torch_version}.*"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kernels_package_doctests() -> None:
    """attncc.kernels' doctests through its installed name: pytest does not collect the
    checkout's kernels/ directory, which it would import as a top-level `kernels`, the name of
    Hugging Face's hub-kernels package that transformers (>= 5.25) imports."""
    import doctest

    import attncc.kernels

    result = doctest.testmod(attncc.kernels)
    assert result.attempted > 0 and result.failed == 0


def test_transformers_finds_hub_kernels_not_the_template_directory() -> None:
    """With the checkout on sys.path (as here), `kernels` is Hugging Face's package when it is
    installed (tests/conftest.py imports it first), never attncc's CUDA templates."""
    module = sys.modules.get("kernels")
    assert module is None or not hasattr(module, "read_template")
