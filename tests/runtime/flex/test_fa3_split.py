"""The FA3 split tail's geometry (runtime/flex/fa3_split.py, mirrored by kernels/fa3/fa3_split.cuh) and
which launches split: CPU only (the kernel's results are tests/gpu/test_fa3_split.py)."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

import attncc
from attncc.runtime.flex.fa3_split import (MAX_PIECES_PER_ITEM, MIN_SPLIT_KEYS, SLOT_WARPS,
                                           TailSplit, tail_split)
from attncc.runtime.flex.gpu_flex import _fa3_tail_split


@pytest.mark.parametrize("items,grid,tiles", list(itertools.product(
    (133, 200, 263, 1000, 2048, 4097), (132, 114, 7), (2, 3, 5, 16, 64, 1000))))
def test_pieces_cover_the_tail_once_in_units_of_one_item(items: int, grid: int,
                                                          tiles: int) -> None:
    """Every tail tile lies in exactly one unit; a piece is one or two units (contiguous, the
    second starting its item); the slot a unit parks in is the one the merger reads for it; an
    item's unit count is what its arrival counter waits for."""
    if tiles * 128 - 5 < MIN_SPLIT_KEYS:
        assert tail_split(items, grid, kv_len=tiles * 128 - 5, tkv=128).pieces == 0
    # 4096-key tiles: every kv_len here reaches MIN_SPLIT_KEYS (the geometry depends on the
    # tile count only)
    s = tail_split(items, grid, kv_len=tiles * 4096 - 5, tkv=4096)
    assert s.tiles == tiles
    rest = items % grid
    assert s.pieces == min(grid, MAX_PIECES_PER_ITEM * rest, rest * tiles)
    assert s.first == items - rest
    assert s.rest == rest and s.counter_ints() == 1 + SLOT_WARPS * rest
    seen: dict[int, list[tuple[int, int, int]]] = {}  # tail item -> (piece, side, slot)
    covered = [0] * s.total
    for j in range(s.pieces):
        assert s.begin(j + 1) - s.begin(j) <= tiles  # at most one item boundary inside
        units = [u for u in (s.unit(j, 0), s.unit(j, 1)) if u is not None]
        assert units and s.unit(j, 0) is not None
        pos = s.begin(j)
        for side, (item, first, count) in enumerate(units):
            assert count > 0 and item * tiles + first == pos
            assert side == 0 or first == 0
            for t in range(pos, pos + count):
                covered[t] += 1
            pos += count
            seen.setdefault(item, []).append((j, side, 2 * j + side))
        assert pos == s.begin(j + 1)
    assert covered == [1] * s.total
    for item, units in seen.items():
        assert len(units) <= MAX_PIECES_PER_ITEM + 1  # the merge reads at most 5 slots
        lo, hi = s.piece_of(item * tiles), s.piece_of((item + 1) * tiles - 1)
        assert [j for j, _, _ in units] == list(range(lo, hi + 1))
        # the slot fa3_split.cuh's merge reads for each unit is the one the unit parked in
        assert [s.part_of(item, j) for j, _, _ in units] == [slot for _, _, slot in units]


@pytest.mark.parametrize("items,grid,kv_len", [(132, 132, 4096), (264, 132, 4096),
                                               (100, 132, 4096), (200, 132, 100),
                                               (200, 132, 4095), (200, 132, 1 << 25)])
def test_no_split_when_there_is_nothing_to_balance(items: int, grid: int, kv_len: int) -> None:
    """A full last round, fewer items than CTAs, one-tile items, items shorter than
    MIN_SPLIT_KEYS, or piece arithmetic that would pass 2^31 in the kernel's 32-bit ints: the
    items run whole (no counters past the claim counter, no workspace)."""
    s = tail_split(items, grid, kv_len, 128)
    assert s.pieces == 0 and s.counter_ints() == 1 and s.partial_floats(128) == 0


def test_workspace_sizes() -> None:
    s = tail_split(2048, 132, 8192, 128)
    assert (s.pieces, s.rest) == (132, 68)
    # 2 slots per piece, 8 warps, 32 lanes, (128 / 8 + 1) float4
    assert s.partial_floats(128) == 2 * 132 * 8 * 32 * 17 * 4
    assert s.partial_floats(64) == 2 * 132 * 8 * 32 * 9 * 4


def test_which_launches_split() -> None:
    """Persistent dense launches of softmax variants without an output transform or a block
    mask split; kernel_options SPLIT_TAIL False, a block mask, an output transform, a variant
    without softmax, a non-persistent grid or CTA pairs keep the items whole."""
    def plan(variant: attncc.Variant, mask: object = None) -> SimpleNamespace:
        return SimpleNamespace(ir=variant.trace()[0], mask=mask)

    def pieces(pl: SimpleNamespace, options: dict | None = None, persistent: bool = True) -> int:
        return _fa3_tail_split(pl, options, 2048, 132, 8192, 128, persistent).pieces

    plain = plan(attncc.Variant(score_mod=lambda s, b, h, q, kv: s * 0.5))
    assert pieces(plain) == 132
    assert pieces(plain, {"SPLIT_TAIL": False}) == 0
    assert pieces(plain, persistent=False) == 0
    assert pieces(plan(attncc.Variant(), mask=object())) == 0
    assert pieces(plan(attncc.Variant(output_mod=lambda o, b, h, q, d: o[d] * 2.0))) == 0
    assert pieces(plan(attncc.Variant(normalize="none"))) == 0
    # CTA pairs: no split tail
    assert _fa3_tail_split(plain, None, 2048, 132, 8192, 128, True, paired=True).pieces == 0
    assert isinstance(_fa3_tail_split(plain, None, 2048, 132, 8192, 128, True), TailSplit)


def test_split_tail_option_is_checked() -> None:
    from attncc.runtime.flex.api import _validate_kernel_options

    _validate_kernel_options({"SPLIT_TAIL": False})
    with pytest.raises(ValueError, match="SPLIT_TAIL"):
        _validate_kernel_options({"SPLIT_TAIL": 0})


def test_head_dim_256_is_persistent_without_split_tail_or_pairs() -> None:
    """D = 256 runs the persistent kernel (kPersistentHeadDim) but neither the split tail nor
    CTA pairs (kSplitHeadDim: the tail's park/merge spilled beside O's 128 accumulators), even
    when kernel_options ask for pairs; codegen refuses a paired D = 256 unit."""
    from attncc.codegen.errors import CodegenError
    from attncc.codegen.generate import generate_source
    from attncc.runtime.flex.gpu_flex import (FA3_PERSISTENT_HEAD_DIMS, FA3_SPLIT_HEAD_DIMS,
                                              fa3_pairs)
    from attncc.runtime.flex.tile_choice import TilePlan

    assert FA3_PERSISTENT_HEAD_DIMS == (64, 128, 256) and FA3_SPLIT_HEAD_DIMS == (64, 128)
    fa3 = TilePlan(128, 64, 2, 1, kernel="fa3")
    assert not fa3_pairs(fa3, False, 2048, 2048, 256, {"PAIRED": True})
    assert fa3_pairs(fa3, False, 2048, 2048, 128, {"PAIRED": True})
    with pytest.raises(CodegenError, match="CTA pairs .* head dims \\(64, 128\\)"):
        generate_source(attncc.Variant().trace()[0], head_dim=256, dtype="bfloat16",
                        kernel="fa3", paired=True)
