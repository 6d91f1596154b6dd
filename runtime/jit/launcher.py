"""Load cubins and launch attncc kernels from Python through the CUDA driver API (cuda-python).

A kernel takes two structs by value: `attncc::AttentionParams` and `VariantParams_<name>`. Both
are packed as bytes from their Python `StructLayout` (attncc.codegen.layout) by a `StructPacker`
(one precompiled `struct.Struct`, one `pack_into` into a buffer allocated once), and
`cuLaunchKernel` gets the address of a pre-built `void*[2]` pointing at the two buffers. That keeps
a launch of a cached kernel to a few microseconds of host time: no per-call allocation, no
cuda-python `(values, types)` marshalling (which also mis-passed a float in an earlier probe).

Modules are cached per (sha256 of the cubin, device): the driver loads a cubin once per context.
Launches go on `torch.cuda.current_stream()`, so they order with torch's work and can be captured
in `torch.cuda.graph` (the driver copies argument bytes at launch time, so the reused buffers are
safe; load the module before capturing -- the first launch outside the graph does that).

Every driver call is checked; failures raise `LaunchError` naming the call and the CUDA error.
Works with cuda-bindings 12 and 13 (`from cuda.bindings import driver` in both).

Example (CPU-only parts):
    >>> from attncc.codegen.layout import struct_layout
    >>> lay = struct_layout("S", [("p", "const void*"), ("n", "int"), ("x", "float"),
    ...                           ("s", "attncc::i64", 2)])
    >>> pk = StructPacker(lay)
    >>> pk.pack({"p": 16, "n": 3, "x": 0.5, "s": [7, 8]}) == lay.pack(
    ...     {"p": 16, "n": 3, "x": 0.5, "s": [7, 8]})
    True
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import struct
import sys
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from attncc.errors import AttnccError

__all__ = ["LaunchError", "StructPacker", "KernelLauncher", "load_kernel", "driver", "driver_check",
           "clear_module_cache"]

_FMT = {"int": "i", "float": "f", "attncc::i64": "q"}
_MISSING = object()
_MAX_STATIC_SMEM = 48 * 1024


class LaunchError(AttnccError, RuntimeError):
    """A CUDA driver call failed while loading or launching a kernel (message names the call)."""


def driver() -> Any:
    from cuda.bindings import driver  # lazily: the compiler half must import without CUDA

    return driver


_PRELOAD: list[threading.Thread] = []


def preload_driver() -> threading.Thread | None:
    """Start importing the CUDA driver bindings on a daemon thread, once per process, when torch
    is a CUDA build and cuda-bindings is installed: importing them takes ~27 ms on the H200 host,
    which a first launch would otherwise wait for (docs/jit.md, "Warm start"). `import attncc`
    calls it; a launch that comes first simply imports them itself. A fork waits for the
    thread, so no child inherits an import lock held by a thread it does not have."""
    torch = sys.modules.get("torch")
    if _PRELOAD or torch is None or getattr(torch.version, "cuda", None) is None:
        return None
    try:
        if importlib.util.find_spec("cuda.bindings") is None:
            return None
    except (ImportError, ValueError):
        return None

    def run() -> None:
        try:
            driver()
        except Exception:  # the first launch imports them again and reports the error
            pass

    t = threading.Thread(target=run, name="attncc-driver-import", daemon=True)
    _PRELOAD.append(t)
    os.register_at_fork(before=t.join)
    t.start()
    return t


def driver_check(result: Any, call: str) -> Any:
    """Unpack a cuda-python driver result `(CUresult, *values)`; raise LaunchError on failure.

    Returns None, the single value, or a tuple of values.

    Example:
        >>> from attncc.runtime.jit.nvrtc import available
        >>> try:
        ...     from cuda.bindings import driver
        ... except ImportError:
        ...     driver = None
        >>> if driver is not None:
        ...     driver_check((driver.CUresult.CUDA_SUCCESS, 5), "cuFake")
        ... else:
        ...     5
        5
    """
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        raise LaunchError(f"{call} failed: {_error_text(err)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


_raw_stream_of: Any = None  # index -> handle, resolved at the first current_raw_stream call


def current_raw_stream(index: int | None) -> int:
    """The CUstream handle of torch's current stream on device `index` (None: the current
    device), without building a `torch.cuda.Stream` (a few microseconds of host time each on
    the eager launch path). The getter is looked up once per process."""
    global _raw_stream_of
    get = _raw_stream_of
    if get is None or index is None:
        import torch

        if index is None:
            index = torch.cuda.current_device()
        if get is None:
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (CUDA builds of torch)
            get = _raw_stream_of = raw if raw is not None else (
                lambda i: torch.cuda.current_stream(i).cuda_stream)
    return int(get(index))


def zero_ints(t: Any, stream: int | None = None) -> None:
    """Zero a contiguous 32-bit tensor: on CUDA a driver memset on `stream` (default: torch's
    current stream; a memset node under graph capture), not torch's fill kernel, whose first
    use in a process loads its module (~6 ms of a warm first call on the H200)."""
    if not t.is_cuda:
        t.zero_()
    elif t.numel():
        if stream is None:
            stream = current_raw_stream(t.device.index)
        driver_check(driver().cuMemsetD32Async(t.data_ptr(), 0, t.numel(), stream),
                     "cuMemsetD32Async")


def _error_text(err: Any) -> str:
    drv = driver()
    name = desc = None
    try:
        e, n = drv.cuGetErrorName(err)
        if int(e) == 0 and n is not None:
            name = n.decode() if isinstance(n, bytes) else str(n)
        e, d = drv.cuGetErrorString(err)
        if int(e) == 0 and d is not None:
            desc = d.decode() if isinstance(d, bytes) else str(d)
    except Exception:  # the error text is best effort; the code itself is always reported
        pass
    code = int(err)
    return f"{name or 'CUDA error'} ({code}){': ' + desc if desc else ''}"


# ------------------------------------------------------------------------------------ packing
class StructPacker:
    """Packs one `StructLayout` into a reusable, fixed-address buffer with a single pack_into.

    `names` is the member order `pack_values` expects (arrays contribute `count` values each).
    `buffer` stays at one address for the packer's lifetime, so a launcher can point a kernel
    argument at it once.

    Example:
        >>> from attncc.codegen.layout import struct_layout
        >>> pk = StructPacker(struct_layout("S", [("n", "int"), ("p", "float*")]))
        >>> pk.fmt, pk.size, pk.names
        ('<i4xQ', 16, ('n', 'p'))
        >>> pk.pack_values((1, 0)).hex()
        '01000000000000000000000000000000'
    """

    def __init__(self, layout: Any) -> None:
        self.layout = layout
        parts = ["<"]
        pos = 0
        names: list[str] = []
        counts: list[int] = []
        for f in sorted(layout.fields, key=lambda f: f.offset):
            if f.offset < pos:
                raise ValueError(f"{layout.name}: member {f.name} overlaps the previous one")
            if f.offset > pos:
                parts.append(f"{f.offset - pos}x")
            code = "Q" if f.ctype.endswith("*") else _FMT.get(f.ctype)
            if code is None:
                raise ValueError(f"{layout.name}::{f.name}: cannot pack C type {f.ctype!r}")
            parts.append(code * f.count if f.count > 1 else code)
            names.append(f.name)
            counts.append(f.count)
            pos = f.offset + f.size
        if layout.size > pos:
            parts.append(f"{layout.size - pos}x")
        self.fmt = "".join(parts)
        self._struct = struct.Struct(self.fmt)
        if self._struct.size != layout.size:
            raise ValueError(f"{layout.name}: packed size {self._struct.size} != layout size "
                             f"{layout.size}")
        self.size = layout.size
        self.names = tuple(names)
        self.counts = tuple(counts)
        self._name_set = frozenset(names)
        ordered = sorted(layout.fields, key=lambda f: f.offset)
        # a one-element array (a 1-d captured tensor's `t_stride[1]`) still takes a sequence
        is_array = [getattr(f, "is_array", f.count != 1) for f in ordered]
        self._members = tuple((f.name, f.count, f.role == "unused", f.ctype.endswith("*"), arr)
                              for f, arr in zip(ordered, is_array))
        self._scalars_only = not any(is_array)
        # ctypes buffer: a stable address the kernel-argument pointer array can hold
        self.buffer = (ctypes.c_char * max(self.size, 1))()
        self.address = ctypes.addressof(self.buffer)

    def flatten(self, values: Mapping[str, Any]) -> tuple:
        """Member values (a mapping, arrays as sequences, None for null pointers) as a flat tuple.

        Example:
            >>> from attncc.codegen.layout import struct_layout
            >>> StructPacker(struct_layout("S", [("s", "attncc::i64", 2), ("p", "int*")])
            ...              ).flatten({"s": [1, 2], "p": None})
            (1, 2, 0)
        """
        if self._scalars_only and len(values) == len(self.names):
            try:  # hot path (AttentionParams): every member given, no arrays
                return tuple([0 if v is None else v for v in map(values.__getitem__, self.names)])
            except KeyError:
                pass  # an unknown key: the slow path names it
        unknown = set(values) - self._name_set
        if unknown:
            raise KeyError(f"{self.layout.name} has no member(s) {', '.join(sorted(unknown))}")
        flat: list[Any] = []
        for name, count, unused, is_ptr, is_array in self._members:
            v = values.get(name, _MISSING)
            if v is _MISSING:
                if unused:
                    flat.extend([0] * count)
                    continue
                raise KeyError(f"no value given for {self.layout.name}::{name}")
            if not is_array:
                flat.append(0 if (v is None and is_ptr) else v)
                continue
            items = list(v)
            if len(items) != count:
                raise ValueError(f"{self.layout.name}::{name} holds {count} value(s), got "
                                 f"{len(items)}")
            flat.extend(0 if (x is None and is_ptr) else x for x in items)
        return tuple(flat)

    def pack_values(self, flat: Sequence[Any]) -> bytes:
        """Pack a flat tuple (see `names`/`flatten`) into `buffer`; returns the bytes too."""
        self._struct.pack_into(self.buffer, 0, *flat)
        return self.buffer.raw[: self.size]

    def pack_values_fast(self, flat: Sequence[Any]) -> None:
        """Pack a flat tuple into `buffer` without copying it out (the launch hot path)."""
        self._struct.pack_into(self.buffer, 0, *flat)

    def pack(self, values: Mapping[str, Any]) -> bytes:
        """Pack a mapping of member values; returns the struct's bytes."""
        return self.pack_values(self.flatten(values))


# ------------------------------------------------------------------------------------ modules
@dataclass
class _Module:
    module: Any
    device: int


_MODULES: dict[tuple[str, int], _Module] = {}
_MODULES_LOCK = threading.Lock()


def _ensure_context(device: int) -> None:
    """Make `device`'s primary context (the one torch uses) current on this thread."""
    drv = driver()
    import torch

    torch.cuda.init()
    if torch.cuda.current_device() != device:
        torch.cuda.set_device(device)
    ctx = driver_check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0:
        cur = driver_check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
        if int(cur) == device:
            return
    dev = driver_check(drv.cuDeviceGet(device), "cuDeviceGet")
    pctx = driver_check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    driver_check(drv.cuCtxSetCurrent(pctx), "cuCtxSetCurrent")


def _load_module(cubin: bytes, device: int) -> _Module:
    key = (hashlib.sha256(cubin).hexdigest(), device)
    with _MODULES_LOCK:
        mod = _MODULES.get(key)
        if mod is None:
            _ensure_context(device)
            drv = driver()
            handle = driver_check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
            mod = _MODULES[key] = _Module(handle, device)
        return mod


def clear_module_cache() -> None:
    """Unload every module this process loaded (kernels launched earlier must have finished)."""
    drv = driver()
    with _MODULES_LOCK:
        for mod in _MODULES.values():
            try:
                _ensure_context(mod.device)
                driver_check(drv.cuModuleUnload(mod.module), "cuModuleUnload")
            except LaunchError:
                pass
        _MODULES.clear()


class KernelLauncher:
    """One loaded kernel function plus its pre-built argument buffers.

    `launch(grid, block, smem, ap_flat, vp_flat, stream=None)` packs the two flat tuples (see
    `StructPacker.flatten`) and launches on `stream` (an int CUstream handle; None = torch's
    current stream for the device). A kernel with one argument struct has `params_layout=None`
    (`vp` is then None and `vp_flat` is ignored). A backward kernel has a third struct,
    `grads_layout` (VariantGrads_<name>), packed from `gp_flat`. Thread-safe: packing and launching happen under
    a lock, since the argument buffers are shared (the driver copies them during
    cuLaunchKernel).
    """

    def __init__(self, cubin: bytes, kernel_name: str, attention_layout: Any, params_layout: Any,
                 *, device: int = 0, dynamic_smem: int = 0, grads_layout: Any = None) -> None:
        drv = driver()
        self.kernel_name = kernel_name
        self.device = device
        self._module = _load_module(cubin, device)
        self.function = driver_check(
            drv.cuModuleGetFunction(self._module.module, kernel_name.encode()),
            f"cuModuleGetFunction({kernel_name})")
        self.max_threads = int(driver_check(drv.cuFuncGetAttribute(
            drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.function),
            "cuFuncGetAttribute(MAX_THREADS_PER_BLOCK)"))
        self.num_regs = int(driver_check(drv.cuFuncGetAttribute(
            drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, self.function),
            "cuFuncGetAttribute(NUM_REGS)"))
        self.local_bytes = int(driver_check(drv.cuFuncGetAttribute(
            drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, self.function),
            "cuFuncGetAttribute(LOCAL_SIZE_BYTES)"))
        self.dynamic_smem = 0
        if dynamic_smem:
            self.set_dynamic_smem(dynamic_smem)
        self.ap = StructPacker(attention_layout)
        # a kernel of one argument struct (the merge-state kernel) has no VariantParams
        self.vp = StructPacker(params_layout) if params_layout is not None else None
        addrs = (self.ap.address,) if self.vp is None else (self.ap.address, self.vp.address)
        # a backward kernel's third argument (kernels/fa2/fa2_backward.cuh)
        self.gp = StructPacker(grads_layout) if grads_layout is not None else None
        if self.gp is not None:
            addrs += (self.gp.address,)
        self._args = (ctypes.c_void_p * len(addrs))(*addrs)
        self._args_addr = ctypes.addressof(self._args)
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}
        self._ex_configs: dict[tuple, Any] = {}
        self._pdl: bool | None = None

    def set_dynamic_smem(self, nbytes: int) -> None:
        """Allow `nbytes` of dynamic shared memory (the opt-in above 48 KB)."""
        if nbytes <= self.dynamic_smem:
            return
        drv = driver()
        if nbytes > _MAX_STATIC_SMEM:
            _ensure_context(self.device)
            optin = int(driver_check(drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                self.device), "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)"))
            if nbytes > optin:
                raise LaunchError(f"{self.kernel_name} needs {nbytes} bytes of shared memory but "
                                  f"device {self.device} allows {optin} per block; choose "
                                  f"smaller tiles (kernel_options BLOCK_M / BLOCK_N / "
                                  f"num_stages)")
        driver_check(drv.cuFuncSetAttribute(
            self.function,
            drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
            f"cuFuncSetAttribute({self.kernel_name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes})")
        self.dynamic_smem = nbytes

    def _stream(self, handle: int) -> Any:
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = driver().CUstream(handle)
        return s

    def _ex_config(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                   stream: int, pdl: bool, cluster: int) -> Any:
        """A cached CUlaunchConfig with the programmatic stream-serialization attribute (`pdl`)
        and / or a cluster dimension (`cluster` CTAs along x, when above 1)."""
        key = (tuple(grid), tuple(block), smem, stream, pdl, cluster)
        cfg = self._ex_configs.get(key)
        if cfg is None:
            drv = driver()
            attrs = []
            if pdl:
                attr = drv.CUlaunchAttribute()
                attr.id = (drv.CUlaunchAttributeID
                           .CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
                attr.value.programmaticStreamSerializationAllowed = 1
                attrs.append(attr)
            if cluster > 1:
                attr = drv.CUlaunchAttribute()
                attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y = cluster, 1
                attr.value.clusterDim.z = 1
                attrs.append(attr)
            cfg = drv.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
            cfg.sharedMemBytes = smem
            cfg.hStream = self._stream(stream)
            cfg.attrs = attrs
            cfg.numAttrs = len(attrs)
            self._ex_configs[key] = cfg
        return cfg

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
               ap_flat: Sequence[Any], vp_flat: Sequence[Any], stream: int | None = None,
               pdl: bool = False, cluster: int = 1, gp_flat: Sequence[Any] | None = None) -> None:
        """Pack both argument structs and launch. `stream`: CUstream handle (None: torch's).

        `pdl=True` launches with programmatic stream serialization (sm_90+; ignored below): the
        kernel may start before the previous kernel in the stream finished, once that kernel's
        CTAs all ran `griddepcontrol.launch_dependents`, and must itself run
        `griddepcontrol.wait` before it reads what that kernel wrote (kernels/common/batch_params.cuh
        wait_for_primary). Captured into a CUDA graph, it becomes a programmatic edge.
        `cluster` > 1 launches clusters of that many consecutive CTAs along x (sm_90; the grid's
        x must be a multiple of it), which run together and share shared memory.
        """
        if stream is None:
            stream = current_raw_stream(self.device)
        if smem > self.dynamic_smem:
            self.set_dynamic_smem(smem)
        pdl = pdl and self._supports_pdl()
        with self._lock:
            self.ap.pack_values_fast(ap_flat)
            if self.vp is not None:
                self.vp.pack_values_fast(vp_flat)
            if self.gp is not None:
                if gp_flat is None:
                    raise LaunchError(f"{self.kernel_name} takes a VariantGrads struct: pass "
                                      f"gp_flat")
                self.gp.pack_values_fast(gp_flat)
            if pdl or cluster > 1:
                cfg = self._ex_config(grid, block, smem, stream, pdl, cluster)
                err, = driver().cuLaunchKernelEx(cfg, self.function, self._args_addr, 0)
            else:
                err, = driver().cuLaunchKernel(self.function, grid[0], grid[1], grid[2],
                                               block[0], block[1], block[2], smem,
                                               self._stream(stream), self._args_addr, 0)
        if int(err) != 0:
            call = "cuLaunchKernelEx" if pdl or cluster > 1 else "cuLaunchKernel"
            raise LaunchError(f"{call}({self.kernel_name}, grid={tuple(grid)}, "
                              f"block={tuple(block)}, cluster={cluster}, smem={smem}) failed: "
                              f"{_error_text(err)}")

    def _supports_pdl(self) -> bool:
        """Programmatic dependent launch needs compute capability 9.0 (checked once)."""
        if self._pdl is None:
            drv = driver()
            major = int(driver_check(drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device),
                "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)"))
            self._pdl = major >= 9
        return self._pdl


def load_kernel(cubin: bytes, kernel_name: str, attention_layout: Any, params_layout: Any, *,
                device: int = 0, dynamic_smem: int = 0,
                grads_layout: Any = None) -> KernelLauncher:
    """A `KernelLauncher` for `kernel_name` in `cubin` on `device` (module loaded once per device).

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     kl = load_kernel(ck.cubin, ck.kernel_name, ck.attention_params_layout,
        ...                      ck.params_layout)
    """
    return KernelLauncher(cubin, kernel_name, attention_layout, params_layout, device=device,
                          dynamic_smem=dynamic_smem, grads_layout=grads_layout)
