"""`attncc.flex_attention` differentiable on CUDA: a torch.autograd.Function around the GPU
forward (which saves only O and the LSE) and the FA2-class backward kernel (backward.py).

A variant's query/key/value/output transforms are per-row elementwise: they run in torch on the
IR evaluator (attncc.ir.evaluator), so torch's autograd differentiates them, and the attention
in between runs on the materialized q/k/v with the transform hooks removed. Captured tensors
that the score_mod reads and that require grad get their gradient from the kernel's CapturedGrad
hook (fp32 buffers, cast to the tensor's dtype). docs/backward.md, "Kernels", has the design.

Example (no GPU needed to strip the transforms):
    >>> import torch, attncc
    >>> ir, _ = attncc.Variant(key_mod=lambda k, b, h, kv, d: k[d] * 2,
    ...                        mask_mod=lambda b, h, q, kv: q >= kv).trace()
    >>> sorted(attention_ir(ir).hooks)
    ['mask_mod']
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from attncc.ir.nodes import walk
from attncc.ir.program import Bindings, VariantIR

__all__ = ["TRANSFORM_HOOKS", "attention_ir", "needs_grad", "differentiable_attention",
           "backward_of_saved", "sinks_grad"]

TRANSFORM_HOOKS = ("query_mod", "key_mod", "value_mod", "output_mod")


def attention_ir(ir: VariantIR) -> VariantIR:
    """`ir` without its transform hooks (the same object when it has none)."""
    if not any(h in ir.hooks for h in TRANSFORM_HOOKS):
        return ir
    return VariantIR(hooks={n: h for n, h in ir.hooks.items() if n not in TRANSFORM_HOOKS},
                     normalize=ir.normalize, name=ir.name, scalars=ir.scalars,
                     tensors=ir.tensors)


def needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               bindings: Bindings, sinks: torch.Tensor | None = None) -> bool:
    """Whether this call must record a graph: grad mode on and an input (the sinks too) or a
    captured tensor requires grad."""
    if not torch.is_grad_enabled():
        return False
    if sinks is not None and sinks.requires_grad:
        return True
    return any(t.requires_grad for t in (query, key, value)) or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in bindings.tensors.values())


def _loads(ir: VariantIR, hook: str) -> frozenset[str]:
    """The captured tensors `hook` reads (none when the variant has no such hook)."""
    if hook not in ir.hooks:
        return frozenset()
    return _loads_of(ir.expr(hook))


@functools.lru_cache(maxsize=256)
def _loads_of(expr: Any) -> frozenset[str]:
    """The captured tensors an (interned, so hashable) expression reads: asked on every
    training call, walked once per expression."""
    return frozenset(n.attr for n in walk(expr) if n.op == "load")


def _score_grad_tensors(ir: VariantIR, bindings: Bindings) -> tuple[str, ...]:
    """The captured tensors the score_mod or mask_mod reads that require grad (a mask's raise
    DifferentiationError in check_grad_tensors)."""
    read = _loads(ir, "score_mod") | _loads(ir, "mask_mod")
    return tuple(t.name for t in ir.tensors if t.name in read
                 and isinstance(bindings.tensors.get(t.name), torch.Tensor)
                 and bindings.tensors[t.name].requires_grad)


def _index(n: int, dim: int, device: torch.device) -> torch.Tensor:
    shape = [1, 1, 1, 1]
    shape[dim] = n
    return torch.arange(n, device=device).view(shape)


def _transform(ir: VariantIR, hook: str, vec: str, pos: str, x: torch.Tensor,
               bindings: Bindings) -> torch.Tensor:
    """A transform hook on a [B, H, S, D] tensor in fp32 (recorded by autograd), rounded to
    x's dtype as the forward kernel rounds it into shared memory; x itself when absent."""
    if hook not in ir.hooks or ir.hook(hook).is_identity:
        return x
    from attncc.ir.evaluator import evaluate

    B, H, S, D = x.shape
    dev = x.device
    env = {vec: x.float(), "b": _index(B, 0, dev), "h": _index(H, 1, dev),
           pos: _index(S, 2, dev), "d": _index(D, 3, dev)}
    tensors = {n: t.to(dev) for n, t in bindings.tensors.items()}
    r = evaluate(ir.expr(hook), env, tensors, dict(bindings.scalars), torch.float32)
    return r.expand(B, H, S, D).to(x.dtype)


@dataclass(frozen=True)
class _Call:
    """What the autograd Function needs besides its tensor inputs."""

    ir: VariantIR  # no transforms
    bindings: Bindings
    block_mask: Any
    scale: float | None
    enable_gqa: bool
    kernel_options: Mapping[str, Any] | None
    grad_tensors: tuple[str, ...]


def sinks_grad(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               dout: torch.Tensor | None, dlse: torch.Tensor | None) -> torch.Tensor:
    """d(sinks) [Hq] of attention with sinks, from what the forward saved: the sink's weight in
    row i is exp(sink_h - LSE_i) (LSE includes the sink), and d sink_h = -sum over rows of that
    weight times delta_i = rowsum(dO * O) - dLSE_i (docs/backward.md, "Attention sinks").

    Example:
        >>> s = torch.zeros(1, dtype=torch.float64)
        >>> o = torch.ones(1, 1, 2, 1, dtype=torch.float64)
        >>> lse = torch.full((1, 1, 2), math.log(2), dtype=torch.float64)
        >>> sinks_grad(s, o, lse, torch.ones_like(o), None).tolist()     # -2 rows * 0.5 * 1
        [-1.0]
    """
    delta = torch.zeros_like(lse, dtype=torch.float32)
    if dout is not None:
        delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    weight = torch.exp(sinks.float().view(1, -1, 1) - lse.float())
    return -(weight * delta).sum((0, 2)).to(sinks.dtype)


class _Attention(torch.autograd.Function):
    """(q, k, v, sinks or None, *captured tensors requiring grad) -> (out, lse); lse is empty
    for normalize none. Saves q, k, v, out and lse: nothing of size S^2."""

    @staticmethod
    def forward(ctx: Any, call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None, *grad_values: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        from .gpu_flex import gpu_flex_attention

        out, lse = gpu_flex_attention(q, k, v, call.ir, call.bindings,
                                      block_mask=call.block_mask, scale=call.scale,
                                      enable_gqa=call.enable_gqa,
                                      return_lse=call.ir.use_softmax,
                                      kernel_options=call.kernel_options, sinks=sinks)
        ctx.call = call
        # an unused output's gradient stays None: no zero LSE gradient made and read per call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse if lse is not None else out.new_empty(0), sinks)
        if lse is None:
            lse = out.new_empty(0, dtype=torch.float32)
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        call: _Call = ctx.call
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        res = _run(call, q, k, v, out, lse if call.ir.use_softmax else None, dout,
                   dlse if call.ir.use_softmax else None)
        # the kernels' dS is unchanged when the LSE includes the sink; its own gradient here
        dsinks = (sinks_grad(sinks, out, lse, dout, dlse)
                  if sinks is not None and ctx.needs_input_grad[4] else None)
        return (None, res.dq, res.dk, res.dv, dsinks,
                *(res.captured[n] for n in call.grad_tensors))


def _run(call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor | None, dout: torch.Tensor, dlse: torch.Tensor | None) -> Any:
    """The backward launch for one saved forward: the forward's plan (merged mask, lists; the
    call cache's entry, as the forward's call found it), captured reads clamped as the
    forward's (cached the same way), then backward.run_backward."""
    from .backward import default_scale, run_backward
    from .gpu_flex import _call_entry, clamped_reads

    entry = _call_entry(q, k, v, call.ir, call.bindings, call.block_mask, call.enable_gqa,
                        call.kernel_options)
    pl = entry.plan
    bindings = call.bindings  # this call's captured values, the mask's merged in
    if pl.mask_scalars or pl.mask_tensors:
        bindings = Bindings({**bindings.scalars, **pl.mask_scalars},
                            {**bindings.tensors, **pl.mask_tensors})
    ir, sizes = clamped_reads(entry, bindings, q, k, v)
    D = q.shape[-1]
    if sizes:
        bindings = Bindings({**bindings.scalars, **sizes}, bindings.tensors)
    opts = call.kernel_options or {}
    return run_backward(q, k, v, out, lse, dout, dlse, ir, bindings, pl.mask,
                        scale=default_scale(D, call.scale), grad_tensors=call.grad_tensors,
                        device=pl.device, fast_math=opts.get("FAST_MATH", True),
                        deterministic=bool(opts.get("DETERMINISTIC", False)),
                        kernel=opts.get("BACKWARD_KERNEL"))


def differentiable_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             ir: VariantIR, bindings: Bindings, *, block_mask: Any = None,
                             scale: float | None = None, enable_gqa: bool = False,
                             kernel_options: Mapping[str, Any] | None = None,
                             sinks: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(out, lse or None)` of a traced variant on CUDA with a graph torch's autograd can
    differentiate: transforms on the evaluator, attention through `_Attention` (`sinks` [Hq]
    too). Errors (a mask reading a tensor that requires grad) are raised before anything
    launches."""
    from attncc.ir.autodiff import check_grad_tensors

    from attncc.errors import InvalidArgument

    from .backward import backward_head_dims_why

    why = backward_head_dims_why(query.shape[-1], value.shape[-1])
    if why is not None:
        raise InvalidArgument(why)
    attn = attention_ir(ir)
    names = check_grad_tensors(attn, _score_grad_tensors(attn, bindings))
    q = _transform(ir, "query_mod", "q", "q_idx", query, bindings)
    k = _transform(ir, "key_mod", "k", "kv_idx", key, bindings)
    v = _transform(ir, "value_mod", "v", "kv_idx", value, bindings)
    call = _Call(attn, bindings, block_mask, scale, enable_gqa, kernel_options, names)
    out, lse = _Attention.apply(call, q, k, v, sinks, *(bindings.tensors[n] for n in names))
    out = _transform(ir, "output_mod", "o", "q_idx", out, bindings)
    return out, (lse if ir.use_softmax else None)


def backward_of_saved(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                      dlse: torch.Tensor | None, ir: VariantIR, bindings: Bindings,
                      block_mask: Any, scale: float | None, enable_gqa: bool,
                      kernel_options: Mapping[str, Any] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                 dict[str, torch.Tensor]] | None:
    # (sinks: the LSE saved includes them, and the kernels' dS is the same; the op's backward
    # adds their own gradient with sinks_grad)
    """The backward of a forward whose `out` and `lse` were saved elsewhere (the torch.library
    op's, runtime/flex/ops.py): (dq, dk, dv, gradients of every float tensor the score_mod
    reads). The op cannot see which captured tensors require grad, so all of them get one.
    None where this path does not apply: transforms (the op's reference differentiates them),
    a tensor that the mask reads too, or head dims the backward kernels do not take.
    `kernel_options`: the forward call's (DETERMINISTIC, BACKWARD_KERNEL, FAST_MATH and the
    tile options apply to the backward as they do in an eager call)."""
    from .backward import backward_head_dims_why

    if attention_ir(ir) is not ir or backward_head_dims_why(query.shape[-1],
                                                           value.shape[-1]) is not None:
        return None
    score_reads = _loads(ir, "score_mod")
    if score_reads & _loads(ir, "mask_mod"):
        return None
    names = tuple(t.name for t in ir.tensors if t.name in score_reads
                  and isinstance(bindings.tensors.get(t.name), torch.Tensor)
                  and bindings.tensors[t.name].is_floating_point())
    call = _Call(ir, bindings, block_mask, scale, enable_gqa, kernel_options, names)
    res = _run(call, query, key, value, out, lse if ir.use_softmax else None, dout,
               dlse if ir.use_softmax else None)
    return res.dq, res.dk, res.dv, res.captured
