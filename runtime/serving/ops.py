"""`torch.ops.attncc.batch_attention_run`: `BatchAttention.run` as a torch.library op.

Under `torch.compile`, `BatchAttention.run` calls this op instead of launching from traced code.
The plan stays eager Python (call `plan()` outside the compiled region, as a serving loop does):
the op finds its `BatchAttention` in a process registry under `handle` (`op_handle`, given at
construction by `register_batch`) and runs it with the latest plan. The variant's captured values are read by `run` itself when the op runs. The fake
implementation gives `out` like q and `lse` [rows, heads] float32. docs/compile.md.

Example:
    >>> import torch
    >>> out, lse = _batch_run_fake(torch.empty(5, 4, 64), [torch.empty(3, 16, 2, 64)], 0, None)
    >>> tuple(out.shape), tuple(lse.shape), lse.dtype
    ((5, 4, 64), (5, 4), torch.float32)
"""
from __future__ import annotations

import importlib
import itertools
import threading
import weakref
from typing import Any, Optional

import torch

from attncc.errors import InvalidArgument

_HANDLES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)
_LOCK = threading.Lock()


def register_batch(batch: Any) -> int:
    """A new BatchAttention's registry handle (`BatchAttention.op_handle`; held weakly)."""
    home = importlib.import_module("attncc.runtime.serving.ops")
    with home._LOCK:
        h = next(home._NEXT)
        home._HANDLES[h] = batch
    return h


def compiled_run(batch: Any, q: torch.Tensor, kv_cache: Any, return_lse: bool,
                 scale: float | None, sinks: torch.Tensor | None = None, k_scale: Any = None,
                 v_scale: Any = None) -> Any:
    """`BatchAttention.run` as Dynamo traces it: one op call. Float sinks and tensor scales
    become float32 in the graph, so the op's run keeps no reference to a graph's tensors
    (a CUDA-graph pool's); float scales are op arguments."""
    kv = [kv_cache] if isinstance(kv_cache, torch.Tensor) else list(kv_cache)
    if isinstance(sinks, torch.Tensor) and sinks.dtype in (torch.float32, q.dtype):
        sinks = sinks.to(torch.float32).contiguous()  # (any other dtype: run's check names it)
    kt, kf = _scale_operands(k_scale)
    vt, vf = _scale_operands(v_scale)
    # an int attribute: Dynamo reads it as a constant (every supported torch; an object
    # argument to an assume_constant_result function is not, before torch 2.13)
    out, lse = torch.ops.attncc.batch_attention_run(q, kv, batch.op_handle, scale, sinks,
                                                    kt, vt, kf, vf)
    return (out, lse) if return_lse else out


def _scale_operands(scale: Any) -> tuple[Any, Any]:
    """An fp8 scale as the op's (tensor, float) pair: a float tensor as float32 (its shape and
    values are checked by run when the op runs), a number as the float, None as neither."""
    if isinstance(scale, torch.Tensor):
        return (scale.to(torch.float32) if scale.is_floating_point() else scale), None
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return None, float(scale)
    if scale is None:
        return None, None
    raise InvalidArgument(f"k_scale / v_scale must be a float or a tensor [num_kv_heads]; got "
                          f"{type(scale).__name__}")


@torch.library.custom_op("attncc::batch_attention_run", mutates_args=())
def batch_run_op(q: torch.Tensor, kv_cache: list[torch.Tensor], handle: int,
                 scale: Optional[float], sinks: Optional[torch.Tensor] = None,
                 k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                 k_scale_value: Optional[float] = None, v_scale_value: Optional[float] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `BatchAttention.run(q, kv_cache, ...)` for the registered BatchAttention
    (its latest plan: fp8 cache, tree mask and all). `k_scale` / `v_scale`: an fp8 cache's
    tensor scales, or `k_scale_value` / `v_scale_value` its float ones (one of each pair)."""
    # pytest's doctest run imports this file twice (see flex/ops.py _registry): one registry
    batch = importlib.import_module("attncc.runtime.serving.ops")._HANDLES.get(handle)
    if batch is None:
        raise InvalidArgument(f"attncc::batch_attention_run: handle {handle} names no live "
                              f"BatchAttention in this process; call BatchAttention.run "
                              f"instead of the op")
    cache = kv_cache[0] if len(kv_cache) == 1 else tuple(kv_cache)
    kw = dict(scale=scale, sinks=sinks,
              k_scale=k_scale if k_scale is not None else k_scale_value,
              v_scale=v_scale if v_scale is not None else v_scale_value)
    if not batch.variant.trace()[0].use_softmax:  # no LSE without a softmax
        out = batch.run(q, cache, **kw)
        return out, torch.zeros(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    return batch.run(q, cache, return_lse=True, **kw)


@batch_run_op.register_fake
def _batch_run_fake(q: torch.Tensor, kv_cache: list[torch.Tensor], handle: int,
                    scale: Optional[float], sinks: Optional[torch.Tensor] = None,
                    k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None,
                    k_scale_value: Optional[float] = None, v_scale_value: Optional[float] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


__all__ = ["batch_run_op", "compiled_run", "register_batch"]
