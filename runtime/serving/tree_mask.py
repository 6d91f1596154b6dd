"""Multi-token decode tree masks: FlashInfer's `custom_mask` / `packed_custom_mask` checked and
turned into the batch kernel's rows, and the device table the kernel reads them from
(docs/serving.md, "Multi-token decode and tree masks").

The user's form is FlashInfer's: request i's mask is its `[q_len_i, kv_len_i]` boolean matrix,
row-major, flattened and concatenated over the batch (`custom_mask`), or each request's
flattened matrix bit-packed on its own with `bitorder="little"` -- bit b of byte k is element
8 k + b -- and the requests' bytes concatenated (`packed_custom_mask`, what
`flashinfer.quantization.segment_packbits` makes). True keeps the key.

The kernel's form is a tree: the keys before the request's last `q_len` (its KV cache before the
step) are all kept, and among the last `q_len` keys (the step's own tokens) query t keeps key j
where bit j of row word t is set. So a mask is accepted when every request has at most
`TREE_MAX_Q` query tokens and its prefix columns are all True; anything else raises, naming the
argument (a general mask belongs in the variant's mask_mod).

Example (two requests: a chain of 3 draft tokens after 5 cached keys, one token after 2):
    >>> import numpy as np
    >>> chain = np.tril(np.ones((3, 3), bool))
    >>> m = np.concatenate([np.hstack([np.ones((3, 5), bool), chain]).ravel(),
    ...                     np.ones(3, bool)])
    >>> rows = tree_rows(m, None, np.array([0, 3, 4]), np.array([8, 3]))
    >>> rows[0, :4].tolist(), rows[1, :2].tolist()
    ([1, 3, 7, 0], [1, 0])
    >>> packed = np.concatenate([np.packbits(m[:24], bitorder="little"),
    ...                          np.packbits(m[24:], bitorder="little")])
    >>> bool((tree_rows(None, packed, np.array([0, 3, 4]), np.array([8, 3])) == rows).all())
    True
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attncc.errors import InvalidArgument

__all__ = ["TREE_MAX_Q", "TreeTable", "tree_rows"]

TREE_MAX_Q = 16
"""Query tokens per request a tree mask may cover: one int32 word per query row, bit j for the
step's key j (kernels/common/batch_params.cuh, `tree_mask`)."""


def _as_numpy(x: Any, name: str) -> np.ndarray:
    """`x` (tensor on any device, array, list) as a 1-D numpy array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu").numpy()
    x = np.asarray(x)
    if x.ndim != 1:
        raise InvalidArgument(f"{name} must be 1-D (the requests' masks flattened and "
                              f"concatenated, FlashInfer's layout), got shape {x.shape}")
    return x


class _Mask:
    """A checked mask in either form: each request's first bit, a bit lookup, and the prefix
    check. The packed form is never unpacked (a batch of 128 x 8 tokens x 32K keys is 4 MB
    of bytes, 32 M bits)."""

    def __init__(self, custom_mask: Any, packed_custom_mask: Any, cells: np.ndarray) -> None:
        self.packed = packed_custom_mask is not None
        self.name = "packed_custom_mask" if self.packed else "custom_mask"
        if not self.packed:
            m = _as_numpy(custom_mask, "custom_mask")
            if m.dtype != np.bool_:
                raise InvalidArgument(f"custom_mask must be a bool tensor (True keeps the "
                                      f"key), got {m.dtype}")
            need, size, unit = int(cells.sum()), m.size, ""
            self.starts = np.concatenate([[0], np.cumsum(cells)[:-1]]).astype(np.int64)
        else:
            m = _as_numpy(packed_custom_mask, "packed_custom_mask")
            if m.dtype != np.uint8:
                raise InvalidArgument(f"packed_custom_mask must be uint8 (bits packed with "
                                      f"bitorder='little'), got {m.dtype}")
            nbytes = (cells + 7) // 8
            need, size, unit = int(nbytes.sum()), m.size, " bytes"
            self.starts = 8 * np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
        if size != need:
            raise InvalidArgument(f"{self.name} has {size}{unit}; this batch needs {need}{unit}:"
                                  f" each request's [q_len, kv_len] mask, row-major"
                                  f"{', packed per request' if unit else ''}, concatenated")
        self.m = m

    def bits(self, pos: np.ndarray) -> np.ndarray:
        """The mask's bits at flat positions `pos` (bool, pos's shape)."""
        if not self.packed:
            return self.m[pos]
        return ((self.m[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1).astype(bool)

    def ranges_all_set(self, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Whether every bit of each non-empty range [s, e) is set; the ranges increase, each
        followed by a non-empty gap."""
        if not self.packed:
            return _all_in_ranges(self.m, s, e)
        # the whole bytes of each range must be 0xFF; the partial bytes at its ends, by bits
        a, b = -(-s // 8), e // 8
        ok = np.ones(s.size, bool)
        whole = a < b
        if whole.any():  # (whole-byte ranges increase too: a_{k+1} >= b_k)
            ok[whole] = _all_in_ranges(self.m == 0xFF, a[whole], b[whole])
        head_end = np.minimum(8 * a, e)
        for lo, hi in ((s, head_end), (np.maximum(8 * b, s), e)):
            part = hi > lo
            ok[part] &= self._byte_bits_set(lo[part], hi[part])
        return ok

    def _byte_bits_set(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Whether bits [lo, hi) (within one byte each) are all set."""
        byte = self.m[lo >> 3].astype(np.int64) >> (lo & 7)
        want = (np.int64(1) << (hi - lo)) - 1
        return (byte & want) == want


def _all_in_ranges(x: np.ndarray, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Whether bool `x` is True on all of each range [s, e) (non-empty, in increasing order,
    a range starting no earlier than the last one ended): logical_and.reduceat over the
    interleaved bounds ANDs each range (the entries between ranges are dropped)."""
    padded = np.concatenate([x, [True]])
    return np.logical_and.reduceat(padded, np.stack([s, e], 1).ravel())[0::2]


def _check_prefix(mask: _Mask, lq: np.ndarray, lkv: np.ndarray) -> None:
    """Raise unless every row keeps all of its request's keys before the last q_len."""
    pre = lkv - lq
    req = np.repeat(np.arange(lq.size), lq)
    row = np.arange(req.size) - np.repeat(np.cumsum(lq) - lq, lq)
    keep = pre[req] > 0
    if not keep.any():
        return
    s = mask.starts[req] + row * lkv[req]
    s, e = s[keep], (s + pre[req])[keep]
    ok = mask.ranges_all_set(s, e)
    if not ok.all():
        bad = int(req[keep][np.argmin(ok)])
        raise InvalidArgument(
            f"{mask.name}: request {bad} hides a key before its last q_len={int(lq[bad])}; the "
            f"batch kernels take a tree mask over the step's own tokens only (every earlier key "
            f"visible). Put other patterns in the variant's mask_mod")


def tree_rows(custom_mask: Any, packed_custom_mask: Any, qo: np.ndarray,
              kv_lens: np.ndarray) -> np.ndarray:
    """int32 `[batch, TREE_MAX_Q]`: word t of request i has bit j set where its query t keeps
    key `kv_len_i - q_len_i + j` (requests' unused words 0). Raises `InvalidArgument` naming
    the argument: both masks given, a wrong dtype or size, a request with more than
    `TREE_MAX_Q` query tokens or fewer keys than queries, a hidden key before the last q_len."""
    if custom_mask is not None and packed_custom_mask is not None:
        raise InvalidArgument("pass custom_mask or packed_custom_mask, not both")
    name = "custom_mask" if packed_custom_mask is None else "packed_custom_mask"
    lq = np.diff(qo).astype(np.int64)
    lkv = np.asarray(kv_lens, np.int64)
    if lq.size and lq.max() > TREE_MAX_Q:
        i = int(np.argmax(lq))
        raise InvalidArgument(f"{name}: request {i} has {int(lq[i])} query tokens; a tree mask "
                              f"covers at most {TREE_MAX_Q} per request (multi-token decode)")
    if (lkv < lq).any():
        i = int(np.argmax(lkv < lq))
        raise InvalidArgument(f"{name}: request {i} has {int(lkv[i])} keys for {int(lq[i])} "
                              f"query tokens; the step's tokens must be in the KV cache")
    mask = _Mask(custom_mask, packed_custom_mask, lq * lkv)
    _check_prefix(mask, lq, lkv)
    # bit (t, j) of request i: element starts_i + t * kv_len_i + (kv_len_i - q_len_i) + j
    t = np.arange(TREE_MAX_Q)
    valid = (t[None, :, None] < lq[:, None, None]) & (t[None, None, :] < lq[:, None, None])
    idx = (mask.starts[:, None, None] + t[None, :, None] * lkv[:, None, None]
           + (lkv - lq)[:, None, None] + t[None, None, :])
    bits = valid & mask.bits(np.where(valid, idx, 0)) if mask.m.size else valid & False
    return (bits.astype(np.int64) << t).sum(-1).astype(np.int32)


class TreeTable:
    """The device table of tree rows (`[max_batch * TREE_MAX_Q]` int32) every plan of a
    BatchAttention on CUDA points its kernels at, so a CUDA graph captured once replays with
    any later plan's mask. All ones (every key kept) where the plan has no mask: a plan
    without one rewrites only the rows a masked plan left. Rows reach the table by an
    asynchronous copy on the current stream from one of two pinned halves, which plans take in
    turn (a half is reused once its copy finished)."""

    def __init__(self, max_batch: int, device: torch.device) -> None:
        n = max_batch * TREE_MAX_Q
        self.device = torch.full((n,), -1, dtype=torch.int32, device=device)
        self._host = torch.empty((2, n), dtype=torch.int32, pin_memory=True)
        self._events: list[Any] = [None, None]
        self._half = 0
        self._dirty = 0  # leading words a masked plan wrote (not all ones)

    def upload(self, rows: np.ndarray | None) -> None:
        """Write `rows` ([batch, TREE_MAX_Q], or None: no mask) for the next launches."""
        if rows is None:
            if not self._dirty:
                return
            n, words = self._dirty, None
        else:
            words = rows.ravel()
            n = max(words.size, self._dirty)
        half = 1 - self._half
        if self._events[half] is not None:
            self._events[half].synchronize()
        host = self._host[half].numpy()
        host[:n] = -1
        if words is not None:
            host[:words.size] = words
        self.device[:n].copy_(self._host[half, :n], non_blocking=True)
        ev = self._events[half] = torch.cuda.Event()
        ev.record()
        self._half, self._dirty = half, 0 if words is None else words.size
