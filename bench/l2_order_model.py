"""An LRU model of the L2 traffic of the dense FA3 kernel's item order: how many K/V bytes come
from DRAM for a given L2 section size (`ATTNCC_FA3_L2_SECTION_BYTES`).

The item list is kernels/fa3/fa3_prefill.cuh's `dense_item` (mirrored in `dense_order`: sections of
heads whose K and V fit in the section size, the remainder section first, within a section
query blocks from the last, then head). The model runs `ctas` CTAs at equal speed, one K/V tile
per step each, every CTA claiming the next item when it finishes one (the dynamic order), and
keeps the last `l2_mib` of tiles in an LRU. Full attention reads every tile of an item; causal
reads tiles 0 .. query block. Counted: K/V tiles only (Q and O are read / written once either
way).

What it says (docs/fa3.md#persistent-scheduling-item-order-and-l2-sections): with the whole
50 MB L2 as the LRU, sections up to
24 MiB read each head's K/V from DRAM once at S = 2048 and 8192; with half of it (25 MB, one of
the H100 / H200's two L2 partitions), 24 MiB sections read full attention's K/V ~2.3 times and
12 MiB sections once. The H200's measurements side with the 25 MB reading: 48 MiB sections cost
full attention 7 % and causal 5 % at S = 2048 (the 50 MB model predicts much less). With the
items' Q and O tiles in the LRU as well (`--qo`: Q and O not marked evict_first) 24 MiB sections
read it ~3.6 times and 12 MiB ones ~1.8 times (hence the kernel marks Q and O evict_first and
uses 12 MiB).

    python -m bench.l2_order_model                  # table: S x section x L2 size
    python -m bench.l2_order_model --S 2048 --sections 12 24 --l2 25
"""
from __future__ import annotations

import argparse
from collections import OrderedDict

from bench.prefill import HEAD_DIM, HEADS, TOKENS

TQ, TKV = 128, 128  # the dense kernel's query rows and keys per tile at head dim 128


def dense_order(slots: int, nqb: int, sec: int) -> list[tuple[int, int]]:
    """The dense kernel's items as (head slot, query block), in list order: sections of `sec`
    head slots, the first one taking the remainder; within a section the last query block of
    every slot first (`dense_item` in kernels/fa3/fa3_prefill.cuh).

    >>> dense_order(3, 2, 2)
    [(0, 1), (0, 0), (1, 1), (2, 1), (1, 0), (2, 0)]
    """
    first = slots - (slots - 1) // sec * sec  # the remainder section: 1 .. sec slots
    out = []
    for w in range(slots * nqb):
        if w < first * nqb:
            s0, n = 0, first
        else:
            s0, n = first + (w - first * nqb) // (sec * nqb) * sec, sec
        r = w - s0 * nqb
        out.append((s0 + r % n, nqb - 1 - r // n))
    return out


def simulate(S: int, section_mib: float, l2_mib: float, *, causal: bool = False,
             ctas: int = 132, qo: bool = False) -> dict[str, float]:
    """K/V MiB read from DRAM (`dram_mib`) for bench/prefill.py's inputs at sequence length S,
    against `ideal_mib` (each head's K and V once); `heads_per_section` as the kernel computes it
    (0 MiB: one section). With `qo`, each item's Q tile (read at its start) and O tile (written
    at its end) pass through the LRU too, as they would without the kernel's L2 eviction hints;
    without it they take none of it, as the kernel marks them evict_first (`l2_evict_first` in
    kernels/hopper/tma.cuh).

    >>> r = simulate(2048, 24, 50)
    >>> (r["heads_per_section"], r["dram_mib"], r["ideal_mib"])
    (24, 128.0, 128.0)
    """
    slots, nqb, tiles = (TOKENS // S) * HEADS, S // TQ, S // TKV
    kv_head = S * HEAD_DIM * 2 * 2  # K and V of one head, 16-bit
    sec = slots if section_mib <= 0 else min(slots, max(1, int(section_mib * 2**20) // kv_head))
    order = dense_order(slots, nqb, sec)
    tile_bytes = TKV * HEAD_DIM * 2 * 2
    capacity = 2 * (int(l2_mib * 2**20) // tile_bytes)  # in half tiles: Q / O are half a tile
    lru: OrderedDict[tuple[int, ...], int] = OrderedDict()  # entry -> its size in half tiles
    used = 0
    misses = 0

    def insert(key: tuple[int, ...], size: int) -> None:
        nonlocal used
        lru[key] = size
        used += size
        while used > capacity:
            used -= lru.popitem(last=False)[1]
    # per CTA: (item index, next tile) or None when it has no more
    state: list[tuple[int, int] | None] = [(c, 0) if c < len(order) else None
                                           for c in range(ctas)]
    claimed = min(ctas, len(order))
    while any(s is not None for s in state):
        for c, s in enumerate(state):
            if s is None:
                continue
            item, t = s
            slot, qb = order[item]
            if qo and t == 0:
                insert(("q", item), 1)
            key = (slot, t)
            if key in lru:
                lru.move_to_end(key)
            else:
                misses += 1
                insert(key, 2)
            t += 1
            if t == (qb + 1 if causal else tiles):
                if qo:
                    insert(("o", item), 1)
                state[c] = (claimed, 0) if claimed < len(order) else None
                claimed += 1
            else:
                state[c] = (item, t)
    return {"heads_per_section": sec, "dram_mib": misses * tile_bytes / 2**20,
            "ideal_mib": slots * kv_head / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--S", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--sections", type=float, nargs="+", default=[8, 12, 16, 24, 48],
                    help="section sizes in MiB (0: one section)")
    ap.add_argument("--l2", type=float, nargs="+", default=[50, 25], help="LRU sizes in MiB")
    ap.add_argument("--qo", action="store_true",
                    help="Q and O tiles pass through the LRU too (no evict_first hints)")
    args = ap.parse_args()
    print("| S | L2 MiB | variant | " + " | ".join(f"{s:g} MiB" for s in args.sections) + " |")
    print("|---|---|---|" + "---|" * len(args.sections))
    for S in args.S:
        for l2 in args.l2:
            for causal in (False, True):
                cells = []
                for sec in args.sections:
                    r = simulate(S, sec, l2, causal=causal, qo=args.qo)
                    cells.append(f"{r['dram_mib'] / r['ideal_mib']:.2f} ({r['heads_per_section']})")
                name = "causal" if causal else "full"
                print(f"| {S} | {l2:g} | {name} | " + " | ".join(cells) + " |")
    print("cells: K/V read from DRAM / each head's K/V once (heads per section)")


if __name__ == "__main__":
    main()
