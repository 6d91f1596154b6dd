"""The backward oracle: dQ/dK/dV and captured-tensor gradients from the derived expressions only.

`attention_backward_reference` computes what a backward kernel computes, the same way: it
recomputes P from (q, k, v) and the forward hooks, runs the standard softmax backward, and
applies the score_mod's derivatives as attncc.ir.autodiff derives them and the backward
kernels' `LogitsGrad` / `CapturedGrad` hooks emit them (docs/backward.md, sections 1-3):

    s = (q' . k') * scale,  s' = score_mod(s),  P = softmax(s' over kept keys)  [or P = s' kept]
    dV' = P^T dO',  dP = dO' V'^T,  dS' = P * (dP - rowsum(dO' * O)) + P * dLSE  [or dS' = dP]
    dS = dS' * LogitsGrad(s)  (0 where masked),  dQ' = dS K' * scale,  dK' = dS^T Q' * scale
    t.grad[idx_r] += sum over kept (q, kv) of dS' * (d score_mod / d t[idx_r])  for every read r

The score_mod is never differentiated by torch here: only its derived expressions are
evaluated (attncc.ir.evaluator, float64), so comparing this with `torch.autograd` through
`runtime/reference.py` checks the derivation. The query/key/value/output transforms are
differentiated by torch autograd through the evaluator on the materialized rows, as the backward
kernels' launcher does. GQA: a kv head's gradients sum over its query heads. A fully masked row
(no kept key, or every kept score -inf) contributes nothing: zero gradients, never NaN.
O(B * Hq * Sq * Skv) memory: an oracle for tests, not a training path.

Example:
    >>> import torch
    >>> from attncc.frontend import Variant
    >>> ir, bind = Variant(score_mod=lambda s, b, h, q, kv: torch.tanh(s)).trace()
    >>> q, k, v, do = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(4))
    >>> g = attention_backward_reference(q, k, v, do, ir, bind)
    >>> q.requires_grad_(); k.requires_grad_(); v.requires_grad_()  # doctest: +ELLIPSIS
    tensor(...)
    >>> from attncc.runtime.reference import attention_reference
    >>> out, _ = attention_reference(q, k, v, ir, bind)
    >>> dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    >>> all(torch.allclose(a, b) for a, b in ((g.dq, dq), (g.dk, dk), (g.dv, dv)))
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from attncc.errors import InvalidArgument
from attncc.ir.autodiff import ScoreModGrad, score_mod_grad
from attncc.ir.evaluator import evaluate
from attncc.ir.nodes import Node
from attncc.ir.program import Bindings, VariantIR

from .reference import (block_size, block_states, is_noop_mask, trace_mask,
                        validate_attention_inputs)

__all__ = ["BackwardResult", "attention_backward_reference"]


@dataclass
class BackwardResult:
    """Gradients of the attention inputs (float_dtype, the inputs' shapes) and of each captured
    tensor asked for (float_dtype, the tensor's shape)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    captured: dict[str, torch.Tensor] = field(default_factory=dict)


def _index(n: int, dim: int, device: torch.device) -> torch.Tensor:
    shape = [1, 1, 1, 1]
    shape[dim] = n
    return torch.arange(n, device=device).view(shape)


class _Eval:
    """The variant's hooks evaluated on torch tensors in float_dtype (captured reads clamped:
    the forward already rejected a read outside its tensor at a position that counts)."""

    def __init__(self, ir: VariantIR, bindings: Bindings, device: torch.device,
                 fdt: torch.dtype) -> None:
        self.ir, self.fdt = ir, fdt
        self.params = dict(bindings.scalars)
        self.tensors = {n: t.detach().to(device) for n, t in bindings.tensors.items()}

    def __call__(self, expr: Node, env: dict[str, Any], tensors: dict | None = None
                 ) -> torch.Tensor:
        return evaluate(expr, env, tensors if tensors is not None else self.tensors,
                        self.params, self.fdt, oob={})

    def transform(self, hook: str, vec: str, x: torch.Tensor, pos: str) -> torch.Tensor:
        h = self.ir.hook(hook)
        if h.is_identity:
            return x
        B, H, S, D = x.shape
        dev = x.device
        env = {vec: x, "b": _index(B, 0, dev), "h": _index(H, 1, dev), pos: _index(S, 2, dev),
               "d": _index(D, 3, dev)}
        return self(h.expr, env).expand(B, H, S, D)


def _keep(ev: _Eval, env: dict[str, Any], block_mask: Any, shape: tuple[int, ...],
          device: torch.device) -> torch.Tensor:
    """[B, Hq, Sq, Skv] bool: the positions the variant's mask and the block mask keep."""
    keep = torch.ones(shape, dtype=torch.bool, device=device)
    if not ev.ir.hook("mask_mod").is_identity:
        keep = keep & ev(ev.ir.expr("mask_mod"), env).expand(shape)
    if block_mask is not None:
        Sq, Skv = shape[2], shape[3]
        bq, bkv = block_size(block_mask)
        st = block_states(block_mask, Skv, device)
        st = st[:, :, torch.arange(Sq, device=device) // bq][..., torch.arange(Skv, device=device)
                                                             // bkv]
        kept = st == 2
        if not is_noop_mask(getattr(block_mask, "mask_mod", None)):
            bm_ir, bm_bind = trace_mask(block_mask.mask_mod)
            bm = _Eval(bm_ir, bm_bind, device, ev.fdt)
            kept = kept | ((st == 1) & bm(bm_ir.expr("mask_mod"), env))
        else:
            kept = kept | (st == 1)
        keep = keep & kept.expand(shape)
    return keep


def _scatter_captured(ev: _Eval, grad: ScoreModGrad, env: dict[str, Any], ds_out: torch.Tensor,
                      keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """`t.grad[idx_r] += dS' * d mod / d t[idx_r]` over kept positions, for every read r."""
    out = {t: torch.zeros(ev.tensors[t].shape, dtype=ev.fdt, device=ds_out.device)
           for t in {r.tensor for r in grad.reads}}
    shape = ds_out.shape
    for r in grad.reads:
        contrib = torch.where(keep, ds_out * ev(r.grad, env).expand(shape), 0)
        acc = out[r.tensor]
        idx = [ev(i, env).expand(shape).long() for i in r.indices]
        for dim, i in enumerate(idx):  # a masked position may index anywhere: keep it in range
            idx[dim] = torch.where(keep, i, 0).clamp(0, max(acc.shape[dim] - 1, 0))
        acc.index_put_(tuple(idx), contrib, accumulate=True)
    return out


def attention_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 dout: torch.Tensor, ir: VariantIR,
                                 bindings: Bindings | None = None, *,
                                 grad_tensors: Sequence[str] = (), block_mask: Any = None,
                                 scale: float | None = None, enable_gqa: bool = False,
                                 dlse: torch.Tensor | None = None,
                                 float_dtype: torch.dtype = torch.float64) -> BackwardResult:
    """Gradients of `attention_reference(q, k, v, ir, bindings, ...)`'s output (and LSE, with
    `dlse`) given `dout`, from the derived expressions only (module doc). `grad_tensors` names
    captured tensors whose gradients to return (`BackwardResult.captured`)."""
    validate_attention_inputs(q, k, v, block_mask, enable_gqa)
    bindings = bindings if bindings is not None else Bindings()
    if tuple(dout.shape) != (*q.shape[:3], v.shape[3]):
        raise InvalidArgument(f"dout has shape {tuple(dout.shape)}; the output's is "
                              f"{(*q.shape[:3], v.shape[3])}")
    if dlse is not None and not ir.use_softmax:
        raise InvalidArgument("dlse: normalize='none' has no LSE")
    grad = score_mod_grad(ir, grad_tensors)
    device, fdt = q.device, float_dtype
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    ev = _Eval(ir, bindings, device, fdt)

    qd, kd, vd = (x.detach().to(fdt).requires_grad_(True) for x in (q, k, v))
    with torch.enable_grad():
        qf = ev.transform("query_mod", "q", qd, "q_idx")
        kf = ev.transform("key_mod", "k", kd, "kv_idx")
        vf = ev.transform("value_mod", "v", vd, "kv_idx")
    qt, kt, vt = (x.detach() for x in (qf, kf, vf))
    kg, vg = kt.repeat_interleave(G, 1), vt.repeat_interleave(G, 1)  # [B, Hq, Skv, .]

    s = (qt @ kg.transpose(-1, -2)) * scale
    env = {"score": s, "b": _index(B, 0, device), "h": _index(Hq, 1, device),
           "q_idx": _index(Sq, 2, device), "kv_idx": _index(Skv, 3, device)}
    shape = (B, Hq, Sq, Skv)
    s_mod = ev(ir.expr("score_mod"), env).expand(shape) if "score_mod" in ir.hooks else s
    keep = _keep(ev, env, block_mask, shape, device)
    if ir.use_softmax:
        p = _probabilities(s_mod, keep)
    else:
        p = torch.where(keep, s_mod, 0)
    o = p @ vg
    do = _output_grad(ev, o, dout.detach().to(fdt))
    dv_t = (p.transpose(-1, -2) @ do)
    dp = do @ vg.transpose(-1, -2)
    if ir.use_softmax:
        delta = (do * o).sum(-1, keepdim=True)
        ds_out = p * (dp - delta)
        if dlse is not None:
            ds_out = ds_out + p * dlse.detach().to(fdt)[..., None]
    else:
        ds_out = dp
    ds_out = torch.where(keep, ds_out, 0)
    ds = ds_out if not grad.has_logits_grad else torch.where(
        keep, ds_out * ev(grad.logits, env).expand(shape), 0)
    dq_t = (ds @ kg) * scale
    dk_t = (ds.transpose(-1, -2) @ qt) * scale
    dk_t = dk_t.reshape(B, Hkv, G, Skv, -1).sum(2)
    dv_t = dv_t.reshape(B, Hkv, G, Skv, -1).sum(2)
    dq, dk, dv = (_vjp(y, x, g) for y, x, g in ((qf, qd, dq_t), (kf, kd, dk_t), (vf, vd, dv_t)))
    return BackwardResult(dq, dk, dv, _scatter_captured(ev, grad, env, ds_out, keep))


def _vjp(y: torch.Tensor, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """`gy`'s vector-Jacobian product through a transform y = f(x) (zeros if y ignores x)."""
    if not y.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(y, x, gy, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def _probabilities(s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over kept keys; a row with no weight (all masked or -inf) is all zeros."""
    s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), -math.inf)
    m = torch.where(m == -math.inf, 0, m)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    return torch.where(denom == 0, 0, e / torch.where(denom == 0, 1, denom))


def _output_grad(ev: _Eval, o: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """dO' = d output_mod / d o applied to dout (torch autograd through the evaluator)."""
    if ev.ir.hook("output_mod").is_identity:
        return dout
    od = o.detach().requires_grad_(True)
    with torch.enable_grad():
        out = ev.transform("output_mod", "o", od, "q_idx")
    return _vjp(out, od, dout)
