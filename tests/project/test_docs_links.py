"""The docs name files and modules that exist: every repository path cited in docs/*.md,
README.md and DEVELOPERS.md (a backticked `dir/file.ext` or a Markdown link target) must be in the
tree, and every backticked dotted `attncc.<subpackage>.name` must import, so a move or rename that
forgets the docs fails here. The journal (docs/journal/) is history and keeps the names of its
day."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "DEVELOPERS.md"]

# `a/b.ext` (optionally `::test_name` or `:line` after it) in backticks, and ](target) links.
_BACKTICKED = re.compile(r"`([\w.-]+(?:/[\w.-]+)*/[\w.-]+\.\w+)(?:::[\w\[\]-]+|:\d+)?`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Cited as examples of output a tool writes, not as files of the repository.
_NOT_REPO_PATHS = {"attncc_kernels/softcap.cu"}


def cited_paths(text: str) -> set[str]:
    """Repository paths a Markdown text cites (URLs, anchors, globs and `$VAR` paths left out).

    Example:
        >>> sorted(cited_paths("see `runtime/jit/tiles.py`, [fa3](fa3.md#split-tail), "
        ...                    "`$OUT/a.json`, `bench/*.py`, [w](https://x.org/a.md)"))
        ['fa3.md', 'runtime/jit/tiles.py']
    """
    found = set(_BACKTICKED.findall(text))
    for target in _LINK.findall(text):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        found.add(target.split("#", 1)[0])
    return {p for p in found if p and not any(c in p for c in "*$<>{}") and p not in _NOT_REPO_PATHS}


def _exists(doc: Path, path: str) -> bool:
    # Links resolve from the citing file's folder (Markdown's rule); backticked paths are
    # written from the repository root. Either reading that names a file is accepted.
    return (ROOT / path).exists() or (doc.parent / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_docs_cite_existing_paths(doc: Path) -> None:
    missing = sorted(p for p in cited_paths(doc.read_text(encoding="utf-8"))
                     if not _exists(doc, p))
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"


def test_the_rule_catches_a_missing_path(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("`runtime/gpu_flex.py` moved; [plan](runtime/serving/plan/format.py) stayed")
    missing = [p for p in cited_paths(doc.read_text()) if not _exists(doc, p)]
    assert missing == ["runtime/gpu_flex.py"]


_TEST_REF = re.compile(r"`([\w/.-]+\.py)::(\w+)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_docs_cite_existing_tests(doc: Path) -> None:
    """A cited `tests/x.py::test_name` names a function defined in that file."""
    refs = set(_TEST_REF.findall(doc.read_text(encoding="utf-8")))
    missing = sorted(f"{f}::{n}" for f, n in refs
                     if not (ROOT / f).exists()
                     or not re.search(rf"def {n}\b", (ROOT / f).read_text(encoding="utf-8")))
    assert not missing, f"{doc.relative_to(ROOT)} cites tests that do not exist: {missing}"


_DOTTED = re.compile(r"`(attncc\.(?:runtime|codegen|ir|frontend)(?:\.\w+)+)")


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module or a module's attribute (the longest importable prefix).

    Example:
        >>> _resolves("attncc.ir.nodes.DType.F32"), _resolves("attncc.ir.nodes.Nope")
        (True, False)
    """
    parts = dotted.split(".")
    for k in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_docs_cite_existing_modules(doc: Path) -> None:
    names = set(_DOTTED.findall(doc.read_text(encoding="utf-8")))
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"{doc.relative_to(ROOT)} cites names that do not import: {missing}"
