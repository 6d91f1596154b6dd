"""Evaluate IR over torch tensors (broadcasting), for the CPU reference path and for tests.

Semantics are torch's on the CPU (docs/semantics.md):

- integers are 32-bit: stored as int64 and wrapped to int32 after every operation, so index
  arithmetic agrees bit for bit with the generated CUDA `int` code; `//` floors and `%` takes
  the sign of the divisor (Python's rules); `to_i32` truncates, saturating at the int32 range,
  NaN -> 0 (what the GPU's cvt.rzi does);
- floats evaluate as `float_dtype` (float32 to mirror the kernel, float64 for the reference
  oracle), except the *discrete cone* (`attncc.ir.discrete`): float arithmetic that reaches an
  int cast, a floor, a comparison or a float `//` / `%` is computed in float32 in the user's
  order, exactly as torch computes the user's Python on float32 tensors;
- gradients flow (every op is a differentiable torch op; nothing leaves torch), with torch's
  conventions; `max(x, bound)` where only `x` requires grad is `torch.clamp`'s (all of a tie's
  gradient to `x`): docs/backward.md, section 1;
- values computed from captured scalars (and constants) only are Python arithmetic: float64,
  rounded to float32 where they meet a float32 tensor; float `//` and `%` use torch's
  fmod-based algorithms (`torch.div(rounding_mode="floor")`, `torch.remainder`), and `x ** c`
  with a scalar exponent takes torch's scalar-exponent path.

Example:
    >>> import torch
    >>> from attncc.ir.nodes import var
    >>> e = var("q_idx") >= var("kv_idx")
    >>> evaluate(e, {"q_idx": torch.arange(3)[:, None], "kv_idx": torch.arange(3)[None, :]}).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> from attncc.ir.nodes import const
    >>> int(evaluate(const(100000) * var("q_idx"), {"q_idx": torch.tensor(100000)}))  # wraps
    1410065408
"""
from __future__ import annotations

from typing import Mapping

import torch

from .discrete import discrete_cone, is_closed, is_python_scalar, is_sink
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
# Integer results that can leave the int32 range and must wrap like the device's `int`.
_WRAPPING = frozenset({"add", "sub", "mul", "neg", "abs", "floordiv", "mod", "load"})
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


class EvalError(RuntimeError):
    """The IR could not be evaluated with the given environment (missing input, bad index)."""


def wrap_i32(x: torch.Tensor) -> torch.Tensor:
    """int64 values reduced to int32 two's complement (what a 32-bit `int` holds).

    Example:
        >>> wrap_i32(torch.tensor([2**31, -2**31 - 1, 5])).tolist()
        [-2147483648, 2147483647, 5]
    """
    return ((x + 2**31) & 0xFFFFFFFF) - 2**31


def to_i32(x: torch.Tensor) -> torch.Tensor:
    """float -> int32 like the GPU's cvt.rzi.s32.f32: truncate, saturate, NaN -> 0 (int64 out).

    Example:
        >>> to_i32(torch.tensor([-2.5, 3e9, float("nan"), float("-inf")])).tolist()
        [-2, 2147483647, 0, -2147483648]
    """
    if not x.is_floating_point():
        return x.long()
    t = torch.nan_to_num(torch.trunc(x.double()), nan=0.0)
    return t.clamp(_I32_MIN, _I32_MAX).long()


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not a.is_floating_point() and bool((b == 0).any()):
        raise EvalError("integer division by zero")
    return torch.div(a, b, rounding_mode="floor")


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not a.is_floating_point() and bool((b == 0).any()):
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
    Results: int64 for I32 (values in the int32 range), bool for BOOL, `float_dtype` for F32.
    A captured-tensor index out of range raises EvalError, unless `oob` is a dict: then the read
    is clamped and recorded there (see `_gather`).
    """
    device = next((v.device for v in env.values() if isinstance(v, torch.Tensor)), None)
    ev = _Evaluator(env, tensors or {}, params or {}, float_dtype, device, discrete_cone(root),
                    oob)
    for n in walk(root):
        ev.visit(n)
    return ev.result(root)


class _Evaluator:
    """Values of the nodes visited so far, in up to three precisions (see the module doc).

    `main`: every non-F32 node, and F32 nodes in `float_dtype`; `exact`: discrete-cone F32
    nodes in float32; `scalar`: F32 values computed from captured scalars, in float64. F32
    constants are made in the dtype of each use.
    """

    def __init__(self, env: Mapping[str, torch.Tensor | int | float],
                 tensors: Mapping[str, torch.Tensor], params: Mapping[str, int | float],
                 float_dtype: torch.dtype, device: torch.device | None,
                 cone: frozenset[Node], oob: "dict[int, tuple] | None" = None) -> None:
        self.env, self.tensors, self.params = env, tensors, params
        self.oob = oob
        self.float_dtype, self.device, self.cone = float_dtype, device, cone
        self.main: dict[Node, torch.Tensor] = {}
        self.exact: dict[Node, torch.Tensor] = {}
        self.scalar: dict[Node, torch.Tensor] = {}

    def visit(self, n: Node) -> None:
        if n.op == "const" and n.dtype is F32:
            return  # made in the dtype each use needs (`arg`)
        if is_python_scalar(n):
            fdt = torch.float64
            value = self.compute(n, fdt, exact=True)
            if n.dtype is F32:
                self.scalar[n] = value
            else:
                self.main[n] = value
            return
        if n.dtype is not F32:  # F32 operands of an int/bool node make it a sink: float32
            self.main[n] = self.compute(n, torch.float32, exact=True)
            return
        if n in self.cone:
            self.exact[n] = self.compute(n, torch.float32, exact=True)
            if self.float_dtype == torch.float32:
                self.main[n] = self.exact[n]
                return
        self.main[n] = self.compute(n, self.float_dtype, exact=is_sink(n))

    def result(self, root: Node) -> torch.Tensor:
        if root.dtype is F32 and (root.op == "const" or root in self.scalar):
            return self.arg(root, False, self.float_dtype)
        return self.main[root]

    def arg(self, a: Node, exact: bool, fdt: torch.dtype) -> torch.Tensor:
        if a.dtype is not F32:
            return self.main[a]
        if a.op == "const":  # a Python float: rounded to the dtype it meets
            return self.as_tensor(a.attr, a, fdt)
        if a in self.scalar:  # a Python float meets a tensor: rounded to its dtype
            return self.scalar[a].to(fdt)
        first, other = (self.exact, self.main) if exact else (self.main, self.exact)
        # a closed expression of constants under a Python scalar has only its `main` value
        return (first[a] if a in first else other[a]).to(fdt)

    def scalar_value(self, n: Node) -> float | None:
        """The Python float a constant or captured-scalar node stands for, else None."""
        if n.op == "const":
            return float(n.attr)
        return float(self.scalar[n]) if n in self.scalar else None

    def as_tensor(self, x: torch.Tensor | int | float, n: Node, fdt: torch.dtype
                  ) -> torch.Tensor:
        dt = torch.int64 if n.dtype is I32 else torch.bool if n.dtype is BOOL else fdt
        if isinstance(x, torch.Tensor):
            return x.to(dt)
        return torch.as_tensor(x, dtype=dt, device=self.device)

    def compute(self, n: Node, fdt: torch.dtype, exact: bool) -> torch.Tensor:
        """`n`'s value with float results in `fdt`; F32 operands exact (float32) or main."""
        a = [self.arg(x, exact, fdt) for x in n.args]
        op = n.op
        if op in ("var", "const", "param", "load", "vec"):
            r = self.leaf(n, a, fdt)
        elif op == "to_f32":
            r = a[0].to(fdt)
        elif op == "to_i32":
            r = to_i32(a[0])
        elif op in _TORCH_UNARY:
            r = _TORCH_UNARY[op](a[0])
        elif op == "floordiv":
            r = _floordiv(*a)
        elif op == "mod":
            r = _mod(*a)
        elif op == "pow" and not is_closed(n.args[0]) and self.scalar_value(n.args[1]) is not None:
            # `x ** 2.0`: torch's tensor-scalar pow (x * x for 2, sqrt for 0.5, ...)
            r = torch.pow(a[0], self.scalar_value(n.args[1]))
        elif op in ("min", "max") and a[0].requires_grad and not a[1].requires_grad:
            # torch.clamp(x, bound) lowers to this: same value, and clamp's gradient at a tie
            # (all of it to x, where torch.maximum would give half; attncc.ir.autodiff)
            r = torch.clamp(a[0], **{"min" if op == "max" else "max": a[1]})
        elif op in _TORCH_BINARY:
            r = _TORCH_BINARY[op](a[0], a[1])
        elif op == "where":
            r = torch.where(a[0], a[1], a[2])
        else:  # pragma: no cover - every op is handled above
            raise EvalError(f"no evaluator for op {op!r}")
        if n.dtype is F32:
            return r.to(fdt)
        if n.dtype is I32 and op in _WRAPPING:
            return wrap_i32(r.long())
        return r

    def leaf(self, n: Node, a: list[torch.Tensor], fdt: torch.dtype) -> torch.Tensor:
        op = n.op
        if op == "var":
            if n.attr not in self.env:
                raise EvalError(f"no value bound for index variable {n.attr!r}")
            return self.as_tensor(self.env[n.attr], n, fdt)
        if op == "const":
            return self.as_tensor(n.attr, n, fdt)
        if op == "param":
            if n.attr not in self.params:
                raise EvalError(f"no value bound for captured scalar {n.attr!r}")
            return self.as_tensor(self.params[n.attr], n, fdt)
        if op == "load":
            if n.attr not in self.tensors:
                raise EvalError(f"no tensor bound for captured tensor {n.attr!r}")
            t = self.tensors[n.attr]
            if self.device is not None and t.device != self.device:
                t = t.to(self.device)
            return self.as_tensor(_gather(t, a, n.attr, self.oob, n), n, fdt)
        if n.attr not in self.env:
            raise EvalError(f"no head vector bound for {n.attr!r}")
        v = self.as_tensor(self.env[n.attr], n, fdt)
        idx = a[0]
        dim = v.shape[-1]
        if idx.numel() and (bool((idx < 0).any()) or bool((idx >= dim).any())):
            raise EvalError(f"{n.attr}[...] index {int(idx.min())}..{int(idx.max())} out of "
                            f"range for head dim {dim}")
        shape = torch.broadcast_shapes(v.shape, idx.shape)
        return torch.gather(v.expand(shape), -1, idx.expand(shape).long())


def eval_const(n: Node) -> bool | int | float:
    """Evaluate a closed expression (no variables) to a Python scalar (for constant folding)."""
    r = evaluate(n, {}, float_dtype=torch.float32)
    if n.dtype is BOOL:
        return bool(r)
    if n.dtype is I32:
        v = int(r)
        return v
    return float(r)
