"""Analyses of a variant's hooks: what each reads, which are identities, static index checks.

Codegen and the runtime use these to specialise: a mask that never reads `b` or `h` needs one
block mask for all batches and heads; an identity hook produces no code; a transform that reads
its head vector out of range is a user error caught before any kernel runs.

Example:
    >>> from attncc.ir.nodes import var
    >>> from attncc.ir.program import Hook, VariantIR
    >>> info = analyze(VariantIR(hooks={"mask_mod": Hook("mask_mod", var("q_idx") >= var("kv_idx"))}))
    >>> info.mask_depends_on_bh, sorted(info.reads["mask_mod"]), info.identity["score_mod"]
    (False, ['kv_idx', 'q_idx'], True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ..errors import TraceError
from .evaluator import EvalError, evaluate
from .nodes import Node, free_vars, walk
from .printer import format_expr
from .program import HOOK_ORDER, HOOK_SIGNATURES, TRANSFORM_HOOKS, VariantIR, identity_expr

__all__ = ["VariantInfo", "analyze", "check_vector_indices", "reads"]


def reads(expr: Node) -> frozenset[str]:
    """The index variables (b, h, q_idx, kv_idx, d) and `score` that `expr` reads.

    Indices of captured-tensor loads count: `doc_ids[b, q_idx]` reads b and q_idx.

    Example:
        >>> from attncc.ir.nodes import var, load, binary, I32
        >>> sorted(reads(binary("eq", load("doc_ids", (var("b"), var("q_idx")), I32), var("kv_idx"))))
        ['b', 'kv_idx', 'q_idx']
    """
    return free_vars(expr)


@dataclass(frozen=True)
class VariantInfo:
    """Facts about a simplified variant, for codegen and the runtime.

    `reads` and `identity` have an entry for each of the six hooks (a missing hook is its
    identity). The `*_depends_on_*` flags are False when the hook is absent.
    """

    reads: dict[str, frozenset[str]]
    identity: dict[str, bool]
    mask_depends_on_bh: bool
    mask_depends_on_b: bool
    mask_depends_on_h: bool
    score_depends_on_bh: bool


def analyze(ir: VariantIR) -> VariantInfo:
    """Simplify `ir` and report what each hook reads and which hooks are identities.

    Example:
        >>> from attncc.ir.nodes import var, load, binary, I32
        >>> from attncc.ir.program import Hook, VariantIR
        >>> doc = lambda i: load("doc_ids", (var("b"), var(i)), I32)
        >>> m = binary("eq", doc("q_idx"), doc("kv_idx"))
        >>> info = analyze(VariantIR(hooks={"mask_mod": Hook("mask_mod", m)}))
        >>> info.mask_depends_on_b, info.mask_depends_on_h, info.mask_depends_on_bh
        (True, False, True)
    """
    from .simplify import simplify_variant  # sympy: loaded only by the analyses that need it

    simple = simplify_variant(ir)
    exprs = {h: simple.expr(h) for h in HOOK_ORDER}
    read = {h: reads(e) for h, e in exprs.items()}
    identity = {h: exprs[h] is identity_expr(h) for h in HOOK_ORDER}
    mask_b = not identity["mask_mod"] and "b" in read["mask_mod"]
    mask_h = not identity["mask_mod"] and "h" in read["mask_mod"]
    score_bh = not identity["score_mod"] and bool({"b", "h"} & read["score_mod"])
    return VariantInfo(reads=read, identity=identity, mask_depends_on_bh=mask_b or mask_h,
                       mask_depends_on_b=mask_b, mask_depends_on_h=mask_h,
                       score_depends_on_bh=score_bh)


def _static_index(idx: Node, params: Mapping[str, int | float]) -> bool:
    """Whether `idx` can be evaluated for every d knowing only d, constants and `params`."""
    for n in walk(idx):
        if n.op in ("load", "vec"):
            return False
        if n.op == "var" and n.attr != "d":
            return False
        if n.op == "param" and n.attr not in params:
            return False
    return True


def check_vector_indices(ir: VariantIR, head_dim: int,
                         params: Mapping[str, int | float] | None = None,
                         v_head_dim: int | None = None) -> None:
    """Raise TraceError if a transform reads its head vector outside [0, head_dim).

    Each `q[idx]` / `k[idx]` / `v[idx]` / `o[idx]` whose index depends only on `d`, constants and
    captured scalars given in `params` is evaluated for every d in range(head_dim). Indices that
    read b, h, q_idx, kv_idx or tensors cannot be checked statically and are skipped.
    `v_head_dim` is the head dim of value_mod/output_mod when it differs from q/k's.

    Example:
        >>> from attncc.ir.nodes import var, vec, const, binary
        >>> from attncc.ir.program import Hook, VariantIR
        >>> wrapped = binary("mod", var("d") + 1, const(64))
        >>> ok = VariantIR(hooks={"query_mod": Hook("query_mod", vec("q", wrapped))})
        >>> check_vector_indices(ok, 64)
        >>> bad = VariantIR(hooks={"query_mod": Hook("query_mod", vec("q", var("d") + 1))})
        >>> check_vector_indices(bad, 64)
        Traceback (most recent call last):
          ...
        attncc.errors.TraceError: query_mod reads q[d + 1] at index 64 (for d = 63), outside the head vector [0, 64)
          hint: use `% D` to wrap (D = 64 here), e.g. q[(d + D // 2) % D]
    """
    params = dict(params or {})
    for hook_name in TRANSFORM_HOOKS:
        hook = ir.hooks.get(hook_name)
        if hook is None:
            continue
        dim = head_dim if hook_name in ("query_mod", "key_mod") or v_head_dim is None \
            else v_head_dim
        d = torch.arange(dim)
        where = f"{hook.source}: " if hook.source is not None else ""
        vecname = HOOK_SIGNATURES[hook_name][2]
        for n in walk(hook.expr):
            if n.op != "vec" or not _static_index(n.args[0], params):
                continue
            text = f"{n.attr}[{format_expr(n.args[0])}]"
            try:
                got = evaluate(n.args[0], {"d": d}, params=params).expand(dim)
            except EvalError as e:
                raise TraceError(f"{where}{hook_name} reads {text}, whose index cannot be "
                                 f"computed: {e}\n  hint: index the head vector with an integer "
                                 f"expression of d in [0, {dim}), e.g. "
                                 f"{vecname}[(d + D // 2) % D]") from None
            bad = (got < 0) | (got >= dim)
            if not bool(bad.any()):
                continue
            ds = d[bad]
            vals = got[bad]
            at = (f"index {int(vals[0])} (for d = {int(ds[0])})" if len(ds) == 1 else
                  f"indices {int(vals.min())}..{int(vals.max())} (for d in "
                  f"{int(ds.min())}..{int(ds.max())})")
            raise TraceError(f"{where}{hook_name} reads {text} at {at}, outside the head vector "
                             f"[0, {dim})\n  hint: use `% D` to wrap (D = {dim} here), e.g. "
                             f"{n.attr}[(d + D // 2) % D]")
