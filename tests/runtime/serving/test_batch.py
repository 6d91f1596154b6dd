"""BatchAttention on the CPU: plan-time validation, the batch reference, and the batch kernels'
translation units (NVRTC). GPU behaviour is pinned in tests/gpu/test_batch.py."""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

import attncc
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention, choose_batch_tiles
from attncc.runtime.reference import attention_reference
from attncc.gym import GYM, causal


def _ba(layout: str = "NHD") -> BatchAttention:
    return BatchAttention(None, kv_layout=layout, device="cpu")


KW = dict(num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=16)


@pytest.mark.parametrize("args,match", [
    (([0, 1, 2], [0, 3, 2], [0, 1, 2], [16, 16]), "kv_indptr must be non-decreasing"),
    (([1, 2], [0, 1], [0], [16]), "qo_indptr must start at 0"),
    (([0, 1], [0, 2], [0, -4], [16]), "negative page id"),
    (([0, 1], [0, 2], [0], [16]), "kv_indices has 1 entries"),
    (([0, 1, 2], [0, 1], [0], [16]), "kv_indptr has 2 entries"),
    (([0, 40], [0, 2], [0, 1], [4]), "40 query tokens but only 20 KV tokens"),
])
def test_plan_rejects_invalid_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _ba().plan(*args, **KW)


def test_plan_rejects_bad_heads_and_maxima() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _ba().plan([0, 1], [0, 1], [0], [3], num_qo_heads=3, num_kv_heads=2, head_dim=128)
    with pytest.raises(ValueError, match="max_batch"):
        BatchAttention(None, device="cpu", max_batch=1).plan([0, 1, 2], [0, 1, 2], [0, 1],
                                                              [3, 3], **KW)
    with pytest.raises(ValueError, match="ragged' takes no kv_indices"):
        _ba("ragged").plan([0, 1], [0, 5], [0], [5], **KW)


def test_plan_lengths_and_tiles() -> None:
    ba = _ba()
    ba.plan([0, 1, 1, 2], [0, 2, 2, 5], [7, 3, 1, 2, 9], [1, 0, 16], **KW)
    assert ba.kv_lens.tolist() == [17, 0, 48]
    assert ba.tiles is not None and ba.tiles.tq == 16  # decode: 1 token x group 2
    ba.plan([0, 300], [0, 30], list(range(30)), [16], **KW)
    assert ba.tiles.tq == 128 and ba.tiles.m_frags == 2


def test_choose_batch_tiles_fits_the_sm() -> None:
    for d in (64, 128, 256):
        for rows in (1, 8, 17, 64, 65, 4096):
            t = choose_batch_tiles(d, rows, 132)
            assert t.tq >= min(rows, t.tq) and t.num_ctas == t.ctas_per_sm * 132
            assert t.ctas_per_sm >= 1


def test_decode_tiles_split_kv_between_warps_and_fit_residency() -> None:
    """Decode tiles (16 fused rows) get KV-splitting warps; the CTAs per SM follow shared memory
    and the 128-register cap the kernel's __launch_bounds__ asks for (fa2_config.cuh kMinBlocks),
    and a forced 4-tuple sets kv_warps."""
    from attncc.runtime.jit.tiles import fa2_config

    t = choose_batch_tiles(128, 8, 132)
    assert (t.tq, t.tkv, t.kv_warps, t.ctas_per_sm) == (16, 32, 2, 6)
    cfg = fa2_config(128, t.tq, t.tkv, t.stages, t.m_frags, t.kv_warps)
    assert cfg.threads == 64 and t.ctas_per_sm * cfg.smem_bytes <= 227 * 1024
    assert t.ctas_per_sm * cfg.threads * 128 <= 65536
    f = choose_batch_tiles(128, 8, 132, force=(16, 64, 2, 4))
    assert (f.tkv, f.kv_warps, f.ctas_per_sm, f.num_ctas) == (64, 4, 3, 396)
    assert choose_batch_tiles(128, 8, 132, force=(16, 32, 2)).kv_warps == 1
    assert choose_batch_tiles(128, 4096, 132).kv_warps == 1
    with pytest.raises(ValueError, match="kv_warps"):
        choose_batch_tiles(128, 64, 132, force=(64, 64, 2, 2))


def test_reference_q_offset_is_the_tail_of_the_full_sequence(rng) -> None:
    """attention_reference(q_offset=n) == the last rows of the full-length computation."""
    ir, bind = attncc.Variant(mask_mod=causal, score_mod=GYM["alibi"](1, 4, 9, 16).score_mod
                              ).trace()
    q, k, v = rng.qkv(1, 4, 9, 16)
    full, full_lse = attention_reference(q, k, v, ir, bind)
    tail, tail_lse = attention_reference(q[:, :, 6:], k, v, ir, bind, q_offset=6)
    assert torch.allclose(tail, full[:, :, 6:]) and torch.allclose(tail_lse, full_lse[:, :, 6:])


def test_batch_reference_hooks_see_the_request_as_b(rng) -> None:
    """The batch kernels pass a request's index as the hooks' b (a document table per request);
    the batch oracle does too: request i equals attention_reference on batch row i of a batch
    whose rows are the requests (here a per-request bias and per-request document ids)."""
    R, n, h, d = 3, 7, 2, 16
    bias = torch.tensor([0.0, 2.0, -3.0])
    docs = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1, 1]])
    variant = attncc.Variant(score_mod=lambda s, b, hh, q, kv: s + bias[b] * (q - kv),
                             mask_mod=lambda b, hh, q, kv: docs[b, q] == docs[b, kv])
    q, k, v = rng.qkv(R, h, n, d)
    out, lse = batch_attention_reference(q.transpose(1, 2).flatten(0, 1),
                                         (k.transpose(1, 2).flatten(0, 1),
                                          v.transpose(1, 2).flatten(0, 1)),
                                         np.arange(R + 1) * n, np.arange(R + 1) * n,
                                         kv_layout="ragged", variant=variant)
    ir, bind = variant.trace()
    want, want_lse = attention_reference(q, k, v, ir, bind)
    assert torch.allclose(out.view(R, n, h, d), want.transpose(1, 2))
    assert torch.allclose(lse.view(R, n, h), want_lse.transpose(1, 2))
    # and b = 0 for every request would not: the bias and the documents differ per request
    first, _ = attention_reference(q[1:2], k[1:2], v[1:2], ir, bind)
    assert not torch.allclose(out.view(R, n, h, d)[1], first[0].transpose(0, 1))


@pytest.mark.parametrize("layout", ["NHD", "HND", "ragged"])
def test_batch_reference_matches_per_request_attention(layout: str, rng) -> None:
    """The batch oracle equals plain attention on each request's gathered K/V (causal, GQA)."""
    page, q_lens, kv_lens, hkv, g, d = 4, [1, 3, 5], [6, 3, 9], 2, 2, 16
    variant = attncc.Variant(mask_mod=causal)
    q = rng.randn(sum(q_lens), hkv * g, d)
    if layout == "ragged":
        k, v = rng.randn(sum(kv_lens), hkv, d), rng.randn(sum(kv_lens), hkv, d)
        kv_indptr = np.cumsum([0] + kv_lens)
        seqs = [(k[a:b], v[a:b]) for a, b in zip(kv_indptr[:-1], kv_indptr[1:])]
        ids = last = None
    else:
        npg = [-(-n // page) for n in kv_lens]
        shape = (sum(npg) + 2, page, hkv, d) if layout == "NHD" else (sum(npg) + 2, hkv, page, d)
        k, v = rng.randn(*shape), rng.randn(*shape)
        ids = np.random.default_rng(0).permutation(sum(npg) + 2)[:sum(npg)]
        kv_indptr = np.cumsum([0] + npg)
        last = [n - (p - 1) * page for n, p in zip(kv_lens, npg)]
        seqs = []
        for i, n in enumerate(kv_lens):
            sel = torch.as_tensor(ids[kv_indptr[i]:kv_indptr[i + 1]])
            kk, vv = k[sel], v[sel]
            if layout == "HND":
                kk, vv = kk.transpose(1, 2), vv.transpose(1, 2)
            seqs.append((kk.flatten(0, 1)[:n], vv.flatten(0, 1)[:n]))
    qo = np.cumsum([0] + q_lens)
    out, lse = batch_attention_reference(q, (k, v), qo, kv_indptr, ids, last, kv_layout=layout,
                                         page_size=page, variant=variant)
    ir, bind = variant.trace()
    for i, (kk, vv) in enumerate(seqs):
        n, m = kv_lens[i], q_lens[i]
        qq = torch.zeros(n, hkv * g, d)
        qq[n - m:] = q[qo[i]:qo[i + 1]]
        want, _ = attention_reference(qq.transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                      vv.transpose(0, 1)[None], ir, bind, enable_gqa=True)
        assert torch.allclose(out[qo[i]:qo[i + 1]], want[0].transpose(0, 1)[n - m:])


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,tq,head_dim", [("causal", 16, 128), ("softcap_causal", 128, 128),
                                              ("rope", 32, 64), ("sigmoid", 16, 256),
                                              ("alibi_causal", 64, 128)])
def test_batch_kernels_compile(name: str, tq: int, head_dim: int) -> None:
    """The persistent kernel and its merge kernel compile for sm_90a (BatchParams' layout
    static_asserts included); one-fragment configurations do not spill."""
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.sources import fa2_source
    from attncc.runtime.jit.nvrtc import compile_cuda

    ir, _ = GYM[name](1, 8, 4096, head_dim).trace()
    tiles = choose_batch_tiles(head_dim, tq, 132)
    src, kname, _, layout = fa2_source(simplify_variant(ir), head_dim=head_dim,
                                       dtype="bfloat16", tq=tiles.tq, tkv=tiles.tkv,
                                       m_frags=tiles.m_frags, batch=True)
    assert layout.name == "attncc::BatchParams" and "static_assert(sizeof(attncc::BatchParams)" in src
    res = compile_cuda(src, arch="sm_90a", verbose=True)
    assert f"{kname}_merge" in res.log and kname in res.log and "warning" not in res.log
    if tiles.m_frags == 1:
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.log)
        assert spills and all(a == "0" and b == "0" for a, b in spills), res.log


# ------------------------------------------------------------------------------------ cascade
def test_cascade_plan_positions_and_checks() -> None:
    from attncc.runtime.serving.cascade import CascadeAttention

    ca = CascadeAttention(None, device="cpu")
    kw = dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    ca.plan([0, 2, 3], prefix_indices=[0, 1, 2], prefix_last_page_len=4, suffix_indptr=[0, 1, 3],
            suffix_indices=[5, 6, 7], suffix_last_page_len=[3, 16], **kw)
    assert ca.prefix_len == 36
    assert ca.q_positions.tolist() == [36 + 3 - 2, 36 + 3 - 1, 36 + 32 - 1]
    assert ca.suffix.kv_lens.tolist() == [3, 32] and ca.prefix.kv_lens.tolist() == [36]
    with pytest.raises(ValueError, match="must be suffix tokens"):
        ca.plan([0, 5], prefix_indices=[0], prefix_last_page_len=16, suffix_indptr=[0, 1],
                suffix_indices=[1], suffix_last_page_len=[2], **kw)
    with pytest.raises(ValueError, match="batch index"):
        CascadeAttention(GYM["document_mask"](2, 8, 64, 128), device="cpu")
    with pytest.raises(ValueError, match="paged"):
        CascadeAttention(None, kv_layout="ragged", device="cpu")


# ------------------------------------------------------------------------------ fast plan path
def _plan_outcome(layout: str, args: tuple, kw: dict, warm: int = 0, **ctor: Any) -> tuple:
    """What plan() does with these arguments: the error it raises, or what it staged. `warm`:
    plan a small valid batch with the same keyword arguments that many times first (twice and
    more: the compiled path then checks and stages the batch in its one call, with the warm
    batch's tiles; errors of the warm plans are ignored)."""
    ba = BatchAttention(None, kv_layout=layout, device="cpu", **ctor)
    small = ([0, 1], [0, 3]) if layout == "ragged" else ([0, 1], [0, 1], [2], [1])
    for _ in range(warm):
        try:
            ba.plan(*small, **kw)
        except Exception:  # noqa: BLE001 -- an invalid kw: the plan below raises as well
            pass
    try:
        ba.plan(*args, **kw)
    except Exception as e:  # noqa: BLE001 -- the exception itself is the outcome
        return type(e).__name__, str(e)
    return ("ok", ba.tiles, ba.kv_lens.tolist(), ba.qo_indptr.tolist(), ba._max_page,
            ba.page_size, ba.page_shift, ba._staging_np.tobytes())


def _random_plan_args(rng: np.random.Generator, layout: str) -> tuple[tuple, dict]:
    """A batch for plan(), often broken in one of the ways plan() must name."""
    B = int(rng.integers(1, 12))
    page = int(rng.choice([1, 4, 16]))
    q = rng.integers(0, 4, B) * (rng.random(B) < 0.8)
    kv = q + rng.integers(0, 300, B)
    flaw = rng.integers(0, 16)
    if flaw == 14:  # more queries than KV tokens
        q[0], kv[0] = 3, 2
    npg = -(-kv // page)
    qo, kvp = np.concatenate([[0], np.cumsum(q)]), np.concatenate([[0], np.cumsum(npg)])
    pages = rng.permutation(int(npg.sum()) + 3)[:int(npg.sum()) + int(rng.integers(0, 3))]
    last = np.where(npg > 0, kv - (npg - 1) * page, 0)
    hk = int(rng.choice([1, 2, 4]))
    kw: dict = dict(num_qo_heads=hk * int(rng.choice([1, 2, 8])), num_kv_heads=hk, head_dim=128,
                    page_size=page)
    if flaw == 0:
        pages[rng.integers(0, pages.size)] = -1 if pages.size else 0
    elif flaw == 1 and B > 1:
        kvp[1], kvp[2] = kvp[2], kvp[1] + 1
    elif flaw == 2:
        last[rng.integers(0, B)] = page + 1
    elif flaw == 3:
        last[rng.integers(0, B)] = 0
    elif flaw == 4:
        qo[-1] += 500
    elif flaw == 5:
        pages = pages[:max(int(kvp[-1]) - 1, 0)]
    elif flaw == 6:
        kw["num_kv_heads"] = 3
    elif flaw == 7:
        kw["page_size"] = 16.0
    elif flaw == 8:
        pages = pages.astype(np.float32)
    elif flaw == 9:
        pages = pages.astype(np.int32)
    elif flaw == 10:
        qo, kvp, pages, last = (torch.as_tensor(x) for x in (qo, kvp, pages, last))
    elif flaw == 11:
        qo = qo.tolist()
    elif flaw == 12:
        last = last[:-1]
    elif flaw == 13:
        kw["head_dim"] = 96
    if layout == "ragged":
        kv_tok = np.concatenate([[0], np.cumsum(kv)])
        return (qo, kv_tok if flaw != 1 else kvp), kw
    return (qo, kvp, pages, last), kw


def _spy_one_call(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The outcomes of `BatchPlanner.plan` (the one C call that checks and stages a batch with
    the last plan's tiles) while the test runs, in call order."""
    from attncc.runtime.serving.plan import planner

    one_call, codes = planner.BatchPlanner.plan, []

    def plan(self: Any, *args: Any) -> Any:
        out = one_call(self, *args)
        codes.append(out[0])
        return out

    monkeypatch.setattr(planner.BatchPlanner, "plan", plan)
    return codes


@pytest.mark.parametrize("layout", ["NHD", "ragged"])
def test_fast_plan_path_matches_the_reference_path(layout: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """plan() with the compiled planner (checks in one C pass, plan packed straight into the
    staging buffer) raises the same errors and stages the same words as the numpy path."""
    from attncc.runtime.serving.plan import planner

    if not planner.available():
        pytest.skip("no C compiler to build the planner")
    rng = np.random.default_rng(11)
    cases = [_random_plan_args(rng, layout) for _ in range(150)]
    ctor = dict(max_batch=10, max_qo_tokens=40, max_pages=2000)
    one_call = _spy_one_call(monkeypatch)
    fast = [[_plan_outcome(layout, a, kw, warm, **ctor) for warm in (0, 3)] for a, kw in cases]
    assert {planner.STAGED, planner.RETILE, planner.INVALID} <= set(one_call)
    monkeypatch.setattr(planner, "_LIB", False)
    slow = [[_plan_outcome(layout, a, kw, warm, **ctor) for warm in (0, 3)] for a, kw in cases]
    assert sum(o[0][0] == "ok" for o in fast) > 20 and sum(o[0][0] != "ok" for o in fast) > 20
    for (args, kw), f, s in zip(cases, fast, slow):
        assert f == s, (args, kw)


def _serving_batches(rng: np.random.Generator, ragged: bool) -> list[tuple[tuple, dict]]:
    """Decode-sized batches, larger then smaller, page ids as int64, int32 and tensors."""
    out = []
    for batch in (256, 200, 3, 64):
        lens = rng.integers(1, 3000, batch)
        npg = -(-lens // 16)
        qo = np.concatenate([[0], np.cumsum(np.where(rng.random(batch) < 0.8, 1, 4))])
        kw = dict(num_qo_heads=32, num_kv_heads=int(rng.choice([4, 8, 32])), head_dim=128)
        if ragged:
            out.append(((qo, np.concatenate([[0], np.cumsum(lens)])), kw))
            continue
        pages = rng.permutation(int(npg.sum()) + 50)[:int(npg.sum()) + int(rng.integers(0, 9))]
        pages = [pages, pages.astype(np.int32), torch.as_tensor(pages)][batch % 3]
        out.append(((qo, np.concatenate([[0], np.cumsum(npg)]), pages,
                     lens - (npg - 1) * 16), {**kw, "page_size": 16}))
    return out


@pytest.mark.parametrize("layout", ["NHD", "ragged"])
def test_fast_plan_path_stages_what_the_reference_path_stages(
        layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving-sized batches planned one after another on one instance, each three times (the
    third, with the tiles of the second, is one C call): the compiled path (plan and page tables
    written by planner.c) leaves the staging buffer word for word as the numpy path does, the
    previous plans' leftovers included."""
    from attncc.runtime.serving.plan import planner

    if not planner.available():
        pytest.skip("no C compiler to build the planner")
    cases = _serving_batches(np.random.default_rng(5), layout == "ragged")

    def staged(ba: BatchAttention) -> list[tuple]:
        outcomes = []
        for args, kw in cases:
            for _ in range(3):
                ba.plan(*args, **kw)
                outcomes.append((ba.tiles, ba.kv_lens.tolist(), ba.qo_indptr.tolist(),
                                 ba._max_page, ba._staging_np.tobytes()))
        return outcomes

    codes = _spy_one_call(monkeypatch)
    fast_ba = BatchAttention(None, kv_layout=layout, device="cpu")
    fast = staged(fast_ba)
    assert isinstance(fast_ba._planner, planner.BatchPlanner)  # the compiled path was taken
    assert codes.count(planner.STAGED) >= len(cases)  # and its one call staged plans
    monkeypatch.setattr(planner, "_LIB", False)
    slow_ba = BatchAttention(None, kv_layout=layout, device="cpu")
    slow = staged(slow_ba)
    assert slow_ba._planner is False
    assert fast == slow


def test_ragged_tables_that_do_not_fit_raise_before_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged batch with more requests than max_pages has no room for its table (one entry per
    request): the compiled and the numpy path raise the same error before staging anything."""
    from attncc.runtime.serving.plan import planner

    args = (np.arange(7), np.arange(7) * 5)
    kw = dict(num_qo_heads=4, num_kv_heads=2, head_dim=128)
    outcome = _plan_outcome("ragged", args, kw, max_pages=2)
    assert outcome[0] == "ValueError" and "6 requests exceed max_pages=2" in outcome[1]
    monkeypatch.setattr(planner, "_LIB", False)
    assert _plan_outcome("ragged", args, kw, max_pages=2) == outcome


def test_a_plan_that_raises_keeps_the_last_plan() -> None:
    """run() reads the last successful plan's layout, tiles and table offsets: a later plan()
    that raises once the staging buffer is prepared (here: a page table that does not fit in
    the buffer of a larger layout) leaves them as they were."""
    ba = BatchAttention(None, kv_layout="ragged", device="cpu", max_pages=2)
    ba.plan([0, 1, 2], [0, 5, 10], num_qo_heads=4, num_kv_heads=2, head_dim=128)
    before = (ba.tiles, ba.layout, dict(ba._offsets), ba.kv_lens.tolist())
    with pytest.raises(ValueError, match="exceed max_pages"):  # and 8 heads: a larger layout
        ba.plan(np.arange(7), np.arange(7) * 5, num_qo_heads=8, num_kv_heads=2, head_dim=128)
    assert (ba.tiles, ba.layout, ba._offsets, ba.kv_lens.tolist()) == before
    assert ba._offsets == ba._table_offsets(ba.layout)


def test_plan_follows_knobs_changed_between_plans() -> None:
    """plan() keeps its tiles, layout and C arguments from one call to the next, keyed on
    everything they depend on: a knob changed in between is honoured as by a new instance."""
    args = ([0, 1, 2], [0, 40, 80], list(range(80)), [16, 16])
    ba = _ba()
    ba.plan(*args, **KW)
    first = ba._plan.kv_chunk
    ba.min_kv_chunk = 64
    ba.plan(*args, **KW)
    fresh = BatchAttention(None, device="cpu", min_kv_chunk=64)
    fresh.plan(*args, **KW)
    assert ba._plan.kv_chunk == fresh._plan.kv_chunk != first
    assert ba._staging_np.tobytes() == fresh._staging_np.tobytes()
    ba.max_batch = 1
    with pytest.raises(ValueError, match="exceeds max_batch=1"):
        ba.plan(*args, **KW)


def test_plans_alternate_staging_halves() -> None:
    """plan() stages into the two halves of its pinned buffer in turn: each plan waits only for
    the copies out of the half it writes (those of the plan before last), leaves the last
    plan's half as it was, and `_staging_np` holds the current plan's words, the same bytes a
    fresh instance stages."""
    from attncc.runtime.serving.batch import used_ranges

    waits: list[int] = []
    copies: list[tuple] = []

    class Uploader:  # stands in for the CUDA copies: records the waits and copies asked for
        def wait(self, half: int) -> None:
            waits.append(half)

        def copy(self, dst: int, src: int, half: int, ranges: list) -> None:
            copies.append((src, half, ranges))

    a = ([0, 1, 3], [0, 40, 41], list(range(41)), [16, 3])
    b = ([0, 2, 3], [0, 10, 30], list(range(30)), [5, 16])
    ba = _ba()
    ba.plan(*a, **KW)
    ba._uploader = Uploader()  # type: ignore[assignment]
    first = ba._staging_np.copy()
    ba.plan(*b, **KW)
    assert ba._staging_np is ba._halves[1] and ba._halves[0].tobytes() == first.tobytes()
    ba.workspace = torch.empty(ba.workspace_bytes(), dtype=torch.uint8)  # (what CUDA plans do:)
    end = ba._offsets["pages"] + 30
    ba._upload(end)
    assert copies == [(ba._staging_np.ctypes.data, 1,
                       used_ranges(ba._staging_np, ba.layout, ba._offsets["qo_indptr"], end))]
    fresh = _ba()
    fresh.plan(*b, **KW)
    assert ba._staging_np.tobytes() == fresh._staging_np.tobytes() != first.tobytes()
    assert ba._plan.num_units == fresh._plan.num_units
    ba.plan(*a, **KW)
    assert ba._staging_np is ba._halves[0] and ba._staging_np.tobytes() == first.tobytes()
    assert waits == [1, 0]


def test_cuda_plans_upload_the_ranges_planner_c_listed() -> None:
    """plan() on CUDA (here with stand-ins for the device, the workspace and the copies) hands
    `_upload` the used word ranges the compiled planner listed when it staged the plan -- the
    ranges `used_ranges` lists from the staging buffer -- and the numpy path's own."""
    import types

    from attncc.runtime.serving.plan import planner
    from attncc.runtime.serving.batch import used_ranges

    copies: list[tuple] = []

    class Uploader:  # records the copies asked for
        def wait(self, half: int) -> None:
            pass

        def copy(self, dst: int, src: int, half: int, ranges: list) -> None:
            copies.append((half, ranges))

    a = ([0, 1, 3], [0, 40, 41], list(range(41)), [16, 3])
    ba = _ba()
    for _ in range(3):  # (on the CPU: staging unpinned, the tiles chosen and kept)
        ba.plan(*a, **KW)
    ws = torch.empty(1, dtype=torch.uint8)
    ba._workspace_for = lambda used: ws  # type: ignore[method-assign]
    ba._uploader, ba.device = Uploader(), types.SimpleNamespace(type="cuda")  # type: ignore
    ba._upload_tree = lambda rows: None  # type: ignore[method-assign]  (no device table here)
    listed: list[tuple] = []  # what the compiled planner listed, when it staged the plan
    if ba._planner:
        c_ranges = ba._planner.used_ranges
        ba._planner.used_ranges = lambda: listed.append(c_ranges()) or listed[-1]
    for args in (a, ([0, 2, 3], [0, 10, 30], list(range(30)), [5, 16]), a):
        ba.plan(*args, **KW)
        end = ba._offsets["pages"] + args[1][-1]
        want = used_ranges(ba._staging_np, ba.layout, ba._offsets["qo_indptr"], end)
        assert copies[-1] == (ba._half, want)
    assert len(copies) == 3 and len(listed) == (3 if planner.available() else 0)


def test_uploader_copies_each_range_then_records_the_half() -> None:
    """_Uploader (plan()'s CUDA side, here with stand-ins for the driver, the stream and the
    events): one checked async copy per range at the range's byte offsets on the current
    stream, then that half's event is recorded; `wait` synchronizes a half's event once per
    copy and not at all before one."""
    from attncc.runtime.serving.batch import _Uploader
    from attncc.runtime.jit.launcher import LaunchError

    log: list[tuple] = []

    class Event:
        def __init__(self, half: int) -> None:
            self.half = half

        def record(self, stream: Any) -> None:
            log.append(("record", self.half, stream))

        def synchronize(self) -> None:
            log.append(("sync", self.half))

    up = _Uploader.__new__(_Uploader)  # (no CUDA here: the fields __init__ would set)
    up.index, up.pending, up.events = 0, [False, False], (Event(0), Event(1))
    up.raw_stream = lambda i: 77
    up._stream = (77, "stream")
    up.memcpy = lambda dst, src, n, stream: (log.append(("copy", dst, src, n, stream)) or (0,))
    up.wait(0)
    up.copy(1000, 5000, 1, [(0, 16), (100, 140)])
    assert log == [("copy", 1000, 5000, 64, 77), ("copy", 1400, 5400, 160, 77),
                   ("record", 1, "stream")]
    for half in (0, 1, 1):
        up.wait(half)
    assert log[3:] == [("sync", 1)]
    up.copy(1000, 5000, 1, [])
    up.raw_stream, up.current_stream = (lambda i: 78), (lambda i: "stream 78")
    up.copy(1000, 5000, 0, [])  # another stream: the last plan's copies are waited for first
    assert log[4:] == [("record", 1, "stream"), ("sync", 1), ("record", 0, "stream 78")]
    up.memcpy = lambda *args: (1,)  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(LaunchError, match="cuMemcpyHtoDAsync"):
        up.copy(1000, 5000, 0, [(0, 16)])


def test_coalesce_ranges() -> None:
    """Sorted, empty ranges dropped, overlapping ones and those under `gap` apart joined."""
    from attncc.runtime.serving.batch import coalesce_ranges

    assert coalesce_ranges([], 10) == []
    assert coalesce_ranges([(5, 5), (7, 3)], 10) == []
    assert coalesce_ranges([(0, 10), (20, 30)], 10) == [(0, 10), (20, 30)]   # 10 apart: kept
    assert coalesce_ranges([(0, 10), (19, 30)], 10) == [(0, 30)]
    assert coalesce_ranges([(0, 50), (10, 20), (60, 70)], 0) == [(0, 50), (60, 70)]
    assert coalesce_ranges([(30, 40), (0, 10), (5, 35)], 0) == [(0, 40)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        starts = rng.integers(0, 1000, 8)
        spans = [(int(s), int(s + w)) for s, w in zip(starts, rng.integers(0, 50, 8))]
        gap = int(rng.integers(0, 100))
        got = coalesce_ranges(spans, gap)
        covered = np.zeros(1100, bool)
        for s0, s1 in spans:
            covered[s0:s1] = True
        joined = np.zeros(1100, bool)
        for s0, s1 in got:
            joined[s0:s1] = True
        assert not (covered & ~joined).any()              # every word of every range
        assert all(got[i + 1][0] - got[i][1] >= gap for i in range(len(got) - 1))
        assert all(covered[s0] and covered[s1 - 1] for s0, s1 in got)   # no stray ends


def test_l2_section_budget_is_the_dense_fa3_kernels() -> None:
    """Causal batch plans run heads in L2 sections of batch.L2_SECTION_BYTES; the dense FA3
    kernel orders its items by the same budget (its ATTNCC_FA3_L2_SECTION_BYTES default): both
    come from attncc.codegen.constants, which every dense FA3 unit static_asserts."""
    from attncc.codegen import constants
    from attncc.codegen.generate import generate_source
    from attncc.runtime.serving.batch import L2_SECTION_BYTES

    assert L2_SECTION_BYTES == constants.L2_SECTION_BYTES == 12 << 20
    ir, _ = attncc.Variant(name="full").trace()
    src = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa3").source
    assert "static_assert((ATTNCC_FA3_L2_SECTION_BYTES_DEFAULT) == 12582912," in src


def test_lazy_plan_is_the_packed_plan() -> None:
    """`ba._plan` (computed on first use) packs to the words plan() staged."""
    ba = _ba()
    ba.plan([0, 1, 3], [0, 40, 41], list(range(41)), [16, 3], **KW)
    assert ba.layout is not None
    staged = ba._staging_np[:ba.layout.size]
    assert ba._plan.pack(ba.layout).tobytes() == staged.tobytes()
    assert ba._plan.num_merges == ba.layout.unpack(staged)["num_merges"]


@pytest.mark.parametrize("section_tokens", [None, 300])
def test_causal_clipped_plan_executes_to_exact_causal_attention(section_tokens: int | None
                                                                ) -> None:
    """clip_causal_units ends each unit at its last query's diagonal; running the clipped plan
    on the CPU in fp64 (units in queue order, partials, then the merge map) still gives exact
    causal attention, with fewer key positions computed. With L2 sections every CTA's queue
    visits the sections in order."""
    import math

    from attncc.runtime.serving.batch import clip_causal_units
    from attncc.runtime.serving.merge import merge_states
    from attncc.runtime.serving.plan.scheduler import WRITE_THROUGH, PlanLayout, plan_into

    gen = torch.Generator().manual_seed(3)
    lq = np.array([40, 1, 200, 17, 64])
    kv = np.array([40, 900, 700, 17, 300])       # prefill chunks: queries are the last tokens
    hq, hk, d, tq = 4, 2, 8, 16
    g = hq // hk
    qo, kv_ptr = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(kv)])
    lay = PlanLayout(8, int(qo[-1]), 96, hq, hk, tq)
    buf = np.zeros(lay.size, dtype=np.int32)
    plan_into(buf, lay, qo, kv, hq, hk, tq, 96, kv_chunk_align=16, min_kv_chunk=16)
    before = lay.unpack(buf)["units"].copy()
    clip_causal_units(buf, lay, qo, kv, g, 0, section_tokens=section_tokens)
    p = lay.unpack(buf)
    u = p["units"]
    assert p["num_merges"] > 0 and (u["kv_end"] < before["kv_end"]).any()
    if section_tokens:
        pair0 = hk * (np.cumsum(kv) - kv)
        sec = (pair0[u["request"]] + u["kv_head"] * kv[u["request"]]) // section_tokens
        ind, cu = p["cta_indptr"], p["cta_units"]
        assert len(set(sec.tolist())) > 3
        for c in range(int(p["num_ctas"])):
            assert (np.diff(sec[cu[ind[c]:ind[c + 1]]]) >= 0).all()
    assert (u["kv_end"] - u["kv_start"]).sum() < (before["kv_end"] - before["kv_start"]).sum()

    q = torch.randn(int(qo[-1]), hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(int(kv_ptr[-1]), hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(int(kv_ptr[-1]), hk, d, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(d)

    def unit_state(x: Any, h: int) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
        r = torch.arange(int(x["q_start"]), int(x["q_start"] + x["q_rows"]))
        req = int(x["request"])
        tok, head = int(qo[req]) + r // g, h * g + r % g
        pos = int(kv[req] - lq[req]) + r // g                       # query positions
        keys = torch.arange(int(x["kv_start"]), int(x["kv_end"]))
        s = (q[tok, head] @ k[kv_ptr[req] + keys, h].T) * scale
        s = s.masked_fill(keys[None, :] > pos[:, None], -math.inf)
        lse = torch.logsumexp(s, 1) if s.shape[1] else torch.full((len(r),), -math.inf,
                                                                   dtype=torch.float64)
        w = torch.where(torch.isinf(lse)[:, None], torch.zeros_like(s), torch.exp(s - lse[:, None]))
        return w @ v[kv_ptr[req] + keys, h], lse, tok, head

    out = torch.full((q.shape[0], hq, d), math.nan, dtype=torch.float64)
    ws_o = torch.full((p["num_partial_slots"], tq, d), math.nan, dtype=torch.float64)
    ws_lse = torch.full((p["num_partial_slots"], tq), math.nan, dtype=torch.float64)
    for c in range(p["num_ctas"]):
        for i in p["cta_units"][p["cta_indptr"][c]:p["cta_indptr"][c + 1]]:
            x = u[i]
            for h in range(int(x["kv_head"]), int(x["kv_head"] + x["kv_heads"])):
                o, lse, tok, head = unit_state(x, h)
                if x["slot"] == WRITE_THROUGH:
                    out[tok, head] = o
                else:
                    ws_o[x["slot"], :len(tok)], ws_lse[x["slot"], :len(tok)] = o, lse
    for m in range(p["num_merges"]):
        t = p["merge_out"][m]
        slots = torch.arange(int(p["merge_indptr"][m]), int(p["merge_indptr"][m + 1]))
        n = int(t["q_rows"])
        o, _ = merge_states(ws_o[slots, :n], ws_lse[slots, :n])
        r = torch.arange(int(t["q_start"]), int(t["q_start"]) + n)
        out[int(t["qo_offset"]) + r // g, int(t["kv_head"]) * g + r % g] = o
    for b in range(len(lq)):
        qs = q[qo[b]:qo[b + 1]].transpose(0, 1)
        ks = k[kv_ptr[b]:kv_ptr[b + 1]].repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[kv_ptr[b]:kv_ptr[b + 1]].repeat_interleave(g, dim=1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        pos = torch.arange(int(kv[b] - lq[b]), int(kv[b]))
        s = s.masked_fill(torch.arange(int(kv[b]))[None, None, :] > pos[None, :, None], -math.inf)
        ref = (torch.softmax(s, -1) @ vs).transpose(0, 1)
        assert torch.allclose(out[qo[b]:qo[b + 1]], ref, atol=1e-10), b


def test_causal_variants_clip_their_plans_others_do_not() -> None:
    """plan() clips units only for masks with a proven bound, and not for decode batches."""
    def units(variant: Any, lq: list[int]) -> np.ndarray:
        ba = BatchAttention(variant, kv_layout="NHD", device="cpu")
        n_pages = [-(-n // 16) for n in (900, 300)]
        ba.plan(np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(n_pages)]),
                np.arange(sum(n_pages)), [900 - 16 * 56, 300 - 16 * 18], num_qo_heads=4,
                num_kv_heads=2, head_dim=128, page_size=16)
        assert ba.layout is not None
        return ba.layout.unpack(ba._staging_np)["units"].copy()

    causal = attncc.Variant(mask_mod=lambda b, h, q, kv: q >= kv)
    prefix = attncc.Variant(mask_mod=lambda b, h, q, kv: (kv < 100) | (q >= kv))
    full = units(None, [500, 300])
    assert (units(prefix, [500, 300])["kv_end"] == full["kv_end"]).all()
    clipped = units(causal, [500, 300])
    assert (clipped["kv_end"] <= full["kv_end"]).all() and (clipped["kv_end"] < full["kv_end"]).any()
    assert (units(causal, [1, 1])["kv_end"] == units(None, [1, 1])["kv_end"]).all()


@pytest.mark.parametrize("lq,kv,hkv", [([1] * 40, [700] * 40, 8), ([300, 1, 2000], [300, 9, 5000], 2),
                                       ([1] * 3, [1, 2, 3], 4)])
def test_used_ranges_carry_everything_the_kernels_read(lq: list[int], kv: list[int],
                                                       hkv: int) -> None:
    """run() uploads only `used_ranges` of the staged plan: a workspace that got just the used
    words (gap=0; the rest left as garbage) unpacks to the same plan and page tables, and the
    merges read no slot past the used ones. The default ranges (neighbours joined) cover the
    used words in fewer copies."""
    from attncc.runtime.serving.batch import used_ranges

    ba = BatchAttention(attncc.Variant(mask_mod=lambda b, h, q, k: q >= k), kv_layout="NHD",
                        device="cpu")
    n_pages = [-(-n // 16) for n in kv]
    ba.plan(np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(n_pages)]),
            np.arange(sum(n_pages)), [n - 16 * (p - 1) for n, p in zip(kv, n_pages)],
            num_qo_heads=4 * hkv, num_kv_heads=hkv, head_dim=128, page_size=16)
    assert ba.layout is not None
    buf, o = ba._staging_np, ba._offsets
    end = o["pages"] + sum(n_pages)
    dev = np.full(end, -7, dtype=np.int32)
    ranges = used_ranges(buf, ba.layout, o["qo_indptr"], end, gap=0)
    for w0, w1 in ranges:
        dev[w0:w1] = buf[w0:w1]
    want, got = ba.layout.unpack(buf), ba.layout.unpack(dev)
    for key, val in want.items():
        if isinstance(val, int):
            assert got[key] == val, key
        else:
            assert val.tobytes() == got[key].tobytes(), key
    for name, count in (("qo_indptr", len(lq) + 1), ("kv_page_indptr", len(lq) + 1),
                        ("kv_lens", len(lq)), ("pages", sum(n_pages))):
        assert np.array_equal(dev[o[name]:o[name] + count], buf[o[name]:o[name] + count]), name
    assert sum(w1 - w0 for w0, w1 in ranges) < end  # less than the whole region
    assert want["merge_indptr"][-1] == want["num_partial_slots"]
    assert want["num_ctas"] == ba.layout.max_ctas  # the grid: every CTA's bounds are used words
    # every word the kernels read lies in the plan's one range: the header, then the sections
    plan_end = ba.layout.used_words(want)
    assert ranges == [(0, plan_end), (o["qo_indptr"], end)]
    for key, val in want.items():
        if not isinstance(val, int) and val.size:
            first = (val.__array_interface__["data"][0] - buf.ctypes.data) // 4
            assert 0 <= first and first + val.nbytes // 4 <= plan_end, key
    joined = used_ranges(buf, ba.layout, o["qo_indptr"], end)
    assert len(joined) <= 2 and all(any(j0 <= w0 and w1 <= j1 for j0, j1 in joined)
                                    for w0, w1 in ranges)


def test_decode_plan_with_merges_is_one_range() -> None:
    """A decode plan at batch 256 with 32 KV heads and split items (bench/plan_time.py's cell
    that missed 50 us with five copies) is one used range, sections back to back from the
    layout's fixed part, plus one range of page tables: plan() uploads it in at most two copies
    (one when the plan fills its room to within UPLOAD_GAP), and the compiled planner lists the
    same ranges."""
    from attncc.runtime.serving.plan import planner
    from attncc.runtime.serving.batch import UPLOAD_GAP, used_ranges
    from attncc.runtime.serving.plan.format import DYNAMIC_SECTIONS, packed_offsets
    from bench.decode import make_batch

    b = make_batch(256, 32, "skewed")
    ba = BatchAttention(None, kv_layout="NHD", max_batch=256, max_qo_tokens=256, device="cpu")
    args = (b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["kv_last_page_len"])
    for _ in range(2):  # the second: one C call with the first plan's tiles
        ba.plan(*args, **b["kw"])
    assert ba.layout is not None
    p, o = ba.layout.unpack(ba._staging_np), ba._offsets
    assert p["num_merges"] > 0 and p["num_kv_heads"] == 32
    at = packed_offsets(ba.layout.dynamic_at, p["num_units"], p["num_merges"])
    assert [p[f"{s}_at"] for s in DYNAMIC_SECTIONS] == [at[s] for s in DYNAMIC_SECTIONS]
    end = o["pages"] + int(np.asarray(b["kv_indptr"])[-1])
    ranges = used_ranges(ba._staging_np, ba.layout, o["qo_indptr"], end, gap=0)
    assert ranges == [(0, at["end"]), (o["qo_indptr"], end)]
    joined = used_ranges(ba._staging_np, ba.layout, o["qo_indptr"], end)
    assert joined == ([(0, end)] if o["qo_indptr"] - at["end"] < UPLOAD_GAP else ranges)
    if planner.available():
        assert ba._planner.used_ranges() == (joined, end)


@pytest.mark.parametrize("layout", ["NHD", "ragged"])
@pytest.mark.parametrize("gap", [0, 1, 100, 16384, 1 << 40])
def test_compiled_used_ranges_are_the_python_used_ranges(layout: str, gap: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled planner lists the used words of the plan it staged (what _upload copies)
    exactly as `used_ranges`, the reference, lists them from the staging buffer: serving-sized
    and small random batches, a causal variant (whose clipped units keep the plan's counts)."""
    from attncc.runtime.serving import batch as batch_mod
    from attncc.runtime.serving.plan import planner

    if not planner.available():
        pytest.skip("no C compiler to build the planner")
    monkeypatch.setattr(batch_mod, "UPLOAD_GAP", gap)  # the gap the planner is made with
    rng = np.random.default_rng(gap % 1000)
    cases = _serving_batches(rng, layout == "ragged")
    cases += [_random_plan_args(rng, layout) for _ in range(80)]
    cases = [c for c in cases if _plan_outcome(layout, *c)[0] == "ok"]
    assert len(cases) > 20
    for variant in (None, attncc.Variant(mask_mod=causal)):
        ba = BatchAttention(variant, kv_layout=layout, device="cpu")
        for args, kw in cases:
            ba.plan(*args, **kw)
            o = ba._offsets
            end = o["pages"] + (len(args[0]) - 1 if layout == "ragged" else int(args[1][-1]))
            want = batch_mod.used_ranges(ba._staging_np, ba.layout, o["qo_indptr"], end, gap)
            assert ba._planner.used_ranges() == (want, end)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_page_id_scan_edges_match_the_reference_path(dtype: type,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled planner checks and stages the page ids in one pass (vectorised while every
    id is below 2**31): ids at and past 2**31 - 1, a negative id among the used ones or in the
    unused tail, and no used ids at all plan (or raise) exactly as on the numpy path."""
    from attncc.runtime.serving.plan import planner

    if not planner.available():
        pytest.skip("no C compiler to build the planner")
    big = np.iinfo(dtype).max
    used = np.arange(40, dtype=dtype) * 3
    cases = [used, np.concatenate([used, [-1]]), np.concatenate([used[:-1], [-5]]),
             np.concatenate([used[:-1], [big]]), np.concatenate([used[:7], [big - 1], used[8:]])]
    if dtype == np.int64:
        cases.append(np.concatenate([used[:3], [2**31 + 7], used[4:]]))
    kvp, last = [0, 19, 40], [16, 3]
    batches = [(qo, ind, pages, last) for pages in cases
               for qo, ind in (([0, 1, 2], kvp), ([0, 0, 0], [0, 0, 0]))]  # (no used id)
    outcomes = [[_plan_outcome("NHD", b, KW, warm) for warm in (0, 3)] for b in batches]
    monkeypatch.setattr(planner, "_LIB", False)
    for b, got in zip(batches, outcomes):
        assert got == [_plan_outcome("NHD", b, KW, warm) for warm in (0, 3)], b
    assert sum(o[0][0] == "ok" for o in outcomes) >= 6
