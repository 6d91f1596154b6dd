"""bench/decode.py's FlexAttention paged-helper setup computes the same attention as attncc's
fp64 batch reference on the same pages (CPU, eager FlexAttention)."""
from __future__ import annotations

import warnings

import numpy as np
import torch

from attncc.runtime.reference import batch_attention_reference


def test_flex_paged_call_matches_the_reference() -> None:
    from bench.decode import PAGE, flex_paged_call

    torch.manual_seed(0)
    lens = np.array([37, 5, 64, 100])
    npg = -(-lens // PAGE)
    total = int(npg.sum()) + 3                                   # unused pages in the pool
    perm = np.random.default_rng(0).permutation(total)[:int(npg.sum())]
    ind = np.concatenate([[0], np.cumsum(npg)])
    k = torch.randn(total, PAGE, 2, 32)
    v, q = torch.randn_like(k), torch.randn(lens.size, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                          # flex on CPU warns (eager)
        out = flex_paged_call(q, k, v, perm, ind, lens, compile=False)()[:, :, 0]
    ref, _ = batch_attention_reference(q, (k, v), np.arange(lens.size + 1), ind, perm,
                                       lens - (npg - 1) * PAGE, page_size=PAGE)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5
