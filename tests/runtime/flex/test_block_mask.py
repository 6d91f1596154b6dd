"""attncc's create_block_mask builds exactly torch's BlockMask (counts, index order, transposed
lists, edge blocks) and classifies affine masks analytically, even at 32k x 32k."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from attncc.ir import tiles
from attncc.runtime.flex.block_mask import BlockMask, create_block_mask

WINDOW = 100
SLOPE_WINDOWS = torch.tensor([16, 64, 200])


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 77) | (q_idx >= kv_idx)


def head_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < SLOPE_WINDOWS[h])


def _docs(n: int, seed: int, shuffled: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, 6, (2, n), generator=g), dim=1).values
    if shuffled:
        ids = ids[:, torch.randperm(n, generator=g)]
    return ids


def _document_mask(doc: torch.Tensor):
    def document(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    return document


def _assert_same(ours: BlockMask, theirs) -> None:
    pairs = [("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
             ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")]
    for num_name, idx_name in pairs:
        a_num, b_num = getattr(ours, num_name), getattr(theirs, num_name)
        a_idx, b_idx = getattr(ours, idx_name), getattr(theirs, idx_name)
        assert a_num.dtype == torch.int32 and a_idx.dtype == torch.int32
        assert a_num.shape == b_num.shape and a_idx.shape == b_idx.shape, num_name
        assert torch.equal(a_num, b_num), num_name
        # torch orders kept ids ascending, then the rest ascending (stable sort): compare all
        assert torch.equal(a_idx, b_idx), idx_name
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths)
    assert ours.shape == theirs.shape
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    assert torch.equal(ours.to_dense(), theirs.to_dense().to(torch.int32))


@pytest.mark.parametrize("mask_mod", [causal, sliding, prefix_lm], ids=lambda f: f.__name__)
@pytest.mark.parametrize("Q_LEN,KV_LEN", [(128, 128), (300, 300), (1000, 1000), (300, 1000),
                                          (1000, 128)])
@pytest.mark.parametrize("B,H", [(None, None), (2, 3)])
def test_matches_torch(mask_mod, Q_LEN, KV_LEN, B, H):
    ours = create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)
    theirs = torch_flex.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu")
    assert ours.classified_by == "analytic"
    _assert_same(ours, theirs)


@pytest.mark.parametrize("BLOCK_SIZE", [64, (128, 64), (32, 128)])
@pytest.mark.parametrize("Q_LEN,KV_LEN", [(300, 300), (1000, 300)])
def test_matches_torch_with_other_block_sizes(BLOCK_SIZE, Q_LEN, KV_LEN):
    for mask_mod in (sliding, head_window):
        ours = create_block_mask(mask_mod, 2, 3, Q_LEN, KV_LEN, BLOCK_SIZE=BLOCK_SIZE)
        theirs = torch_flex.create_block_mask(mask_mod, 2, 3, Q_LEN, KV_LEN, device="cpu",
                                              BLOCK_SIZE=BLOCK_SIZE)
        _assert_same(ours, theirs)


@pytest.mark.parametrize("n", [128, 300, 1000])
@pytest.mark.parametrize("shuffled", [False, True], ids=["sorted_ids", "shuffled_ids"])
def test_document_mask_matches_torch(n, shuffled):
    mask_mod = _document_mask(_docs(n, seed=n, shuffled=shuffled))
    ours = create_block_mask(mask_mod, 2, None, n, n)
    theirs = torch_flex.create_block_mask(mask_mod, 2, None, n, n, device="cpu")
    # sorted ids make doc[b, kv] monotone in kv (checked on the data): analytic; shuffled: dense
    assert ours.classified_by == ("dense" if shuffled else "analytic")
    _assert_same(ours, theirs)


def test_non_affine_mask_matches_torch():
    def stripes(b, h, q_idx, kv_idx):
        return (q_idx % 3) == (kv_idx % 4)

    ours = create_block_mask(stripes, None, 2, 300, 257, BLOCK_SIZE=(16, 32))
    theirs = torch_flex.create_block_mask(stripes, None, 2, 300, 257, device="cpu",
                                          BLOCK_SIZE=(16, 32))
    assert ours.classified_by == "dense"
    _assert_same(ours, theirs)


def test_captured_scalar_value_is_used():
    global WINDOW
    old = WINDOW
    try:
        WINDOW = 7
        small = create_block_mask(sliding, None, None, 512, 512, BLOCK_SIZE=16)
        WINDOW = 300
        large = create_block_mask(sliding, None, None, 512, 512, BLOCK_SIZE=16)
        _assert_same(large, torch_flex.create_block_mask(sliding, None, None, 512, 512,
                                                         device="cpu", BLOCK_SIZE=16))
    finally:
        WINDOW = old
    assert int(small.full_kv_num_blocks.sum()) < int(large.full_kv_num_blocks.sum())
    assert small.bindings.scalars == {"WINDOW": 7}


def test_edge_blocks_are_never_full():
    # everything kept, but the last blocks stick out past the sequence: torch calls them partial
    bm = create_block_mask(lambda b, h, q, kv: q >= 0, None, None, 200, 300)
    assert bm.full_kv_num_blocks[0, 0].tolist() == [2, 0]
    assert bm.kv_num_blocks[0, 0].tolist() == [1, 3]


def test_large_causal_mask_is_analytic(monkeypatch):
    def no_dense(*args, **kwargs):
        raise AssertionError("a causal mask must not be evaluated densely")

    monkeypatch.setattr(tiles, "_dense_kept", no_dense)
    n = 32768
    bm = create_block_mask(causal, None, None, n, n)
    nb = n // 128
    assert bm.classified_by == "analytic"
    assert bm.kv_num_blocks.shape == (1, 1, nb)
    assert torch.equal(bm.kv_num_blocks[0, 0], torch.ones(nb, dtype=torch.int32))
    assert torch.equal(bm.full_kv_num_blocks[0, 0], torch.arange(nb, dtype=torch.int32))
    assert torch.equal(bm.kv_indices[0, 0, :, 0], torch.arange(nb, dtype=torch.int32))
    assert torch.equal(bm.q_num_blocks[0, 0], torch.ones(nb, dtype=torch.int32))
    assert torch.equal(bm.full_q_num_blocks[0, 0], torch.arange(nb - 1, -1, -1, dtype=torch.int32))


def test_broadcast_batch_and_heads_match_torch_shapes():
    bm = create_block_mask(causal, 4, 8, 256, 256)
    assert bm.kv_num_blocks.shape == (4, 8, 2) and bm.kv_indices.shape == (4, 8, 2, 2)
    assert bm.q_indices.shape == (4, 8, 2, 2)
    assert bm.shape == (4, 8, 256, 256)
    hw = create_block_mask(head_window, None, 3, 256, 256)
    assert hw.kv_num_blocks.shape == (1, 3, 2)


def test_to_torch_round_trip_and_device_move():
    bm = create_block_mask(sliding, 2, 3, 300, 300, BLOCK_SIZE=64)
    t = bm.to_torch()
    assert isinstance(t, torch_flex.BlockMask)
    _assert_same(bm, t)
    moved = bm.to("cpu")
    _assert_same(moved, t)
    assert moved.mask_ir is bm.mask_ir and moved.mask_mod is sliding


def test_from_kv_blocks_derives_the_transposed_lists_like_torch():
    theirs = torch_flex.create_block_mask(prefix_lm, 2, 1, 300, 700, device="cpu", BLOCK_SIZE=64)
    ours = BlockMask.from_kv_blocks(theirs.kv_num_blocks, theirs.kv_indices,
                                    theirs.full_kv_num_blocks, theirs.full_kv_indices,
                                    BLOCK_SIZE=64, mask_mod=prefix_lm, seq_lengths=(300, 700))
    _assert_same(ours, theirs)


def test_repr_summarises_sparsity():
    text = repr(create_block_mask(causal, None, None, 1024, 1024))
    assert "sparsity=43.75%" in text and "8 full + 8 partial of 64" in text
    assert "mask_mod=causal" in text and "analytic" in text


def test_bad_arguments_say_what_to_change():
    with pytest.raises(TypeError, match="mask_mod function"):
        create_block_mask(None, 1, 1, 128, 128)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="BLOCK_SIZE must be an int >= 1"):
        create_block_mask(causal, 1, 1, 128, 128, BLOCK_SIZE=0)
    with pytest.raises(ValueError, match="Q_LEN must be an int >= 1"):
        create_block_mask(causal, 1, 1, 0, 128)


def _kv_major_brute_force(num: torch.Tensor, idx: torch.Tensor):
    """Per kv block, the q blocks whose first num entries list it, ascending, then the rest."""
    *lead, nq, nkv = idx.shape
    q_num = torch.zeros(*lead, nkv, dtype=torch.int32)
    q_idx = torch.zeros(*lead, nkv, nq, dtype=torch.int32)
    for pos in torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(-1, len(lead)):
        at = tuple(int(p) for p in pos)
        for c in range(nkv):
            rows = [r for r in range(nq) if c in idx[at + (r,)][:int(num[at + (r,)])].tolist()]
            rest = [r for r in range(nq) if r not in rows]
            q_num[at + (c,)] = len(rows)
            q_idx[at + (c,)] = torch.tensor(rows + rest, dtype=torch.int32)
    return q_num, q_idx


def _random_q_major(g: torch.Generator, lead: tuple[int, ...], nq: int, nkv: int):
    """Random Q-major lists whose padding (past num) holds garbage ids, which must be ignored."""
    dense = torch.rand(*lead, nq, nkv, generator=g) < 0.4
    num = dense.sum(-1).to(torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    garbage = torch.randint(0, nkv, order.shape, generator=g)
    slot = torch.arange(nkv)
    idx = torch.where(slot < num[..., None], order, garbage).to(torch.int32)
    return num, idx


@pytest.mark.parametrize("lead,nq,nkv", [((1, 1), 1, 1), ((2, 3), 5, 7), ((1, 2), 9, 3),
                                         ((3,), 4, 4)])
def test_kv_major_blocks_matches_brute_force(lead, nq, nkv):
    from attncc.runtime.flex.block_mask import kv_major_blocks

    g = torch.Generator().manual_seed(nq * 31 + nkv)
    num, idx = _random_q_major(g, lead, nq, nkv)
    q_num, q_idx = kv_major_blocks(num, idx)
    want_num, want_idx = _kv_major_brute_force(num, idx)
    assert q_num.dtype == torch.int32 and q_idx.dtype == torch.int32
    assert torch.equal(q_num, want_num) and torch.equal(q_idx, want_idx)


def test_kv_major_blocks_keeps_broadcast_dims_broadcast():
    from attncc.runtime.flex.block_mask import kv_major_blocks

    num, idx = _random_q_major(torch.Generator().manual_seed(3), (1, 1), 6, 5)
    q_num, q_idx = kv_major_blocks(num.expand(4, 3, 6), idx.expand(4, 3, 6, 5))
    assert q_num.shape == (4, 3, 5) and q_idx.shape == (4, 3, 5, 6)
    assert q_idx.stride()[:2] == (0, 0)
    want_num, want_idx = _kv_major_brute_force(num, idx)
    assert torch.equal(q_num, want_num.expand(4, 3, 5))
    assert torch.equal(q_idx, want_idx.expand(4, 3, 5, 6))


def test_kv_major_blocks_rejects_mismatched_shapes():
    from attncc.runtime.flex.block_mask import kv_major_blocks

    with pytest.raises(ValueError, match=r"num_blocks \[..., q_blocks\]"):
        kv_major_blocks(torch.zeros(1, 1, 3, dtype=torch.int32),
                        torch.zeros(1, 1, 4, 2, dtype=torch.int32))


def _dense_mask(mask_mod, B, H, Q_LEN, KV_LEN):
    b, h, q, kv = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(Q_LEN),
                                 torch.arange(KV_LEN), indexing="ij")
    return mask_mod(b, h, q, kv)


@pytest.mark.parametrize("mask_mod,B,H", [(sliding, 1, 1), (prefix_lm, 2, 1),
                                          (head_window, 1, 3)],
                         ids=["sliding", "prefix_lm", "head_window"])
def test_create_block_mask_kv_major_lists_split_full_and_partial(mask_mod, B, H):
    """q_* / full_q_* against a brute force over the element mask: a kv block lists a q block as
    FULL when all BLOCK x BLOCK elements are kept, PARTIAL when some are."""
    Q_LEN, KV_LEN, BS = 300, 200, 64
    bm = create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=BS)
    dense = _dense_mask(mask_mod, B, H, Q_LEN, KV_LEN).expand(B, H, Q_LEN, KV_LEN)
    nq, nkv = -(-Q_LEN // BS), -(-KV_LEN // BS)
    padded = torch.zeros(B, H, nq * BS, nkv * BS, dtype=torch.int64)
    padded[..., :Q_LEN, :KV_LEN] = dense.to(torch.int64)
    kept = padded.view(B, H, nq, BS, nkv, BS).sum(dim=(3, 5))
    for kind, blocks in (("", (kept > 0) & (kept < BS * BS)), ("full_", kept == BS * BS)):
        num = getattr(bm, f"{kind}q_num_blocks")
        idx = getattr(bm, f"{kind}q_indices")
        for b, h, c in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(nkv)):
            rows = torch.nonzero(blocks[b, h, :, c]).flatten().tolist()
            rest = [r for r in range(nq) if r not in rows]
            assert int(num[b, h, c]) == len(rows), (kind, b, h, c)
            assert idx[b, h, c].tolist() == rows + rest, (kind, b, h, c)
    # and they are what kv_major_blocks derives from the Q-major lists
    from attncc.runtime.flex.block_mask import kv_major_blocks
    for kind in ("", "full_"):
        q_num, q_idx = kv_major_blocks(getattr(bm, f"{kind}kv_num_blocks"),
                                       getattr(bm, f"{kind}kv_indices"))
        assert torch.equal(q_num, getattr(bm, f"{kind}q_num_blocks"))
        assert torch.equal(q_idx, getattr(bm, f"{kind}q_indices"))
