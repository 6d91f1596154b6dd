"""docs/ops.md is what scripts/ops_table.py generates from torch's op lists, and every op it
calls supported is exercised against torch (tests/frontend/test_ops.py) and compiled
(tests/codegen/test_ops_compile.py)."""
from __future__ import annotations

import re

import pytest
import torch

from attncc.frontend.torch_ops import COVERAGE, UNSUPPORTED
from scripts import ops_table
from tests.helpers.op_cases import NO_CASE, sources
from tests.helpers.op_kernel import case_nodes

_ROW = re.compile(r"^\| (\S+) \| (yes|no|error) \| (.*?) \| (.*) \|$")


def _committed() -> str:
    return ops_table.DOC.read_text(encoding="utf-8")


def test_committed_table_is_the_generated_one() -> None:
    made = f"torch {'.'.join(torch.__version__.split('.')[:2])}'s op lists"
    if made not in _committed():  # another torch lists other ops: the rows it shares agree
        shared = set(_committed().splitlines()) & set(ops_table.render().splitlines())
        assert sum(bool(_ROW.match(ln)) for ln in shared) > 150
        pytest.skip("docs/ops.md was generated with another torch version")
    assert _committed() == ops_table.render(), "docs/ops.md is stale: python -m scripts.ops_table"


def test_every_supported_spelling_is_tested_and_compiled() -> None:
    compiled = {name for name, _, _ in case_nodes()}
    yes = []
    for line in _committed().splitlines():
        m = _ROW.match(line)
        if m and m.group(2) == "yes":
            yes += re.findall(r"`([\w.]+)`", m.group(3))
    assert len(yes) > 250
    for spelling in yes:
        if spelling not in COVERAGE or spelling in UNSUPPORTED:
            continue  # a spelling of a supported op that raises (e.g. Tensor.float_power)
        if spelling in NO_CASE:
            continue
        assert sources(spelling), f"{spelling} has no case in tests/helpers/op_cases.py"
        assert spelling in compiled, f"{spelling} is not in the NVRTC kernel"
    # and every traced name is in the table
    listed = set(re.findall(r"`((?:torch|Tensor)[\w.]*)`", _committed()))
    assert set(COVERAGE) <= listed, sorted(set(COVERAGE) - listed)


def test_check_mode_reports_a_stale_table(tmp_path, monkeypatch) -> None:
    stale = tmp_path / "ops.md"
    stale.write_text("# old\n", encoding="utf-8")
    monkeypatch.setattr(ops_table, "DOC", stale)
    assert ops_table.main(["--check"]) == 1
    assert ops_table.main([]) == 0 and ops_table.main(["--check"]) == 0
