"""Hoisting key/value transforms out of attention: one variant becomes a pre-pass and the rest.

`key_mod` and `value_mod` read only the key/value row and its position (`k`, `b`, `h` = the KV
head, `kv_idx`, `d`) and captured values -- nothing of the query. Inside an attention kernel they
still run once per query block that loads the tile (S_q / T_q times per key, times the query heads
sharing the KV head), so a RoPE on keys costs more than the attention. Split off, they run once
per K/V row in a pre-pass (kernels/kv_transform.cuh) that writes transformed copies, and the
attention runs with identity key/value hooks on those copies. Both paths round the transformed
row to the storage type before the GEMMs, so the results agree.

`split_kv_transforms` is a pure function of the IR; whether hoisting pays (the pre-pass reads and
writes K/V once more) is the runtime's choice: `kv_loads_per_row`.

Example:
    >>> from attncc.ir.nodes import var, vec
    >>> from attncc.ir.program import Hook, VariantIR
    >>> ir = VariantIR(hooks={"key_mod": Hook("key_mod", vec("k", var("d")) * 2.0),
    ...                       "mask_mod": Hook("mask_mod", var("q_idx") >= var("kv_idx"))},
    ...                name="double_k")
    >>> pre, rest = split_kv_transforms(ir)
    >>> sorted(pre.hooks), sorted(rest.hooks), pre.name
    (['key_mod'], ['mask_mod'], 'double_k_kv')
    >>> split_kv_transforms(rest)[0] is None
    True
"""
from __future__ import annotations

from dataclasses import replace

from .nodes import walk
from .program import VariantIR

KV_HOOKS = ("key_mod", "value_mod")


def has_kv_transforms(ir: VariantIR) -> bool:
    """Whether `ir` has a key_mod or value_mod that is not its identity.

    Example:
        >>> has_kv_transforms(VariantIR())
        False
    """
    return any(not ir.hook(h).is_identity for h in KV_HOOKS)


def _keep_captures(ir: VariantIR) -> VariantIR:
    """`ir` with only the captured scalars and tensors its hooks read (in their order)."""
    used = {(n.op, n.attr) for h in ir.hooks.values() for n in walk(h.expr)
            if n.op in ("param", "load")}
    return replace(ir, scalars=tuple(p for p in ir.scalars if ("param", p.name) in used),
                   tensors=tuple(t for t in ir.tensors if ("load", t.name) in used))


def split_kv_transforms(ir: VariantIR) -> tuple[VariantIR | None, VariantIR]:
    """`(prepass, attention)`: the variant's non-identity key/value hooks alone (named
    `<name>_kv`, normalize unchanged, only the captures they read), and the variant without
    them. `(None, ir)` when there is nothing to hoist.

    Example:
        >>> split_kv_transforms(VariantIR(name="plain"))
        (None, VariantIR(hooks={}, normalize='softmax', name='plain', scalars=(), tensors=()))
    """
    moved = {n: h for n, h in ir.hooks.items() if n in KV_HOOKS and not h.is_identity}
    if not moved:
        return None, ir
    pre = _keep_captures(replace(ir, hooks=moved, name=f"{ir.name}_kv"))
    rest = _keep_captures(replace(ir, hooks={n: h for n, h in ir.hooks.items()
                                             if n not in KV_HOOKS}))
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
