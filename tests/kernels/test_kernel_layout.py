"""kernels/ is grouped by role: every template sits in one role folder, pyproject ships it, and
every kernel's file list names templates that exist (docs/kernel-interface.md, section 1)."""
from __future__ import annotations

import re

import pytest

from tests.helpers import ROOT

ROLES = {"common", "hopper", "fa2", "fa3", "small"}


def _package_data_globs() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r'^"attncc\.kernels" = \[(.*)\]$', text, flags=re.M)
    assert line is not None, "pyproject.toml ships no attncc.kernels package data"
    return re.findall(r'"([^"]+)"', line.group(1))


def test_every_template_is_in_a_role_folder_and_shipped() -> None:
    kernels = ROOT / "kernels"
    cuh = sorted(p.relative_to(kernels).as_posix() for p in kernels.rglob("*.cuh"))
    assert cuh and all(p.split("/")[0] in ROLES and p.count("/") == 1 for p in cuh), cuh
    shipped = {p.relative_to(kernels).as_posix() for g in _package_data_globs()
               for p in kernels.glob(g)}
    assert shipped == set(cuh)


def test_every_kernel_names_existing_templates_and_every_template_is_used() -> None:
    from attncc.codegen.generate import COMMON_TEMPLATES, KERNELS
    from attncc.kernels import template_path

    used = {*COMMON_TEMPLATES, "small/merge_state.cuh", "small/bwd_rows.cuh",
            "small/bwd_dq.cuh"}
    for spec in KERNELS.values():
        used.update(spec.files)
    assert all(template_path(f).is_file() for f in used)
    kernels = ROOT / "kernels"
    assert used == {p.relative_to(kernels).as_posix() for p in kernels.rglob("*.cuh")}


def test_template_names_are_paths_inside_the_package() -> None:
    from attncc.kernels import read_template

    with pytest.raises(FileNotFoundError, match="did you mean 'fa3/fa3_prefill.cuh'"):
        read_template("fa3_prefill.cuh")
    for bad in ("../pyproject.toml", "fa2/../../x.cuh", "/etc/passwd", "", "fa2//x.cuh"):
        with pytest.raises(ValueError, match="must be a path under attncc.kernels"):
            read_template(bad)
