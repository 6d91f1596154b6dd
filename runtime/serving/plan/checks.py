"""The checks of a serving batch, shared by `BatchAttention.plan` and the fp64
`batch_attention_reference` (one function, so the GPU and CPU paths accept and reject the same
batches): `check_batch` returns the checked `CheckedBatch` or raises naming the argument.

Example:
    >>> b = check_batch([0, 1, 3], [0, 1, 2], [1, 0], [10, 16], kv_layout="NHD",
    ...                 num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    >>> b.kv_lens.tolist(), b.max_page
    ([10, 16], 2)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attncc.errors import InvalidArgument, check_int

from ...jit.tiles import HEAD_DIMS
from .format import as_indptr
from .scheduler import paged_kv_lens

__all__ = ["CheckedBatch", "KV_LAYOUTS", "RAGGED_PAGE", "check_batch", "check_ragged_table",
           "int_array", "np_int", "page_shift"]

KV_LAYOUTS = ("NHD", "HND", "ragged")
RAGGED_PAGE = 1 << 30  # a ragged request is one "page" this long (see batch_params.cuh)


def int_array(x: Any, name: str) -> np.ndarray:
    """`x` (tensor, array, list) as a 1-D numpy array of integers of its own dtype (no copy
    where numpy need not make one); a ValueError naming `name` if it is not 1-D integers (an
    empty array of any dtype passes)."""
    if type(x) is not np.ndarray:  # (the cheap test first: plan() runs every step)
        if isinstance(x, torch.Tensor):
            x = x.detach().to("cpu").numpy()
        x = np.asarray(x)
    if x.ndim != 1 or (x.size and x.dtype.kind not in "iu"
                       and not np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {x.shape} dtype "
                         f"{x.dtype}")
    return x


def np_int(x: Any, name: str, copy: bool = True) -> np.ndarray:
    """`int_array(x, name)` as int64, a copy unless `copy=False`."""
    return int_array(x, name).astype(np.int64, copy=copy)


def page_shift(page_size: int) -> int:
    """log2(page_size) for the kernel's page arithmetic, -1 when not a power of two."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


@dataclass(slots=True)
class CheckedBatch:
    """A checked batch: what `BatchAttention.plan` schedules and stages."""

    qo: np.ndarray              # int64 [batch+1] query CSR (a copy: the instance keeps it)
    kv_lens: np.ndarray         # int64 [batch]
    page_indptr: np.ndarray     # [batch+1] CSR of `pages` (any integer dtype)
    pages: np.ndarray           # page ids (ragged: each request's first KV token)
    page: int                   # tokens per page (ragged: RAGGED_PAGE)
    shift: int                  # log2(page), -1 when not a power of two
    max_page: int               # pages (ragged: tokens) the KV cache must hold
    max_q_len: int              # the longest request's query tokens
    qpos: np.ndarray | None = None
    kvoff: np.ndarray | None = None


def check_batch(qo_indptr: Any, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, *,
                kv_layout: str, num_qo_heads: Any, num_kv_heads: Any, head_dim: Any,
                page_size: Any, q_positions: Any = None, kv_position_offset: Any = None,
                max_batch: int | None = None, max_qo_tokens: int | None = None,
                max_pages: int | None = None, head_dims: tuple[int, ...] | None = HEAD_DIMS
                ) -> CheckedBatch:
    """The checks of `BatchAttention.plan` and `batch_attention_reference` (one function, so
    the GPU and CPU paths accept and reject the same batches): the first failure raises a
    ValueError (TypeError for a non-int size) naming the argument and what to fix. The maxima
    and `head_dims` (what the kernels take) are left out (None) by the reference.

    Example:
        >>> check_batch([0, 1], [0, 1], [-1], [4], kv_layout="NHD", num_qo_heads=4,
        ...             num_kv_heads=2, head_dim=64, page_size=16)
        Traceback (most recent call last):
        ...
        attncc.errors.InvalidArgument: kv_indices holds a negative page id (-1)
    """
    num_qo_heads = check_int("num_qo_heads", num_qo_heads, 1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
    head_dim = check_int("head_dim", head_dim, 1)
    if kv_layout not in KV_LAYOUTS:
        raise InvalidArgument(f"kv_layout={kv_layout!r}: use one of {KV_LAYOUTS}")
    qo = np_int(qo_indptr, "qo_indptr")
    kvp = np_int(kv_indptr, "kv_indptr")
    as_indptr(qo, "qo_indptr")  # the scheduler's messages: one wording
    as_indptr(kvp, "kv_indptr")
    batch = qo.size - 1
    if kvp.size != batch + 1:
        raise InvalidArgument(f"kv_indptr has {kvp.size} entries, qo_indptr describes {batch} "
                              f"requests: it needs {batch + 1}")
    if (max_batch is not None and batch > max_batch) or \
            (max_qo_tokens is not None and int(qo[-1]) > max_qo_tokens):
        raise InvalidArgument(f"batch of {batch} requests / {int(qo[-1])} query tokens exceeds "
                              f"max_batch={max_batch} / max_qo_tokens={max_qo_tokens} given to "
                              f"BatchAttention")
    if num_qo_heads % num_kv_heads:
        raise InvalidArgument(f"num_qo_heads={num_qo_heads} must be a multiple of "
                              f"num_kv_heads={num_kv_heads}")
    if head_dims is not None and head_dim not in head_dims:
        raise InvalidArgument(f"head_dim={head_dim}: the batch kernel supports {head_dims}")
    if kv_layout == "ragged":
        if kv_indices is not None or kv_last_page_len is not None:
            raise InvalidArgument("kv_layout='ragged' takes no kv_indices / kv_last_page_len: "
                                  "kv_indptr is the CSR of KV tokens")
        if max_pages is not None:
            check_ragged_table(batch, max_pages)
        kv_lens = np.diff(kvp)
        pages = kvp[:-1]                      # one "page" per request: its first token
        page_indptr = np.arange(batch + 1)
        page, shift = RAGGED_PAGE, 30
        max_page = int(kvp[-1])                # tokens the cache must hold
    else:
        if kv_indices is None or kv_last_page_len is None:
            raise InvalidArgument(f"kv_layout={kv_layout!r} needs kv_indices and "
                                  f"kv_last_page_len")
        page_size = check_int("page_size", page_size, 1, "pass the tokens per page")
        pages = np_int(kv_indices, "kv_indices")
        last = np_int(kv_last_page_len, "kv_last_page_len")
        if pages.size < kvp[-1]:
            raise InvalidArgument(f"kv_indices has {pages.size} entries but kv_indptr[-1] = "
                                  f"{int(kvp[-1])}")
        if max_pages is not None and pages.size > max_pages:
            raise InvalidArgument(f"{pages.size} page ids exceed max_pages={max_pages}")
        if pages.size and pages.min() < 0:
            raise InvalidArgument(f"kv_indices holds a negative page id ({int(pages.min())})")
        kv_lens = paged_kv_lens(kvp, last, page_size).astype(np.int64)
        page_indptr = kvp
        page, shift = page_size, page_shift(page_size)
        used = pages[:int(kvp[-1])]
        max_page = int(used.max()) + 1 if used.size else 0   # pages the cache needs
    q_lens = np.diff(qo)
    qpos = kvoff = None
    if q_positions is not None:
        qpos = np_int(q_positions, "q_positions")
        if qpos.size != int(qo[-1]) or (qpos.size and qpos.min() < 0):
            raise InvalidArgument(f"q_positions must hold {int(qo[-1])} non-negative positions "
                                  f"(one per query token), got {qpos.size}")
    if kv_position_offset is not None:
        kvoff = np_int(kv_position_offset, "kv_position_offset")
        if kvoff.size != batch or (kvoff.size and kvoff.min() < 0):
            raise InvalidArgument(f"kv_position_offset must hold {batch} non-negative offsets")
    if qpos is None and np.any(q_lens > kv_lens):
        i = int(np.argmax(q_lens > kv_lens))
        raise InvalidArgument(f"request {i} has {int(q_lens[i])} query tokens but only "
                              f"{int(kv_lens[i])} KV tokens: queries are the last tokens of "
                              f"their sequence, so the KV cache must already hold them")
    return CheckedBatch(qo, kv_lens, page_indptr, pages, page, shift, max_page,
                        int(q_lens.max(initial=0)), qpos, kvoff)


def check_ragged_table(requests: int, max_pages: int) -> None:
    """A ragged batch's page table holds one entry per request (its first KV token)."""
    if requests > max_pages:
        raise ValueError(f"a ragged batch takes one page-table entry per request: {requests} "
                         f"requests exceed max_pages={max_pages}; construct "
                         f"BatchAttention(max_pages=...) with room for them")
