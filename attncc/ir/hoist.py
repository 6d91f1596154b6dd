"""Hoisting transforms out of attention: one variant becomes a pre-pass and the rest.

`query_mod`, `key_mod` and `value_mod` read only their own row and its position (`q`/`k`/`v`,
`b`, `h`, `q_idx`/`kv_idx`, `d`) and captured values -- never the other side of attention.
Inside an attention kernel the key/value ones still run once per query block that loads the
tile (S_q / T_q times per key, times the query heads sharing the KV head), so a RoPE on keys
costs more than the attention; the query one runs once per row but on the CTA's critical path.
Split off, they run once per row in a pre-pass (kernels/small/prepass.cuh) that writes transformed
copies, and the attention runs with identity hooks on those copies. Both paths round the
transformed row to the storage type before the GEMMs, so the results agree.

`split_transforms` is a pure function of the IR; whether hoisting pays (the pre-pass reads and
writes the tensor once more) is the runtime's choice, with `kv_loads_per_row`.

Example:
    >>> from attncc.ir.nodes import var, vec
    >>> from attncc.ir.program import Hook, VariantIR
    >>> ir = VariantIR(hooks={"key_mod": Hook("key_mod", vec("k", var("d")) * 2.0),
    ...                       "mask_mod": Hook("mask_mod", var("q_idx") >= var("kv_idx"))},
    ...                name="double_k")
    >>> pre, rest = split_transforms(ir, KV_HOOKS)
    >>> sorted(pre.hooks), sorted(rest.hooks), pre.name
    (['key_mod'], ['mask_mod'], 'double_k_pre')
    >>> split_transforms(rest, PREPASS_HOOKS)[0] is None
    True
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from .nodes import walk
from .program import VariantIR

KV_HOOKS = ("key_mod", "value_mod")
PREPASS_HOOKS = ("query_mod", "key_mod", "value_mod")  # the hooks a pre-pass can run


def transforms_in(ir: VariantIR, hooks: Iterable[str] = PREPASS_HOOKS) -> tuple[str, ...]:
    """Which of `hooks` `ir` has as something other than its identity.

    Example:
        >>> transforms_in(VariantIR())
        ()
    """
    return tuple(h for h in hooks if not ir.hook(h).is_identity)


def _keep_captures(ir: VariantIR) -> VariantIR:
    """`ir` with only the captured scalars and tensors its hooks read (in their order)."""
    used = {(n.op, n.attr) for h in ir.hooks.values() for n in walk(h.expr)
            if n.op in ("param", "load")}
    return replace(ir, scalars=tuple(p for p in ir.scalars if ("param", p.name) in used),
                   tensors=tuple(t for t in ir.tensors if ("load", t.name) in used))


def split_transforms(ir: VariantIR, hooks: Iterable[str]) -> tuple[VariantIR | None, VariantIR]:
    """`(prepass, attention)`: the variant's non-identity hooks among `hooks` (a subset of
    PREPASS_HOOKS) alone, named `<name>_pre`, normalize unchanged, with only the captures they
    read; and the variant without them. `(None, ir)` when there is nothing to move.

    Example:
        >>> split_transforms(VariantIR(name="plain"), KV_HOOKS)
        (None, VariantIR(hooks={}, normalize='softmax', name='plain', scalars=(), tensors=()))
    """
    wanted = set(hooks)
    if not wanted <= set(PREPASS_HOOKS):
        raise ValueError(f"only {', '.join(PREPASS_HOOKS)} can run in a pre-pass, not "
                         f"{', '.join(sorted(wanted - set(PREPASS_HOOKS)))}")
    moved = {n: h for n, h in ir.hooks.items() if n in wanted and not h.is_identity}
    if not moved:
        return None, ir
    pre = _keep_captures(replace(ir, hooks=moved, name=f"{ir.name}_pre"))
    rest = _keep_captures(replace(ir, hooks={n: h for n, h in ir.hooks.items()
                                             if n not in moved}))
    return pre, rest


def kv_loads_per_row(*, q_len: int, num_q_heads: int, num_kv_heads: int, rows_per_cta: int,
                     head_fusion: int = 1) -> int:
    """How many CTAs of an attention grid load each K/V row (at most; masks skip some): the
    query blocks of one head times the query heads (or fused head groups) sharing a KV head.
    An in-kernel key/value transform runs that many times per row; the pre-pass runs once and
    costs one more read and write of K/V, so hoisting pays from 2 loads on.

    Example:
        >>> kv_loads_per_row(q_len=8192, num_q_heads=32, num_kv_heads=8, rows_per_cta=128)
        256
        >>> kv_loads_per_row(q_len=1, num_q_heads=32, num_kv_heads=8, rows_per_cta=16,
        ...                  head_fusion=4)
        1
    """
    rows = q_len * head_fusion  # a fused CTA covers head_fusion heads' rows of the same positions
    return -(-rows // rows_per_cta) * (num_q_heads // head_fusion) // num_kv_heads
