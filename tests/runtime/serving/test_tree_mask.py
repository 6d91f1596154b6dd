"""Multi-token decode tree masks on the CPU: FlashInfer's custom_mask / packed_custom_mask turned
into the kernel's rows (runtime/serving/tree_mask.py), plan()'s refusals, and the fp64
reference's masks (tests/gpu/test_multitoken_gpu.py runs the kernels against it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attncc.errors import InvalidArgument
from attncc.frontend import Variant
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.serving.tree_mask import TREE_MAX_Q, tree_rows
from tests.helpers.trees import packed, tree_batch


def qo_of(lq: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lq)]).astype(np.int64)


def test_rows_hold_each_tree_bit_for_bit() -> None:
    """Bit j of word t of request i is the tree's (t, j): decoding the rows gives back every
    request's [q_len, q_len] block, and unused words are 0; custom and packed forms agree."""
    lq, lkv = [1, 2, 5, 8, 16, 3], [1, 40, 5, 100, 16, 9]
    mask, trees = tree_batch(lq, lkv)
    rows = tree_rows(mask, None, qo_of(lq), np.array(lkv))
    assert rows.shape == (len(lq), TREE_MAX_Q) and rows.dtype == np.int32
    for i, tr in enumerate(trees):
        q = lq[i]
        bits = (rows[i, :q, None].astype(np.int64) >> np.arange(q)) & 1
        assert (bits.astype(bool) == tr).all()
        assert (rows[i, q:] == 0).all()
    assert (tree_rows(None, packed(mask, lq, lkv), qo_of(lq), np.array(lkv)) == rows).all()
    as_tensor = tree_rows(torch.from_numpy(mask), None, qo_of(lq), np.array(lkv))
    assert (as_tensor == rows).all()


def test_sixteen_tokens_use_the_sign_bit_word() -> None:
    """A 16-token chain sets bit 15 (the int32 word stays exact) and the full row is 0xFFFF."""
    lq, lkv = [16], [20]
    mask = np.hstack([np.ones((16, 4), bool), np.tril(np.ones((16, 16), bool))]).ravel()
    rows = tree_rows(mask, None, qo_of(lq), np.array(lkv))
    assert rows[0].tolist() == [(1 << (t + 1)) - 1 for t in range(16)]


@pytest.mark.parametrize("case, match", [
    ("both", "not both"),
    ("dtype", "bool"),
    ("packed_dtype", "uint8"),
    ("size", "needs"),
    ("too_many", "at most 16"),
    ("prefix", "hides a key before"),
    ("two_d", "1-D"),
])
def test_bad_masks_raise_naming_the_argument(case: str, match: str) -> None:
    lq, lkv = [3, 2], [10, 4]
    mask, _ = tree_batch(lq, lkv)
    qo, kv = qo_of(lq), np.array(lkv)
    args: tuple = (mask, None)
    if case == "both":
        args = (mask, packed(mask, lq, lkv))
    elif case == "dtype":
        args = (mask.astype(np.int32), None)
    elif case == "packed_dtype":
        args = (None, packed(mask, lq, lkv).astype(np.int32))
    elif case == "size":
        args = (mask[:-1], None)
    elif case == "too_many":
        lq, lkv = [17], [20]
        qo, kv = qo_of(lq), np.array(lkv)
        args = (np.ones(17 * 20, bool), None)
    elif case == "prefix":
        mask = mask.copy()
        mask[10 + 2] = False  # request 0, query 1, key 2: a cached key
        args = (mask, None)
    elif case == "two_d":
        args = (mask.reshape(1, -1), None)
    with pytest.raises(InvalidArgument, match=match):
        tree_rows(*args, qo, kv)


def test_a_hidden_key_in_the_last_prefix_column_is_found() -> None:
    """The prefix check covers every row's last cached key (the range ends right before the
    step's keys), in the packed form too."""
    lq, lkv = [4, 4], [9, 12]
    mask, _ = tree_batch(lq, lkv)
    bad = mask.copy()
    bad[9 * 4 + 3 * 12 + 7] = False  # request 1, query 3, key 7 (its last cached key)
    with pytest.raises(InvalidArgument, match="request 1"):
        tree_rows(bad, None, qo_of(lq), np.array(lkv))
    with pytest.raises(InvalidArgument, match="request 1"):
        tree_rows(None, packed(bad, lq, lkv), qo_of(lq), np.array(lkv))


KW = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)


def test_plan_takes_tree_masks_and_refuses_what_the_kernels_cannot_run() -> None:
    """plan() on the CPU: accepts a tree mask (FlashInfer's arguments), runs it on the FA2
    kernel's tiles, and refuses q_positions, kernel='fa3' and a hidden cached key."""
    lq, lkv = [4, 8], [30, 20]
    mask, _ = tree_batch(lq, lkv)
    pages = [0, 1, 2, 3]
    args = (qo_of(lq), [0, 2, 4], pages, [14, 4])
    ba = BatchAttention(None, device="cpu")
    ba.plan(*args, **KW, custom_mask=torch.from_numpy(mask))
    assert ba.tiles.kernel == "fa2" and ba._tree_plan
    ba.plan(*args, **KW, packed_custom_mask=torch.from_numpy(packed(mask, lq, lkv)))
    ba.plan(*args, **KW)
    assert not ba._tree_plan
    with pytest.raises(ValueError, match="q_positions"):
        ba.plan(*args, **KW, custom_mask=mask, q_positions=np.arange(12))
    with pytest.raises(ValueError, match="kernel='fa3'"):
        BatchAttention(None, device="cpu", kernel="fa3").plan(*args, **KW, custom_mask=mask)
    bad = mask.copy()
    bad[0] = False
    with pytest.raises(InvalidArgument, match="hides a key"):
        ba.plan(*args, **KW, custom_mask=bad)
    assert ba.kv_lens.tolist() == lkv  # the failed plan left the last one


def _paged(lkv: list[int], heads: int, d: int, page: int, seed: int = 0):
    """A random NHD paged cache holding `lkv` tokens per request, pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page) for n in lkv]
    total = sum(n_pages)
    ids = torch.randperm(total, generator=g).tolist()
    k = torch.randn(total, page, heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, page, heads, d, generator=g, dtype=torch.float64)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).tolist()
    last = [n - (p - 1) * page for n, p in zip(lkv, n_pages)]
    return (k, v), indptr, ids, last


def test_reference_tree_mask_of_a_chain_is_causal_attention() -> None:
    """A chain tree (each draft token sees those before it) under the plain variant is exactly
    the causal variant without a mask; the packed form gives the same bits."""
    lq, lkv = [3, 8, 1], [20, 17, 5]
    cache, indptr, ids, last = _paged(lkv, 2, 16, 4)
    q = torch.randn(sum(lq), 8, 16, dtype=torch.float64)
    chain = np.concatenate([np.hstack([np.ones((a, b - a), bool),
                                       np.tril(np.ones((a, a), bool))]).ravel()
                            for a, b in zip(lq, lkv)])
    causal = Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, name="causal")
    common = dict(kv_layout="NHD", page_size=4)
    want, want_lse = batch_attention_reference(q, cache, qo_of(lq), indptr, ids, last,
                                               variant=causal, **common)
    got, got_lse = batch_attention_reference(q, cache, qo_of(lq), indptr, ids, last,
                                             custom_mask=torch.from_numpy(chain), **common)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    got_p, _ = batch_attention_reference(q, cache, qo_of(lq), indptr, ids, last,
                                         packed_custom_mask=packed(chain, lq, lkv), **common)
    assert torch.equal(got_p, want)


def test_reference_tree_mask_drops_exactly_the_hidden_keys() -> None:
    """Each query of a random tree attends to its cached keys and its ancestors only: the
    reference equals softmax attention over exactly those keys, computed by hand."""
    lq, lkv, hq, hkv, d = [5, 6], [9, 6], 4, 2, 8
    cache, indptr, ids, last = _paged(lkv, hkv, d, 1, seed=3)
    q = torch.randn(sum(lq), hq, d, dtype=torch.float64)
    mask, trees = tree_batch(lq, lkv, seed=5)
    out, lse = batch_attention_reference(q, cache, qo_of(lq), indptr, ids, last,
                                         kv_layout="NHD", page_size=1,
                                         custom_mask=torch.from_numpy(mask))
    k, v = cache
    for i, (a, b) in enumerate(zip(lq, lkv)):
        pages = ids[indptr[i]:indptr[i + 1]]
        ki, vi = k[pages, 0], v[pages, 0]  # [kv, hkv, d] (page size 1)
        for t in range(a):
            keep = np.concatenate([np.ones(b - a, bool), trees[i][t]])
            for h in range(hq):
                s = ki[keep, h // (hq // hkv)] @ q[qo_of(lq)[i] + t, h] / d ** 0.5
                p = torch.softmax(s, 0)
                want = p @ vi[keep, h // (hq // hkv)]
                assert torch.allclose(out[qo_of(lq)[i] + t, h], want, atol=1e-12)
                assert torch.allclose(lse[qo_of(lq)[i] + t, h], torch.logsumexp(s, 0))


def test_packed_and_bool_forms_agree_on_random_masks() -> None:
    """The packed form is checked on its bytes (never unpacked): on random batches -- ranges
    starting and ending inside bytes, one-byte ranges, whole bytes -- with one random cached key
    hidden half the time, it accepts and rejects exactly what the bool form does, with the
    same rows and the same request named."""
    rng = np.random.default_rng(11)
    for trial in range(60):
        n = int(rng.integers(1, 6))
        lq = [int(x) for x in rng.integers(1, 17, n)]
        lkv = [q + int(rng.integers(0, 40)) for q in lq]
        mask, _ = tree_batch(lq, lkv, seed=trial)
        pre = [(i, t, c) for i, (q, kv) in enumerate(zip(lq, lkv)) for t in range(q)
               for c in range(kv - q)]
        if pre and trial % 2:
            i, t, c = pre[int(rng.integers(0, len(pre)))]
            mask[sum(a * b for a, b in zip(lq[:i], lkv[:i])) + t * lkv[i] + c] = False
        results = []
        for args in ((mask, None), (None, packed(mask, lq, lkv))):
            try:
                results.append(tree_rows(*args, qo_of(lq), np.array(lkv)))
            except InvalidArgument as e:
                results.append(str(e).split(":")[1].split(" hides")[0])
        if isinstance(results[0], np.ndarray):
            assert isinstance(results[1], np.ndarray) and (results[0] == results[1]).all()
        else:
            assert results[0] == results[1], (trial, results)
            assert not (pre and trial % 2 == 0)


def test_masked_plan_after_an_fa3_capture_raises() -> None:
    """A graph that captured the FA3 batch kernel would replay it without the tree: plan()
    refuses the mask (the flag run() sets while capturing FA3, set by hand on the CPU)."""
    lq, lkv = [4], [30]
    mask, _ = tree_batch(lq, lkv)
    ba = BatchAttention(None, device="cpu")
    ba._fa3_captured = True
    with pytest.raises(ValueError, match="FA3 batch kernel"):
        ba.plan(qo_of(lq), [0, 2], [0, 1], [14], **KW, custom_mask=mask)
    ba.plan(qo_of(lq), [0, 2], [0, 1], [14], **KW)  # without a mask it plans


def test_a_tree_mask_with_an_fp8_cache_is_refused() -> None:
    """The fp8 cache's kernel forms carry no tree checks (their registers widen the cache), so
    plan() refuses the pair before anything runs, naming both arguments."""
    ba = BatchAttention(None, kv_layout="NHD", max_batch=2, max_qo_tokens=8, device="cpu")
    mask = np.ones(2 * 40, dtype=bool)
    with pytest.raises(ValueError, match="custom_mask / packed_custom_mask with kv_data_type"):
        ba.plan(np.array([0, 2]), np.array([0, 3]), np.arange(3), np.array([8]),
                num_qo_heads=8, num_kv_heads=8, head_dim=64, page_size=16,
                custom_mask=mask, kv_data_type=torch.float8_e4m3fn)
