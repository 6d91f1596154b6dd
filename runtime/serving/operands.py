"""run()'s checks of its tensors against the plan: the KV cache's views and strides, q, and the
optional out / lse, each raising a ValueError that names the argument before any launch
(docs/serving.md#plan--run for the layouts).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from attncc.errors import InvalidArgument, check_int

from ..jit.tiles import padded_head_dim

__all__ = ["HeadDims", "PlannedShape", "cache_views", "check_kv_dtype", "check_lse", "check_out",
           "check_q", "plan_head_dims"]


class HeadDims(NamedTuple):
    """A plan's head dims: query/key, value, and the kernels' width (their padded width when
    either is not it; attncc.codegen.tiles.padded_head_dim)."""

    qk: int
    vo: int
    width: int

    @property
    def padded(self) -> bool:
        return (self.qk, self.vo) != (self.width, self.width)


def plan_head_dims(head_dim: Any, head_dim_qk: Any = None, head_dim_vo: Any = None) -> HeadDims:
    """plan()'s head dims from `head_dim` or FlashInfer's `head_dim_qk` (one of them), and
    `head_dim_vo` (default: the same): multiples of 8 from 32 to 256, checked here.

    Example:
        >>> plan_head_dims(128), plan_head_dims(None, 192, 128).width
        (HeadDims(qk=128, vo=128, width=128), 256)
        >>> plan_head_dims(96, head_dim_vo=64).padded
        True
        >>> plan_head_dims(128, 64)
        Traceback (most recent call last):
        ...
        attncc.errors.InvalidArgument: head_dim=128 and head_dim_qk=64 disagree: pass one of them (FlashInfer's head_dim_qk is attncc's head_dim)
    """
    if head_dim is None and head_dim_qk is None:
        raise InvalidArgument("plan() needs head_dim (or FlashInfer's name for it, head_dim_qk)")
    if head_dim is not None and head_dim_qk is not None and head_dim != head_dim_qk:
        raise InvalidArgument(f"head_dim={head_dim} and head_dim_qk={head_dim_qk} disagree: pass "
                              f"one of them (FlashInfer's head_dim_qk is attncc's head_dim)")
    name = "head_dim" if head_dim is not None else "head_dim_qk"
    qk = check_int(name, head_dim if head_dim is not None else head_dim_qk, 1)
    vo = qk if head_dim_vo is None else check_int("head_dim_vo", head_dim_vo, 1)
    try:
        width, _ = padded_head_dim(qk, vo, (name, "head_dim_vo"))
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    return HeadDims(qk, vo, width)


class PlannedShape:
    """What the current plan fixes about run()'s tensors: the layout, the heads and head dim,
    the page size, and the page rows (or ragged tokens) every page id and token must fit."""

    __slots__ = ("kv_layout", "device", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                 "max_page", "head_dim_vo")

    def __init__(self, kv_layout: str, device: torch.device, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, max_page: int,
                 head_dim_vo: int | None = None) -> None:
        self.kv_layout, self.device = kv_layout, device
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size, self.max_page = page_size, max_page
        self.head_dim_vo = head_dim if head_dim_vo is None else head_dim_vo


def _split_cache(kv_cache: Any, ragged: bool) -> tuple[Any, Any]:
    """(k, v) of `kv_cache`: a (k, v) pair, or (paged layouts) one [num_pages, 2, ...] tensor."""
    if isinstance(kv_cache, torch.Tensor) and not ragged:
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache as one tensor must be [num_pages, 2, ...] (k and v); "
                             f"got {tuple(kv_cache.shape)}")
        return kv_cache[:, 0], kv_cache[:, 1]
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        return kv_cache[0], kv_cache[1]
    raise ValueError("kv_cache must be (k_cache, v_cache) or a [num_pages, 2, ...] tensor")


def _check_cache_tensor(name: str, t: Any, s: PlannedShape) -> None:
    """`name` ("k_cache" / "v_cache") holds every page id and token of the plan, with a
    contiguous, 16-byte aligned head dim (the value head dim in v_cache)."""
    if not isinstance(t, torch.Tensor) or t.device != s.device:
        raise ValueError(f"{name} must be a tensor on {s.device}")
    Hkv, D = s.num_kv_heads, s.head_dim_vo if name == "v_cache" else s.head_dim
    if s.kv_layout == "ragged":
        want = (s.max_page, Hkv, D)
        ok = t.dim() == 3 and t.shape[0] >= want[0] and t.shape[1:] == want[1:]
    else:
        pg = s.page_size
        want = ((s.max_page, pg, Hkv, D) if s.kv_layout == "NHD" else (s.max_page, Hkv, pg, D))
        ok = t.dim() == 4 and t.shape[0] >= want[0] and t.shape[1:] == want[1:]
    if not ok:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; the plan needs "
                         f"{'[>=' + str(want[0]) + ', ' + ', '.join(map(str, want[1:]))}]"
                         f" ({s.kv_layout} layout; every page id and token must fit)")
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st % 8 for st in t.stride()[:-1]):
        raise ValueError(f"{name} needs a contiguous, 16-byte aligned head dim")


def cache_views(kv_cache: Any, s: PlannedShape) -> tuple[torch.Tensor, torch.Tensor,
                                                          tuple[int, int, int]]:
    """(k, v, (stride_page, stride_slot, stride_head)) in elements -- in head rows when the
    value head dim is not the key's (the kernels then scale them by each); checks the shapes.

    Example:
        >>> s = PlannedShape("NHD", torch.device("cpu"), 4, 2, 64, 16, 3)
        >>> k = torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16)
        >>> cache_views((k, k.clone()), s)[2]
        (2048, 128, 64)
        >>> cache_views((k[:2], k), s)
        Traceback (most recent call last):
        ValueError: k_cache has shape (2, 16, 2, 64); the plan needs [>=3, 16, 2, 64] (NHD layout; every page id and token must fit)
    """
    k, v = _split_cache(kv_cache, s.kv_layout == "ragged")
    for name, t in (("k_cache", k), ("v_cache", v)):
        _check_cache_tensor(name, t, s)
    dk, dv = s.head_dim, s.head_dim_vo
    if dk == dv and k.stride() != v.stride():
        raise ValueError(f"k_cache and v_cache must have the same strides; got {k.stride()} "
                         f"and {v.stride()}")
    # Dv != Dqk: the kernels step through both caches in head rows (fa2_batch.cuh BatchWork)
    rows = [st // dk for st in k.stride()[:-1]]
    if dk != dv and (any(st % dk for st in k.stride()[:-1])
                     or list(v.stride()[:-1]) != [r * dv for r in rows]):
        raise ValueError(f"k_cache and v_cache must have the same strides in rows of their head "
                         f"dims ({dk} and {dv}), e.g. both contiguous; got {k.stride()} and "
                         f"{v.stride()}")
    if s.kv_layout == "ragged":
        strides = (k.stride(0), k.stride(0), k.stride(1))
    elif s.kv_layout == "NHD":
        strides = (k.stride(0), k.stride(1), k.stride(2))
    else:
        strides = (k.stride(0), k.stride(2), k.stride(1))
    if dk != dv:  # in head rows: K's offsets are rows * Dqk, V's rows * Dv
        strides = (strides[0] // dk, strides[1] // dk, strides[2] // dk)
    return k, v, strides


def check_q(q: Any, total_q: int, s: PlannedShape) -> None:
    """q is a bf16/fp16 tensor on the plan's device with at least the plan's `total_q` rows,
    the plan's heads and head dim, and a contiguous, 16-byte aligned head dim."""
    H, D = s.num_qo_heads, s.head_dim
    if (not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] < total_q
            or q.shape[1:] != (H, D) or q.device != s.device
            or q.dtype not in (torch.bfloat16, torch.float16) or q.stride(2) != 1
            or q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8):
        raise ValueError(f"q must be a bf16/fp16 CUDA tensor [{total_q}, {H}, {D}] (the "
                         f"planned batch; more rows are allowed) with a contiguous, 16-byte "
                         f"aligned head dim; got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q)}")


def check_kv_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv8: torch.dtype | None = None) -> None:
    """The cache holds q's dtype (the kernels read both as one element type), or the fp8
    dtype `kv8` the plan named (plan(kv_data_type=...)), with 16-byte aligned rows."""
    want = kv8 if kv8 is not None else q.dtype
    if k.dtype != want or v.dtype != want:
        bad = k.dtype if k.dtype != want else v.dtype
        if kv8 is None:
            raise ValueError(f"kv_cache dtype {bad} != q dtype {q.dtype} (an fp8 cache: "
                             f"plan(..., kv_data_type={bad}))")
        raise ValueError(f"kv_cache dtype {bad} != the plan's kv_data_type {kv8}")
    if kv8 is not None and any(st % 16 for st in (*k.stride()[:-1], *v.stride()[:-1])):
        raise ValueError(f"an fp8 kv_cache needs rows 16-byte aligned: strides that are "
                         f"multiples of 16 elements; got {k.stride()} and {v.stride()}")


def check_out(out: torch.Tensor | None, q: torch.Tensor, head_dim_vo: int | None = None
              ) -> torch.Tensor:
    """`out`, or a new contiguous tensor like q when None, with `head_dim_vo` columns (None:
    q's); a given one has that shape and q's dtype and a contiguous head dim."""
    shape = (*q.shape[:2], q.shape[2] if head_dim_vo is None else head_dim_vo)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if out.shape != shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be a {shape} {q.dtype} tensor")
    return out


def check_lse(lse: torch.Tensor | None, want: bool, q: torch.Tensor,
              device: torch.device) -> torch.Tensor | None:
    """`lse` (made when `want` and not given): a (q rows, heads) float32 tensor with unit head
    stride; None when neither asked for nor given."""
    if want and lse is None:
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=device)
    if lse is not None and (lse.shape != (q.shape[0], q.shape[1])
                            or lse.dtype != torch.float32 or lse.stride(1) != 1):
        raise ValueError(f"lse must be a ({q.shape[0]}, {q.shape[1]}) float32 tensor")
    return lse
