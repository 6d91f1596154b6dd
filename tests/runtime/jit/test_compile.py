"""attncc.compile: function / Variant / IR in, cubin out; captured values never change the source
(so a new value is a cache hit); a fresh process hits the disk cache; export needs no NVRTC."""
from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attncc import Variant
from attncc.codegen import generate as generate_mod
from attncc.errors import CompileError
from attncc.runtime.jit import nvrtc as nvrtc_mod
from attncc.runtime.jit.cache import KernelCache
from attncc.runtime.jit.compile import CompiledKernel, compile, dtype_name, export, trace_variant
from attncc.runtime.jit.nvrtc import available

# By module path: a package re-export of the `compile` function must not shadow the module here.
compile_mod = importlib.import_module("attncc.runtime.jit.compile")
needs_nvrtc = pytest.mark.skipif(not available(), reason="NVRTC cannot be loaded")
ARCH = "sm_90a"


def softcap_causal(cap: float) -> Variant:
    return Variant(score_mod=lambda s, b, h, q, kv: cap * torch.tanh(s / cap),
                   mask_mod=lambda b, h, q, kv: q >= kv, name="softcap_causal")


# ---- no NVRTC needed ---------------------------------------------------------------------------

def test_dtype_spellings() -> None:
    assert dtype_name(torch.bfloat16) == dtype_name("bf16") == "bfloat16"
    assert dtype_name(torch.float16) == dtype_name("half") == "float16"
    with pytest.raises(CompileError, match="dtype"):
        dtype_name(torch.int8)


def test_trace_variant_accepts_function_variant_and_ir() -> None:
    ir, b = trace_variant(lambda s, b, h, q, kv: s * 2)
    assert list(ir.hooks) == ["score_mod"] and b.scalars == {}
    ir2, b2 = trace_variant(softcap_causal(30.0))
    assert set(ir2.hooks) == {"score_mod", "mask_mod"} and b2.scalars == {"cap": 30.0}
    assert trace_variant(ir2)[0] is ir2


def test_bad_head_dim_is_a_compile_error() -> None:
    with pytest.raises(CompileError, match="head_dim"):
        compile(softcap_causal(30.0), head_dim=0, arch=ARCH, cache=False)


def test_export_is_pure_codegen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvrtc() -> None:
        raise AssertionError("export must not touch NVRTC")

    monkeypatch.setattr(nvrtc_mod, "_nvrtc", no_nvrtc)
    p = export(softcap_causal(30.0), tmp_path / "sub" / "sc.cu", head_dim=128, dtype=torch.bfloat16)
    text = p.read_text()
    assert p == tmp_path / "sub" / "sc.cu"
    assert "attncc_softcap_causal_simple_d128_bf16" in text and "__global__" in text
    q = export(lambda b, h, qi, kv: qi >= kv, tmp_path, head_dim=64)  # a directory: default name
    assert q.parent == tmp_path and q.suffix == ".cu" and q.exists()


# ---- with NVRTC --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attncc-cache")


@pytest.fixture(scope="module")
def first(cache_dir: Path) -> CompiledKernel:
    if not available():
        pytest.skip("NVRTC cannot be loaded")
    return compile(softcap_causal(30.0), head_dim=128, dtype="bfloat16", arch=ARCH,
                   cache=KernelCache(cache_dir))


@pytest.mark.nvrtc
@needs_nvrtc
def test_compiled_kernel_fields(first: CompiledKernel) -> None:
    assert not first.cache_hit
    assert first.cubin[:4] == b"\x7fELF" and first.kernel_name.encode() in first.cubin
    assert first.kernel_name == "attncc_softcap_causal_simple_d128_bf16"
    assert f'void {first.kernel_name}(' in first.source
    assert (first.arch, first.head_dim, first.dtype) == (ARCH, 128, "bfloat16")
    assert first.kernel == "simple"
    assert first.bindings.scalars == {"cap": 30.0}
    assert [s.name for s in first.ir.scalars] == ["cap"]
    assert first.params_layout.size == 4  # one float: cap
    assert first.attention_params_layout.size > 0
    assert first.options[0] == f"--gpu-architecture={ARCH}"


@pytest.mark.nvrtc
@needs_nvrtc
def test_new_captured_value_is_a_cache_hit_with_same_source(first: CompiledKernel,
                                                            cache_dir: Path) -> None:
    again = compile(softcap_causal(50.0), head_dim=128, arch=ARCH, cache=KernelCache(cache_dir))
    assert again.cache_hit  # fresh KernelCache: empty memory, so this is the disk entry
    assert again.source == first.source and again.cubin == first.cubin
    assert again.bindings.scalars == {"cap": 50.0} and first.bindings.scalars == {"cap": 30.0}
    c = KernelCache(cache_dir)
    compile(softcap_causal(1.0), head_dim=128, arch=ARCH, cache=c)
    warm = compile(softcap_causal(2.0), head_dim=128, arch=ARCH, cache=c)  # in-memory memo
    assert warm.cache_hit and warm.bindings.scalars == {"cap": 2.0} and warm.cubin == first.cubin


@pytest.mark.nvrtc
@needs_nvrtc
def test_ptx_and_export(first: CompiledKernel, tmp_path: Path) -> None:
    ptx = first.ptx()
    assert f".entry {first.kernel_name}" in ptx and ".target sm_90a" in ptx
    assert first.ptx() is ptx  # memoized on the kernel
    p = first.export(tmp_path / "k.cu")
    assert p.exists() and first.kernel_name in p.read_text()
    assert first.export(tmp_path).name == f"{first.kernel_name}.cu"


@pytest.mark.nvrtc
@needs_nvrtc
def test_plain_score_mod_through_default_cache(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))

    def alibi_ish(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score - (q_idx - kv_idx) * 0.5

    k = compile(alibi_ish, head_dim=64, dtype=torch.float16, arch="sm_80")
    assert not k.cache_hit and k.dtype == "float16" and k.cubin[:4] == b"\x7fELF"
    assert list(k.ir.hooks) == ["score_mod"] and k.bindings.scalars == {}
    assert len(KernelCache(tmp_path).entries()) == 1
    assert compile(alibi_ish, head_dim=64, dtype="float16", arch="sm_80").cache_hit
    # the same function under cache=False compiles again and writes nothing new
    assert not compile(alibi_ish, head_dim=64, dtype="float16", arch="sm_80", cache=False).cache_hit
    assert len(KernelCache(tmp_path).entries()) == 1


@pytest.mark.nvrtc
@needs_nvrtc
def test_nvrtc_failure_names_variant_and_line(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = generate_mod.generate_source

    def broken(ir, **kw):  # type: ignore[no-untyped-def]
        gen = real(ir, **kw)
        return replace(gen, source=gen.source + "\nint oops = undefined_symbol_xyz;\n")

    monkeypatch.setattr(compile_mod, "generate_source", broken)
    with pytest.raises(CompileError) as ei:
        compile(softcap_causal(30.0), head_dim=128, arch=ARCH, cache=KernelCache(tmp_path))
    e = ei.value
    assert "softcap_causal" in str(e) and "undefined_symbol_xyz" in e.log
    assert e.line == "int oops = undefined_symbol_xyz;"
    assert "int oops = undefined_symbol_xyz;" in str(e)
    assert KernelCache(tmp_path).entries() == []  # failures are never cached


def test_import_attncc_does_not_load_sympy() -> None:
    """ir.simplify (and with it sympy) loads on the first compile, not on `import attncc`
    (0.44 -> 0.16 s after torch on the dev VM)."""
    import subprocess
    import sys

    code = "import sys, attncc; print('attncc.ir.simplify' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
