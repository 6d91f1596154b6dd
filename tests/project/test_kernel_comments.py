"""Kernel comments point to the docs, and what they point to exists: a `docs/x.md, "Heading"`
citation in `kernels/*.cuh` names a heading of that file (a phrase of it), cited repository
paths exist, and no comment cites the retired bench/NOTES.md, a session's "stop N" or the
never-written KERNEL_INTERFACE.md, so a renamed docs section or a moved file fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

KERNELS = sorted((ROOT / "kernels").rglob("*.cuh"))

_STALE = re.compile(r"NOTES\.md|\bstop \d+|KERNEL_INTERFACE")
_SECTION = re.compile(r'(docs/[\w/.-]+\.md),? "([^"]+)"')
_PATH = re.compile(r"\b((?:docs|runtime|kernels|bench|scripts|tests|attncc)/[\w/.-]*\w\.\w+)")


def comment_text(source: str) -> str:
    """The `//` comments of a CUDA source as one line of prose (continuation lines joined).

    >>> comment_text('int x;  // a "b\\n// c" d\\nint y;')
    'a "b c" d'
    """
    parts = [line.split("//", 1)[1].strip() for line in source.splitlines() if "//" in line]
    return " ".join(parts)


def section_citations(text: str) -> list[tuple[str, str]]:
    """(docs file, heading phrase) pairs a comment cites.

    >>> section_citations('see docs/fa3.md, "Split tail" and docs/x.md "A, B"')
    [('docs/fa3.md', 'Split tail'), ('docs/x.md', 'A, B')]
    """
    return _SECTION.findall(text)


def _headings(doc: Path) -> list[str]:
    return [line for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


@pytest.mark.parametrize("cuh", KERNELS, ids=lambda p: p.name)
def test_kernel_comments_cite_no_retired_history(cuh: Path) -> None:
    stale = sorted(set(_STALE.findall(comment_text(cuh.read_text(encoding="utf-8")))))
    assert not stale, f"{cuh.name} cites {stale}; point to a docs section or a journal heading"


@pytest.mark.parametrize("cuh", KERNELS, ids=lambda p: p.name)
def test_kernel_comments_cite_existing_sections(cuh: Path) -> None:
    bad = []
    for doc, phrase in section_citations(comment_text(cuh.read_text(encoding="utf-8"))):
        path = ROOT / doc
        if not path.exists() or not any(phrase in h for h in _headings(path)):
            bad.append(f'{doc}, "{phrase}"')
    assert not bad, f"{cuh.name} cites docs sections that do not exist: {bad}"


@pytest.mark.parametrize("cuh", KERNELS, ids=lambda p: p.name)
def test_kernel_comments_cite_existing_paths(cuh: Path) -> None:
    cited = set(_PATH.findall(comment_text(cuh.read_text(encoding="utf-8"))))
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"{cuh.name} cites paths that do not exist: {missing}"


def test_the_rules_catch_a_bad_comment() -> None:
    text = comment_text('x;  // bench/NOTES.md stop 19; docs/fa3.md, "No such heading";\n'
                        "// runtime/gpu_flex.py\n")
    assert _STALE.findall(text) == ["NOTES.md", "stop 19"]
    doc, phrase = section_citations(text)[0]
    assert not any(phrase in h for h in _headings(ROOT / doc))
    assert not (ROOT / _PATH.findall(text)[-1]).exists()
