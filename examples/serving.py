"""attncc for serving: one decode/prefill step over a paged KV cache, plan once, run (in a graph).

Run: `python examples/serving.py`. On a CPU machine it plans the batch (the scheduler and its
checks run on the host) and computes the step with the exact reference; with a CUDA GPU it also
runs `BatchAttention`, replays it from a CUDA graph with a second plan, and runs the
shared-prefix `CascadeAttention`, checking each against the reference.

The batch mixes what a serving step holds: three decode requests (one new token each) and one
prefill chunk of 24 tokens, GQA with 8 query heads over 2 KV heads, a soft-capped causal variant,
KV pages of 16 tokens scattered over the cache.
"""
from __future__ import annotations

import numpy as np
import torch

import attncc
from attncc.runtime.reference import batch_attention_reference

HQ, HKV, D, PAGE = 8, 2, 64, 16


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx       # positions: a request's queries are its last KV tokens


variant = attncc.Variant(score_mod=softcap, mask_mod=causal, name="serving_softcap")


def paged_batch(q_lens: list[int], kv_lens: list[int], num_pages: int, seed: int) -> dict:
    """Host-side page tables of one step: each request's pages, drawn from a shuffled pool."""
    rng = np.random.default_rng(seed)
    pages_per = [-(-n // PAGE) for n in kv_lens]
    pool = rng.permutation(num_pages)[:sum(pages_per)]
    return dict(qo_indptr=np.concatenate([[0], np.cumsum(q_lens)]),
                kv_indptr=np.concatenate([[0], np.cumsum(pages_per)]),
                kv_indices=pool,
                kv_last_page_len=np.array([n - (p - 1) * PAGE
                                           for n, p in zip(kv_lens, pages_per)]))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def main() -> None:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    num_pages = 64
    k_cache = torch.randn(num_pages, PAGE, HKV, D, device=dev, dtype=dtype)   # NHD layout
    v_cache = torch.randn_like(k_cache)
    heads = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE)

    # 1. Plan a step: three decodes and one 24-token prefill chunk. plan() checks the page tables
    #    (bad ids, non-monotone indptr, too-small caches raise here, naming the argument).
    step = paged_batch([1, 1, 24, 1], [700, 33, 200, 5], num_pages, seed=1)
    ba = attncc.BatchAttention(variant, kv_layout="NHD", max_batch=16, max_qo_tokens=64,
                               device=dev)
    ba.plan(**step, **heads)
    print(f"plan: tiles T_q={ba.tiles.tq} T_kv={ba.tiles.tkv}, {ba.tiles.num_ctas} CTAs, "
          f"{ba._plan.num_units} work units, {ba._plan.num_merges} split items merged")

    q = torch.randn(int(step["qo_indptr"][-1]), HQ, D, device=dev, dtype=dtype)
    ref, _ = batch_attention_reference(q, (k_cache, v_cache), **step, page_size=PAGE,
                                       variant=variant)
    if not cuda:
        print(f"reference step (CPU, exact): out {tuple(ref.shape)}; a GPU runs "
              f"BatchAttention.run, CUDA graphs and CascadeAttention")
        return

    # 2. Run it, then capture run() in a CUDA graph: a new plan changes only the workspace
    #    contents, so the same graph replays any later step that fits the maxima.
    out = ba.run(q, (k_cache, v_cache))
    print(f"BatchAttention.run: rel err vs fp64 reference {rel_err(out, ref):.1e}")
    static_out = torch.empty_like(q)
    ba.run(q, (k_cache, v_cache), out=static_out)          # compile/warm before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.run(q, (k_cache, v_cache), out=static_out)
    step2 = paged_batch([1, 1, 24, 1], [64, 512, 40, 300], num_pages, seed=2)
    ba.plan(**step2, **heads)                               # same token count: q's shape holds
    graph.replay()
    ref2, _ = batch_attention_reference(q, (k_cache, v_cache), **step2, page_size=PAGE,
                                        variant=variant)
    print(f"graph replay with a new plan: rel err {rel_err(static_out, ref2):.1e}")

    # 3. A prefix shared by every request (a system prompt) is read once with CascadeAttention.
    prefix_pages, suffix = np.arange(8), [np.arange(8 + 2 * i, 10 + 2 * i) for i in range(4)]
    ca = attncc.CascadeAttention(None, kv_layout="NHD", max_qo_tokens=16)
    ca.plan(np.arange(5), prefix_indices=prefix_pages, prefix_last_page_len=PAGE,
            suffix_indptr=np.concatenate([[0], np.cumsum([len(s) for s in suffix])]),
            suffix_indices=np.concatenate(suffix), suffix_last_page_len=np.full(4, PAGE),
            **heads)
    qd = torch.randn(4, HQ, D, device=dev, dtype=dtype)
    lists = [np.concatenate([prefix_pages, s]) for s in suffix]   # the same step, single format
    ref3, _ = batch_attention_reference(
        qd, (k_cache, v_cache), np.arange(5),
        np.concatenate([[0], np.cumsum([len(x) for x in lists])]), np.concatenate(lists),
        np.full(4, PAGE), page_size=PAGE)
    out3 = ca.run(qd, (k_cache, v_cache))
    print(f"CascadeAttention (128-token shared prefix): rel err {rel_err(out3, ref3):.1e}")


if __name__ == "__main__":
    main()
