"""Host side of TMA: CUDA tensor maps for kernels/hopper/tma.cuh (Hopper bulk tensor copies).

`tensor_map_2d(t, box_rows, box_cols)` describes a 2-D row-major CUDA tensor `t` (bf16/fp16;
any row stride that is a multiple of 16 bytes) as tiles of `box_rows x box_cols` with the
128-byte swizzle, and returns the 128-byte map in a small uint8 CUDA tensor (64-byte aligned,
as TMA requires) whose address kernels take. `tensor_map_3d` and `tensor_map_4d` do the same
for 3-D and 4-D tensors and boxes (the FA3 batch kernel's GQA query boxes; the dense FA3
kernel's output, [batch, heads, seq, head_dim] with any 16-byte strides). Encoding needs the
CUDA driver (cuda-bindings).

Example:
    >>> import torch
    >>> if torch.cuda.is_available():  # doctest: +SKIP
    ...     k = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    ...     tmap = tensor_map_2d(k, 64, 64)      # pass tmap.data_ptr() to the kernel
"""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np
import torch

from .launcher import _ensure_context, current_raw_stream, driver, driver_check

__all__ = ["tensor_map_2d", "tensor_map_3d", "tensor_map_4d", "encode_map", "MapCache", "MapSlot",
           "SLOT_BYTES"]

_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
           torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}


def tensor_map_2d(t: torch.Tensor, box_rows: int, box_cols: int, swizzle: str = "128B"
                  ) -> torch.Tensor:
    """A CUDA tensor map for the 2-D tensor `t` in boxes of `box_rows x box_cols` elements."""
    if t.dim() != 2:
        raise ValueError(f"tensor_map_2d needs a 2-D tensor, got {tuple(t.shape)}")
    return _encode(t, (box_rows, box_cols), swizzle, "tensor_map_2d")


def tensor_map_3d(t: torch.Tensor, box: tuple[int, int, int], swizzle: str = "128B"
                  ) -> torch.Tensor:
    """A CUDA tensor map for the 3-D tensor `t` in boxes of `box` = (n0, n1, n2) elements
    (outermost first, as `t.shape`).

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     q = torch.randn(1000, 32, 128, device="cuda", dtype=torch.bfloat16)
        ...     tmap = tensor_map_3d(q, (8, 8, 64))  # 8 tokens x 8 heads x 64 columns
    """
    if t.dim() != 3:
        raise ValueError(f"tensor_map_3d needs a 3-D tensor, got {tuple(t.shape)}")
    return _encode(t, box, swizzle, "tensor_map_3d")


def tensor_map_4d(t: torch.Tensor, box: tuple[int, int, int, int], swizzle: str = "128B"
                  ) -> torch.Tensor:
    """A CUDA tensor map for the 4-D tensor `t` in boxes of `box` elements (outermost first).

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     o = torch.empty(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
        ...     tmap = tensor_map_4d(o, (1, 1, 64, 64))  # 64 rows x 64 columns of one head
    """
    if t.dim() != 4:
        raise ValueError(f"tensor_map_4d needs a 4-D tensor, got {tuple(t.shape)}")
    return _encode(t, box, swizzle, "tensor_map_4d")


def _encode(t: torch.Tensor, box: tuple[int, ...], swizzle: str, what: str) -> torch.Tensor:
    """cuTensorMapEncodeTiled for `t` as a 128-byte uint8 tensor on `t`'s device."""
    raw = np.frombuffer(encode_map(t, box, swizzle, what), dtype=np.uint8)
    return torch.from_numpy(raw.copy()).to(t.device)  # 256-byte aligned


def encode_map(t: torch.Tensor, box: tuple[int, ...], swizzle: str = "128B",
               what: str = "encode_map") -> bytes:
    """The 128 bytes of a CUDA tensor map for `t` (innermost dim contiguous, any rank 2..5) in
    boxes of `box` elements (outermost first), as MapCache stores them."""
    if t.device.type != "cuda" or t.dtype not in _DTYPES:
        raise ValueError(f"{what} needs a {len(box)}-D bf16/fp16 CUDA tensor, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    outer = t.stride()[:-1]
    if t.stride(-1) != 1 or any((st * t.element_size()) % 16 for st in outer) or \
            t.data_ptr() % 16:
        raise ValueError(f"{what}: rows must be contiguous, 16-byte aligned and a multiple of "
                         f"16 bytes apart; strides {t.stride()}")
    if swizzle == "128B" and box[-1] * t.element_size() > 128:
        raise ValueError(f"box {box}: with the 128-byte swizzle a box row holds at most 128 bytes "
                         f"({128 // t.element_size()} elements)")
    if any(not 1 <= n <= 256 for n in box):
        raise ValueError(f"box {box}: every box dimension must be 1..256 elements")
    d = driver()
    sw = {"128B": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
          "none": d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE}[swizzle]
    rank = t.dim()
    tmap: Any = driver_check(d.cuTensorMapEncodeTiled(
        getattr(d.CUtensorMapDataType, _DTYPES[t.dtype]), rank, t.data_ptr(),
        [d.cuuint64_t(n) for n in reversed(t.shape)],
        [d.cuuint64_t(st * t.element_size()) for st in reversed(outer)],
        [d.cuuint32_t(n) for n in reversed(box)],
        [d.cuuint32_t(1)] * rank,
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return np.array([int(w) & 0xFFFFFFFFFFFFFFFF for w in tmap.opaque],
                    dtype=np.uint64).tobytes()


SLOT_BYTES = 512   # four maps: the most one launch reads (the dense FA3 kernel's q, k, v, o)
_CHUNK_SLOTS = 64  # slots per device allocation


@dataclass(eq=False)
class MapSlot:
    """One 512-byte home of a launch's maps in device memory (`data_ptr()` is what a kernel's
    `tma` argument takes) and its pinned host twin, the source of the copy that fills it."""
    device_ptr: int
    host_ptr: int
    event: Any = None     # recorded after the last copy from host_ptr (None: none pending)
    stream: int = 0       # the stream of the last launch that read it (0: none yet)
    pinned: bool = False  # used while a CUDA graph was being captured: never reused

    def data_ptr(self) -> int:
        return self.device_ptr


class _Arena:
    """Slots in memory allocated with the driver (cuMemAlloc / cuMemHostAlloc), outside torch's
    caching allocator: a map made while torch records a CUDA graph must not live in the graph's
    private pool, where cudagraph trees require every live tensor to be a graph output
    (docs/compile.md, "CUDA graphs"). Chunks are never freed (a few KiB per device)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.free: list[MapSlot] = []

    def take(self) -> MapSlot:
        if not self.free:
            self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"attncc: every TMA map slot on cuda:{self.device} is held by a captured CUDA "
                f"graph; run the captured function once eagerly before capturing it, or capture "
                f"fewer distinct inputs")
        _ensure_context(self.device)
        d = driver()
        n = _CHUNK_SLOTS * SLOT_BYTES
        dev = int(driver_check(d.cuMemAlloc(n), "cuMemAlloc"))
        host = int(driver_check(d.cuMemHostAlloc(n, 0), "cuMemHostAlloc"))
        self.free.extend(MapSlot(dev + i * SLOT_BYTES, host + i * SLOT_BYTES)
                         for i in reversed(range(_CHUNK_SLOTS)))


def _fill(slot: MapSlot, raw: bytes, stream: int) -> None:
    """Copy `raw` into `slot` on `stream` (stream order makes it visible to the next launch;
    inside a capture the copy becomes a node of the graph, replayed from the pinned twin)."""
    d = driver()
    if slot.event is not None:  # the previous copy out of the host twin must have happened
        driver_check(d.cuEventSynchronize(slot.event), "cuEventSynchronize")
    ctypes.memmove(slot.host_ptr, raw, len(raw))
    s = d.CUstream(stream)
    if slot.stream not in (0, stream):  # a launch on another stream may still read the slot
        done = driver_check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                            "cuEventCreate")
        driver_check(d.cuEventRecord(done, d.CUstream(slot.stream)), "cuEventRecord")
        driver_check(d.cuStreamWaitEvent(s, done, 0), "cuStreamWaitEvent")
        driver_check(d.cuEventDestroy(done), "cuEventDestroy")
    slot.stream = stream
    driver_check(d.cuMemcpyHtoDAsync(d.CUdeviceptr(slot.device_ptr), slot.host_ptr, len(raw), s),
                 "cuMemcpyHtoDAsync")
    if slot.pinned:
        return  # captured: the host twin is never rewritten, so no event is needed
    if slot.event is None:
        slot.event = driver_check(
            d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    driver_check(d.cuEventRecord(slot.event, s), "cuEventRecord")


class MapCache:
    """Device copies of tensor maps by what they encode (addresses, shapes, strides, boxes), the
    least recently used reused past `size` per device: a repeated launch -- and a CUDA graph
    capture after a warm-up launch -- reuses the copy instead of encoding maps again. The copy
    is stream-ordered and from pinned memory, so it never blocks the host, and the slot of a map
    a captured graph reads is never reused (docs/compile.md, "CUDA graphs").

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     c = MapCache(4)
        ...     k = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
        ...     s = c.get(("k", k.data_ptr()), k.device, lambda: encode_map(k, (64, 64)))
        ...     s.data_ptr() == c.get(("k", k.data_ptr()), k.device, lambda: b"").data_ptr()
        True
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._maps: "OrderedDict[Hashable, MapSlot]" = OrderedDict()
        self._arenas: dict[int, _Arena] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, device: torch.device, make: Callable[[], bytes],
            stream: int | None = None) -> MapSlot:
        """The slot holding `make()`'s maps (at most SLOT_BYTES) for `key` on `device`, ready
        for a launch on `stream` (a CUstream handle; default: torch's current stream)."""
        capturing = torch.cuda.is_current_stream_capturing()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if stream is None:
            stream = current_raw_stream(index)
        key = (index, key)
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                self._maps.move_to_end(key)
                hit.pinned = hit.pinned or capturing
                if hit.stream != stream and hit.event is not None and not capturing:
                    # filled on another stream: its copy may not have landed yet (a capture
                    # starts after a device synchronize, and may not wait on outside events)
                    d = driver()
                    driver_check(d.cuStreamWaitEvent(d.CUstream(stream), hit.event, 0),
                                 "cuStreamWaitEvent")
                hit.stream = stream
                return hit
        raw = make()
        if len(raw) > SLOT_BYTES:
            raise ValueError(f"{len(raw)} bytes of tensor maps: a slot holds {SLOT_BYTES}")
        with self._lock:
            slot = self._slot(index)
            slot.pinned = capturing
            _fill(slot, raw, stream)
            self._maps[key] = slot
            return slot

    def _slot(self, index: int) -> MapSlot:
        """A free slot on device `index`: the least recently used unpinned one past `size`."""
        on_device = [(k, s) for k, s in self._maps.items() if k[0] == index and not s.pinned]
        arena = self._arenas.get(index) or self._arenas.setdefault(index, _Arena(index))
        if len(on_device) >= self.size:
            old_key, old = on_device[0]
            del self._maps[old_key]
            return old
        return arena.take()
