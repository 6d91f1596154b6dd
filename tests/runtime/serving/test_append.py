"""attncc.append_paged_kv_cache and its index helpers (runtime/serving/append.py): tokens land in
the page and slot their position names (NHD, HND, one-tensor caches; page sizes 1/16/64), the
cache then reads back as the dense K/V through the batch reference, a key_mod is applied at each
token's position, and every bad position is refused before anything is written."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import InvalidArgument
from attncc.runtime.reference import batch_attention_reference

H, D = 2, 16


def _layout(kv_lens: list[int], page: int, seed: int):
    """Shuffled page ids (unused pages between) for requests of `kv_lens` tokens."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page) for n in kv_lens]
    ids = torch.randperm(2 * sum(n_pages) + 3, generator=g)[:sum(n_pages)]
    indptr = torch.tensor([0] + [sum(n_pages[:i + 1]) for i in range(len(kv_lens))])
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
    return ids, indptr, last, 2 * sum(n_pages) + 3


def _cache(layout: str, pages: int, page: int, as_one: bool):
    shape = (pages, page, H, D) if layout == "NHD" else (pages, H, page, D)
    if as_one:
        t = torch.full((pages, 2, *shape[1:]), float("nan"))
        return t, (t[:, 0], t[:, 1])
    k, v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    return (k, v), (k, v)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("as_one", [False, True])
def test_appended_tokens_read_back_as_the_dense_kv(layout: str, page: int, as_one: bool) -> None:
    """Fill whole requests by appending in two steps (a prefix, then the rest), then attention
    over the cache equals attention over the dense K/V the tokens came from."""
    kv_lens = [37, 1, 70, 16]
    ids, indptr, last, pages = _layout(kv_lens, page, seed=page)
    cache, (kc, vc) = _cache(layout, pages, page, as_one)
    g = torch.Generator().manual_seed(1)
    dense_k = [torch.randn(n, H, D, generator=g) for n in kv_lens]
    dense_v = [torch.randn(n, H, D, generator=g) for n in kv_lens]
    for part in (0, 1):  # first the first half of each request, then the rest
        cut = [n // 2 for n in kv_lens]
        lo = [0 if part == 0 else c for c in cut]
        hi = [c if part == 0 else n for c, n in zip(cut, kv_lens)]
        # the lengths after this append: the request's pages shrink to fit them
        lens = torch.tensor(hi)
        n_pages = [-(-n // page) if n else 0 for n in hi]
        step_indptr = torch.tensor([0] + [sum(n_pages[:i + 1]) for i in range(len(hi))])
        step_ids = torch.cat([ids[indptr[i]:indptr[i] + n_pages[i]] for i in range(len(hi))])
        step_last = torch.tensor([n - (p - 1) * page if p else 0 for n, p in zip(hi, n_pages)])
        counts = [h - l for l, h in zip(lo, hi)]
        append_indptr = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))])
        b, pos = attncc.get_batch_indices_positions(append_indptr, lens, int(append_indptr[-1]))
        assert pos.tolist() == [p for l, h in zip(lo, hi) for p in range(l, h)]
        k = torch.cat([dense_k[i][lo[i]:hi[i]] for i in range(len(kv_lens))])
        v = torch.cat([dense_v[i][lo[i]:hi[i]] for i in range(len(kv_lens))])
        attncc.append_paged_kv_cache(k, v, b, pos, cache, step_ids, step_indptr, step_last,
                                     kv_layout=layout)
    assert torch.equal(attncc.get_seq_lens(indptr, last, page), torch.tensor(kv_lens))
    q = torch.randn(len(kv_lens), 2 * H, D, generator=g)
    qo = torch.arange(len(kv_lens) + 1)
    out, _ = batch_attention_reference(q, (kc, vc), qo, indptr, ids, last, kv_layout=layout,
                                       page_size=page)
    for i, n in enumerate(kv_lens):
        kk = dense_k[i].double().repeat_interleave(2, dim=1)  # GQA: 2 query heads per KV head
        vv = dense_v[i].double().repeat_interleave(2, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) / math.sqrt(D)
        want = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
        torch.testing.assert_close(out[i], want)


def test_key_mod_is_applied_at_each_tokens_position() -> None:
    """RoPE-like key_mod: the cache holds k * cos(pos) at the token's position."""
    def key_mod(k, b, h, kv_idx, d):
        return k[d] * torch.cos(kv_idx * 0.1)

    rope_like = attncc.Variant(key_mod=key_mod)
    ids, indptr, last, pages = _layout([20, 5], 16, seed=3)
    (kc, vc), _ = _cache("NHD", pages, 16, False)
    k, v = torch.randn(25, H, D), torch.randn(25, H, D)
    b, pos = attncc.get_batch_indices_positions(torch.tensor([0, 20, 25]),
                                                torch.tensor([20, 5]), 25)
    attncc.append_paged_kv_cache(k, v, b, pos, (kc, vc), ids, indptr, last, key_mod=rope_like)
    pg = ids[indptr[b.long()] + pos.long() // 16]
    got = kc[pg, pos.long() % 16]
    want = (k * torch.cos(pos.float() * torch.tensor(0.1, dtype=torch.float32))[:, None, None])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(vc[pg, pos.long() % 16], v)
    with pytest.raises(InvalidArgument, match="no key_mod"):
        attncc.append_paged_kv_cache(k, v, b, pos, (kc, vc), ids, indptr, last,
                                     key_mod=attncc.Variant())


def test_bad_positions_are_refused_before_writing() -> None:
    ids, indptr, last, pages = _layout([20, 5], 16, seed=4)
    (kc, vc), _ = _cache("NHD", pages, 16, False)
    before = kc.clone()
    k, v = torch.randn(2, H, D), torch.randn(2, H, D)
    cases = [(torch.tensor([0, 1]), torch.tensor([3, 5]), "inside each request's length"),
             (torch.tensor([0, 1]), torch.tensor([-1, 0]), "inside each request's length"),
             (torch.tensor([0, 2]), torch.tensor([0, 0]), "batch_indices must lie"),
             (torch.tensor([0]), torch.tensor([0]), r"\[nnz=2\]")]
    for b, pos, msg in cases:
        with pytest.raises(InvalidArgument, match=msg):
            attncc.append_paged_kv_cache(k, v, b, pos, (kc, vc), ids, indptr, last)
    with pytest.raises(InvalidArgument, match=r"append_key must be \[nnz, 2, 16\]"):
        attncc.append_paged_kv_cache(torch.randn(2, 3, D), v, torch.tensor([0, 1]),
                                     torch.tensor([0, 0]), (kc, vc), ids, indptr, last)
    with pytest.raises(InvalidArgument, match="kv_layout"):
        attncc.append_paged_kv_cache(k, v, torch.tensor([0, 1]), torch.tensor([0, 0]),
                                     (kc, vc), ids, indptr, last, kv_layout="ragged")
    assert torch.equal(kc.isnan(), before.isnan())  # nothing written
