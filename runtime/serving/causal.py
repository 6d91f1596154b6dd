"""Causal clipping of a staged plan's work units, and the L2 sections its CTA queues are
rebalanced in (docs/serving.md#causal-clipping-and-l2-sections).

A plan has no block lists: every tile of a unit's KV range runs. When the variant's mask
provably keeps no key past `q_idx + bound` (attncc.ir.kv_bound), `clip_causal_units` ends each
unit's range there, in the staged words, and rebalances the queues on the clipped costs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from attncc.codegen import constants
from attncc.ir.program import VariantIR

from .plan import scheduler
from .plan.lpt import lpt_schedule

__all__ = ["L2_SECTION_BYTES", "clip_causal_units", "mask_causal_bound", "section_tokens"]

L2_SECTION_BYTES = constants.L2_SECTION_BYTES
"""K/V bytes of the (request, KV head) pairs a causal prefill plan's CTAs work on at a time
(`clip_causal_units`' sections; 12 MiB of the H100 / H200's 50 MB L2, as the dense FA3 kernel's
ATTNCC_FA3_L2_SECTION_BYTES: both read attncc.codegen.constants), for K and V of q_data_type's
element size. Paged causal prefill is insensitive to 12 vs 24 MiB, the dense
kernel prefers 12 (docs/serving.md#causal-clipping-and-l2-sections)."""


def clip_causal_units(buf: np.ndarray, layout: scheduler.PlanLayout, qo: np.ndarray,
                      kv_lens: np.ndarray, group: int, bound: int, qpos: np.ndarray | None = None,
                      kvoff: np.ndarray | None = None, section_tokens: int | None = None) -> None:
    """End every packed work unit's KV range where its mask keeps nothing more: a mask with
    kv_idx <= q_idx + bound (attncc.ir.kv_bound) keeps no key past its unit's last query
    position + bound, so a causal prefill tile stops at its diagonal instead of its request's
    end -- about half a causal prefill's tiles, which the kernels would only mask away. A unit
    whose range becomes empty writes an empty partial state (the merge skips it). The CTA
    queues are then rebalanced (longest first) on the clipped costs. In place, on
    the staged plan words `buf` (the positions the hooks see: `qpos` per query token if given,
    else kv_len - q_len + t; keys shifted by `kvoff` per request if given).

    `section_tokens`: rebalance in L2 sections -- the (request, KV head) pairs in order, cut
    wherever their K/V passes another `section_tokens` tokens, each section's units assigned
    (longest first) before the next one's (`lpt_schedule(section=...)`). Longest first over the
    whole batch starts every head's longest query tile at once: at S = 2048 x 128 heads the
    first rounds then read ~128 heads' K/V, more than the L2 holds, where the sections keep the
    CTAs on a few heads at a time (the dense FA3 kernel's item order does the same).

    Example:
        >>> from attncc.runtime.serving.plan import scheduler
        >>> lay = scheduler.PlanLayout(4, 64, 2, 1, 1, 16)
        >>> buf = np.zeros(lay.size, np.int32)
        >>> qo, kv = np.array([0, 40]), np.array([40])
        >>> scheduler.plan_into(buf, lay, qo, kv, 1, 1, 16, 2, kv_chunk_align=16, min_kv_chunk=16)
        >>> clip_causal_units(buf, lay, qo, kv, 1, 0)
        >>> u = lay.unpack(buf)["units"].view(np.int32).reshape(3, 8)
        >>> u[:, [3, 4, 5, 6]].tolist()   # q rows [start, +rows) -> keys [start, end)
        [[0, 16, 0, 16], [16, 16, 0, 32], [32, 8, 0, 40]]
    """
    p = layout.unpack(buf)  # views: the writes below land in `buf`
    u = p["units"]
    req, q_start = u["request"], u["q_start"]
    first_tok, last_tok = q_start // group, (q_start + u["q_rows"] - 1) // group
    if qpos is None:
        q_max = kv_lens[req] - (qo[req + 1] - qo[req]) + last_tok
    else:  # the largest given position among each unit's tokens
        q_max = np.array([qpos[o + f:o + t + 1].max() for o, f, t in
                          zip(qo[req].tolist(), first_tok.tolist(), last_tok.tolist())],
                         dtype=np.int64).reshape(-1)
    limit = q_max + bound + 1 - (kvoff[req] if kvoff is not None else 0)
    heads = u["kv_heads"].astype(np.int64)
    before = int(((u["kv_end"] - u["kv_start"]) * heads).sum())
    u["kv_end"] = np.clip(limit, u["kv_start"], u["kv_end"])
    keys = u["kv_end"] - u["kv_start"]
    # The CTA queues were balanced on the unclipped costs, and the clipped units of a causal
    # prefill range from empty to whole: balance them again (same cost rule as the scheduler,
    # alpha = beta = 1, times the unit's KV heads) unless clipping removed under a tenth of the
    # keys (a mixed step with one short prefill chunk: not worth the host time). Merges sum
    # their slots in the plan's order, whatever CTA ran them, so the output bits do not depend
    # on the new queues. (A unit's heads share its rows and KV range: one clip fits them all.)
    if 10 * (before - int((keys * heads).sum())) < before:
        return
    section = None
    if section_tokens:
        hk = layout.num_kv_heads
        kv = np.asarray(kv_lens, dtype=np.int64)
        pair0 = hk * (np.cumsum(kv) - kv)  # K/V tokens of the pairs of the requests before
        section = (pair0[req] + u["kv_head"] * kv[req]) // int(section_tokens)
    p["cta_indptr"][:], p["cta_units"][:] = lpt_schedule(
        (u["q_rows"].astype(np.int64) + keys) * heads, p["num_ctas"], section=section)


def section_tokens(kernel: str, head_dim: int, dtype: Any) -> int | None:
    """`clip_causal_units`' L2 sections for the FA3 batch kernel: the tokens of K and V of
    `dtype` (a torch dtype) that fill `L2_SECTION_BYTES`; None for FA2 (`kernel` "fa2"), whose
    paged causal prefill the sectioned order slowed down.

    Example:
        >>> import torch
        >>> section_tokens("fa3", 128, torch.bfloat16), section_tokens("fa2", 128, torch.bfloat16)
        (24576, None)
    """
    if kernel != "fa3":
        return None
    return L2_SECTION_BYTES // (2 * head_dim * dtype.itemsize)


def mask_causal_bound(ir: VariantIR) -> int | None:
    """`attncc.ir.kv_bound.causal_bound` of the variant's simplified mask: the `c` with every
    kept key at `kv_idx <= q_idx + c`; None with no mask, or no bound its structure proves.

    Example:
        >>> import attncc
        >>> causal = lambda b, h, q, kv: q >= kv
        >>> mask_causal_bound(attncc.Variant(mask_mod=causal).trace()[0])
        0
        >>> mask_causal_bound(attncc.Variant().trace()[0]) is None
        True
    """
    from attncc.ir.kv_bound import causal_bound
    from attncc.ir.simplified import simplify_variant

    mask = simplify_variant(ir).hook("mask_mod")
    return None if mask.is_identity else causal_bound(mask.expr)
