"""The FA3 dense kernel's split tail, host side: which launches split their last round by keys and
how large the workspace is (the kernel's geometry is kernels/fa3/fa3_split.cuh; this mirrors it).

When the persistent grid of G CTAs does not divide the num_items equal items, the last
R = num_items % G items are cut into P = min(G, 4 R, R * T) pieces of consecutive K/V tiles (T
per item), so the last round ends together instead of leaving G - R CTAs idle. Each piece holds
one or two units (an item over a range of its tiles); the consumer warps park a unit's partial
state in a slot and the item's last arrival merges. Items shorter than MIN_SPLIT_KEYS run whole.

Example (bench/prefill.py's full attention at S = 8192: 2048 items of 64 tiles on 132 CTAs):
    >>> s = tail_split(num_items=2048, grid=132, kv_len=8192, tkv=128)
    >>> s.first, s.tiles, s.total, s.pieces
    (1980, 64, 4352, 132)
    >>> s.unit(0, 0), s.unit(0, 1)
    ((0, 0, 32), None)
    >>> s.unit(1, 0), s.unit(1, 1)
    ((0, 32, 32), (1, 0, 1))
"""
from __future__ import annotations

from dataclasses import dataclass

from attncc.codegen import constants

__all__ = ["TailSplit", "tail_split", "SLOT_WARPS"]

# Consumer warps per CTA (two warpgroups of four): one slot and one arrival counter each per unit.
SLOT_WARPS = constants.FA3_SLOT_WARPS
# At most this many pieces per tail item (kernels/fa3/fa3_split.cuh's kMaxPiecesPerItem), and the
# shortest items that split (kMinSplitKeys: below it the split's fixed cost per unit outweighs
# the idle share of the last round it recovers; docs/fa3.md#split-tail).
MAX_PIECES_PER_ITEM = constants.MAX_PIECES_PER_ITEM
MIN_SPLIT_KEYS = constants.MIN_SPLIT_KEYS


@dataclass(frozen=True)
class TailSplit:
    """The tail's geometry (kernels/fa3/fa3_split.cuh's TailSplit): list index of the first tail
    item, tiles per item, the tail's tiles, pieces (0: no split)."""
    first: int
    tiles: int
    total: int
    pieces: int

    def begin(self, j: int) -> int:
        """Tail tile where piece j starts (j = pieces: the tail's end)."""
        return j * self.total // self.pieces

    def piece_of(self, t: int) -> int:
        """The piece holding tail tile t."""
        return ((t + 1) * self.pieces - 1) // self.total

    def part_of(self, item: int, j: int) -> int:
        """The part (2 j + side: its workspace slot) of tail item `item` in piece j, as the
        merge finds it: the piece's second unit when the piece began in the item before."""
        return 2 * j + (1 if self.begin(j) < item * self.tiles else 0)

    def unit(self, j: int, side: int) -> tuple[int, int, int] | None:
        """Unit `side` (0 or 1) of piece j as (tail item, first tile, tile count), or None when
        the piece has no such unit."""
        b, e = self.begin(j), self.begin(j + 1)
        item = b // self.tiles + side
        lo, hi = max(b, item * self.tiles), min(e, (item + 1) * self.tiles)
        return (item, lo - item * self.tiles, hi - lo) if hi > lo else None

    @property
    def rest(self) -> int:
        """R, the tail's items."""
        return self.total // self.tiles if self.pieces else 0

    def counter_ints(self) -> int:
        """Ints of the kernel's counter buffer: the claim counter, then one arrival counter per
        tail item and consumer warp (all zero at launch)."""
        return 1 + SLOT_WARPS * self.rest

    def partial_floats(self, head_dim: int) -> int:
        """Floats of the partial-state workspace: a slot per (piece, side) and consumer warp, of
        32 lanes x (head_dim / 8 + 1) float4 (O, then the row maxima and sums)."""
        return 2 * self.pieces * SLOT_WARPS * 32 * (head_dim // 8 + 1) * 4


def tail_split(num_items: int, grid: int, kv_len: int, tkv: int) -> TailSplit:
    """The split of a persistent dense FA3 launch of `num_items` full-length items on `grid`
    CTAs (kernels/fa3/fa3_split.cuh's tail_split; pieces 0 when the last round is full, items are one
    tile or shorter than MIN_SPLIT_KEYS, or the 32-bit piece arithmetic would overflow).

    Example:
        >>> tail_split(2112, 132, 4096, 128).pieces  # 16 full rounds: nothing to split
        0
        >>> tail_split(2048, 132, 2048, 128).pieces  # 2048 keys: the items run whole
        0
        >>> tail_split(136, 132, 8192, 128).pieces  # 4 items left: 4 pieces each
        16
    """
    rest, tiles = num_items % grid, -(-kv_len // tkv)
    pieces = min(grid, MAX_PIECES_PER_ITEM * rest, rest * tiles)
    if (num_items <= grid or rest == 0 or tiles < 2 or kv_len < MIN_SPLIT_KEYS
            or rest * tiles * pieces >= 1 << 31):
        return TailSplit(num_items, tiles, 0, 0)
    return TailSplit(num_items - rest, tiles, rest * tiles, pieces)
