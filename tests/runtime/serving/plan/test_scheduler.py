"""serving.plan.scheduler: the CPU half of the load-balanced persistent-kernel scheduler."""
from __future__ import annotations

import heapq
import math
import statistics
import time

import numpy as np
import pytest
import torch

from attncc.runtime.serving.merge import merge_states
from attncc.runtime.serving.plan import planner
from attncc.runtime.serving.plan.format import DYNAMIC_SECTIONS
from attncc.runtime.serving.plan.lpt import cta_queues
from attncc.runtime.serving.plan.scheduler import (
    HEADER_FIELDS, MERGE_TARGET_DTYPE, WORK_UNIT_DTYPE, WRITE_THROUGH, Plan, PlanLayout,
    cost_ticks, kv_chunk_size, lpt_schedule, paged_kv_lens, plan,
    simulate, workspace_bytes,
)
from tests.helpers import ROOT

NUM_SMS = 132   # H100 / H200


# --------------------------------------------------------------------------- helpers

def indptr(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def lpt_schedule_reference(costs, num_ctas: int, tiebreak=None, section=None
                           ) -> tuple[np.ndarray, np.ndarray]:
    """The specification of `lpt_schedule` (and planner.c): a plain Python min-heap of
    ``(load, cta)`` over the units taken by section, cost descending, tiebreak, index."""
    c = [int(x) for x in costs]
    tb = [0] * len(c) if tiebreak is None else [int(x) for x in tiebreak]
    sec = [0] * len(c) if section is None else [int(x) for x in section]
    order = sorted(range(len(c)), key=lambda u: (sec[u], -c[u], tb[u], u))
    heap = [(0, cta) for cta in range(num_ctas)]
    assign = []
    for u in order:
        load, cta = heapq.heappop(heap)
        assign.append(cta)
        heapq.heappush(heap, (load + c[u], cta))
    return cta_queues(np.asarray(order, dtype=np.int64), np.asarray(assign, dtype=np.int64),
                      num_ctas)


def zipf_lengths(rng: np.random.Generator, n: int, scale: int, cap: int, a: float = 1.5) -> np.ndarray:
    return np.minimum(rng.zipf(a, n) * scale, cap).astype(np.int64)


def random_problem(rng: np.random.Generator) -> dict:
    """A random small problem, with empty requests, GQA, all tile sizes, few or many CTAs."""
    batch = int(rng.integers(1, 12))
    hk = int(rng.choice([1, 2, 4]))
    g = int(rng.choice([1, 2, 4, 8]))
    lq = rng.integers(0, 40, batch) * (rng.random(batch) > 0.15)
    if rng.random() < 0.5:
        kv = rng.integers(0, 3000, batch)
    else:
        kv = zipf_lengths(rng, batch, 64, 20000)
    kv = kv * (rng.random(batch) > 0.1)
    return dict(qo_indptr=indptr(lq), kv_lens=kv, num_qo_heads=hk * g, num_kv_heads=hk,
                tile_q=int(rng.choice([16, 32, 64, 128])), num_ctas=int(rng.integers(1, 40)),
                alpha=float(rng.choice([0.0, 0.5, 1.0, 3.0])), beta=float(rng.choice([0.25, 1.0])),
                kv_chunk_align=int(rng.choice([1, 16, 32])), min_kv_chunk=int(rng.choice([1, 64, 128])))


PROBLEMS = [random_problem(np.random.default_rng(seed)) for seed in range(60)]


def unit_groups(p: Plan) -> np.ndarray:
    """The scheduler's tie-break key per unit: 4 * request + 2 * last_tile + last_chunk."""
    u = p.units
    rows = np.diff(p.qo_indptr.astype(np.int64)) * p.group_size
    last_tile = u["q_start"].astype(np.int64) + p.tile_q >= rows[u["request"]]
    last_chunk = u["kv_start"].astype(np.int64) + p.kv_chunk >= p.kv_lens[u["request"]]
    return 4 * u["request"].astype(np.int64) + 2 * last_tile + last_chunk


def plan_ticks(p: Plan) -> np.ndarray:
    u = p.units
    heads = u["kv_heads"].astype(np.int64)
    total = p.alpha * float((u["q_rows"] * heads).sum()) + p.beta * float(
        ((u["kv_end"] - u["kv_start"]) * heads).sum())
    return cost_ticks(p.unit_costs(), p.num_ctas, total)


def check_structure(p: Plan, kv_chunk_align: int = 1, min_kv_chunk: int = 1) -> None:
    """Every documented invariant of a plan's arrays."""
    u = p.units
    n = p.num_units
    assert u.dtype == WORK_UNIT_DTYPE and p.merge_out.dtype == MERGE_TARGET_DTYPE
    for a in (p.cta_indptr, p.cta_units, p.merge_indptr, p.qo_indptr, p.kv_lens):
        assert a.dtype == np.int32 and not a.flags.writeable
    # queues: a CSR partition of all units
    assert p.cta_indptr.shape == (p.num_ctas + 1,) and p.cta_indptr[0] == 0
    assert p.cta_indptr[-1] == n and np.all(np.diff(p.cta_indptr) >= 0)
    assert np.array_equal(np.sort(p.cta_units), np.arange(n))
    # unit order (request, kv_head, q_start, kv_start) and field ranges
    keys = np.stack([u["request"], u["kv_head"], u["q_start"], u["kv_start"]]).astype(np.int64)
    if n > 1:
        assert np.all(np.lexsort(keys[::-1]) == np.arange(n))
    assert np.all(u["kv_heads"] >= 1) and np.all(u["kv_head"] % u["kv_heads"] == 0)
    assert np.all(u["kv_head"] + u["kv_heads"] <= p.num_kv_heads)
    spans = u["kv_heads"] > 1  # only write-through units of one-tile requests span heads
    assert np.all(p.num_kv_heads % u["kv_heads"] == 0)
    assert np.all(u["slot"][spans] == WRITE_THROUGH) and np.all(u["q_start"][spans] == 0)
    rows = np.diff(p.qo_indptr.astype(np.int64)) * p.group_size
    assert np.all(rows[u["request"][spans]] <= p.tile_q)
    assert np.all((u["q_rows"] >= 1) & (u["q_rows"] <= p.tile_q))
    assert np.all(u["q_start"] % p.tile_q == 0)
    assert np.all((u["kv_head"] >= 0) & (u["kv_head"] < p.num_kv_heads))
    assert np.all(u["kv_end"] - u["kv_start"] <= p.kv_chunk) and np.all(u["kv_start"] % p.kv_chunk == 0)
    assert np.all(u["kv_end"] <= p.kv_lens[u["request"]]) and np.all(u["kv_start"] <= u["kv_end"])
    assert p.kv_chunk % kv_chunk_align == 0 and p.kv_chunk >= min_kv_chunk
    # slots: split units take 0..S-1 in unit order, write-through units are -1
    split = u["slot"] != WRITE_THROUGH
    assert np.array_equal(u["slot"][split], np.arange(p.num_partial_slots))
    assert np.array_equal(split, p.kv_lens[u["request"]] > p.kv_chunk)
    # reduction map: one entry per split item, slots ascending in kv start, covering [0, kv_len)
    assert p.merge_indptr[0] == 0 and p.merge_indptr[-1] == p.num_partial_slots
    unit_of_slot = np.flatnonzero(split)
    seen = set()
    for m in range(p.num_merges):
        members = unit_of_slot[p.merge_indptr[m]:p.merge_indptr[m + 1]]
        assert members.size >= 2
        t = p.merge_out[m]
        for name in MERGE_TARGET_DTYPE.names:
            want = p.qo_indptr[u["request"][members]] if name == "qo_offset" else u[name][members]
            assert np.all(want == t[name])
        assert np.all(u["kv_heads"][members] == 1)
        assert u["kv_start"][members[0]] == 0
        assert np.array_equal(u["kv_start"][members[1:]], u["kv_end"][members[:-1]])
        assert u["kv_end"][members[-1]] == p.kv_lens[t["request"]]
        key = (int(t["request"]), int(t["kv_head"]), int(t["q_start"]))
        assert key not in seen
        seen.add(key)


def coverage(p: Plan) -> list[np.ndarray]:
    """Per request, how often each (kv head, fused row, kv position) is computed."""
    rows = np.diff(p.qo_indptr) * p.group_size
    counts = [np.zeros((p.num_kv_heads, r, kv), dtype=np.int64) for r, kv in zip(rows, p.kv_lens)]
    for x in p.units:
        counts[x["request"]][x["kv_head"]:x["kv_head"] + x["kv_heads"],
                             x["q_start"]:x["q_start"] + x["q_rows"],
                             x["kv_start"]:x["kv_end"]] += 1
    return counts


def written(p: Plan) -> np.ndarray:
    """How often each (query token, query head) output row is written (directly or by a merge)."""
    out = np.zeros((int(p.qo_indptr[-1]), p.num_qo_heads), dtype=np.int64)
    targets = [(x, int(x["kv_heads"])) for x in p.units if x["slot"] == WRITE_THROUGH]
    targets += [(t, 1) for t in p.merge_out]     # a split item is one KV head
    for x, n in targets:
        r = np.arange(x["q_start"], x["q_start"] + x["q_rows"])
        for h in range(int(x["kv_head"]), int(x["kv_head"]) + n):
            np.add.at(out, (p.qo_indptr[x["request"]] + r // p.group_size,
                            h * p.group_size + r % p.group_size), 1)
    return out


# --------------------------------------------------------------------------- coverage & structure

@pytest.mark.parametrize("seed", range(len(PROBLEMS)))
def test_every_position_covered_exactly_once(seed: int) -> None:
    kw = PROBLEMS[seed]
    p = plan(**kw)
    check_structure(p, kw["kv_chunk_align"], kw["min_kv_chunk"])
    for c in coverage(p):
        assert np.all(c == 1)
    assert np.all(written(p) == 1)   # every output row written once, empty-KV rows included


def test_plan_executes_to_exact_attention() -> None:
    """Run the plan on CPU in fp64 (units in CTA queue order, partials to the workspace, then
    the reduction map with merge_states) and compare with attention computed directly."""
    gen = torch.Generator().manual_seed(7)
    lq = np.array([3, 0, 1, 17, 5, 2])
    kv = np.array([700, 40, 0, 300, 1500, 129])
    hq, hk, d = 8, 2, 16
    g = hq // hk
    p = plan(indptr(lq), kv, hq, hk, tile_q=16, num_ctas=40, min_kv_chunk=32, kv_chunk_align=16)
    assert p.num_merges > 0 and np.any(p.units["slot"] == WRITE_THROUGH)
    q = torch.randn(int(lq.sum()), hq, d, generator=gen, dtype=torch.float64)
    kv_ptr = indptr(kv)
    k = torch.randn(int(kv.sum()), hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(int(kv.sum()), hk, d, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(d)

    def unit_state(x, h):   # partial attention of one head of a unit: o [rows, d], lse [rows]
        r = torch.arange(int(x["q_start"]), int(x["q_start"] + x["q_rows"]))
        tok, head = int(p.qo_indptr[x["request"]]) + r // g, h * g + r % g
        base = kv_ptr[x["request"]]
        ks = k[base + x["kv_start"]: base + x["kv_end"], h]
        vs = v[base + x["kv_start"]: base + x["kv_end"], h]
        s = (q[tok, head] @ ks.T) * scale
        if s.shape[1] == 0:
            empty_lse = torch.full((len(r),), -math.inf, dtype=torch.float64)
            return torch.zeros(len(r), d, dtype=torch.float64), empty_lse, tok, head
        lse = torch.logsumexp(s, 1)
        return torch.softmax(s, 1) @ vs, lse, tok, head

    out = torch.full((q.shape[0], hq, d), math.nan, dtype=torch.float64)
    out_lse = torch.full((q.shape[0], hq), math.nan, dtype=torch.float64)
    ws_o = torch.full((p.num_partial_slots, p.tile_q, d), math.nan, dtype=torch.float64)
    ws_lse = torch.full((p.num_partial_slots, p.tile_q), math.nan, dtype=torch.float64)
    for cta in range(p.num_ctas):
        for i in p.cta_units[p.cta_indptr[cta]:p.cta_indptr[cta + 1]]:
            x = p.units[i]
            for h in range(int(x["kv_head"]), int(x["kv_head"] + x["kv_heads"])):
                o, lse, tok, head = unit_state(x, h)
                if x["slot"] == WRITE_THROUGH:
                    out[tok, head], out_lse[tok, head] = o, lse
                else:
                    ws_o[x["slot"], :len(tok)], ws_lse[x["slot"], :len(tok)] = o, lse
    for m in range(p.num_merges):
        t = p.merge_out[m]
        slots = torch.arange(int(p.merge_indptr[m]), int(p.merge_indptr[m + 1]))
        n = int(t["q_rows"])
        o, lse = merge_states(ws_o[slots, :n], ws_lse[slots, :n])
        r = torch.arange(int(t["q_start"]), int(t["q_start"]) + n)
        tok, head = t["qo_offset"] + r // g, t["kv_head"] * g + r % g
        out[tok, head], out_lse[tok, head] = o, lse

    for b in range(len(lq)):
        qs = q[indptr(lq)[b]:indptr(lq)[b + 1]].transpose(0, 1)               # [hq, lq, d]
        ks = k[kv_ptr[b]:kv_ptr[b + 1]].repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[kv_ptr[b]:kv_ptr[b + 1]].repeat_interleave(g, dim=1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        got_o = out[indptr(lq)[b]:indptr(lq)[b + 1]].transpose(0, 1)
        got_lse = out_lse[indptr(lq)[b]:indptr(lq)[b + 1]].transpose(0, 1)
        if kv[b] == 0:
            assert torch.all(got_o == 0) and torch.all(torch.isneginf(got_lse))
            continue
        torch.testing.assert_close(got_o, torch.softmax(s, -1) @ vs, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
    assert not torch.isnan(out).any()


# --------------------------------------------------------------------------- LPT

def lpt_cases():
    rng = np.random.default_rng(11)
    cases = [(np.array([], dtype=np.int64), 3), (np.array([5]), 1), (np.array([0, 0, 0]), 2),
             (np.array([7, 7, 7, 7, 7]), 2), (np.array([4, 3, 3, 0, 2]), 8)]
    for i in range(120):
        n, p = int(rng.integers(0, 600)), int(rng.integers(1, 70))
        kind = i % 5
        if kind == 0:
            c = rng.integers(0, 4, n)                                   # many ties and zeros
        elif kind == 1:
            c = rng.integers(1, 10**9, n)
        elif kind == 2:
            c = rng.zipf(1.3, n) % 10**7
        elif kind == 3:                                                  # few huge, many tiny
            c = np.concatenate([rng.integers(10**6, 10**7, n // 20), rng.integers(0, 5, n - n // 20)])
        else:                                                            # long equal runs
            c = np.repeat(rng.integers(1, 50, 8), rng.integers(0, 3 * p, 8))
        cases.append((c.astype(np.int64), p))
    return cases


@pytest.mark.parametrize("costs, num_ctas", lpt_cases())
def test_vectorised_lpt_equals_heap(costs: np.ndarray, num_ctas: int) -> None:
    got = lpt_schedule(costs, num_ctas)
    ref = lpt_schedule_reference(costs, num_ctas)
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
    tiebreak = (np.arange(costs.size) * 7919) % 13
    got = lpt_schedule(costs, num_ctas, tiebreak)
    ref = lpt_schedule_reference(costs, num_ctas, tiebreak)
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
    # sections: costs rise again (after runs of zeros too) at every section boundary
    section = (np.arange(costs.size) * 104729) % 5
    for tb in (None, tiebreak):
        got = lpt_schedule(costs, num_ctas, tb, section)
        ref = lpt_schedule_reference(costs, num_ctas, tb, section)
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])


@pytest.mark.parametrize("seed", range(0, len(PROBLEMS), 3))
def test_plan_assignment_is_the_heap_lpt(seed: int) -> None:
    """The plan's queues are exactly a Python heap's LPT over the units' tick costs, with the
    documented tie-break (cost group, then unit index)."""
    p = plan(**PROBLEMS[seed])
    indptr_ref, units_ref = lpt_schedule_reference(plan_ticks(p), p.num_ctas, unit_groups(p))
    assert np.array_equal(p.cta_indptr, indptr_ref) and np.array_equal(p.cta_units, units_ref)


@pytest.mark.parametrize("seed", range(len(PROBLEMS)))
def test_load_balance_bound(seed: int) -> None:
    p = plan(**PROBLEMS[seed])
    if p.num_units == 0:
        return
    ticks = [int(t) for t in plan_ticks(p)]                    # exact integer loads
    per_cta = [sum(ticks[i] for i in p.cta_units[p.cta_indptr[c]:p.cta_indptr[c + 1]])
               for c in range(p.num_ctas)]
    assert max(per_cta) * p.num_ctas <= sum(ticks) + p.num_ctas * max(ticks)
    loads = simulate(p)
    costs = p.unit_costs()
    assert max(loads) <= sum(loads) / p.num_ctas + costs.max() + 1e-9 * (1 + sum(loads))


def test_simulate_matches_numpy() -> None:
    p = plan(**PROBLEMS[3])
    costs = p.unit_costs()
    cta = np.repeat(np.arange(p.num_ctas), np.diff(p.cta_indptr))
    expect = np.bincount(cta, weights=costs[p.cta_units], minlength=p.num_ctas)
    assert np.allclose(simulate(p), expect)
    assert simulate(p, costs=np.ones(p.num_units)) == np.diff(p.cta_indptr).astype(float).tolist()
    with pytest.raises(ValueError, match="costs has"):
        simulate(p, costs=[1.0])


def test_zipf_balances_better_than_one_cta_per_request() -> None:
    rng = np.random.default_rng(5)
    batch, hq, hk = 96, 32, 8
    lq = np.ones(batch, dtype=np.int64)                      # decode
    kv = zipf_lengths(rng, batch, 128, 262144)
    p = plan(indptr(lq), kv, hq, hk, tile_q=16, num_ctas=NUM_SMS)
    loads = simulate(p)
    # one CTA per request: a request's whole work (all heads, whole KV) on one CTA
    per_request = hk * (p.alpha * (hq // hk) + p.beta * kv)
    ideal = sum(loads) / p.num_ctas
    print(f"\nZipf decode batch {batch}: max CTA load {max(loads):.0f} with the plan, "
          f"{per_request.max():.0f} with one CTA per request (mean load {ideal:.0f})")
    assert max(loads) < 0.5 * per_request.max()
    assert max(loads) <= 1.2 * ideal


# --------------------------------------------------------------------------- edge cases

def test_empty_requests() -> None:
    p = plan(indptr([0, 3, 2, 0]), [50, 0, 300, 0], 4, 2, 16, num_ctas=3)
    assert set(p.units["request"].tolist()) == {1, 2}                 # l_q = 0: no units
    empty_kv = p.units[p.units["request"] == 1]
    assert empty_kv["kv_heads"].sum() == 2                             # both heads (one span)
    assert np.all(empty_kv["kv_start"] == 0) and np.all(empty_kv["kv_end"] == 0)
    assert np.all(empty_kv["slot"] == WRITE_THROUGH)                   # writes o = 0, lse = -inf
    assert np.all(written(p) == 1)
    none = plan(indptr([0, 0]), [10, 0], 4, 2, 16, num_ctas=4)
    assert none.num_units == 0 and none.cta_indptr.tolist() == [0] * 5 and none.num_merges == 0
    empty_batch = plan([0], [], 4, 2, 16, num_ctas=2)
    assert empty_batch.batch_size == 0 and empty_batch.num_units == 0
    check_structure(p), check_structure(none), check_structure(empty_batch)


@pytest.mark.parametrize("lq, kv", [(1, 1_000_000), (2048, 2048)])
def test_one_huge_request_is_split_across_all_ctas(lq: int, kv: int) -> None:
    p = plan(indptr([lq]), [kv], 32, 8, 64, num_ctas=NUM_SMS)
    check_structure(p, 16, 128)
    assert np.all(np.diff(p.cta_indptr) > 0)                          # every CTA has work
    loads = simulate(p)
    assert max(loads) <= 1.15 * sum(loads) / p.num_ctas
    assert all(c.min() == 1 == c.max() for c in coverage(p))
    # a decode request (8 work items for 132 CTAs) must be split; a long prefill (1,024 query
    # tiles x heads) already has more items than CTAs and is not
    items = 8 * -(-lq * 4 // 64)
    assert (p.num_merges > 0) == (items < NUM_SMS)


def test_batch_with_an_item_per_cta_is_not_split() -> None:
    """The chunk is the average work of a CTA over all KV heads: a batch with at least one
    (request, KV head) item per CTA keeps every item whole (no merges), one with fewer splits."""
    big = plan(indptr(np.ones(64, dtype=np.int64)), np.full(64, 1024), 32, 32, 16, num_ctas=792,
               min_kv_chunk=256, kv_chunk_align=32)
    assert big.num_units == 64 * 32 and big.num_merges == 0
    small = plan(indptr(np.ones(16, dtype=np.int64)), np.full(16, 1024), 32, 4, 16, num_ctas=792,
                 min_kv_chunk=256, kv_chunk_align=32)
    assert small.kv_chunk == 256 and small.num_units == 16 * 4 * 4 and small.num_merges == 64


def test_decode_gqa_group_8_is_fused() -> None:
    rng = np.random.default_rng(3)
    batch = 64
    kv = rng.integers(1, 5000, batch)
    p = plan(indptr(np.ones(batch, dtype=np.int64)), kv, 64, 8, 16, num_ctas=NUM_SMS)
    check_structure(p, 16, 128)
    assert p.group_size == 8 and np.all(p.units["q_rows"] == 8) and np.all(p.units["q_start"] == 0)
    # each (request, kv head) is one work item: 8 query heads x 1 token in one tile
    items = {(int(x["request"]), h) for x in p.units
             for h in range(int(x["kv_head"]), int(x["kv_head"] + x["kv_heads"]))}
    assert len(items) == batch * 8 and p.units["kv_heads"].sum() == batch * 8
    assert np.all(written(p) == 1)


@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
def test_chunks_are_page_aligned(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    batch = 40
    pages = rng.integers(0, 300, batch)
    last = np.where(pages > 0, rng.integers(1, page_size + 1, batch), 0)
    kv = paged_kv_lens(indptr(pages), last, page_size)
    # more CTAs than the ~320 work items, so that requests are split into chunks
    p = plan(indptr(rng.integers(1, 20, batch)), kv, 16, 4, 32, num_ctas=1024,
             kv_chunk_align=page_size)
    check_structure(p, page_size, 128)
    assert p.kv_chunk % page_size == 0 and np.all(p.units["kv_start"] % page_size == 0)
    assert p.num_merges > 0


def test_paged_kv_lens() -> None:
    assert paged_kv_lens([0, 1, 1, 4], [16, 0, 1], 16).tolist() == [16, 0, 33]
    assert paged_kv_lens([0], [], 8).tolist() == []
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] is 0"):
        paged_kv_lens([0, 2], [0], 16)
    with pytest.raises(ValueError, match="kv_last_page_len must be in"):
        paged_kv_lens([0, 2], [17], 16)
    with pytest.raises(ValueError, match="kv_last_page_len has 2 entries"):
        paged_kv_lens([0, 2], [1, 1], 16)
    with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
        paged_kv_lens([0, 2, 1], [1, 1], 16)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        paged_kv_lens([0, 2], [1], 0)


def test_kv_chunk_size_formula() -> None:
    # L = round_up(max(ceil(work / ctas), floor), align)
    assert kv_chunk_size(132 * 1000, 132) == 1008
    assert kv_chunk_size(132 * 1000 + 1, 132) == 1008
    assert kv_chunk_size(0, 132) == 128
    assert kv_chunk_size(10, 1, min_kv_chunk=1, kv_chunk_align=1) == 10
    p = plan(indptr([100, 1]), [4000, 9000], 8, 2, 32, num_ctas=4)
    work = 2 * (math.ceil(100 * 4 / 32) * 4000 + 1 * 9000)  # both KV heads' work
    assert p.kv_chunk == kv_chunk_size(work, 4)


@pytest.mark.parametrize("impl", ["numpy", "c"])
def test_requests_within_two_chunks_are_not_split(impl: str) -> None:
    """bench/decode.py's constant cells on 792 CTAs (Hq 32, 1K keys): batch 64 x 8 KV heads
    would cut each request into 672 + 352 keys and merge them all; its longest range is within
    two chunks, so it is not split. Batch 64 x 4 KV heads (chunks of 352: three pieces) and a
    long request among short ones still are."""
    if impl == "c" and not planner.available():
        pytest.skip("no C compiler for the compiled planner")
    decode = indptr([1] * 64)
    p = plan(decode, [1024] * 64, 32, 8, 16, num_ctas=792, kv_chunk_align=32, impl=impl)
    assert (p.kv_chunk, p.num_merges, p.num_units) == (1024, 0, 512)
    assert kv_chunk_size(8 * 64 * 1024, 792, 128, 32) == 672  # the formula alone would split
    p = plan(decode, [1024] * 64, 32, 4, 16, num_ctas=792, kv_chunk_align=32, impl=impl)
    assert (p.kv_chunk, p.num_merges) == (352, 256)
    p = plan(decode, [8192] + [512] * 63, 32, 8, 16, num_ctas=792, kv_chunk_align=32, impl=impl)
    assert p.kv_chunk == kv_chunk_size(8 * (8192 + 63 * 512), 792, 128, 32) < 8192 // 2
    assert p.num_merges > 0


# --------------------------------------------------------------------------- determinism & packing

def test_determinism_bitwise() -> None:
    rng = np.random.default_rng(9)
    lq, kv = rng.integers(0, 300, 128), zipf_lengths(rng, 128, 64, 100000)
    layout = PlanLayout(max_batch=256, max_qo_tokens=65536, max_ctas=2 * NUM_SMS, num_qo_heads=32,
                        num_kv_heads=8, tile_q=64)
    args = (32, 8, 64, 2 * NUM_SMS)
    a = plan(indptr(lq), kv, *args).pack(layout)
    for qo, kvs in [(indptr(lq), kv), (indptr(lq).astype(np.int32), kv.astype(np.int32)),
                    (indptr(lq).tolist(), kv.tolist()),
                    (torch.from_numpy(indptr(lq)), torch.from_numpy(kv))]:
        b = plan(qo, kvs, *args).pack(layout)
        assert a.dtype == b.dtype == np.int32 and a.tobytes() == b.tobytes()


def test_pack_roundtrip_and_offsets() -> None:
    """Plan.pack's header, cta_indptr at the layout's fixed offsets and the sections back to
    back after them at the offsets the header holds (one used range), read back by unpack."""
    layout = PlanLayout(max_batch=16, max_qo_tokens=512, max_ctas=24, num_qo_heads=8,
                        num_kv_heads=2, tile_q=32)
    rng = np.random.default_rng(4)
    sizes = set()
    for num_ctas in (1, 7, 24):
        lq = rng.integers(0, 40, 12)
        kv = rng.integers(0, 4000, 12)
        p = plan(indptr(lq), kv, 8, 2, 32, num_ctas)
        buf = p.pack(layout)
        sizes.add(buf.size)
        d = layout.unpack(buf)
        header = dict(zip(HEADER_FIELDS, buf[:len(HEADER_FIELDS)].tolist()))
        assert header["num_units"] == p.num_units and header["kv_chunk"] == p.kv_chunk
        assert header["layout_size"] == layout.size and header["total_qo_tokens"] == lq.sum()
        assert header["group_size"] == 4 and header["num_ctas"] == num_ctas
        assert np.array_equal(d["units"], p.units) and np.array_equal(d["cta_units"], p.cta_units)
        assert np.array_equal(d["cta_indptr"], p.cta_indptr)
        assert np.array_equal(d["merge_indptr"], p.merge_indptr)
        assert np.array_equal(d["merge_out"], p.merge_out)
        # a grid of max_ctas CTAs: the ones past num_ctas find empty queues
        o = layout.offsets["cta_indptr"]
        assert o == len(HEADER_FIELDS)
        assert np.all(buf[o + num_ctas:o + layout.max_ctas + 1] == p.num_units)
        # the sections back to back from dynamic_at, each 16-byte aligned, as the header says
        at = [header[f"{s}_at"] for s in DYNAMIC_SECTIONS]
        ends = [a + d[s].nbytes // 4 for a, s in zip(at, DYNAMIC_SECTIONS)]
        assert at[0] == layout.dynamic_at == o + -(-(layout.max_ctas + 1) // 4) * 4
        assert all(a % 4 == 0 and 0 <= a - e < 4 for a, e in zip(at[1:], ends))
        assert ends[-1] == layout.used_words(header) <= layout.size
        assert not buf[layout.used_words(header):].any()  # the room after the plan: untouched
        # into a caller's (e.g. pinned) buffer
        pinned = torch.zeros(layout.size + 8, dtype=torch.int32)
        out = p.pack(layout, out=pinned.numpy())
        assert np.shares_memory(out, pinned.numpy()) and np.array_equal(out[:layout.size], buf)
    assert sizes == {layout.size}
    assert all(off % 4 == 0 for off in layout.offsets.values())


@pytest.mark.parametrize("change, message", [
    (dict(lq=[1] * 17), "batch_size 17 > PlanLayout.max_batch = 16"),
    (dict(lq=[100] * 6), "total query tokens 600 > PlanLayout.max_qo_tokens = 512"),
    (dict(num_ctas=25), "num_ctas 25 > PlanLayout.max_ctas = 24"),
    (dict(tile_q=64), "tile_q 64 but PlanLayout.tile_q = 32"),
    (dict(hk=4), "num_kv_heads 4 but PlanLayout.num_kv_heads = 2"),
])
def test_pack_names_the_exceeded_maximum(change: dict, message: str) -> None:
    layout = PlanLayout(max_batch=16, max_qo_tokens=512, max_ctas=24, num_qo_heads=8,
                        num_kv_heads=2, tile_q=32)
    lq = change.get("lq", [3, 5])
    p = plan(indptr(lq), [100] * len(lq), 8, change.get("hk", 2), change.get("tile_q", 32),
             change.get("num_ctas", 24))
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        p.pack(layout)


def test_pack_out_validation() -> None:
    layout = PlanLayout(2, 16, 2, 1, 1, 16)
    p = plan([0, 1], [10], 1, 1, 16, 2)
    with pytest.raises(ValueError, match="layout needs"):
        p.pack(layout, out=np.zeros(layout.size - 1, dtype=np.int32))
    with pytest.raises(ValueError, match="contiguous 1-D int32"):
        p.pack(layout, out=np.zeros(layout.size, dtype=np.int64))
    with pytest.raises(ValueError, match="bad magic"):
        layout.unpack(np.zeros(layout.size, dtype=np.int32))
    buf = p.pack(layout)
    buf[HEADER_FIELDS.index("merge_out_at")] += 4  # not where the counts put it
    with pytest.raises(ValueError, match="section offsets do not match"):
        layout.unpack(buf)


def test_kernels_read_the_header_words_python_writes() -> None:
    """kernels/common/batch_params.cuh's header constants are codegen.layout.PLAN_HEADER_CONSTANTS
    (every batch translation unit static_asserts them too, but only NVRTC sees those), and
    planner.c's header size is the same."""
    import re

    from attncc.codegen.layout import PLAN_HEADER_CONSTANTS

    root = ROOT
    cuh = (root / "kernels" / "common" / "batch_params.cuh").read_text()
    assert dict(re.findall(r"constexpr int (kPlan\w+) = (\d+);", cuh)) == {
        k: str(v) for k, v in PLAN_HEADER_CONSTANTS}
    enum = re.search(r"enum \{ HEADER_WORDS = (\d+), AT_UNITS = (\d+)",
                     (root / "runtime" / "serving" / "plan" / "planner.c").read_text())
    assert enum and (int(enum[1]), int(enum[2])) == (len(HEADER_FIELDS),
                                                     HEADER_FIELDS.index("units_at"))


# --------------------------------------------------------------------------- workspace bound

def bound_problems():
    rng = np.random.default_rng(21)
    out = [random_problem(rng) for _ in range(150)]
    for _ in range(50):   # adversarial: a few requests just above the chunk length, many tiny
        p = int(rng.integers(1, 20))
        batch = int(rng.integers(1, 30))
        kv = rng.integers(0, 3, batch)
        big = rng.integers(0, batch, int(rng.integers(1, batch + 1)))
        kv[big] = rng.integers(1, 400)
        hk = int(rng.choice([1, 2, 8]))
        out.append(dict(qo_indptr=indptr(rng.integers(1, 3, batch)), kv_lens=kv, num_qo_heads=hk,
                        num_kv_heads=hk, tile_q=16, num_ctas=p, alpha=1.0, beta=1.0,
                        kv_chunk_align=1, min_kv_chunk=1))
    return out


def test_workspace_and_layout_bounds_hold() -> None:
    worst = 0.0
    for kw in bound_problems():
        p = plan(**kw)
        hk, num_ctas = kw["num_kv_heads"], kw["num_ctas"]
        layout = PlanLayout(max_batch=p.batch_size, max_qo_tokens=int(p.qo_indptr[-1]),
                            max_ctas=num_ctas, num_qo_heads=kw["num_qo_heads"], num_kv_heads=hk,
                            tile_q=kw["tile_q"])
        items = int(np.unique(np.stack([p.units["request"], p.units["kv_head"],
                                         p.units["q_start"]]), axis=1).shape[1]) if p.num_units else 0
        assert items <= layout.max_items
        assert p.num_partial_slots <= max(0, 2 * hk * num_ctas - 2)
        assert p.num_merges <= max(0, hk * num_ctas - 1)
        assert p.num_units <= items + hk * num_ctas - 1 or p.num_partial_slots == 0
        p.pack(layout)                              # fits: every derived maximum holds
        if p.num_partial_slots:
            worst = max(worst, p.num_partial_slots / (2 * hk * num_ctas - 2))
    print(f"\nworst partial slots / (2 * num_kv_heads * num_ctas - 2) = {worst:.3f}")
    assert worst > 0.5   # the adversarial cases come near the bound


def test_workspace_bytes() -> None:
    layout = PlanLayout(max_batch=256, max_qo_tokens=8192, max_ctas=2 * NUM_SMS, num_qo_heads=32,
                        num_kv_heads=8, tile_q=64)
    slots = layout.max_partial_slots
    assert slots == 2 * 8 * 2 * NUM_SMS - 2
    rows = slots * 64
    assert workspace_bytes(layout, 128, 32, 4) == rows * 128 * 4 + rows * 4
    assert workspace_bytes(layout, 128, 32, 2) == math.ceil(rows * 128 * 2 / 256) * 256 + rows * 4
    with pytest.raises(ValueError, match="num_qo_heads 16 != PlanLayout.num_qo_heads = 32"):
        workspace_bytes(layout, 128, 16, 2)


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(qo_indptr=[1, 2]), ValueError, "qo_indptr must start at 0, got 1"),
    (dict(qo_indptr=[0, 3, 2], kv_lens=[1, 1]), ValueError,
     r"qo_indptr must be non-decreasing: qo_indptr\[2\]"),
    (dict(qo_indptr=[]), ValueError, "qo_indptr must have at least one entry"),
    (dict(qo_indptr=[[0, 1]]), ValueError, "qo_indptr must be 1-D"),
    (dict(qo_indptr=[0.0, 1.0]), TypeError, "qo_indptr must hold integers"),
    (dict(kv_lens=[-1]), ValueError, r"kv_lens must be >= 0, kv_lens\[0\] = -1"),
    (dict(kv_lens=[1, 2]), ValueError, "kv_lens has 2 entries, qo_indptr describes 1 requests"),
    (dict(num_qo_heads=6, num_kv_heads=4), ValueError,
     r"num_qo_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
    (dict(tile_q=48), ValueError, r"tile_q must be one of \(16, 32, 64, 128\), got 48"),
    (dict(num_ctas=0), ValueError, "num_ctas must be >= 1, got 0"),
    (dict(num_ctas=2.0), TypeError, "num_ctas must be an int"),
    (dict(alpha=-1.0), ValueError, "alpha must be finite and >= 0"),
    (dict(beta=math.inf), ValueError, "beta must be finite and >= 0"),
    (dict(alpha=0.0, beta=0.0), ValueError, "alpha and beta cannot both be 0"),
    (dict(kv_chunk_align=0), ValueError, "kv_chunk_align must be >= 1"),
    (dict(min_kv_chunk=0), ValueError, "min_kv_chunk must be >= 1"),
    (dict(kv_lens=[2**31]), ValueError, "int32 range"),
])
def test_validation_names_the_argument(kwargs: dict, error: type, message: str) -> None:
    args = dict(qo_indptr=[0, 4], kv_lens=[100], num_qo_heads=8, num_kv_heads=2, tile_q=16,
                num_ctas=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        plan(**args)


def test_lpt_validation() -> None:
    with pytest.raises(TypeError, match="costs must be integers"):
        lpt_schedule([1.5], 2)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        lpt_schedule([-1], 2)
    with pytest.raises(ValueError, match="tiebreak has 1 entries"):
        lpt_schedule([1, 2], 2, tiebreak=[0])
    with pytest.raises(OverflowError, match="2\\*\\*62"):
        lpt_schedule([2**61, 2**61], 4)


# --------------------------------------------------------------------------- speed

def _median_us(fn, runs: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


@pytest.mark.speed
@pytest.mark.parametrize("case", ["decode-uniform", "decode-zipf", "prefill-uniform", "prefill-zipf"])
def test_plan_host_time_batch_256(case: str) -> None:
    """Host time of plan() at batch 256 (Llama-3-8B heads: 32 query, 8 KV; 2 CTAs per SM of an
    H100). The issue's target is 50 us; measured 0.6-1.2 ms (decode) and 1.6-3.3 ms (prefill,
    10-22k units) on VMs. The asserts are loose guards against regressions (e.g. a Python loop
    per unit), not the target, so that a slow CI machine does not fail them."""
    rng = np.random.default_rng(0)
    batch = 256
    kind, dist = case.split("-")
    if kind == "decode":
        lq = np.ones(batch, dtype=np.int64)
        kv = (rng.integers(512, 8192, batch) if dist == "uniform"
              else zipf_lengths(rng, batch, 256, 131072))
        tile_q = 16
    else:
        lq = rng.integers(16, 256, batch) if dist == "uniform" else zipf_lengths(rng, batch, 16, 2048)
        kv = lq + (rng.integers(0, 4096, batch) if dist == "uniform"
                   else zipf_lengths(rng, batch, 128, 32768))
        tile_q = 128
    qo = indptr(lq)
    p = plan(qo, kv, 32, 8, tile_q, 2 * NUM_SMS)
    median = _median_us(lambda: plan(qo, kv, 32, 8, tile_q, 2 * NUM_SMS), runs=200)
    print(f"\nplan() batch {batch} {case}: median {median:.0f} us over 200 runs "
          f"({p.num_units} units, {p.num_merges} split items, kv_chunk {p.kv_chunk})")
    assert median < (5_000 if kind == "decode" else 20_000)


# --------------------------------------------------------------------------- head spans

def test_head_spans_pin_the_rule() -> None:
    """A one-tile, unsplit request's units span the largest divisor s of num_kv_heads with
    s * (one head's cost) <= total cost / (2 * num_ctas); split and multi-tile ones span 1."""
    qo = indptr(np.ones(256, dtype=np.int64))
    p = plan(qo, np.full(256, 1024), 32, 32, 16, num_ctas=792, kv_chunk_align=32,
             min_kv_chunk=256)
    # one head costs 1025, the mean CTA load 256 * 32 * 1025 / 792: s * 1025 <= 5.17 * 1025
    assert p.num_units == 2048 and np.all(p.units["kv_heads"] == 4)
    assert np.array_equal(p.unit_costs(), np.full(2048, 4 * 1025.0))
    assert sum(simulate(p)) == 256 * 32 * 1025
    off = plan(qo, np.full(256, 1024), 32, 32, 16, 792, kv_chunk_align=32, min_kv_chunk=256,
               head_span=False)
    assert off.num_units == 8192 and np.all(off.units["kv_heads"] == 1)
    # mixed: a long split request and a prefill (3 tiles) keep span 1, short decode rows span
    lq, kv = np.array([1, 1, 40, 1]), np.array([50_000, 100, 300, 0])
    m = plan(indptr(lq), kv, 8, 8, 16, num_ctas=16)
    check_structure(m, 16, 128)
    span = {int(r): set(m.units["kv_heads"][m.units["request"] == r].tolist()) for r in range(4)}
    assert span == {0: {1}, 1: {8}, 2: {1}, 3: {8}}
    assert np.all(written(m) == 1) and all(np.all(c == 1) for c in coverage(m))


def test_spanned_plans_cover_every_row_once_at_serving_scale() -> None:
    rng = np.random.default_rng(17)
    for hk in (4, 8, 32):
        batch = 256
        kv = np.minimum(rng.zipf(1.5, batch) * 300, 40_000)
        lq = np.where(rng.random(batch) < 0.9, 1, rng.integers(1, 5, batch))
        p = plan(indptr(lq), kv, 32, hk, 16, num_ctas=792, kv_chunk_align=16, min_kv_chunk=256)
        check_structure(p, 16, 256)
        assert np.all(written(p) == 1)
        if hk > 4:
            assert p.units["kv_heads"].max() > 1
        # the spans keep the list-scheduling bound of the greedy
        loads = simulate(p)
        assert max(loads) <= sum(loads) / p.num_ctas + p.unit_costs().max() + 1e-6


def test_problems_exercise_head_spans() -> None:
    """The random problems of the coverage / heap tests include units of several heads."""
    spanned = [kw for kw in PROBLEMS if plan(**kw).units["kv_heads"].max(initial=1) > 1]
    assert len(spanned) >= 5
