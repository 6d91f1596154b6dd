"""Speculative-decoding tree masks in FlashInfer's layouts, for the multi-token decode tests
(tests/runtime/serving/test_tree_mask.py on the CPU, tests/gpu/test_multitoken_gpu.py)."""
from __future__ import annotations

import numpy as np


def random_tree(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random token tree of n nodes in topological order, as a bool [n, n] mask: node t
    keeps itself and its ancestors."""
    keep = np.eye(n, dtype=bool)
    for t in range(1, n):
        keep[t] |= keep[int(rng.integers(0, t))]
    return keep


def tree_batch(lq: list[int], lkv: list[int], seed: int = 0) -> tuple[np.ndarray, list]:
    """FlashInfer's flattened custom_mask of random trees after fully visible prefixes (request
    i: [lq[i], lkv[i]] row-major), and the trees."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(q, rng) for q in lq]
    parts = [np.hstack([np.ones((q, kv - q), bool), tr]).ravel()
             for q, kv, tr in zip(lq, lkv, trees)]
    return (np.concatenate(parts) if parts else np.zeros(0, bool)), trees


def packed(mask: np.ndarray, lq: list[int], lkv: list[int]) -> np.ndarray:
    """FlashInfer's segment_packbits(bitorder="little") of a flattened custom mask: each
    request's segment packed on its own, the bytes concatenated."""
    out, at = [], 0
    for q, kv in zip(lq, lkv):
        out.append(np.packbits(mask[at:at + q * kv], bitorder="little"))
        at += q * kv
    return np.concatenate(out) if out else np.zeros(0, np.uint8)
