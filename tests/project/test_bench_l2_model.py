"""bench/l2_order_model.py: the dense FA3 item order it mirrors, and the DRAM traffic it
predicts for L2 section sizes at bench/prefill.py's S = 2048
(docs/fa3.md#persistent-scheduling-item-order-and-l2-sections)."""
from __future__ import annotations


def test_dense_order_remainder_section_first_then_last_query_blocks() -> None:
    from bench.l2_order_model import dense_order

    order = dense_order(slots=5, nqb=3, sec=2)  # sections: {0}, {1, 2}, {3, 4}
    assert order[:3] == [(0, 2), (0, 1), (0, 0)]
    assert order[3:9] == [(1, 2), (2, 2), (1, 1), (2, 1), (1, 0), (2, 0)]
    assert sorted(order) == [(s, q) for s in range(5) for q in range(3)]  # every item once


def test_sections_half_the_l2_read_each_head_once() -> None:
    from bench.l2_order_model import simulate

    # 16 tiles per item, 128 heads: with a 25 MiB LRU, 12 MiB sections (shipped) read each
    # head's K/V once, 24 MiB sections 2.33 times, 48 MiB ~6 times; causal only from 48 MiB
    assert simulate(2048, 12, 25)["dram_mib"] == 128.0
    assert round(simulate(2048, 24, 25)["dram_mib"] / 128, 2) == 2.33
    assert simulate(2048, 48, 25)["dram_mib"] > 5 * 128
    assert simulate(2048, 24, 25, causal=True)["dram_mib"] == 128.0
    assert simulate(2048, 48, 25, causal=True)["dram_mib"] > 2 * 128
    # one section over every head: nearly every tile read from DRAM
    assert simulate(2048, 0, 50)["heads_per_section"] == 128


def test_q_and_o_through_the_lru_evict_k_and_v() -> None:
    """Without L2 hints each item's Q and O tiles pass through the L2 too (`qo=True`): 12 MiB
    sections then read full attention's K/V ~1.8 times at S = 2048 and 24 MiB ~3.6 times --
    the traffic the FA3 kernels' evict_first hints on Q and O (kernels/hopper/tma.cuh) remove."""
    from bench.l2_order_model import simulate

    assert round(simulate(2048, 12, 25, qo=True)["dram_mib"] / 128, 2) == 1.82
    assert round(simulate(2048, 24, 25, qo=True)["dram_mib"] / 128, 2) == 3.58
    assert simulate(2048, 12, 25, qo=True, causal=True)["dram_mib"] == 128.0
