"""Evaluate IR over torch tensors (broadcasting), for the CPU reference path and for tests.

Integers evaluate as int64 and floats as `float_dtype` (float32 to mirror the kernel, float64
for the reference oracle). Semantics follow the generated CUDA: `//` floors, `%` takes the sign
of the divisor (Python's rules, which the CUDA helpers implement), `to_i32` truncates.

Example:
    >>> import torch
    >>> from attncc.ir.nodes import var
    >>> e = var("q_idx") >= var("kv_idx")
    >>> evaluate(e, {"q_idx": torch.arange(3)[:, None], "kv_idx": torch.arange(3)[None, :]}).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
"""
from __future__ import annotations

from typing import Mapping

import torch

from .nodes import BOOL, F32, I32, Node, walk

_TORCH_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2,
    "log": torch.log, "log2": torch.log2, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos,
    "floor": torch.floor, "not": torch.logical_not,
}
_TORCH_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "pow": torch.pow, "min": torch.minimum, "max": torch.maximum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or,
}


class EvalError(RuntimeError):
    """The IR could not be evaluated with the given environment (missing input, bad index)."""


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point():
        return torch.floor(a / b)
    if bool((b == 0).any()):
        raise EvalError("integer division by zero")
    return torch.div(a, b, rounding_mode="floor")


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point():
        return a - torch.floor(a / b) * b
    if bool((b == 0).any()):
        raise EvalError("integer modulo by zero")
    return torch.remainder(a, b)


def _gather(t: torch.Tensor, idx: list[torch.Tensor], name: str,
            oob: "dict[int, tuple] | None" = None, node: Node | None = None) -> torch.Tensor:
    """`t[idx...]` with broadcast indices. An index outside its dim raises EvalError; with an
    `oob` dict it is clamped into the dim instead (the kernels' clamped read) and
    `oob[id(node)] = (node, out_of_range, indices)` records where, for the caller to decide
    whether that position counts (a masked position does not)."""
    shape = torch.broadcast_shapes(*(i.shape for i in idx)) if idx else ()
    flat = [i.expand(shape).long() for i in idx]
    bad = None
    for dim, i in enumerate(flat):
        n = t.shape[dim]
        if i.numel() and (bool((i < 0).any()) or bool((i >= n).any())):
            if oob is None:
                lo, hi = int(i.min()), int(i.max())
                raise EvalError(f"index {lo}..{hi} out of range for dim {dim} of {name} "
                                f"(size {n})")
            out = (i < 0) | (i >= n)
            bad = out if bad is None else bad | out
    if bad is not None:
        oob[id(node)] = (node, bad, flat)  # type: ignore[index]
        if t.numel() == 0:  # nothing to clamp to: zeros (every read is out of range)
            return torch.zeros(shape, dtype=t.dtype, device=t.device)
        flat = [i.clamp(0, t.shape[d] - 1) for d, i in enumerate(flat)]
    return t[tuple(flat)] if flat else t.reshape(())


def evaluate(root: Node, env: Mapping[str, torch.Tensor | int | float],
             tensors: Mapping[str, torch.Tensor] | None = None,
             params: Mapping[str, int | float] | None = None,
             float_dtype: torch.dtype = torch.float32,
             oob: "dict[int, tuple] | None" = None) -> torch.Tensor:
    """Evaluate `root`; `env` binds index variables / `score` / head vectors q,k,v,o.

    Head vectors are tensors whose last dim is the head dim; `vec(q, i)` gathers along it with
    the broadcast index `i`. Captured tensors come from `tensors`, captured scalars from `params`.
    A captured-tensor index out of range raises EvalError, unless `oob` is a dict: then the read
    is clamped and recorded there (see `_gather`).
    """
    tensors = tensors or {}
    params = params or {}
    device = None
    for v in env.values():
        if isinstance(v, torch.Tensor):
            device = v.device
            break
    vals: dict[int, torch.Tensor] = {}

    def as_tensor(x: torch.Tensor | int | float, n: Node) -> torch.Tensor:
        dt = torch.int64 if n.dtype is I32 else torch.bool if n.dtype is BOOL else float_dtype
        return torch.as_tensor(x, dtype=dt, device=device) if not isinstance(x, torch.Tensor) \
            else x.to(dt)

    for n in walk(root):
        a = [vals[id(x)] for x in n.args]
        op = n.op
        if op == "var":
            if n.attr not in env:
                raise EvalError(f"no value bound for index variable {n.attr!r}")
            r = as_tensor(env[n.attr], n)
        elif op == "const":
            r = as_tensor(n.attr, n)
        elif op == "param":
            if n.attr not in params:
                raise EvalError(f"no value bound for captured scalar {n.attr!r}")
            r = as_tensor(params[n.attr], n)
        elif op == "load":
            if n.attr not in tensors:
                raise EvalError(f"no tensor bound for captured tensor {n.attr!r}")
            t = tensors[n.attr]
            if device is not None and t.device != device:
                t = t.to(device)
            r = as_tensor(_gather(t, a, n.attr, oob, n), n)
        elif op == "vec":
            if n.attr not in env:
                raise EvalError(f"no head vector bound for {n.attr!r}")
            v = as_tensor(env[n.attr], n)
            idx = a[0]
            dim = v.shape[-1]
            if idx.numel() and (bool((idx < 0).any()) or bool((idx >= dim).any())):
                raise EvalError(f"{n.attr}[...] index {int(idx.min())}..{int(idx.max())} out of "
                                f"range for head dim {dim}")
            shape = torch.broadcast_shapes(v.shape, idx.shape)
            r = torch.gather(v.expand(shape), -1, idx.expand(shape).long())
        elif op in ("to_f32", "to_i32"):
            r = a[0].to(float_dtype) if op == "to_f32" else (
                torch.trunc(a[0]).long() if a[0].is_floating_point() else a[0].long())
        elif op in _TORCH_UNARY:
            r = _TORCH_UNARY[op](a[0])
        elif op == "floordiv":
            r = _floordiv(*a)
        elif op == "mod":
            r = _mod(*a)
        elif op in _TORCH_BINARY:
            r = _TORCH_BINARY[op](a[0], a[1])
        elif op == "where":
            r = torch.where(a[0], a[1], a[2])
        else:  # pragma: no cover - every op is handled above
            raise EvalError(f"no evaluator for op {op!r}")
        if n.dtype is F32 and r.dtype != float_dtype:
            r = r.to(float_dtype)
        vals[id(n)] = r
    return vals[id(root)]


def eval_const(n: Node) -> bool | int | float:
    """Evaluate a closed expression (no variables) to a Python scalar (for constant folding)."""
    r = evaluate(n, {}, float_dtype=torch.float32)
    if n.dtype is BOOL:
        return bool(r)
    if n.dtype is I32:
        v = int(r)
        return v
    return float(r)
