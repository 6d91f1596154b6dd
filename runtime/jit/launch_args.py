"""Launch-argument pieces every kernel kind uses: a variant's captured tensors and scalars as
VariantParams member values (`captured`), and the variant with its unsafe captured reads
clamped (`clamped`).

Example:
    >>> import torch
    >>> ELEM_NAMES[torch.bfloat16]
    'bfloat16'
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

from attncc.ir.program import Bindings, VariantIR

__all__ = ["ELEM_NAMES", "captured", "clamped"]

ELEM_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
              torch.bfloat16: "bfloat16", torch.int8: "int8", torch.uint8: "uint8",
              torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
              torch.bool: "bool"}
"""torch dtype -> the element type name a traced captured tensor carries."""

# keyed by tensor identity: a plain WeakKeyDictionary compares keys with ==, elementwise for
# tensors (torch's WeakIdKeyDictionary exists for exactly this)
_DEVICE_COPIES: Any = WeakIdKeyDictionary()


def _on_device(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A captured tensor on the kernel's device. CPU tensors are copied once and the copy reused
    while the CPU tensor is unchanged (its version counter), so repeated calls -- and CUDA graph
    replays after a warm-up call -- do no host-to-device traffic."""
    if t.device == device:
        return t
    if t.device.type != "cpu":
        raise ValueError(f"captured tensor {name!r} is on {t.device} but query is on {device}; "
                         f"move it with {name} = {name}.to({str(device)!r}) before defining "
                         f"the mod")
    hit = _DEVICE_COPIES.get(t)
    if hit is not None and hit[0] == t._version and hit[1].device == device:
        return hit[1]
    copy = t.to(device)
    _DEVICE_COPIES[t] = (t._version, copy)
    return copy


def captured(ir: VariantIR, bindings: Bindings, device: torch.device) -> dict[str, Any]:
    """Member values of VariantParams for the launch; checks captured tensors' device/dtype."""
    tensors: dict[str, tuple[int, list[int], list[int]]] = {}
    for t in ir.tensors:
        val = bindings.tensors.get(t.name)
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"captured tensor {t.name!r} has no value in the bindings")
        if ELEM_NAMES.get(val.dtype) != t.elem:
            raise ValueError(f"captured tensor {t.name!r} is {val.dtype} but was traced as "
                             f"{t.elem}; trace the variant again")
        val = _on_device(t.name, val, device)
        tensors[t.name] = (val.data_ptr(), list(val.stride()), list(val.shape))
    scalars = {s.name: bindings.scalars[s.name] for s in ir.scalars}
    return {"tensors": tensors, "scalars": scalars}


def clamped(ir: VariantIR | None, shapes: Any, tensors: Mapping[str, Any],
            scalars: Mapping[str, Any], computed: Any = None
            ) -> tuple[VariantIR | None, dict[str, int]]:
    """`ir` with its unsafe captured reads clamped (the same object when none is), or
    CapturedReadError for a read outside its tensor at a kept position (`computed`: where the
    kernel evaluates the hooks, None for everywhere)."""
    if ir is None or not ir.tensors:
        return ir, {}
    from attncc.ir.analysis import check_captured_reads, clamp_reads
    from attncc.ir.simplified import simplify_variant

    simple = simplify_variant(ir)  # the expressions the kernel runs
    found = check_captured_reads(simple, shapes, tensors, scalars, computed)
    if not found.clamp:
        return ir, {}
    return clamp_reads(simple, found.clamp, tensors)
