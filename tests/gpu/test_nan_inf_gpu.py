"""NaN and inf on the GPU: every kernel gives the CPU reference's pattern
(tests/runtime/serving/test_nan_inf.py pins the reference to torch's flex_attention;
docs/semantics.md, "NaN and inf").

FA2 and FA3 dense (single CTA, CTA pairs, the split tail), the batch kernels (FA3 prefill, FA2
decode with split rows and the merge kernel), `attncc.merge_state` on CUDA and cascade attention.
Inputs are fresh random bf16 tensors with a NaN / inf poked in (or a score_mod that makes one);
outputs start as a finite sentinel (NaN is a legal result here, so it cannot be the poison): an
element left unwritten keeps the sentinel and fails the comparison. Compared with the fp64
reference: the NaN pattern of out and LSE exactly, infinities exactly, finite values within bf16
tolerance.

One case is not an exact-pattern case on the GPU: a NaN or inf value row at a key a row masks,
inside a key tile that row's query tile reads (P V multiplies it by 0: NaN); without a block mask
the dense kernels read every key tile. The reference never reads it; the kernels agree only for
rows whose query tile skips that key tile (a block mask's absent block), which
`test_masked_nonfinite_value_in_a_skipped_tile_is_never_read` checks.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import pytest
import torch

import attncc
from attncc.runtime.flex import gpu_flex
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.serving.merge import merge_pair
from attncc.runtime.reference import attention_reference

pytestmark = pytest.mark.gpu

NAN, INF = float("nan"), float("inf")
SENTINEL = 1000.0  # finite poison: far outside any output or LSE of these inputs


def _sm90() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


def assert_pattern(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 2e-2) -> None:
    """Same NaN positions, same infinities, finite values close (bf16 storage)."""
    got, ref = got.double(), ref.double()
    assert got.shape == ref.shape, what
    gn, rn = got.isnan(), ref.isnan()
    assert torch.equal(gn, rn), (f"{what}: {int((gn & ~rn).sum())} unexpected NaN, "
                                 f"{int((rn & ~gn).sum())} missing NaN (first "
                                 f"{(gn ^ rn).nonzero()[:4].tolist()})")
    ri = ref.isinf()
    assert torch.equal(got.isinf(), ri) and torch.equal(got[ri], ref[ri]), f"{what}: infinities"
    fin = torch.isfinite(ref)
    assert not (got[fin] == SENTINEL).any(), f"{what}: elements left unwritten"
    g, r = got[fin], ref[fin]
    if r.numel():
        assert float((g - r).norm() / r.norm().clamp_min(1e-6)) < tol, what
        assert float((g - r).abs().max()) < 0.1 + 0.05 * float(r.abs().max()), what


# --------------------------------------------------------------------------------- dense cases
def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q >= kv


def every_7th_row_masked(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q % 7 != 3


def _poke(*edits: tuple[str, int, int, int, float]) -> Callable:
    """Set [name][b=0, head, position, element] = value for each edit."""
    def f(t: dict[str, torch.Tensor]) -> None:
        for name, h, pos, e, val in edits:
            t[name][0, h, pos, e] = val
    return f


def _score_at_key(j: int, val: float) -> Callable:
    return lambda s, b, h, q, kv: torch.where(kv == j, val, s)


def _score_at_row(i: int, val: float) -> Callable:
    return lambda s, b, h, q, kv: torch.where(q == i, val, s)


# (id, poke, score_mod, mask_mod): the CPU cases of tests/runtime/serving/test_nan_inf.py at GPU
# sizes; every nonfinite value row sits at a key all rows keep, so the pattern is exact on every
# kernel
DENSE = [
    ("nan_q_row", _poke(("q", 0, 37, 5, NAN)), None, None),
    ("nan_k_key_causal", _poke(("k", 0, 300, 5, NAN)), None, causal),
    ("nan_v_key", _poke(("v", 0, 300, 5, NAN)), None, None),
    ("posinf_k_key_causal", _poke(("k", 0, 300, 5, INF)), None, causal),
    ("neginf_k_key", _poke(("k", 1, 200, 2, -INF)), None, None),
    ("posinf_v_key", _poke(("v", 1, 100, 9, INF)), None, None),
    ("score_nan_key_causal", None, _score_at_key(300, NAN), causal),
    ("score_posinf_key_causal", None, _score_at_key(300, INF), causal),
    ("score_neginf_row", None, _score_at_row(37, -INF), None),
    ("score_nan_and_posinf_causal", None, lambda s, b, h, q, kv: torch.where(
        kv == 100, NAN, torch.where(kv == 300, INF, s)), causal),
    ("score_log_causal", None, lambda s, b, h, q, kv: torch.log(s), causal),
    ("masked_rows_nan_q_nan_v", _poke(("q", 0, 3, 1, NAN), ("v", 0, 300, 5, NAN)), None,
     every_7th_row_masked),
]

# (id, kernel_options): FA2; FA3 single-CTA and CTA pairs (sm_90)
KERNELS = [
    ("fa2", {"KERNEL": "fa2"}),
    ("fa3", {"KERNEL": "fa3", "PAIRED": False, "SPLIT_TAIL": False}),
    ("fa3_paired", {"KERNEL": "fa3", "PAIRED": True, "SPLIT_TAIL": False}),
]


def _dense_inputs(B: int, hq: int, hkv: int, s: int, d: int, seed: int,
                  poke: Callable | None) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, hq, s, d, generator=gen, device="cuda").bfloat16()
    k = torch.randn(B, hkv, s, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(B, hkv, s, d, generator=gen, device="cuda").bfloat16()
    if poke is not None:
        poke({"q": q, "k": k, "v": v})
    return q, k, v


def _run_dense(q, k, v, ir, bind, opts, block_mask=None):
    out = torch.full_like(q, SENTINEL)
    lse = torch.full(q.shape[:3], SENTINEL, device=q.device)
    gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=block_mask,
                                enable_gqa=q.shape[1] != k.shape[1], return_lse=True,
                                kernel_options=opts, out=out, lse_out=lse)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernel,opts", KERNELS, ids=[k[0] for k in KERNELS])
@pytest.mark.parametrize("case", DENSE, ids=[c[0] for c in DENSE])
def test_dense_kernels_match_reference_pattern(case: tuple, kernel: str, opts: dict,
                                               d: int) -> None:
    if kernel.startswith("fa3") and not _sm90():
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    name, poke, score_mod, mask_mod = case
    B, hq, hkv, s = 2, 4, 2, 512  # GQA 2: the poked kv head 0 feeds query heads 0 and 1
    q, k, v = _dense_inputs(B, hq, hkv, s, d, seed=len(name) * 31 + d, poke=poke)
    ir, bind = attncc.Variant(score_mod=score_mod, mask_mod=mask_mod).trace()
    out, lse = _run_dense(q, k, v, ir, bind, opts)
    ref, ref_lse = attention_reference(q, k, v, ir, bind, enable_gqa=True)
    assert ref.isnan().any() or ref.isinf().any() or torch.isneginf(ref_lse).any(), \
        "the case must produce a nonfinite result"
    assert_pattern(out, ref, f"{name} {kernel} out")
    assert_pattern(lse, ref_lse, f"{name} {kernel} lse")


@pytest.mark.parametrize("kernel,opts", KERNELS[:2], ids=[k[0] for k in KERNELS[:2]])
def test_masked_nonfinite_value_in_a_skipped_tile_is_never_read(kernel: str, opts: dict) -> None:
    """A causal block mask, NaN / inf in the last key's value row: rows whose query tile ends
    before that key's tile never read it (finite, equal to the reference); the last row keeps
    it. (Without a block mask the dense kernels read every key tile and apply the mask_mod per
    element: every row's column would be NaN, as in torch's kernels.)"""
    if kernel.startswith("fa3") and not _sm90():
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    s, d = 1024, 128
    q, k, v = _dense_inputs(1, 2, 2, s, d, seed=7,
                            poke=_poke(("v", 0, s - 1, 3, NAN), ("v", 1, s - 1, 4, INF)))
    bm = attncc.create_block_mask(causal, None, None, s, s, device="cuda")
    ir, bind = attncc.Variant().trace()
    out, lse = _run_dense(q, k, v, ir, bind, opts, block_mask=bm)
    ref, ref_lse = attention_reference(q, k, v, ir, bind, block_mask=bm)
    early = s - 1 - 256 - 256  # no query / key tile is longer than 256 rows
    assert_pattern(out[:, :, :early], ref[:, :, :early], f"{kernel} rows before the key's tile")
    assert_pattern(lse, ref_lse, f"{kernel} lse")  # LSE never involves values
    assert out[0, 0, s - 1, 3].isnan() and out[0, 1, s - 1, 4] == INF


@pytest.mark.parametrize("kernel,opts", KERNELS[:2], ids=[k[0] for k in KERNELS[:2]])
def test_normalize_none_propagates_nan(kernel: str, opts: dict) -> None:
    """normalize="none" (out = sum of sigmoid(score) * v over kept keys): a NaN query row, a NaN
    key under causal masking (rows before it never see it) and a score_mod NaN at a masked key."""
    if kernel.startswith("fa3") and not _sm90():
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    s, d = 512, 128
    q, k, v = _dense_inputs(1, 2, 2, s, d, seed=9,
                            poke=_poke(("q", 0, 37, 5, NAN), ("k", 1, 300, 2, NAN)))
    variant = attncc.Variant(
        score_mod=lambda sc, b, h, qi, kv: torch.where(kv == qi + 1, NAN, torch.sigmoid(sc)),
        mask_mod=causal, normalize="none")
    ir, bind = variant.trace()
    out = torch.full_like(q, SENTINEL)
    gpu_flex.gpu_flex_attention(q, k, v, ir, bind, kernel_options=opts, out=out)
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, ir, bind)
    assert ref[0, 0, 37].isnan().all() and ref[0, 1, 300:].isnan().all()
    assert not ref[0, 1, :300].isnan().any()
    assert_pattern(out, ref, f"normalize=none {kernel}")


def test_fa3_split_tail_keeps_the_pattern() -> None:
    """The split tail (fa3_split.cuh) merges units of a row cut by keys: a unit with a NaN
    logit, one with a +inf logit, and a row whose every logit is -inf."""
    if not _sm90():
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    from attncc.runtime.flex.fa3_split import tail_split

    B, h, s, d, tkv = 1, 5, 4100, 128, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = B * h * -(-s // 128)
    assert tail_split(items, min(items, sms), s, tkv).pieces > 0, "the tail does not split"
    poke = _poke(("k", 2, 4097, 0, NAN), ("k", 3, 10, 0, INF), ("q", 4, 4000, 1, NAN),
                 ("v", 1, 2000, 7, NAN))
    q, k, v = _dense_inputs(B, h, h, s, d, seed=3, poke=poke)
    ir, bind = attncc.Variant(score_mod=_score_at_row(4099, -INF)).trace()
    opts = {"KERNEL": "fa3", "PREPASS": "none", "BLOCK_N": tkv, "SPLIT_TAIL": True,
            "PAIRED": False}
    out, lse = _run_dense(q, k, v, ir, bind, opts)
    ref, ref_lse = attention_reference(q, k, v, ir, bind)
    assert_pattern(out, ref, "split tail out")
    assert_pattern(lse, ref_lse, "split tail lse")


# --------------------------------------------------------------------------------- batch
PAGE = 16


def _paged(q_lens: list[int], kv_lens: list[int], hkv: int, g: int, d: int, seed: int
           ) -> dict[str, Any]:
    """q and an NHD paged cache (page 16), request i's pages consecutive from `first[i]`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    n_pages = [-(-n // PAGE) for n in kv_lens]
    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
    total = int(indptr[-1])
    q = torch.randn(int(qo[-1]), hkv * g, d, generator=gen, device="cuda").bfloat16()
    k = torch.randn(total, PAGE, hkv, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(total, PAGE, hkv, d, generator=gen, device="cuda").bfloat16()
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, n_pages)])
    return dict(q=q, k=k, v=v, qo=qo, indptr=indptr, ids=torch.arange(total), last=last,
                kv_lens=kv_lens)


def _batch_poke(b: dict[str, Any], g: int) -> None:
    """NaN in request 0's key 5; +inf in request 1's key 50 (element 3 of kv head 1, and its
    query head g's element 3 made positive: a +inf score); NaN in the last request's value at
    the key just before its queries (kept by all of them) and in its first query (head 1)."""
    def at(r: int, t: int) -> tuple[int, int]:  # request r's token t: (page, slot)
        return int(b["indptr"][r]) + t // PAGE, t % PAGE

    r_last = len(b["kv_lens"]) - 1
    lq = int(b["qo"][r_last + 1] - b["qo"][r_last])
    b["k"][(*at(0, 5), 0, 3)] = NAN
    b["k"][(*at(1, 50), 1, 3)] = INF
    b["q"][int(b["qo"][1]):int(b["qo"][2]), g, 3] = 1.0
    b["v"][(*at(r_last, b["kv_lens"][r_last] - lq - 1), 0, 7)] = NAN
    b["q"][int(b["qo"][r_last]), 1, 2] = NAN


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_batch_kernels_and_merge_keep_the_pattern(kernel: str) -> None:
    """Decode (FA2, GQA 8: long rows split and merged by the merge kernel) and prefill-shaped
    chunks (FA3 batch, split too), causal; the lengths of test_batch.py's merge test."""
    if kernel == "fa3":
        if not _sm90():
            pytest.skip("the FA3 batch kernel needs an sm_90 GPU")
        q_lens, kv_lens, g = [300, 129, 1], [9000, 4000, 12000], 4
    else:
        q_lens, kv_lens, g = [1] * 6, [30000, 9000, 1, 4000, 17, 12000], 8
    hkv, d = 2, 128
    b = _paged(q_lens, kv_lens, hkv, g, d, seed=5)
    _batch_poke(b, g)
    variant = attncc.Variant(mask_mod=causal)
    ba = BatchAttention(variant, kv_layout="NHD", kernel=kernel)
    ba.plan(b["qo"], b["indptr"], b["ids"], b["last"], num_qo_heads=hkv * g, num_kv_heads=hkv,
            head_dim=d, page_size=PAGE)
    assert ba._plan is not None and ba._plan.num_merges > 0  # the merge kernel runs
    out = torch.full_like(b["q"], SENTINEL)
    lse = torch.full(b["q"].shape[:2], SENTINEL, device="cuda")
    ba.run(b["q"], (b["k"], b["v"]), out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = batch_attention_reference(b["q"], (b["k"], b["v"]), b["qo"], b["indptr"],
                                             b["ids"], b["last"], page_size=PAGE,
                                             variant=variant)
    assert ref.isnan().any() and torch.isposinf(ref_lse).any()
    assert_pattern(out, ref, f"batch {kernel} out")
    assert_pattern(lse, ref_lse, f"batch {kernel} lse")


def test_cascade_keeps_the_pattern() -> None:
    """Shared prefix + suffixes merged (merge kernel): a NaN value in the prefix reaches every
    query, a NaN key in one suffix only its request's queries."""
    from attncc.runtime.serving.cascade import CascadeAttention

    hkv, g, d, page, prefix = 2, 2, 128, 16, 256
    q_lens, s_lens = [1, 3, 1, 5], [1, 40, 300, 64]
    gen = torch.Generator(device="cuda").manual_seed(13)
    pre_pages = prefix // page
    s_pages = [-(-n // page) for n in s_lens]
    total = pre_pages + sum(s_pages)
    k = torch.randn(total, page, hkv, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(total, page, hkv, d, generator=gen, device="cuda").bfloat16()
    pre_ids = torch.arange(pre_pages)
    suf_ids = torch.arange(pre_pages, total)
    sptr = torch.tensor([0] + list(itertools.accumulate(s_pages)))
    slast = torch.tensor([n - (p - 1) * page for n, p in zip(s_lens, s_pages)])
    v[3, 5, 0, 11] = NAN                       # prefix page 3: every request, kv head 0
    k[int(pre_pages + sptr[2]), 2, 1, 4] = NAN  # request 2's first suffix key, kv head 1
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    q = torch.randn(int(qo[-1]), hkv * g, d, generator=gen, device="cuda").bfloat16()
    ca = CascadeAttention(None, kv_layout="NHD")
    ca.plan(qo, prefix_indices=pre_ids, prefix_last_page_len=page, suffix_indptr=sptr,
            suffix_indices=suf_ids, suffix_last_page_len=slast, num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=page)
    got, lse = ca.run(q, (k, v), return_lse=True)
    torch.cuda.synchronize()
    lists = [torch.cat([pre_ids, suf_ids[int(sptr[i]):int(sptr[i + 1])]]) for i in range(4)]
    ind = torch.tensor([0] + list(itertools.accumulate(len(x) for x in lists)))
    ref, ref_lse = batch_attention_reference(q, (k, v), qo, ind, torch.cat(lists), slast,
                                             page_size=page)
    assert ref.isnan().any()
    assert_pattern(got, ref, "cascade out")
    assert_pattern(lse, ref_lse, "cascade lse")


# --------------------------------------------------------------------------------- merge
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_state_on_cuda_propagates_nan_and_inf(dtype: torch.dtype) -> None:
    """The merge kernel against the CPU merge in float64 on the same states: NaN lse, +inf lse,
    a NaN o with finite lse (also with an underflowing weight), empty states holding NaN."""
    from attncc.runtime.serving.merge_kernel import fits_kernel

    rows, d = 64, 64
    gen = torch.Generator(device="cuda").manual_seed(2)
    o_a = torch.randn(rows, d, generator=gen, device="cuda").to(dtype)
    o_b = torch.randn(rows, d, generator=gen, device="cuda").to(dtype)
    lse_a = 3 * torch.randn(rows, generator=gen, device="cuda")
    lse_b = 3 * torch.randn(rows, generator=gen, device="cuda")
    lse_a[0], lse_b[1] = NAN, NAN                    # a NaN logit in one part
    lse_a[2], lse_b[3] = INF, INF                    # a +inf logit in one part
    lse_a[4], lse_b[4] = INF, NAN                    # both
    o_a[2], o_b[3], o_a[4] = NAN, NAN, NAN           # (the +inf parts' outputs are NaN)
    o_a[5, 7] = NAN                                  # NaN value, finite lse
    o_a[6, 1], lse_a[6], lse_b[6] = NAN, -200.0, 0.0  # ... whose weight underflows
    lse_a[7] = -INF                                  # empty: its NaN o is never read
    o_a[7] = NAN
    lse_a[8] = lse_b[8] = -INF                       # both empty
    o_a[8] = o_b[8] = NAN
    assert fits_kernel(o_a, lse_a, o_b, lse_b)
    out, lse = attncc.merge_state(o_a, lse_a, o_b, lse_b)
    torch.cuda.synchronize()
    ref, ref_lse = merge_pair(o_a.double().cpu(), lse_a.double().cpu(), o_b.double().cpu(),
                              lse_b.double().cpu())
    assert ref[0].isnan().all() and math.isnan(ref_lse[0]) and ref_lse[2] == INF
    assert ref[7].isfinite().all() and torch.equal(ref[8], torch.zeros(d, dtype=torch.float64))
    assert_pattern(out.cpu(), ref, f"merge {dtype} out")
    assert_pattern(lse.cpu(), ref_lse, f"merge {dtype} lse")
