"""The form memo (runtime/jit/forms.py): a warm compile_spec answers from the cache directory
without rendering the translation unit, re-pointed at the caller's IR and device; anything
that could change the form gives a new key."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from attncc.gym import GYM
from attncc.runtime.jit import forms, kernels
from attncc.runtime.jit.kernels import KernelSpec, compile_spec

ARCH = "sm_90a"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _prepass(name: str = "softcap", d: int = 64, **kw: object) -> KernelSpec:
    from attncc.ir.simplified import simplify_variant

    ir = simplify_variant(GYM[name](1, 4, 256, d).trace()[0])
    return KernelSpec("prepass", ir, d, "bfloat16", **kw)


@pytest.mark.nvrtc
def test_a_warm_compile_spec_renders_nothing(cache_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    first = compile_spec(KernelSpec("merge", dtype="float16", device=0), ARCH)
    assert list((cache_dir / "forms").glob("*.bin")), "the form was not remembered"

    def refuse(*a: object, **kw: object) -> None:
        raise AssertionError("a warm compile_spec rendered or compiled")

    monkeypatch.setattr(kernels, "generate", refuse)
    monkeypatch.setattr(kernels, "compile_form", refuse)
    forms.FormMemo.default().store.clear_memory()  # read it back from the disk
    again = compile_spec(KernelSpec("merge", dtype="float16", device=1), ARCH)
    assert again.result.cubin == first.result.cubin and again.gen.source == first.gen.source
    assert again.spec.device == 1 and again.gen.kernel_name == first.gen.kernel_name


def test_the_key_covers_the_spec_the_arch_and_the_sources(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    key = forms.FormMemo.key
    spec = _prepass()
    base = key(spec, ARCH)
    assert base == key(replace(spec, device=3), ARCH)  # the form does not depend on the device
    assert base == key(_prepass(), ARCH)  # a re-trace in another call hits the same entry
    others = {key(replace(spec, head_dim=128), ARCH), key(spec, "sm_80"),
              key(replace(spec, fast_math=False), ARCH), key(_prepass("alibi"), ARCH)}
    assert base not in others and len(others) == 4
    monkeypatch.setattr(forms, "sources_digest", lambda: "an edited template")
    assert key(spec, ARCH) != base


def test_the_digest_sees_an_edited_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from attncc.ir import digest

    src = tmp_path / "pkg"
    src.mkdir()
    (src / "a.cuh").write_text("int x;")
    monkeypatch.setattr(forms, "_package_dirs", lambda: [src])
    monkeypatch.setattr(digest, "_digests", {})
    before = forms.sources_digest()
    assert forms.sources_digest() == before  # remembered for the process
    (src / "a.cuh").write_text("int yy;")
    monkeypatch.setattr(digest, "_digests", {})
    assert forms.sources_digest() != before
    (src / "b.cuh").write_text("")  # a new file too
    monkeypatch.setattr(digest, "_digests", {})
    assert len({before, forms.sources_digest()}) == 2


_PROCESS = """
import sys
from attncc.gym import GYM
from attncc.ir.simplified import simplify_variant
from attncc.runtime.jit import kernels
ir = simplify_variant(GYM["rope"](1, 4, 256, 64).trace()[0])  # fresh, then read from the store
if sys.argv[1] == "warm":
    def refuse(*a, **kw):
        raise SystemExit("the warm process rendered or compiled")
    kernels.generate = kernels.compile_form = refuse
kernels.compile_spec(kernels.KernelSpec("prepass", ir, 64, "bfloat16"), "sm_90a")
"""


@pytest.mark.nvrtc
def test_a_new_process_finds_the_form_a_cold_one_compiled(cache_dir: Path) -> None:
    """The key of a freshly simplified IR equals that of the same IR read back from the store,
    so the first warm process (the one `attncc warm` prepared for) renders nothing."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ATTNCC_CACHE_DIR": str(cache_dir)}
    for mode in ("cold", "warm"):
        p = subprocess.run([sys.executable, "-c", _PROCESS, mode], env=env, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]


def test_an_unreadable_entry_is_a_miss(cache_dir: Path) -> None:
    memo, spec = forms.FormMemo(), _prepass()
    memo.store.put(memo.key(spec, ARCH), b"not a pickle")
    assert memo.load(memo.key(spec, ARCH)) is None


@pytest.mark.nvrtc
def test_a_trail_walks_the_forms_past_the_memo(cache_dir: Path) -> None:
    spec = KernelSpec("merge", dtype="bfloat16")
    compile_spec(spec, ARCH)
    trail: list = []
    compile_spec(spec, ARCH, trail)
    assert len(trail) == 1 and trail[0].spec == spec
