"""Two attention states merged on the GPU in one launch (kernels/small/merge_state.cuh).

`merge_state_cuda` is what `attncc.merge_state` runs on CUDA tensors it can take (see
`fits_kernel`) and what `CascadeAttention` joins its two passes with. It computes in float32
whatever the storage type of o (the torch formula of `merge.py` computes in the inputs'
dtype), writes o in that storage type and lse in float32, and needs no host synchronisation, so
it can be captured in a CUDA graph. The kernel comes from the kernel cache
(runtime/jit/kernels.py), one per (storage type, device).

Example (launching needs a GPU):
    >>> import torch
    >>> fits_kernel(torch.zeros(4, 128), torch.zeros(4), torch.zeros(4, 128), torch.zeros(4))
    False
"""
from __future__ import annotations

from typing import Any

import torch

from attncc.codegen import constants

from ..jit.launcher import current_raw_stream

__all__ = ["fits_kernel", "merge_fitting_states", "merge_state_cuda"]

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_THREADS = constants.MERGE_STATE_THREADS  # kernels/small/merge_state.cuh merge::kThreads


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def fits_kernel(o_a: torch.Tensor, lse_a: torch.Tensor | None, o_b: torch.Tensor,
                lse_b: torch.Tensor | None) -> bool:
    """Whether the merge kernel takes these states as they are: CUDA tensors on one device, o_a
    and o_b of one shape and storage type (bf16/fp16/fp32), contiguous and 16-byte aligned, a
    head dim that is a multiple of 8, and (for softmax states) float32 contiguous lse of o's
    shape without the head dim. Reads no tensor values (no host synchronisation).

    Example:
        >>> fits_kernel(torch.zeros(2, 8), None, torch.zeros(2, 8), None)  # CPU tensors
        False
    """
    if not (o_a.is_cuda and o_b.is_cuda and o_a.device == o_b.device):
        return False
    if o_a.dtype not in _DTYPES or o_b.dtype != o_a.dtype or o_a.shape != o_b.shape:
        return False
    if o_a.dim() < 1 or o_a.shape[-1] % 8 or not all(
            t.is_contiguous() and _aligned(t) for t in (o_a, o_b)):
        return False
    for lse in (lse_a, lse_b):
        if lse is not None and not (lse.device == o_a.device and lse.dtype == torch.float32
                                    and lse.is_contiguous() and lse.shape == o_a.shape[:-1]):
            return False
    return True


def _kernel(dtype: str, device: int) -> Any:
    from ..jit.kernels import KernelSpec, get_kernel

    return get_kernel(KernelSpec("merge", dtype=dtype, device=device)).launcher


def merge_state_cuda(o_a: torch.Tensor, lse_a: torch.Tensor | None, o_b: torch.Tensor,
                     lse_b: torch.Tensor | None, *, out: torch.Tensor | None = None,
                     lse_out: torch.Tensor | None = None, want_lse: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge two states (`fits_kernel` must hold) on the current stream: `(o, lse)`.

    With `lse_a` and `lse_b` None the states are unnormalised sums (variants with
    normalize='none') and `o = o_a + o_b`, lse None. `out` / `lse_out` (optional) receive the
    result; `want_lse=False` skips writing lse. An empty state (lse = -inf) is never read.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     o = torch.randn(2, 4, 128, device="cuda", dtype=torch.bfloat16)
        ...     lse = torch.zeros(2, 4, device="cuda")
        ...     m, l = merge_state_cuda(o, lse, o, lse)      # m == o, l == log 2
    """
    if not fits_kernel(o_a, lse_a, o_b, lse_b):
        raise ValueError("merge_state_cuda: the states do not fit the merge kernel (see "
                         "fits_kernel); use attncc.merge_state")
    softmax = lse_a is not None
    if softmax != (lse_b is not None):
        raise ValueError("merge_state_cuda: give both lse or neither")
    if out is None:
        out = torch.empty_like(o_a)
    elif not (out.shape == o_a.shape and out.dtype == o_a.dtype and out.device == o_a.device
              and out.is_contiguous() and _aligned(out)):
        raise ValueError(f"merge_state_cuda: out must be a contiguous, 16-byte aligned "
                         f"{o_a.dtype} tensor of shape {tuple(o_a.shape)}")
    if softmax and want_lse and lse_out is None:
        lse_out = torch.empty(o_a.shape[:-1], dtype=torch.float32, device=o_a.device)
    if lse_out is not None and not (lse_out.shape == o_a.shape[:-1] and lse_out.is_contiguous()
                                    and lse_out.dtype == torch.float32):
        raise ValueError(f"merge_state_cuda: lse_out must be a contiguous float32 tensor of "
                         f"shape {tuple(o_a.shape[:-1])}")
    return _launch(o_a, lse_a, o_b, lse_b, out, lse_out)


def merge_fitting_states(o_a: torch.Tensor, lse_a: torch.Tensor | None, o_b: torch.Tensor,
                         lse_b: torch.Tensor | None, *, want_lse: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`merge_state_cuda` into new tensors, for a caller that has just checked `fits_kernel`
    (and gives both lse or neither): the checks are not run again.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     o = torch.randn(2, 4, 128, device="cuda", dtype=torch.bfloat16)
        ...     m, _ = merge_fitting_states(o, None, o, None)      # m == 2 o
    """
    lse_out = None
    if lse_a is not None and want_lse:
        lse_out = torch.empty(o_a.shape[:-1], dtype=torch.float32, device=o_a.device)
    return _launch(o_a, lse_a, o_b, lse_b, torch.empty_like(o_a), lse_out)


def _launch(o_a: torch.Tensor, lse_a: torch.Tensor | None, o_b: torch.Tensor,
            lse_b: torch.Tensor | None, out: torch.Tensor, lse_out: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel on checked states and outputs, on the current stream."""
    softmax = lse_a is not None
    head_dim = o_a.shape[-1]
    rows = o_a.numel() // head_dim if head_dim else 0
    if rows == 0:
        return out, (lse_out if softmax else None)
    device = o_a.device.index if o_a.device.index is not None else torch.cuda.current_device()
    kern = _kernel(_DTYPES[o_a.dtype], device)
    params = {"o_a": o_a.data_ptr(), "lse_a": lse_a.data_ptr() if softmax else None,
              "o_b": o_b.data_ptr(), "lse_b": lse_b.data_ptr() if softmax else None,
              "o_out": out.data_ptr(),
              "lse_out": lse_out.data_ptr() if (softmax and lse_out is not None) else None,
              "rows": rows, "head_dim": head_dim, "softmax": int(softmax)}
    blocks = -(-rows * (head_dim // 8) // _THREADS)
    kern.launch((blocks, 1, 1), (_THREADS, 1, 1), 0, kern.ap.flatten(params), (),
                stream=current_raw_stream(o_a.device.index))
    return out, (lse_out if softmax else None)
