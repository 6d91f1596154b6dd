"""NVRTC wrapper: compiles tiny kernels for sm_80 / sm_90a, emits PTX, reports compile errors with
NVRTC's log and the offending source line, and uses only the API that cuda-bindings 12 and 13
share."""
from __future__ import annotations

import pytest

from attncc.errors import CompileError
from attncc.runtime.jit import nvrtc as nv
from attncc.runtime.jit.nvrtc import (NvrtcResult, available, build_options, compile_cuda,
                                      normalize_arch, nvrtc_version, offending_lines)

needs_nvrtc = pytest.mark.skipif(not available(), reason="NVRTC cannot be loaded")

TINY = 'extern "C" __global__ void scale(float* x, float s) {\n  x[threadIdx.x] *= s;\n}\n'
BROKEN = ('extern "C" __global__ void bad(float* x) {\n'
          '  float y = expf(x[0]);\n'
          '  x[threadIdx.x] = not_declared + y;\n'
          '  x[1] = also_missing;\n'
          '}\n')


def test_normalize_arch_spellings() -> None:
    assert normalize_arch("sm_90a") == "sm_90a"
    assert normalize_arch("SM90A") == "sm_90a"
    assert normalize_arch("80") == "sm_80"
    assert normalize_arch("compute_90a") == "sm_90a"
    assert normalize_arch("sm_100f") == "sm_100f"
    with pytest.raises(CompileError, match="not a GPU architecture"):
        normalize_arch("hopper")


def test_build_options_defaults_are_exact_math() -> None:
    opts = build_options("sm_90a")
    assert opts[0] == "--gpu-architecture=sm_90a"
    assert "-std=c++17" in opts and "-default-device" in opts
    assert not any("fast_math" in o or "fast-math" in o for o in opts)
    assert build_options("sm_80", emit="ptx")[0] == "--gpu-architecture=compute_80"
    assert "--ptxas-options=-v" in build_options("sm_80", verbose=True)
    assert build_options("sm_80", include_dirs=["/x"])[-1] == "--include-path=/x"
    with pytest.raises(ValueError, match="emit"):
        build_options("sm_80", emit="sass")


def test_offending_lines_only_reports_our_file() -> None:
    log = ('attncc.cu(3): error: identifier "a" is undefined\n'
           'other.h(1): error: whatever\n'
           'attncc.cu(3): error: again\n'
           'attncc.cu(1): warning: unused\n'
           'attncc.cu(2): catastrophic error: cannot open source file\n')
    src = "l1\nl2\nl3\n"
    assert offending_lines(log, src, "attncc.cu") == [(3, "l3"), (2, "l2")]


def test_arch_none_without_gpu_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(CompileError, match="arch='sm_90a'"):
        compile_cuda(TINY, arch=None)


def test_nul_in_source_is_rejected() -> None:
    with pytest.raises(ValueError, match="NUL"):
        compile_cuda("int x;\0int y;", arch="sm_80")


@pytest.mark.nvrtc
@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compiles_tiny_kernel(arch: str) -> None:
    r = compile_cuda(TINY, arch=arch)
    assert isinstance(r, NvrtcResult)
    assert isinstance(r.cubin, bytes) and r.cubin[:4] == b"\x7fELF"
    assert r.ptx is None and isinstance(r.log, str)
    assert r.options[0] == f"--gpu-architecture={arch}"
    assert b"scale" in r.cubin  # the extern "C" entry keeps its unmangled name


@pytest.mark.nvrtc
@needs_nvrtc
def test_version_and_supported_archs() -> None:
    major, minor = nvrtc_version()
    assert isinstance(major, int) and isinstance(minor, int) and major >= 12
    assert 80 in nv.supported_archs() and 90 in nv.supported_archs()


@pytest.mark.nvrtc
@needs_nvrtc
def test_emit_ptx_targets_the_virtual_arch() -> None:
    r = compile_cuda(TINY, arch="sm_90a", emit="ptx")
    assert r.cubin == b"" and r.ptx is not None
    assert ".target sm_90a" in r.ptx and ".entry scale" in r.ptx
    assert not r.ptx.endswith("\0")


@pytest.mark.nvrtc
@needs_nvrtc
def test_verbose_puts_ptxas_resource_report_in_log() -> None:
    # Twice: on NVRTC >= 12.9 the second compile would come from the driver's compute cache,
    # which skips ptxas and drops the report, unless the wrapper opts out of that cache.
    for _ in range(2):
        r = compile_cuda(TINY, arch="sm_90a", verbose=True)
        assert "registers" in r.log and "scale" in r.log


@pytest.mark.nvrtc
@needs_nvrtc
def test_compile_error_carries_log_and_offending_lines() -> None:
    with pytest.raises(CompileError) as ei:
        compile_cuda(BROKEN, arch="sm_90a", name="variant_bad.cu")
    e = ei.value
    assert "not_declared" in e.log and "also_missing" in e.log
    assert e.line == "  x[threadIdx.x] = not_declared + y;"
    assert e.lineno == 3  # type: ignore[attr-defined]
    assert e.source == BROKEN
    msg = str(e)
    assert "NVRTC_ERROR_COMPILATION" in msg
    assert "variant_bad.cu:3: x[threadIdx.x] = not_declared + y;" in msg
    assert "variant_bad.cu:4: x[1] = also_missing;" in msg
    assert "--gpu-architecture=sm_90a" in msg


@pytest.mark.nvrtc
@needs_nvrtc
def test_bad_option_and_unsupported_arch_are_compile_errors() -> None:
    with pytest.raises(CompileError, match="INVALID_OPTION") as ei:
        compile_cuda(TINY, arch="sm_80", options=["--no-such-flag"])
    assert "--no-such-flag" in ei.value.log
    with pytest.raises(CompileError, match="cannot target sm_30"):
        compile_cuda(TINY, arch="sm_30")


class _FastEnumLike(int):
    """cuda-bindings 13.x returns int-subclass results with `.name` instead of IntEnum members."""

    @property
    def name(self) -> str:
        return "NVRTC_SUCCESS" if self == 0 else f"NVRTC_ERROR_{int(self)}"


class _Bindings13Shim:
    """Re-shapes every result tuple of the real module the way 13.x does (same call signatures)."""

    def __init__(self, real: object) -> None:
        self._real = real
        self.calls: list[str] = []

    def __getattr__(self, attr: str) -> object:
        fn = getattr(self._real, attr)

        def call(*args: object) -> tuple:
            self.calls.append(attr)
            out = fn(*args)
            return (_FastEnumLike(int(out[0])), *out[1:])

        return call


@pytest.mark.nvrtc
@needs_nvrtc
def test_wrapper_only_relies_on_int_results(monkeypatch: pytest.MonkeyPatch) -> None:
    shim = _Bindings13Shim(nv._nvrtc())
    monkeypatch.setattr(nv, "_nvrtc", lambda: shim)
    assert compile_cuda(TINY, arch="sm_80").cubin[:4] == b"\x7fELF"
    assert shim.calls[-1] == "nvrtcDestroyProgram"  # every program is destroyed, result checked
    with pytest.raises(CompileError, match="NVRTC_ERROR_6") as ei:
        compile_cuda(BROKEN, arch="sm_80")
    assert ei.value.line is not None


@needs_nvrtc
@pytest.mark.nvrtc
def test_a_warm_process_reads_the_version_without_loading_nvrtc(tmp_path) -> None:
    """The NVRTC version (part of every cubin key) is remembered in the cache directory; a new
    process whose cubin is cached reaches it without importing cuda.bindings.nvrtc."""
    import json
    import os
    import subprocess
    import sys

    code = ("import sys\n"
            "from attncc.runtime.jit.cache import cached_compile\n"
            f"r, hit = cached_compile({TINY!r}, arch='sm_80')\n"
            "print(hit, 'cuda.bindings.nvrtc' in sys.modules)\n")
    env = {**os.environ, "ATTNCC_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    assert runs == [["False", "True"], ["True", "False"]]
    memo = json.loads((tmp_path / "nvrtc-version.json").read_text())
    assert tuple(memo["version"]) == nvrtc_version()
    memo["library"][1] += 1  # another library file: the memo no longer applies
    (tmp_path / "nvrtc-version.json").write_text(json.dumps(memo))
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert again == ["True", "True"]
