"""scripts/kernel_hashes.py: the cubin hash list that proves a kernel re-housing changed nothing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

ARGS = ["--kinds", "fa3-single,fa3-split,fa3-pair,fa2-decode,merge", "--variants", "causal",
        "--dims", "64", "--jobs", "1"]


def _hashes(cache: Path) -> list[str]:
    env = {**os.environ, "ATTNCC_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-m", "scripts.kernel_hashes", *ARGS],
                         capture_output=True, text=True, env=env, check=True, cwd=ROOT).stdout
    return out.splitlines()


@pytest.mark.nvrtc
def test_kernel_hashes_deterministic_across_fresh_compiles(tmp_path: Path) -> None:
    """Two runs with empty, separate caches (every kernel compiled twice) print the same list:
    one line a form, sorted by form, each a 64-digit hash; the split-tail launch runs the
    single form's cubin and the pair form is another cubin."""
    first, second = _hashes(tmp_path / "a"), _hashes(tmp_path / "b")
    assert first == second
    forms = {ln.split()[1]: ln.split()[0] for ln in first}
    assert sorted(forms) == ["fa2-decode", "fa3-pair", "fa3-single", "fa3-split", "merge"]
    assert len(first) == 6  # the merge kernel for bfloat16 and float16
    assert first == sorted(first, key=lambda ln: ln.split("  ", 1)[::-1])
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in forms.values())
    assert forms["fa3-split"] == forms["fa3-single"] != forms["fa3-pair"]
    assert all(" D=64 sm_90a attncc_causal_" in ln for ln in first if " merge " not in ln)


def test_kernel_hashes_rejects_unknown_kind() -> None:
    from scripts.kernel_hashes import main

    with pytest.raises(SystemExit, match="--kinds: unknown \\['fa4'\\]"):
        main(["--kinds", "fa4"])


_RENAMED = """
namespace {ns} {{ template <typename T> struct Traits {{ static constexpr bool kOne = true; }}; }}
extern "C" __global__ void k(float* x) {{ if ({ns}::Traits<float>::kOne) x[0] = x[0] * 2.f; }}
"""


@pytest.mark.nvrtc
def test_code_hash_sees_through_renamed_static_members() -> None:
    """A struct's static constexpr member is a global symbol in the cubin, so renaming its
    namespace changes the cubin's hash; `--code` hashes only the .text sections, which stay."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from kernel_hashes import _code_sha, _sha, code_sections
    from attncc.runtime.jit.nvrtc import compile_cuda

    a, b = (compile_cuda(_RENAMED.format(ns=ns), arch="sm_90a").cubin for ns in ("fa2", "common"))
    assert _sha(a) != _sha(b)
    assert _code_sha(a) == _code_sha(b)
    assert list(code_sections(a)) == [".text.k"] and code_sections(a)[".text.k"]
