"""Head dims other than 64/128/256 and a value head dim other than the query's, on the GPU
(issue 31; docs/flex-api.md and docs/serving.md, "Head dims"): flex_attention (FA2's padded
form, and on sm_90 FA3's where both real dims are 64 or more) at D in {32, 80, 96, 112, 160,
192} and (Dqk, Dv) in {(192, 128), (128, 64), (64, 128)}, causal and a score_mod, odd lengths,
GQA, and a shape with more 128-row items than SMs (FA3's persistent CTAs); BatchAttention
paged decode and prefill at a few of those dims, page sizes 1 and 16, NHD and HND (split-KV
rows merged), and a CascadeAttention; the errors before launch. Every case against the fp64
reference: fresh random inputs, outputs poisoned with NaN before the run, relative Frobenius
error < 2e-2, the LSE within 2e-2."""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import attncc
from attncc.gym import GYM
from attncc.runtime.flex.gpu_flex import gpu_flex_attention
from attncc.runtime.reference import attention_reference, batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.serving.cascade import CascadeAttention

pytestmark = pytest.mark.gpu

FLEX_DIMS = [(d, d) for d in (32, 80, 96, 112, 160, 192)] + [(192, 128), (128, 64), (64, 128)]
# (batch, Hq, Hkv, Sq, Skv): odd lengths with GQA 4, and a short query block against long keys
FLEX_SHAPES = [(2, 8, 2, 77, 133), (1, 4, 4, 5, 1031), (2, 16, 4, 999, 1999)]
BATCH_DIMS = [(80, 80), (96, 96), (192, 128), (64, 128)]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} NaN / unwritten values"
    den = ref.double().norm()
    num = (got.double() - ref.double()).norm()
    return float(num / den) if float(den) > 0 else float(num)


def _variant(name: str) -> attncc.Variant:
    if name == "causal":  # (queries are the last Sq positions of the keys)
        return attncc.Variant(mask_mod=lambda b, h, q, kv: kv <= q, name="hd_causal")
    return attncc.Variant(score_mod=lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)
                          - 0.01 * (q - kv).abs(), name="hd_softcap_bias")


def _lse_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    live = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), live)
    assert (got[live].double() - ref[live]).abs().max().item() < 2e-2


@pytest.mark.parametrize("dims", FLEX_DIMS, ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("shape", FLEX_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["causal", "softcap_bias"])
@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_flex_padded_head_dims(dims: tuple[int, int], shape: tuple[int, ...], name: str,
                               kernel: str) -> None:
    dqk, dv = dims
    if kernel == "fa3" and (min(dims) < 64 or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("FA3's padded form: sm_90 and real head dims of 64 or more")
    B, hq, hkv, sq, skv = shape
    g = torch.Generator(device="cuda").manual_seed(dqk * 7 + dv + sq)
    q = torch.randn(B, hq, sq, dqk, generator=g, device="cuda").bfloat16()
    k = torch.randn(B, hkv, skv, dqk, generator=g, device="cuda").bfloat16()
    v = torch.randn(B, hkv, skv, dv, generator=g, device="cuda").bfloat16()
    ir, bindings = _variant(name).trace()
    out = torch.full((B, hq, sq, dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((B, hq, sq), float("nan"), device="cuda")
    gpu_flex_attention(q, k, v, ir, bindings, enable_gqa=hq != hkv, return_lse=True, out=out,
                       lse_out=lse, kernel_options={"KERNEL": kernel})
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, ir, bindings, enable_gqa=hq != hkv)
    assert out.shape[-1] == dv
    err = _rel(out, ref)
    assert err < 2e-2, f"relative error {err:.3e}"
    _lse_close(lse, ref_lse)
    # the public entry point (the default kernel choice; on sm_90 too) agrees
    got = attncc.flex_attention(q, k, v, _variant(name), enable_gqa=hq != hkv)
    assert _rel(got, ref) < 2e-2


def test_flex_bad_head_dims_fail_before_launch() -> None:
    q = torch.randn(1, 4, 32, 96, device="cuda", dtype=torch.bfloat16)
    ir, _ = attncc.Variant(name="hd_plain").trace()
    for d, dv, msg in ((100, 100, "query head_dim 100"), (96, 20, "value head_dim 20"),
                       (96, 264, "value head_dim 264"), (24, 24, "query head_dim 24")):
        qq = torch.randn(1, 4, 32, d, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn(1, 4, 32, dv, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=msg):
            gpu_flex_attention(qq, qq, vv, ir)
    q48 = torch.randn(1, 4, 32, 48, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'fa3' runs padded head dims of 64 or more"):
        gpu_flex_attention(q48, q48, q48, ir, kernel_options={"KERNEL": "fa3"})
    rope = GYM["rope"](1, 4, 32, 96)
    with pytest.raises(ValueError, match="query_mod, key_mod"):
        attncc.flex_attention(q, q, q, rope)
    qg = q.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="the GPU backward runs head dims 64, 128 and 256"):
        attncc.flex_attention(qg, q, q)
    with torch.no_grad():  # the forward alone runs
        assert attncc.flex_attention(qg, q, q).shape == q.shape


def _paged(layout: str, page: int, q_lens: list[int], kv_lens: list[int], hkv: int, g: int,
           dqk: int, dv: int, seed: int) -> dict[str, Any]:
    """Random q and a paged K/V cache (K rows of Dqk, V rows of Dv; shuffled page ids with
    unused pages between)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16()

    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    n_pages = [-(-n // page) for n in kv_lens]
    total = sum(n_pages)
    perm = torch.randperm(2 * total + 3, generator=torch.Generator().manual_seed(seed))[:total]

    def cache(d: int) -> torch.Tensor:
        return rnd(*((2 * total + 3, page, hkv, d) if layout == "NHD"
                     else (2 * total + 3, hkv, page, d)))

    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
    return dict(q=rnd(int(qo[-1]), hkv * g, dqk), cache=(cache(dqk), cache(dv)), qo=qo,
                kv_indptr=indptr, kv_indices=perm, last=last)


DECODE = ([1] * 6, [1, 17, 300, 1500, 4095, 9000])  # long rows split and merged
PREFILL = ([1, 37, 300, 5], [40, 37, 2000, 700])


@pytest.mark.parametrize("dims", BATCH_DIMS, ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("lens", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_batch_padded_head_dims(dims: tuple[int, int], layout: str, page: int,
                                lens: tuple[list[int], list[int]]) -> None:
    dqk, dv = dims
    hkv, g = 2, 4
    b = _paged(layout, page, lens[0], lens[1], hkv, g, dqk, dv, seed=dqk + dv + page)
    variant = _variant("causal")
    ba = BatchAttention(variant, kv_layout=layout)
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim_qk=dqk, head_dim_vo=dv, page_size=page)
    assert ba.tiles.kernel == "fa2" and (ba.head_dim, ba.head_dim_vo) == (dqk, dv)
    out = torch.full((b["q"].shape[0], hkv * g, dv), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    lse = torch.full(b["q"].shape[:2], float("nan"), device="cuda")
    ba.run(b["q"], b["cache"], out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = batch_attention_reference(b["q"], b["cache"], b["qo"], b["kv_indptr"],
                                             b["kv_indices"], b["last"], kv_layout=layout,
                                             page_size=page, variant=variant)
    err = _rel(out, ref)
    assert err < 2e-2, f"relative error {err:.3e}"
    _lse_close(lse, ref_lse)


def test_batch_bad_head_dims_fail_at_plan() -> None:
    ba = BatchAttention(kv_layout="NHD")
    args = ([0, 1], [0, 1], [0], [4])
    for kw, msg in ((dict(head_dim=100), "head_dim 100"), (dict(head_dim=96, head_dim_vo=12),
                                                           "head_dim_vo 12"),
                    (dict(head_dim_qk=264), "head_dim_qk 264"),
                    (dict(head_dim=128, head_dim_qk=96), "disagree")):
        with pytest.raises(ValueError, match=msg):
            ba.plan(*args, num_qo_heads=4, num_kv_heads=2, page_size=16, **kw)
    with pytest.raises(ValueError, match="kernel='fa3'"):
        BatchAttention(kernel="fa3").plan(*args, num_qo_heads=4, num_kv_heads=2, head_dim=96,
                                          page_size=16)
    rope = BatchAttention(GYM["rope"](1, 4, 32, 96))
    with pytest.raises(ValueError, match="query_mod, key_mod"):
        rope.plan(*args, num_qo_heads=4, num_kv_heads=2, head_dim=96, page_size=16)
    ba.plan(*args, num_qo_heads=4, num_kv_heads=2, head_dim=192, head_dim_vo=128,
            page_size=16)
    k = torch.zeros(1, 16, 2, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(1, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 192, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"v_cache has shape \(1, 16, 2, 192\)"):
        ba.run(q, (k, k))
    with pytest.raises(ValueError, match="same strides in rows of their head dims"):
        ba.run(q, (k, torch.zeros(1, 2, 16, 128, device="cuda",
                                  dtype=torch.bfloat16).transpose(1, 2)))
    assert ba.run(q, (k, v)).shape == (1, 4, 128)


def test_cascade_value_head_dim() -> None:
    """A shared prefix and per-request suffixes at Dqk 192 / Dv 128: both passes padded, their
    states merged."""
    hkv, g, page, dqk, dv = 2, 4, 16, 192, 128
    gen = torch.Generator(device="cuda").manual_seed(31)
    k = torch.randn(40, page, hkv, dqk, generator=gen, device="cuda").bfloat16()
    v = torch.randn(40, page, hkv, dv, generator=gen, device="cuda").bfloat16()
    qo = torch.tensor([0, 1, 4, 5])
    q = torch.randn(5, hkv * g, dqk, generator=gen, device="cuda").bfloat16()
    prefix, suffix = [3, 7, 9], [[0, 1], [2], [4, 5, 6]]
    sptr = torch.tensor([0, 2, 3, 6])
    slast = torch.tensor([5, 16, 1])
    ca = CascadeAttention(_variant("causal"))
    ca.plan(qo, prefix_indices=torch.tensor(prefix), prefix_last_page_len=16,
            suffix_indptr=sptr, suffix_indices=torch.tensor(sum(suffix, [])),
            suffix_last_page_len=slast, num_qo_heads=hkv * g, num_kv_heads=hkv,
            head_dim_qk=dqk, head_dim_vo=dv, page_size=page)
    out, lse = ca.run(q, (k, v), return_lse=True)
    # the same requests as one paged batch each: prefix pages then suffix pages
    pages = [prefix + s for s in suffix]
    ref, ref_lse = batch_attention_reference(
        q, (k, v), qo, torch.tensor([0] + list(itertools.accumulate(map(len, pages)))),
        torch.tensor(sum(pages, [])), slast, page_size=page, variant=_variant("causal"))
    assert out.shape == (5, hkv * g, dv)
    assert _rel(out, ref) < 2e-2
    _lse_close(lse, ref_lse)
