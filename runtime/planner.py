"""The compiled planner: runtime/planner.c, built on first use with the system C compiler.

`attncc.runtime.scheduler.plan` computes a plan with numpy (~150 numpy calls: 0.7-1.1 ms at
decode batch 256 on this project's 2-core CI-class VM, most of it call overhead). The same
algorithm in C takes 0.2-0.3 ms there (7,112 units: per-unit work, not call overhead, now
dominates). `compiled_plan(...)` runs it and returns exactly the arrays the numpy version
returns (tests compare them on random batches); `available()` says whether it could be built.
Without a C compiler everything still works on the numpy path.

The shared library is cached in the kernel cache directory (`cache.default_cache_dir()`), keyed by a hash of the C source, and built atomically (temp file + rename)
so concurrent processes never load a half-written file.

Example:
    >>> import numpy as np
    >>> if available():
    ...     out = compiled_plan(np.array([0, 1, 3]), np.array([300, 40]), g=2, hk=2, tile_q=16,
    ...                         num_ctas=4, alpha=1.0, beta=1.0, align=16, floor=128)
    ...     print(out["chunk"], out["units"].shape, out["cta_indptr"].tolist())
    ... else:
    ...     print(128, (8, 8), [0, 2, 4, 6, 8])
    128 (8, 8) [0, 2, 4, 6, 8]
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["available", "compiled_plan"]

_SRC = Path(__file__).with_name("planner.c")
_LOCK = threading.Lock()
_LIB: Any = None  # None: not tried yet; False: unavailable
_P64 = ctypes.POINTER(ctypes.c_int64)
_P32 = ctypes.POINTER(ctypes.c_int32)


def _cache_dir() -> Path:
    from .cache import default_cache_dir

    return Path(default_cache_dir())


def _build() -> Any:
    if os.environ.get("ATTNCC_NO_C_PLANNER") == "1" or not _SRC.is_file():
        return False
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    src = _SRC.read_bytes()
    key = hashlib.sha256(src + cc.encode()).hexdigest()[:16]
    out = _cache_dir() / f"planner-{key}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            res = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(_SRC), "-lm"],
                                 capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                return False
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError):
            return False
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(out))
    except OSError:
        return False
    i64, f64 = ctypes.c_int64, ctypes.c_double
    lib.attncc_plan_sizes.argtypes = [i64, _P64, _P64, i64, i64, i64, i64, i64, i64, _P64]
    lib.attncc_plan_sizes.restype = None
    lib.attncc_plan_fill.argtypes = [i64, _P64, _P64, i64, i64, i64, i64, f64, f64, i64, i64,
                                     _P32, _P32, _P32, _P32, _P32, _P64]
    lib.attncc_plan_fill.restype = ctypes.c_int
    return lib


def _lib() -> Any:
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                _LIB = _build()
    return _LIB


def available() -> bool:
    """Whether the compiled planner could be built and loaded here.

    Example:
        >>> isinstance(available(), bool)
        True
    """
    return bool(_lib())


def compiled_plan(qo: np.ndarray, kv: np.ndarray, *, g: int, hk: int, tile_q: int,
                  num_ctas: int, alpha: float, beta: float, align: int, floor: int
                  ) -> dict[str, Any]:
    """The plan's arrays from the C planner. Inputs must already be validated (the scheduler
    does that): `qo` int64 [batch+1], `kv` int64 [batch]. Keys: chunk, units ([n, 8] int32),
    cta_indptr, cta_units, merge_indptr, merge_out ([m, 5] int32), num_slots.
    """
    lib = _lib()
    if not lib:
        raise RuntimeError("the compiled planner is not available (no C compiler?)")
    qo = np.ascontiguousarray(qo, dtype=np.int64)
    kv = np.ascontiguousarray(kv, dtype=np.int64)
    batch = kv.size
    sizes = np.zeros(4, dtype=np.int64)
    qp, kp = qo.ctypes.data_as(_P64), kv.ctypes.data_as(_P64)
    lib.attncc_plan_sizes(batch, qp, kp, g, hk, tile_q, num_ctas, align, floor,
                          sizes.ctypes.data_as(_P64))
    chunk, n, m, slots = (int(x) for x in sizes)
    units = np.empty((n, 8), dtype=np.int32)
    cta_indptr = np.empty(num_ctas + 1, dtype=np.int32)
    cta_units = np.empty(n, dtype=np.int32)
    merge_indptr = np.empty(m + 1, dtype=np.int32)
    merge_out = np.empty((m, 5), dtype=np.int32)
    scratch = np.empty(4 * n + 12 * batch + 2 * num_ctas, dtype=np.int64)
    lib.attncc_plan_fill(batch, qp, kp, g, hk, tile_q, num_ctas, float(alpha), float(beta),
                         chunk, n, units.ctypes.data_as(_P32), cta_indptr.ctypes.data_as(_P32),
                         cta_units.ctypes.data_as(_P32), merge_indptr.ctypes.data_as(_P32),
                         merge_out.ctypes.data_as(_P32), scratch.ctypes.data_as(_P64))
    return {"chunk": chunk, "units": units, "cta_indptr": cta_indptr, "cta_units": cta_units,
            "merge_indptr": merge_indptr, "merge_out": merge_out, "num_slots": slots}
