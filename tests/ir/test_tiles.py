"""The per-tile mask classifier is exact: analytic classification (monotone-atom bisection) and
the dense fallback agree element-for-element with brute-force evaluation of the mask."""
from __future__ import annotations

import random

import pytest
import torch

from attncc.frontend import trace_mods
from attncc.ir import tiles
from attncc.ir.evaluator import evaluate
from attncc.ir.nodes import BOOL, F32, I32, binary, cast, const, load, param, unary, var, where
from attncc.ir.tiles import (TileClass, block_classes, classify_tile, is_affine_mask,
                             kv_monotonic)

q, kv, b, h = var("q_idx"), var("kv_idx"), var("b"), var("h")


def fdiv(x, c):
    return binary("floordiv", x, const(c) if isinstance(c, int) else c)


def eq(x, y):
    return binary("eq", x, y)


def ne(x, y):
    return binary("ne", x, y)


# ----------------------------------------------------------------------------- monotonicity


def test_kv_monotonic_rules():
    assert kv_monotonic(kv) == "inc"
    assert kv_monotonic(q * 3 + h) == "const"
    assert kv_monotonic(q - kv) == "dec"
    assert kv_monotonic(unary("neg", kv)) == "dec"
    assert kv_monotonic(kv * -1) == "dec"
    assert kv_monotonic(kv * 2 + q) == "inc"
    assert kv_monotonic(kv * 0) == "const"
    assert kv_monotonic(fdiv(kv, 64)) == "inc"
    assert kv_monotonic(fdiv(kv, -3)) == "dec"
    assert kv_monotonic(binary("min", kv, q)) == "inc"
    assert kv_monotonic(binary("max", q - kv, const(0))) == "dec"
    assert kv_monotonic(binary("min", kv, q - kv)) is None
    assert kv_monotonic(kv - fdiv(kv, 2)) is None  # inc - inc: unknown without simplification
    assert kv_monotonic(binary("mod", kv, const(8))) is None
    assert kv_monotonic(unary("abs", q - kv)) is None
    assert kv_monotonic(binary("max", q - kv, kv - q)) is None
    assert kv_monotonic(binary("div", kv, const(2.0))) is None  # true division not covered
    assert kv_monotonic(binary("floordiv", q, kv)) is None  # kv in the divisor
    assert kv_monotonic(kv * h) is None  # sign of a non-constant factor unknown
    s = param("s", I32)
    assert kv_monotonic(kv * s) is None
    assert kv_monotonic(kv * s, {"s": 3}) == "inc"
    assert kv_monotonic(kv * s, {"s": -2}) == "dec"
    assert kv_monotonic(fdiv(kv, s), {"s": 0}) is None
    assert kv_monotonic(cast(kv, F32) * 0.5) == "inc"
    assert kv_monotonic(cast(cast(q - kv, F32) * 0.5, I32)) == "dec"
    assert kv_monotonic(where(q > 3, kv, kv * 2)) == "inc"  # kv-free condition picks a branch
    assert kv_monotonic(where(kv > 3, kv, q)) is None


def test_sorted_tensor_loads_are_monotone_only_when_the_data_is_sorted():
    doc = load("doc", (b, kv), I32)
    sorted_doc = torch.tensor([[0, 0, 1, 1, 3], [2, 2, 2, 5, 5]])
    assert kv_monotonic(doc) is None  # no data: unknown
    assert kv_monotonic(doc, tensors={"doc": sorted_doc}) == "inc"
    assert kv_monotonic(doc, tensors={"doc": sorted_doc.flip(1)}) == "dec"
    assert kv_monotonic(doc, tensors={"doc": torch.tensor([[0, 1, 0, 1, 0]])}) is None
    rev = load("doc", (b, const(4) - kv), I32)
    assert kv_monotonic(rev, tensors={"doc": sorted_doc}) == "dec"
    nan = torch.tensor([[0.0, float("nan"), 1.0]])
    assert kv_monotonic(load("x", (b, kv), F32), tensors={"x": nan}) is None


@pytest.mark.parametrize("mask,affine", [
    (q >= kv, True),
    ((q >= kv) & (q - kv < 256), True),
    ((kv < 64) | (q >= kv), True),
    (eq(fdiv(q, 128), fdiv(kv, 128)), True),
    (~((q >= kv) & ne(fdiv(q, 7), fdiv(kv, 7))), True),
    (where(h > 2, q >= kv, kv < 10), True),
    ((kv >= load("start", (b, q), I32)) & (kv < load("end", (b, q), I32)), True),
    (const(True), True),
    (q < 5, True),  # kv-free: constant along each row
    (eq(binary("mod", q, const(7)), binary("mod", kv, const(7))), False),
    (eq(load("doc", (b, q), I32), load("doc", (b, kv), I32)), False),
    (load("keep", (kv,), I32) >= 1, False),
    (load("keep", (kv,), BOOL), False),
])
def test_is_affine_mask(mask, affine):
    assert is_affine_mask(mask) is affine


# ----------------------------------------------------------------------------- brute force


def _dense(mask, B, H, Q, KV, params=None, tensors=None):
    env = {"b": torch.arange(B).view(B, 1, 1, 1), "h": torch.arange(H).view(1, H, 1, 1),
           "q_idx": torch.arange(Q).view(1, 1, Q, 1), "kv_idx": torch.arange(KV).view(1, 1, 1, KV)}
    return evaluate(mask, env, tensors or {}, params or {}).expand(B, H, Q, KV)


def _dense_counts(mask, B, H, Q, KV, BQ, BK, params=None, tensors=None):
    m = _dense(mask, B, H, Q, KV, params, tensors)
    nq, nk = -(-Q // BQ), -(-KV // BK)
    m = torch.nn.functional.pad(m, (0, nk * BK - KV, 0, nq * BQ - Q))
    return m.reshape(B, H, nq, BQ, nk, BK).sum((3, 5))


def _brute_tile(mask, q0, q1, k0, k1, b_, h_, params, tensors, kv_len):
    k1 = min(k1, kv_len) if kv_len is not None else k1
    if q1 <= q0 or k1 <= k0:
        return TileClass.EMPTY
    env = {"b": torch.tensor(b_), "h": torch.tensor(h_), "q_idx": torch.arange(q0, q1)[:, None],
           "kv_idx": torch.arange(k0, k1)[None, :]}
    m = evaluate(mask, env, tensors or {}, params or {}).expand(q1 - q0, k1 - k0)
    n = int(m.sum())
    return TileClass.EMPTY if n == 0 else TileClass.FULL if n == m.numel() else TileClass.PARTIAL


def _traced(fn):
    ir, bind = trace_mods({"mask_mod": fn})
    return ir.expr("mask_mod"), dict(bind.scalars), dict(bind.tensors)


WINDOW = 40
HEAD_WINDOWS = torch.tensor([8, 24, 64, 3])
STARTS = torch.tensor([[0, 5, 5, 30, 30, 30, 90, 90, 120, 150] * 20,
                       [3, 100, 100, 0, 0, 60, 70, 70, 120, 199] * 20])
DOC = torch.stack([
    torch.repeat_interleave(torch.arange(8), torch.tensor([13, 40, 1, 70, 9, 22, 31, 14])),
    torch.repeat_interleave(torch.arange(3), torch.tensor([128, 64, 8]))])
VALID = torch.arange(200)[None, :] < torch.tensor([[150], [190]])  # bool, sorted along kv

TILE_MASKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "sliding_const": lambda b, h, q, kv: (q >= kv) & (q - kv < 40),
    "sliding_captured": lambda b, h, q, kv: (q >= kv) & (q - kv < WINDOW),
    "prefix_lm": lambda b, h, q, kv: (kv < 37) | (q >= kv),
    "chunked": lambda b, h, q, kv: q // 48 == kv // 48,
    "chunked_causal_not": lambda b, h, q, kv: (q >= kv) & ~(q // 32 != kv // 32),
    "or_of_windows": lambda b, h, q, kv: ((q - kv).clamp(min=0) < 5) | (kv - q > 50),
    "head_window": lambda b, h, q, kv: (q >= kv) & (q - kv < HEAD_WINDOWS[h]),
    "head_scaled_window": lambda b, h, q, kv: (q - kv <= 16 * h) & (kv - q <= 16 * h),
    "empty_paradox": lambda b, h, q, kv: (q >= kv) & (q < kv),
    "full_paradox": lambda b, h, q, kv: (q >= kv) | (q < kv),
    "where_combo": lambda b, h, q, kv: torch.where(q % 2 == 0, q >= kv, kv < 30),
    "ranges": lambda b, h, q, kv: (kv >= STARTS[b, q]) & (kv < STARTS[b, q] + 25),
    "negative_scale": lambda b, h, q, kv: kv * -3 + q * 2 > -60,
    "sorted_docs": lambda b, h, q, kv: (DOC[b, q] == DOC[b, kv]) & (q >= kv),
    "valid_prefix": lambda b, h, q, kv: VALID[b, kv] & (q - kv < 90),
    "non_affine": lambda b, h, q, kv: (q % 7) == (kv % 5),
}


def test_tile_masks_take_the_expected_path():
    for name, fn in TILE_MASKS.items():
        expr, params, tensors = _traced(fn)
        assert is_affine_mask(expr, params, tensors) is (name != "non_affine"), name


def test_classify_tile_matches_brute_force_on_random_tiles():
    rng = random.Random(1234)
    seen = {c: 0 for c in TileClass}
    n_tiles = 0
    for name, fn in TILE_MASKS.items():
        expr, params, tensors = _traced(fn)
        for _ in range(40):
            size_q, size_k = rng.choice([1, 7, 16, 32, 64]), rng.choice([1, 5, 16, 32, 64])
            if rng.random() < 0.5:  # block-aligned tiles, as kernels use them
                q0 = rng.randrange(0, 180 // size_q + 1) * size_q
                k0 = rng.randrange(0, 180 // size_k + 1) * size_k
            else:
                q0, k0 = rng.randrange(0, 180), rng.randrange(0, 180)
            q1, k1 = min(q0 + size_q, 200), min(k0 + size_k, 200)
            kv_len = rng.choice([None, 200, 150, k0 + size_k // 2])
            b_, h_ = rng.randrange(2), rng.randrange(4)
            got = classify_tile(expr, q0, q1, k0, k1, b=b_, h=h_, params=params,
                                tensors=tensors, kv_len=kv_len)
            want = _brute_tile(expr, q0, q1, k0, k1, b_, h_, params, tensors, kv_len)
            assert got is want, (name, q0, q1, k0, k1, h_, kv_len)
            seen[got] += 1
            n_tiles += 1
    assert n_tiles >= 500
    assert min(seen.values()) >= 50, seen  # all three classes are exercised


def test_empty_paradox_is_empty_although_each_atom_is_partial():
    expr, _, _ = _traced(TILE_MASKS["empty_paradox"])
    for a in expr.args:
        assert classify_tile(a, 0, 64, 0, 64) is TileClass.PARTIAL
    assert classify_tile(expr, 0, 64, 0, 64) is TileClass.EMPTY
    kept, total = block_classes(expr, 1, 1, 300, 300, 64, 64)
    assert int(kept.sum()) == 0 and int(total.sum()) == 300 * 300


@pytest.mark.parametrize("name", sorted(TILE_MASKS))
@pytest.mark.parametrize("shape", [(2, 4, 200, 200, 64, 64), (1, 3, 130, 171, 32, 16),
                                   (2, 2, 7, 190, 128, 128)])
def test_block_classes_matches_dense_counts(name, shape):
    B, H, Q, KV, BQ, BK = shape
    expr, params, tensors = _traced(TILE_MASKS[name])
    kept, total = block_classes(expr, B, H, Q, KV, BQ, BK, params, tensors)
    want = _dense_counts(expr, B, H, Q, KV, BQ, BK, params, tensors)
    assert kept.dtype == torch.int64 and kept.dim() == 4
    assert kept.shape[0] in (1, B) and kept.shape[1] in (1, H)
    assert torch.equal(kept.expand_as(want), want)
    ones = _dense_counts(const(True), 1, 1, Q, KV, BQ, BK)
    assert torch.equal(total.expand_as(want), ones.expand_as(want))


def test_block_classes_broadcasts_only_unread_batch_and_head():
    B, H = 3, 4
    expr, params, tensors = _traced(TILE_MASKS["causal"])
    assert block_classes(expr, B, H, 64, 64, 16, 16)[0].shape == (1, 1, 4, 4)
    expr, params, tensors = _traced(TILE_MASKS["head_window"])
    assert block_classes(expr, B, H, 64, 64, 16, 16, params, tensors)[0].shape == (1, 4, 4, 4)
    expr, params, tensors = _traced(TILE_MASKS["ranges"])
    assert block_classes(expr, 1, H, 64, 64, 16, 16, params, tensors)[0].shape == (1, 1, 4, 4)


def test_affine_masks_never_evaluate_densely(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("dense evaluation on an affine mask")

    monkeypatch.setattr(tiles, "_dense_kept", boom)
    for name, fn in TILE_MASKS.items():
        if name == "non_affine":
            continue
        expr, params, tensors = _traced(fn)
        block_classes(expr, 1, 4, 200, 200, 64, 64, params, tensors)


@pytest.mark.parametrize("name", ["sliding_captured", "non_affine", "sorted_docs"])
def test_chunking_gives_the_same_counts(name, monkeypatch):
    expr, params, tensors = _traced(TILE_MASKS[name])
    whole = block_classes(expr, 1, 2, 200, 190, 16, 32, params, tensors)[0]
    monkeypatch.setattr(tiles, "ANALYTIC_CHUNK_ELEMS", 40)  # forces one q-block per chunk
    monkeypatch.setattr(tiles, "DENSE_CHUNK_ELEMS", 1000)
    chunked = block_classes(expr, 1, 2, 200, 190, 16, 32, params, tensors)[0]
    assert torch.equal(whole, chunked)


def _random_side(rng: random.Random):
    """A random kv-monotone integer expression of q, kv, h."""
    terms = [q * rng.randint(-2, 2), h * rng.randint(-3, 3), const(rng.randint(-40, 40))]
    k = kv * rng.choice([1, 2, -1, 3])
    if rng.random() < 0.4:
        k = fdiv(k, rng.choice([3, 16, -5]))
    if rng.random() < 0.3:
        k = binary(rng.choice(["min", "max"]), k, q * rng.choice([1, -1]) + rng.randint(0, 60))
    e = k
    for t in terms:
        e = e + t
    if rng.random() < 0.3:
        e = fdiv(e, rng.choice([2, 7]))
    return e


def _random_mask(rng: random.Random, depth: int = 0):
    if depth >= 2 or rng.random() < 0.35:
        op = rng.choice(["lt", "le", "gt", "ge", "eq", "ne"])
        return binary(op, _random_side(rng), q + rng.randint(-30, 30))
    kind = rng.choice(["and", "or", "not", "where"])
    if kind == "not":
        return ~_random_mask(rng, depth + 1)
    if kind == "where":
        return where(q > rng.randint(0, 100), _random_mask(rng, depth + 1),
                     _random_mask(rng, depth + 1))
    return binary(kind, _random_mask(rng, depth + 1), _random_mask(rng, depth + 1))


def test_random_affine_masks_match_dense_counts():
    rng = random.Random(7)
    for i in range(30):
        mask = _random_mask(rng)
        assert is_affine_mask(mask), mask
        Q, KV = rng.randint(1, 150), rng.randint(1, 150)
        BQ, BK = rng.choice([1, 8, 16, 64]), rng.choice([1, 8, 32, 128])
        kept, _ = block_classes(mask, 1, 3, Q, KV, BQ, BK)
        want = _dense_counts(mask, 1, 3, Q, KV, BQ, BK)
        assert torch.equal(kept.expand_as(want), want), (i, mask, Q, KV, BQ, BK)


def test_non_positive_lengths_are_rejected():
    with pytest.raises(ValueError, match="positive"):
        block_classes(q >= kv, 1, 1, 0, 10, 16, 16)
