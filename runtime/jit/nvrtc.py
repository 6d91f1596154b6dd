"""A thin, checked wrapper around NVRTC (`cuda.bindings.nvrtc`): CUDA C++ source -> cubin / PTX.

Works with cuda-bindings 12.x and 13.x. Both expose the same C-shaped API in which every call
returns a tuple whose first element is an `nvrtcResult` (an `IntEnum` in 12.x, an int-subclass
"FastEnum" in 13.x: we only ever use `int(err)` and `.name`), and output buffers are `char*`
parameters that accept any writable bytes-like object. We pass a fresh `bytearray` so NVRTC never
writes into an immutable (possibly interned) `bytes` object.

Example:
    >>> from attncc.runtime.jit.nvrtc import available, compile_cuda
    >>> src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }'
    >>> if available():
    ...     r = compile_cuda(src, arch="sm_80")
    ...     assert r.cubin[:4] == b"\\x7fELF"
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from attncc.errors import CompileError

# Always on. -default-device: helper functions need no __device__ annotation. No --use_fast_math:
# attncc promises results that match the torch reference, and fast-math changes expf/tanhf/div.
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17", "-default-device")

_ARCH_RE = re.compile(r"^(?:(sm|compute)_?)?(\d{2,3})([af]?)$")


@dataclass(frozen=True)
class NvrtcResult:
    """What one NVRTC compile produced.

    `cubin` is empty when PTX was requested; `ptx` is None when a cubin was requested; `log` is
    NVRTC's program log (warnings, and the ptxas resource report with `verbose=True`); `options`
    are the exact options NVRTC was given.
    """

    cubin: bytes
    ptx: str | None
    log: str
    options: tuple[str, ...]


def _nvrtc() -> Any:
    from cuda.bindings import nvrtc  # imported lazily: the compiler half must import without CUDA

    return nvrtc


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when NVRTC can be loaded and answers a version query (no GPU needed).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    try:
        err, major, _minor = _nvrtc().nvrtcVersion()
        return int(err) == 0 and major is not None
    except Exception:  # ImportError, or the shared library failing to dlopen (RuntimeError/OSError)
        return False


def nvrtc_version() -> tuple[int, int]:
    """The (major, minor) version of the NVRTC library that compiles our kernels.

    Part of every cubin's cache key, so a warm process needs it before its first launch. It is
    remembered in the cache directory with the identity of the library it came from (path, size,
    mtime), and read from there while that file is unchanged: a warm start then loads no NVRTC
    (docs/jit.md, "Warm start").

    Example:
        >>> if available():
        ...     assert nvrtc_version() >= (12, 0)
    """
    global _VERSION
    if _VERSION is None:
        _VERSION = _remembered_version() or loaded_version()
    return _VERSION


_VERSION: tuple[int, int] | None = None
_QUERIED = False  # _VERSION came from the loaded library, not the memo
_MEMO_NAME = "nvrtc-version.json"


def loaded_version() -> tuple[int, int]:
    """Load NVRTC, ask its version (once per process), and remember it with the library's
    identity for later processes; from then on `nvrtc_version()` answers this."""
    global _VERSION, _QUERIED
    if _QUERIED and _VERSION is not None:
        return _VERSION
    _require()
    err, major, minor = _nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    _VERSION, _QUERIED = (int(major), int(minor)), True
    lib = _loaded_library()
    if lib is not None and _remembered_version() != _VERSION:
        with contextlib.suppress(OSError, ImportError):  # (ImportError: nvrtc.py run alone)
            memo = _memo_path()
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"bindings": _bindings_version(), "library": lib,
                                       "version": list(_VERSION)}))
            os.replace(tmp, memo)
    return _VERSION


def _memo_path() -> "os.PathLike[str]":
    from .cache_dir import default_cache_dir

    return default_cache_dir() / _MEMO_NAME


def _bindings_version() -> str:
    import cuda.bindings

    return str(getattr(cuda.bindings, "__version__", "?"))


def _loaded_library() -> list[Any] | None:
    """[path, size, mtime_ns] of the libnvrtc this process mapped (Linux), else None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libnvrtc.so"):
                    st = os.stat(path)
                    return [path, st.st_size, st.st_mtime_ns]
    except (OSError, IndexError):
        pass
    return None


def _remembered_version() -> tuple[int, int] | None:
    """The remembered version while its library file and cuda-bindings are unchanged."""
    try:
        with open(_memo_path()) as f:
            memo = json.load(f)
        path, size, mtime = memo["library"]
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) != (size, mtime) or \
                memo["bindings"] != _bindings_version():
            return None
        return int(memo["version"][0]), int(memo["version"][1])
    except (OSError, ValueError, KeyError, TypeError, IndexError, ImportError):
        return None


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The SM numbers this NVRTC can target, e.g. (..., 80, 86, 89, 90, 100, 120).

    Example:
        >>> if available():
        ...     assert 90 in supported_archs()
    """
    _require()
    err, archs = _nvrtc().nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs")
    return tuple(int(a) for a in archs)


def device_arch() -> str:
    """The architecture of the current CUDA device, as NVRTC spells it ("sm_90a" on Hopper).

    Hopper gets the arch-specific `sm_90a` because our FA3-style kernels use wgmma/TMA, which only
    exist there. Raises CompileError when torch sees no CUDA GPU.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():
        ...     assert device_arch().startswith("sm_")
    """
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # torch missing or its CUDA init failing: same answer, no GPU to ask
        has_gpu = False
    if not has_gpu:
        raise CompileError("arch=None compiles for the current GPU, but torch.cuda sees no CUDA "
                           "device here; pass an explicit arch, e.g. arch='sm_90a' (H100/H200) or "
                           "arch='sm_80' (A100)")
    major, minor = torch.cuda.get_device_capability()
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def normalize_arch(arch: str | None) -> str:
    """Canonical `sm_XY[a|f]` for an arch string; None means the current device.

    Accepts "sm_90a", "sm90a", "90a", "compute_90a" (the virtual arch names the same target).

    Example:
        >>> normalize_arch("90a"), normalize_arch("compute_80"), normalize_arch("sm_100f")
        ('sm_90a', 'sm_80', 'sm_100f')
    """
    if arch is None:
        return device_arch()
    m = _ARCH_RE.match(str(arch).strip().lower())
    if m is None:
        raise CompileError(f"arch={arch!r} is not a GPU architecture; use a string like 'sm_80', "
                           f"'sm_90a' or 'sm_100a'")
    return f"sm_{m.group(2)}{m.group(3)}"


def _version_or_zero() -> tuple[int, int]:
    global _VERSION
    if _VERSION is None:  # read the memo once: nvrtc_version() then answers from _VERSION
        _VERSION = _remembered_version()
        if _VERSION is None and not available():
            return (0, 0)
    return nvrtc_version()


def _require() -> None:
    if not available():
        raise CompileError("NVRTC could not be loaded: install cuda-python's NVRTC, e.g. "
                           "`pip install cuda-bindings nvidia-cuda-nvrtc-cu12` (CUDA 12) or "
                           "`pip install 'cuda-bindings>=13' nvidia-cuda-nvrtc` (CUDA 13)")


def _err_name(err: Any) -> str:
    return getattr(err, "name", None) or f"nvrtcResult({int(err)})"


def _check(err: Any, call: str, log: str = "") -> None:
    if int(err) != 0:
        msg = f"{call} failed with {_err_name(err)}"
        raise CompileError(msg + (f":\n{log}" if log else ""), log=log)


def _read(prog: Any, size_fn: Callable[..., Any], get_fn: Callable[..., Any], what: str) -> bytes:
    """Run a NVRTC size/get pair and return the filled buffer."""
    err, size = size_fn(prog)
    _check(err, f"nvrtcGet{what}Size")
    if not size:
        return b""
    buf = bytearray(size)
    (err,) = get_fn(prog, buf)
    _check(err, f"nvrtcGet{what}")
    return bytes(buf)


def _program_log(prog: Any) -> str:
    nv = _nvrtc()
    raw = _read(prog, nv.nvrtcGetProgramLogSize, nv.nvrtcGetProgramLog, "ProgramLog")
    return raw.rstrip(b"\0").decode("utf-8", errors="replace").strip()


def offending_lines(log: str, source: str, name: str) -> list[tuple[int, str]]:
    """The (line number, text) of every source line NVRTC's log reports an error on, in order.

    Example:
        >>> log = 'k.cu(2): error: identifier "y" is undefined'
        >>> offending_lines(log, "int a;\\nint b = y;", "k.cu")
        [(2, 'int b = y;')]
    """
    src_lines = source.splitlines()
    seen: list[int] = []
    for m in re.finditer(rf"^{re.escape(name)}\((\d+)\): (?:catastrophic )?error", log, re.M):
        n = int(m.group(1))
        if n not in seen and 1 <= n <= len(src_lines):
            seen.append(n)
    return [(n, src_lines[n - 1]) for n in seen]


def _compile_error(err: Any, log: str, source: str, name: str, arch: str,
                   options: Sequence[str]) -> CompileError:
    bad = offending_lines(log, source, name)
    parts = [f"NVRTC could not compile {name} for {arch} ({_err_name(err)}).", "", "NVRTC log:",
             log or "(empty)"]
    if bad:
        parts += ["", "Offending generated source line(s):"]
        parts += [f"  {name}:{n}: {text.strip()}" for n, text in bad[:8]]
    parts += ["", "options: " + " ".join(options), "",
              "If this source came from attncc codegen, it is an attncc bug: please report it with "
              "the file from attncc.export(variant, path, head_dim=..., dtype=...)."]
    exc = CompileError("\n".join(parts), log=log, line=bad[0][1] if bad else None, source=source)
    exc.lineno = bad[0][0] if bad else None  # type: ignore[attr-defined]
    return exc


def build_options(arch: str, *, emit: str = "cubin", options: Sequence[str] = (),
                  include_dirs: Sequence[str] = (), verbose: bool = False) -> tuple[str, ...]:
    """The exact NVRTC option list `compile_cuda` uses (also part of the cache key).

    Example:
        >>> build_options("sm_90a", options=["-lineinfo"])
        ('--gpu-architecture=sm_90a', '-std=c++17', '-default-device', '-lineinfo')
        >>> build_options("sm_90a", emit="ptx")[0]
        '--gpu-architecture=compute_90a'
    """
    if emit not in ("cubin", "ptx"):
        raise ValueError(f"emit={emit!r}: use 'cubin' or 'ptx'")
    arch = normalize_arch(arch)
    # A real arch (sm_XX) makes NVRTC run ptxas and produce a cubin; the virtual compute_XX arch
    # stops at PTX, which is what `emit="ptx"` wants (portable to newer GPUs via the driver JIT).
    target = arch if emit == "cubin" else "compute_" + arch[3:]
    opts = [f"--gpu-architecture={target}", *DEFAULT_OPTIONS]
    opts += [f"--include-path={d}" for d in include_dirs]
    if verbose and emit == "cubin":
        opts.append("--ptxas-options=-v")  # register/smem/spill report lands in the program log
        # NVRTC >= 12.9 reuses cubins from the driver's compute cache (~/.nv/ComputeCache) and
        # then skips ptxas, so the report silently goes missing; verified on 12.9 and 13.0 that
        # --no-cache brings it back and leaves the cubin byte-identical.
        if _version_or_zero() >= (12, 9):
            opts.append("--no-cache")
    opts += [str(o) for o in options]
    return tuple(opts)


def compile_cuda(source: str, *, arch: str | None, name: str = "attncc.cu",
                 options: Sequence[str] = (), include_dirs: Sequence[str] = (),
                 emit: str = "cubin", verbose: bool = False) -> NvrtcResult:
    """Compile self-contained CUDA C++ with NVRTC; raises CompileError with the log on failure.

    `arch` is "sm_80", "sm_90a", ... (None: the current GPU). `emit="ptx"` compiles for the virtual
    `compute_XX` target and returns PTX text instead of a cubin. `verbose=True` adds ptxas's
    resource report to `.log`. The error names the offending source line(s) and NVRTC's log.

    Example:
        >>> src = 'extern "C" __global__ void k(float* x) { x[0] = expf(x[0]); }'
        >>> if available():
        ...     r = compile_cuda(src, arch="sm_90a", verbose=True)
        ...     assert "registers" in r.log and len(r.cubin) > 0
        ...     assert ".entry k" in compile_cuda(src, arch="sm_90a", emit="ptx").ptx
    """
    if "\0" in source:
        raise ValueError("CUDA source contains a NUL character; NVRTC would silently truncate it")
    arch = normalize_arch(arch)
    opts = build_options(arch, emit=emit, options=options, include_dirs=include_dirs,
                         verbose=verbose)
    _require()
    sm = int(_ARCH_RE.match(arch).group(2))  # type: ignore[union-attr]
    if sm not in supported_archs():
        raise CompileError(f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot target {arch}; it "
                           f"supports sm_{', sm_'.join(map(str, supported_archs()))}. Use an "
                           f"NVRTC release that supports {arch}, or one of those archs")
    nv = _nvrtc()
    err, prog = nv.nvrtcCreateProgram(source.encode("utf-8"), name.encode("utf-8"), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        encoded = [o.encode("utf-8") for o in opts]
        (err,) = nv.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(prog)
        if int(err) != 0:
            raise _compile_error(err, log, source, name, arch, opts)
        if emit == "ptx":
            ptx = _read(prog, nv.nvrtcGetPTXSize, nv.nvrtcGetPTX, "PTX")
            result = NvrtcResult(b"", ptx.rstrip(b"\0").decode("utf-8"), log, opts)
        else:
            cubin = _read(prog, nv.nvrtcGetCUBINSize, nv.nvrtcGetCUBIN, "CUBIN")
            if not cubin:
                raise CompileError(f"NVRTC produced no cubin for {arch} (options "
                                   f"{' '.join(opts)})", log=log, source=source)
            result = NvrtcResult(cubin, None, log, opts)
    except BaseException:
        nv.nvrtcDestroyProgram(prog)  # best effort: the original error is the one to report
        raise
    (err,) = nv.nvrtcDestroyProgram(prog)
    _check(err, "nvrtcDestroyProgram")
    return result
