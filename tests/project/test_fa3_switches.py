"""The FA3 kernels' compile-time switches: only product forms and constants remain (issue 28
retired the A/B-only ones, keeping their default branch), and
scripts/experiments/fa3_experiment.py refuses to define a macro the kernels do not read."""
from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

RETIRED = ("PINGPONG", "TAIL_PASS", "REBUILD_Q_ALL", "BAND_MASK", "TRIM", "TILE_META", "DYNAMIC",
           "REMAINDER_FIRST", "STORE_V4", "BULK_STORE", "L2_HINTS")


def _experiment() -> object:
    from scripts.experiments import fa3_experiment

    return fa3_experiment


def test_kernels_read_only_the_kept_switches() -> None:
    assert _experiment().kernel_switches() == {  # type: ignore[attr-defined]
        "ATTNCC_FA3_L2_SECTION_BYTES", "ATTNCC_FA3_V_LBO", "ATTNCC_FA3_V_SBO"}


def test_retired_switches_are_gone_from_kernels() -> None:
    """Not read anywhere, not even in a comment that would send a reader looking for one."""
    pattern = re.compile(r"ATTNCC_FA3_(" + "|".join(RETIRED) + r")\b")
    hits = [f"{f.name}: {m.group(0)}" for f in sorted((ROOT / "kernels").rglob("*.cuh"))
            for m in pattern.finditer(f.read_text())]
    assert hits == []


@pytest.mark.parametrize("name", [f"ATTNCC_FA3_{r}" for r in RETIRED] + ["ATTNCC_FA3_TYPO"])
def test_experiment_rejects_a_define_the_kernels_do_not_read(name: str) -> None:
    check = _experiment().check_configs  # type: ignore[attr-defined]
    with pytest.raises(SystemExit, match=f"do not read {name} .*scripts/ab_kernels.py"):
        check(["", f"opt:PAIRED=false,{name}=0"])


def test_experiment_accepts_kept_switches_and_options() -> None:
    _experiment().check_configs(  # type: ignore[attr-defined]
        ["", "ATTNCC_FA3_V_LBO=8192", "ATTNCC_FA3_L2_SECTION_BYTES=25165824,opt:PAIRED=true"])
