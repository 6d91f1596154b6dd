"""Cascade attention: a KV prefix shared by every request of a batch, plus each request's suffix.

FlashInfer's composable formats (arXiv 2501.01005, §3.1.2). With a shared prefix (a system
prompt, or many samples of one prompt), a single-format batch loads the prefix's KV once per
request. Cascade attention splits the work into two BatchAttention passes:

1. the prefix, as ONE request whose queries are all the batch's query tokens: the head-group
   fused tiles then hold many requests' queries, so each prefix KV tile is read once for all of
   them (the seed's large-B_r block row);
2. each request's own suffix pages (block rows of one request, as in a normal batch);

and merges the two attention states with the composition operator (one launch of
`merge_fitting_states`, or `merge_pair` where the states do not fit that kernel). No KV data
moves: both passes read the same paged cache through different page lists. The hooks see true
positions in both passes: query token t of request i is position `P + s_i - q_i + t` (P prefix
tokens, s_i suffix tokens, q_i queries: the queries are the last tokens of prefix + suffix), and
suffix token j is position `P + j`.

Limits: the variant may not read the batch index `b` (in the prefix pass every query belongs to
one merged request) and may not have an `output_mod` (it must apply after the merge, not per
part). Paged layouts only ("NHD", "HND").

Example (CPU: planning and its checks; `run` needs a GPU):
    >>> ca = CascadeAttention(None, device="cpu")
    >>> ca.plan([0, 1, 2], prefix_indices=[7, 8], prefix_last_page_len=16,
    ...         suffix_indptr=[0, 1, 2], suffix_indices=[3, 4], suffix_last_page_len=[5, 16],
    ...         num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    >>> ca.prefix_len, ca.q_positions.tolist()
    (32, [36, 47])
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attncc.errors import InvalidArgument
from attncc.frontend import Variant

from .batch import BatchAttention
from .plan.checks import np_int
from .merge import merge_pair
from .merge_kernel import fits_kernel, merge_fitting_states

__all__ = ["CascadeAttention"]


class CascadeAttention:
    """Shared-prefix + per-request-suffix attention (see the module docstring)."""

    def __init__(self, variant: Variant | None = None, kv_layout: str = "NHD", *,
                 max_batch: int = 256, max_qo_tokens: int = 16384, max_pages: int = 1 << 20,
                 device: Any = "cuda") -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout={kv_layout!r}: CascadeAttention works on paged caches "
                             f"('NHD' or 'HND')")
        if variant is not None:
            from attncc.ir.analysis import reads  # sympy: only when a variant needs checking

            ir, _ = variant.trace()
            if any("b" in reads(h.expr) for h in ir.hooks.values()):
                raise ValueError("the variant reads the batch index `b`; in cascade attention the "
                                 "shared prefix is attended by all requests at once, so `b` has "
                                 "no single value there -- use BatchAttention for this variant")
            if "output_mod" in ir.hooks and not ir.hook("output_mod").is_identity:
                raise ValueError("the variant has an output_mod, which must apply to the merged "
                                 "result; use BatchAttention for this variant")
            self._softmax = ir.use_softmax
        else:
            self._softmax = True
        kw = dict(kv_layout=kv_layout, max_qo_tokens=max_qo_tokens, max_pages=max_pages,
                  device=device)
        self.prefix = BatchAttention(variant, max_batch=1, **kw)  # type: ignore[arg-type]
        self.suffix = BatchAttention(variant, max_batch=max_batch, **kw)  # type: ignore[arg-type]

    def plan(self, qo_indptr: Any, *, prefix_indices: Any, prefix_last_page_len: int,
             suffix_indptr: Any, suffix_indices: Any, suffix_last_page_len: Any,
             num_qo_heads: int, num_kv_heads: int, head_dim: int | None = None,
             page_size: int, q_data_type: torch.dtype = torch.bfloat16,
             kv_data_type: torch.dtype | None = None, head_dim_qk: int | None = None,
             head_dim_vo: int | None = None) -> None:
        """Plan both passes. `prefix_indices`: the shared prefix's page ids (in order);
        `prefix_last_page_len`: tokens in its last page. `suffix_*`: each request's own pages,
        as `BatchAttention.plan` takes them (and `q_data_type`, `kv_data_type`: an fp8 cache,
        which `run` reads with its k_scale / v_scale; `head_dim` or `head_dim_qk`, and
        `head_dim_vo`: the head dims). Every request's queries must be suffix tokens."""
        qo = np_int(qo_indptr, "qo_indptr")
        pre = np_int(prefix_indices, "prefix_indices")
        last = int(prefix_last_page_len)
        if pre.size and not 1 <= last <= page_size:
            raise ValueError(f"prefix_last_page_len={last} must be in 1..page_size={page_size}")
        P = (pre.size - 1) * page_size + last if pre.size else 0
        sptr = np_int(suffix_indptr, "suffix_indptr")
        slast = np_int(suffix_last_page_len, "suffix_last_page_len")
        if sptr.size != qo.size or slast.size != qo.size - 1:
            raise ValueError(f"suffix_indptr / suffix_last_page_len must describe the "
                             f"{qo.size - 1} requests of qo_indptr")
        npages = np.diff(sptr)
        s_len = np.where(npages > 0, (npages - 1) * page_size + slast, 0)
        q_len = np.diff(qo)
        if np.any(q_len > s_len):
            i = int(np.argmax(q_len > s_len))
            raise ValueError(f"request {i} has {int(q_len[i])} query tokens but a suffix of "
                             f"{int(s_len[i])} tokens: its queries must be suffix tokens")
        # true positions: query t of request i sits at P + s_i - q_i + t
        req = np.repeat(np.arange(q_len.size), q_len)
        tok = np.arange(int(qo[-1])) - np.repeat(qo[:-1], q_len)
        qpos = P + s_len[req] - q_len[req] + tok
        heads = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size,
                     q_data_type=q_data_type, kv_data_type=kv_data_type)
        self.prefix.plan([0, int(qo[-1])], [0, pre.size], pre, [last if pre.size else 0],
                         q_positions=qpos, **heads)
        self.suffix.plan(qo, sptr, suffix_indices, slast, q_positions=qpos,
                         kv_position_offset=np.full(q_len.size, P), **heads)
        self.prefix_len, self.q_positions = P, qpos

    def run(self, q: torch.Tensor, kv_cache: Any, *, return_lse: bool = False,
            sinks: torch.Tensor | None = None, k_scale: Any = None,
            v_scale: Any = None) -> Any:
        """`out [total_q, num_qo_heads, head_dim_vo]` in q's dtype (and the merged lse).
        `sinks` [num_qo_heads]: attention-sink logits, joined once: by the prefix pass's
        kernels (every query row is in it), or the suffix pass's when the prefix is empty; the
        merge composes the states, so the merged lse includes the sink (docs/serving.md,
        "Attention sinks"). An fp8 cache's `k_scale` / `v_scale` as `BatchAttention.run` takes
        them. Under torch.compile: two `attncc::batch_attention_run` calls and the merge as
        torch ops (docs/compile.md)."""
        if not self._softmax and return_lse:
            raise ValueError("return_lse=True but the variant has normalize='none'")
        if sinks is not None and not self._softmax:
            raise InvalidArgument("sinks were given but the variant has normalize='none': a "
                                  "sink joins a softmax denominator; drop sinks")
        sc = dict(k_scale=k_scale, v_scale=v_scale)
        if self._softmax:
            pre_sinks = sinks if getattr(self, "prefix_len", 0) > 0 else None
            suf_sinks = sinks if pre_sinks is None else None
            o1, l1 = self.prefix.run(q, kv_cache, return_lse=True, sinks=pre_sinks, **sc)
            o2, l2 = self.suffix.run(q, kv_cache, return_lse=True, sinks=suf_sinks, **sc)
        else:
            o1, l1 = self.prefix.run(q, kv_cache, **sc), None
            o2, l2 = self.suffix.run(q, kv_cache, **sc), None
        # one launch (a dozen elementwise ops otherwise; those under torch.compile, where the
        # two passes are attncc::batch_attention_run calls and the merge is traced torch ops)
        if not torch.compiler.is_compiling() and fits_kernel(o1, l1, o2, l2):
            out, lse = merge_fitting_states(o1, l1, o2, l2, want_lse=return_lse)
            return (out, lse) if return_lse else out
        if not self._softmax:
            return (o1.float() + o2.float()).to(q.dtype)
        o, lse = merge_pair(o1.float(), l1, o2.float(), l2)
        out = o.to(q.dtype)
        return (out, lse) if return_lse else out
