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


def _mask_bits(custom_mask: Any, packed_custom_mask: Any, cells: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """The mask as one flat bool array and each request's first element in it."""
    if packed_custom_mask is None:
        m = _as_numpy(custom_mask, "custom_mask")
        if m.dtype != np.bool_:
            raise InvalidArgument(f"custom_mask must be a bool tensor (True keeps the key), got "
                                  f"{m.dtype}")
        need, unit = int(cells.sum()), ""
        starts = np.concatenate([[0], np.cumsum(cells)[:-1]]).astype(np.int64)
    else:
        p = _as_numpy(packed_custom_mask, "packed_custom_mask")
        if p.dtype != np.uint8:
            raise InvalidArgument(f"packed_custom_mask must be uint8 (bits packed with "
                                  f"bitorder='little'), got {p.dtype}")
        nbytes = (cells + 7) // 8
        need, unit = int(nbytes.sum()), " bytes"
        starts = 8 * np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
        m = np.unpackbits(p, bitorder="little").view(np.bool_)
    size = m.size if packed_custom_mask is None else m.size // 8
    if size != need:
        name = "custom_mask" if packed_custom_mask is None else "packed_custom_mask"
        raise InvalidArgument(f"{name} has {size}{unit}; this batch needs {need}{unit}: each "
                              f"request's [q_len, kv_len] mask, row-major"
                              f"{', packed per request' if unit else ''}, concatenated")
    return m, starts


def _check_prefix(m: np.ndarray, starts: np.ndarray, lq: np.ndarray, lkv: np.ndarray,
                  name: str) -> None:
    """Raise unless every row keeps all of its request's keys before the last q_len."""
    pre = lkv - lq
    req = np.repeat(np.arange(lq.size), lq)
    row = np.arange(req.size) - np.repeat(np.cumsum(lq) - lq, lq)
    keep = pre[req] > 0
    if not keep.any():
        return
    s = starts[req] + row * lkv[req]
    s, e = s[keep], (s + pre[req])[keep]
    # ranges [s, e) in increasing order, each followed by a non-empty gap (the row's q_len last
    # keys): logical_and.reduceat over the interleaved bounds ANDs each range
    padded = np.concatenate([m, [True]])
    ok = np.logical_and.reduceat(padded, np.stack([s, e], 1).ravel())[0::2]
    if not ok.all():
        bad = int(req[keep][np.argmin(ok)])
        raise InvalidArgument(
            f"{name}: request {bad} hides a key before its last q_len={int(lq[bad])}; the batch "
            f"kernels take a tree mask over the step's own tokens only (every earlier key "
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
    m, starts = _mask_bits(custom_mask, packed_custom_mask, lq * lkv)
    _check_prefix(m, starts, lq, lkv, name)
    # bit (t, j) of request i: element starts_i + t * kv_len_i + (kv_len_i - q_len_i) + j
    t = np.arange(TREE_MAX_Q)
    valid = (t[None, :, None] < lq[:, None, None]) & (t[None, None, :] < lq[:, None, None])
    idx = (starts[:, None, None] + t[None, :, None] * lkv[:, None, None]
           + (lkv - lq)[:, None, None] + t[None, None, :])
    bits = np.where(valid, m[np.where(valid, idx, 0)] if m.size else False, False)
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
