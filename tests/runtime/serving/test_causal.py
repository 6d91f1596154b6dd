"""runtime/serving/causal.py: clipping a staged plan's units at their diagonal, the L2 sections
of the rebalanced queues, and the mask bound that decides whether to clip (CPU, pure)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import attncc
from attncc.runtime.serving import causal as causal_mod
from attncc.runtime.serving.causal import (L2_SECTION_BYTES, clip_causal_units,
                                           mask_causal_bound, section_tokens)
from attncc.runtime.serving.plan.scheduler import PlanLayout, plan_into


def _staged(lq: list[int], kv: list[int], hq: int, hk: int, tq: int = 16,
            ctas: int = 24) -> tuple[np.ndarray, PlanLayout, np.ndarray, np.ndarray]:
    """A packed plan of requests with `lq` query and `kv` KV tokens (queries the last ones)."""
    qo = np.concatenate([[0], np.cumsum(lq)])
    kv_lens = np.array(kv)
    lay = PlanLayout(len(lq) + 2, int(qo[-1]) + 8, ctas, hq, hk, tq)
    buf = np.zeros(lay.size, dtype=np.int32)
    plan_into(buf, lay, qo, kv_lens, hq, hk, tq, ctas, kv_chunk_align=16, min_kv_chunk=16)
    return buf, lay, qo, kv_lens


def _want_ends(u: np.ndarray, qo: np.ndarray, kv: np.ndarray, group: int, bound: int,
               qpos: np.ndarray | None, kvoff: np.ndarray | None) -> np.ndarray:
    """Each unit's clipped KV end, one unit at a time: its largest query position + bound + 1
    (shifted by the request's key offset), held within [kv_start, kv_end]."""
    ends = []
    for x in u:
        req = int(x["request"])
        toks = range(int(x["q_start"]) // group, (int(x["q_start"]) + int(x["q_rows"]) - 1)
                      // group + 1)
        if qpos is None:
            q_max = max(int(kv[req]) - int(qo[req + 1] - qo[req]) + t for t in toks)
        else:
            q_max = max(int(qpos[int(qo[req]) + t]) for t in toks)
        limit = q_max + bound + 1 - (int(kvoff[req]) if kvoff is not None else 0)
        ends.append(min(max(limit, int(x["kv_start"])), int(x["kv_end"])))
    return np.array(ends)


def _queues_hold_every_unit_once(p: dict) -> bool:
    ind, cu = p["cta_indptr"], p["cta_units"]
    listed = np.sort(cu[:int(ind[int(p["num_ctas"])])])
    return listed.tolist() == list(range(int(p["num_units"])))


@pytest.mark.parametrize("bound", [0, 5, 37])
@pytest.mark.parametrize("positions", [False, True])
def test_clipped_ends_are_each_units_last_query_plus_bound(bound: int, positions: bool) -> None:
    """Every unit ends at min(its end, max(its start, last query position + bound + 1)), with
    default positions or explicit q_positions / kv_position_offset; starts, rows and slots
    are untouched, and the queues still list every unit exactly once."""
    rng = np.random.default_rng(bound)
    lq, kv = [40, 1, 200, 17, 64], [40, 900, 700, 17, 300]
    buf, lay, qo, kv_lens = _staged(lq, kv, 4, 2)
    qpos = kvoff = None
    if positions:
        qpos = np.concatenate([np.sort(rng.integers(0, k, n)) for n, k in zip(lq, kv)])
        kvoff = rng.integers(-5, 20, len(lq))
    before = lay.unpack(buf)["units"].copy()
    clip_causal_units(buf, lay, qo, kv_lens, 2, bound, qpos, kvoff)
    p = lay.unpack(buf)
    u = p["units"]
    assert u["kv_end"].tolist() == _want_ends(before, qo, kv_lens, 2, bound, qpos, kvoff).tolist()
    for field in ("request", "kv_head", "kv_heads", "q_start", "q_rows", "kv_start", "slot"):
        assert (u[field] == before[field]).all(), field
    assert _queues_hold_every_unit_once(p)


def test_a_small_clip_keeps_the_queues() -> None:
    """Clipping under a tenth of the keys (one short prefill chunk among long decodes) ends the
    units but leaves the CTA queues as the scheduler balanced them."""
    buf, lay, qo, kv_lens = _staged([1] * 12 + [20], [4000] * 12 + [4000], 8, 2)
    queues = (lay.unpack(buf)["cta_indptr"].copy(), lay.unpack(buf)["cta_units"].copy())
    keys = lambda: int((lay.unpack(buf)["units"]["kv_end"]  # noqa: E731
                        - lay.unpack(buf)["units"]["kv_start"]).sum())
    full = keys()
    clip_causal_units(buf, lay, qo, kv_lens, 4, 0)
    assert 0 < full - keys() < full / 10
    p = lay.unpack(buf)
    assert (p["cta_indptr"] == queues[0]).all() and (p["cta_units"] == queues[1]).all()


def test_a_large_clip_rebalances_longest_first() -> None:
    """A causal prefill loses about half its keys: the queues are rebuilt on the clipped costs,
    so the most loaded CTA carries less than it would in the scheduler's queues, and every
    unit is still queued once."""
    buf, lay, qo, kv_lens = _staged([512, 512], [512, 512], 4, 2, ctas=16)

    def max_load(words: np.ndarray) -> int:
        p = lay.unpack(words)
        u, ind, cu = p["units"], p["cta_indptr"], p["cta_units"]
        cost = (u["q_rows"].astype(np.int64) + u["kv_end"] - u["kv_start"]) * u["kv_heads"]
        return max(int(cost[cu[ind[c]:ind[c + 1]]].sum()) for c in range(int(p["num_ctas"])))

    stale = buf.copy()
    clip_causal_units(buf, lay, qo, kv_lens, 2, 0)
    lay.unpack(stale)["units"]["kv_end"] = lay.unpack(buf)["units"]["kv_end"]
    assert _queues_hold_every_unit_once(lay.unpack(buf))
    assert max_load(buf) < max_load(stale)


def test_sections_order_each_queue() -> None:
    """With L2 sections, each CTA's queue visits the sections (cut every `section_tokens` K/V
    tokens of the (request, KV head) pairs in order) in ascending order."""
    buf, lay, qo, kv_lens = _staged([300, 200, 400], [300, 900, 400], 8, 4, ctas=12)
    clip_causal_units(buf, lay, qo, kv_lens, 2, 0, section_tokens=500)
    p = lay.unpack(buf)
    u = p["units"]
    pair0 = 4 * (np.cumsum(kv_lens) - kv_lens)
    sec = (pair0[u["request"]] + u["kv_head"] * kv_lens[u["request"]]) // 500
    assert len(set(sec.tolist())) > 3
    ind, cu = p["cta_indptr"], p["cta_units"]
    for c in range(int(p["num_ctas"])):
        assert (np.diff(sec[cu[ind[c]:ind[c + 1]]]) >= 0).all(), c


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_section_tokens_fill_the_l2_budget(d: int, dtype: torch.dtype) -> None:
    """FA3 sections hold L2_SECTION_BYTES of K and V (2 x D elements a token); FA2 has none
    (its paged causal prefill was slower in sections) and never reads the dtype."""
    got = section_tokens("fa3", d, dtype)
    assert got is not None
    per_token = 2 * d * dtype.itemsize
    assert got * per_token <= L2_SECTION_BYTES < (got + 1) * per_token
    assert section_tokens("fa2", d, object()) is None


def test_l2_section_budget_is_the_one_batch_exports() -> None:
    from attncc.runtime.serving import batch

    assert batch.L2_SECTION_BYTES is causal_mod.L2_SECTION_BYTES == 12 << 20


@pytest.mark.parametrize("mask,want", [
    (lambda b, h, q, kv: q >= kv, 0),
    (lambda b, h, q, kv: kv <= q + 7, 7),
    (lambda b, h, q, kv: (q >= kv) & (q - kv < 64), 0),
    (lambda b, h, q, kv: kv < q, -1),
    (lambda b, h, q, kv: (kv < 100) | (q >= kv), None),   # a prefix sees past the diagonal
    (lambda b, h, q, kv: kv >= q, None),
    (None, None),
])
def test_mask_causal_bound(mask: object, want: int | None) -> None:
    """The bound clipping uses: the c with every kept key at kv_idx <= q_idx + c, None when
    the mask proves none (or there is no mask)."""
    variant = attncc.Variant() if mask is None else attncc.Variant(mask_mod=mask)
    assert mask_causal_bound(variant.trace()[0]) == want
