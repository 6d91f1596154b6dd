"""The FA3 kernel (kernels/fa3/fa3_prefill.cuh: TMA + wgmma, warp-specialized), selected with
kernel_options={"KERNEL": "fa3"}, against the fp64 reference. GPU tests need an sm_90 GPU; the
CPU tests pin the option's checks; tests/runtime/flex/test_kernel_spills.py that the cases
compile for sm_90a without spills."""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import attncc
from attncc.ir.hoist import KV_HOOKS, PREPASS_HOOKS
from attncc.runtime.flex import gpu_flex
from attncc.runtime.flex.gpu_flex import choose_tiles
from attncc.gym import GYM, causal, sliding_window
from attncc.runtime.jit.kernels import generate

from tests.helpers.repeats import assert_repeats_bitwise
from tests.helpers.variants import VARIANTS

FA3 = {"KERNEL": "fa3"}


CASES = [(v, d, s, g, n) for (v, d, n), s, g in zip(
    itertools.product(("noop", "causal", "softcap_causal", "alibi_causal"), (64, 128), (64, 128)),
    itertools.cycle((1, 17, 300, 1000, 4096, 129)), itertools.cycle((1, 4, 1)))] + [
    ("noop", 256, 1000, 4, 64), ("softcap_causal", 256, 4096, 1, 64),
    ("alibi_causal", 256, 129, 1, 64)]
# query/key/value/output transforms (odd lengths: rows and keys past the end are skipped), each
# run with the transforms applied in shared memory by the attention kernel, with the key/value
# ones and with all of them in the pre-pass (runtime/flex/prepass.py)
TRANSFORM_CASES = [
    ("rope", 128, 1000, 4, 128), ("rope", 64, 129, 1, 128), ("rope_interleaved", 128, 300, 1, 64),
    ("value_output", 128, 1000, 1, 128), ("value_output", 64, 17, 4, 128),
    ("rope", 256, 300, 1, 64), ("value_output", 256, 129, 1, 64)]


def test_fa3_default_stages_fill_shared_memory() -> None:
    """Without num_stages the K/V ring is as deep as 227 KB allows (at most 4): 128-key tiles get
    3 stages at head dim 128 and 4 at 64; head dim 256 gets 64-key tiles and 2 stages."""
    got = {d: choose_tiles(d, q_len=4096, kv_len=4096, group=1, heads=8, batch=1,
                           kernel_options=FA3) for d in (64, 128, 256)}
    assert {d: (p.tkv, p.stages) for d, p in got.items()} == {64: (128, 4), 128: (128, 3),
                                                              256: (64, 2)}


def test_fa3_is_picked_where_it_fits() -> None:
    """fa3_ok (sm_90, contiguous inputs) makes FA3 the default for >= 128 query
    rows whose block mask has 128-row / 128-key blocks; FA2 runs everything else, and
    kernel_options KERNEL or BLOCK_M keep their meaning."""
    def pick(**kw: Any) -> str:
        args = dict(q_len=4096, kv_len=4096, group=1, heads=8, batch=1, fa3_ok=True)
        return choose_tiles(128, **{**args, **kw}).kernel

    assert pick() == "fa3"
    assert pick(block_q=128, block_kv=128) == "fa3"
    assert pick(fa3_ok=False) == "fa2"
    assert pick(q_len=100) == "fa2"                           # fewer rows than one FA3 tile
    assert pick(block_q=64, block_kv=64) == "fa2"             # blocks FA3 cannot walk
    assert pick(kernel_options={"KERNEL": "fa2"}) == "fa2"
    assert pick(kernel_options={"BLOCK_M": 64}) == "fa2"
    assert pick(kernel_options={"BLOCK_N": 64}) == "fa3"


def test_fa3_option_checks() -> None:
    plan = choose_tiles(128, q_len=500, kv_len=500, group=4, heads=8, batch=1,
                        kernel_options=FA3)
    assert (plan.kernel, plan.tq, plan.tkv, plan.gf) == ("fa3", 128, 128, 1)
    plan = choose_tiles(64, q_len=500, kv_len=500, group=1, heads=8, batch=1,
                        kernel_options={**FA3, "BLOCK_N": 64, "num_stages": 4})
    assert (plan.tkv, plan.stages) == (64, 4)
    with pytest.raises(ValueError, match="head dims 64, 128 and 256"):
        choose_tiles(96, q_len=5, kv_len=5, group=1, heads=1, batch=1, kernel_options=FA3)
    with pytest.raises(ValueError, match="blocks of 128 query rows"):
        choose_tiles(64, q_len=5, kv_len=5, group=1, heads=1, batch=1, block_q=64, block_kv=128,
                     kernel_options=FA3)
    with pytest.raises(ValueError, match="a multiple of 128 keys"):
        choose_tiles(64, q_len=5, kv_len=5, group=1, heads=1, batch=1, block_q=128, block_kv=64,
                     kernel_options=FA3)
    with pytest.raises(ValueError, match="BLOCK_N=32: the FA3 kernel's KV tiles are 64 or 128"):
        choose_tiles(64, q_len=5, kv_len=5, group=1, heads=1, batch=1,
                     kernel_options={**FA3, "BLOCK_N": 32})
    with pytest.raises(ValueError, match="more than the 227 KB"):
        choose_tiles(128, q_len=5, kv_len=5, group=1, heads=1, batch=1,
                     kernel_options={**FA3, "num_stages": 4})
    with pytest.raises(ValueError, match="needs 2 to 4 stages, not 1"):
        choose_tiles(64, q_len=500, kv_len=500, group=1, heads=1, batch=1,
                     kernel_options={**FA3, "num_stages": 1})
    # without KERNEL, one stage is an FA2 choice (a one-stage FA3 ring would deadlock: a stage
    # is released one iteration after it is read)
    plan = choose_tiles(64, q_len=300, kv_len=300, group=1, heads=4, batch=1, fa3_ok=True,
                        kernel_options={"num_stages": 1})
    assert (plan.kernel, plan.stages) == ("fa2", 1)
    with pytest.raises(ValueError, match="'fa2' \\(default\\) or 'fa3'"):
        choose_tiles(64, q_len=5, kv_len=5, group=1, heads=1, batch=1,
                     kernel_options={"KERNEL": "fa4"})


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: Any, bind: Any, bm: Any,
           g: int, tkv: int = 128, scale: float | None = None, **options: Any) -> None:
    from attncc.runtime.reference import attention_reference

    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=bm, enable_gqa=g > 1,
                                return_lse=True, kernel_options={**FA3, "BLOCK_N": tkv, **options},
                                out=out, lse_out=lse, scale=scale)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, ir, bind, block_mask=bm, enable_gqa=g > 1,
                                       scale=scale)
    assert not torch.isnan(out).any()
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
    live = torch.isfinite(ref_lse)
    assert (lse[live].double() - ref_lse[live]).abs().max().item() < 2e-2


# The split K/V ring (every 2-stage ring without K/V transforms or the bulk O store) and the
# persistent D = 256 kernel (docs/fa3.md, "The split K/V ring and D = 256"): 256 items on the
# SMs, so CTAs run several items and the ring's phases run on across them; GQA; causal through
# a block mask; lengths that leave partial tiles; PERSISTENT False (one CTA per item).
RING_CASES = [("noop", 256, 2048, 1, True), ("softcap_causal", 256, 1900, 2, True),
              ("causal", 256, 2048, 4, False), ("alibi_causal", 256, 1000, 1, True),
              ("causal", 128, 2048, 1, True), ("softcap_causal", 64, 1900, 2, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,d,s,g,persistent", RING_CASES,
                         ids=[f"{c[0]}-d{c[1]}-s{c[2]}-g{c[3]}-{'p' if c[4] else 'np'}"
                              for c in RING_CASES])
def test_fa3_split_ring_and_persistent_d256(name: str, d: int, s: int, g: int, persistent: bool,
                                            rng: Any) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    q, k, v = rng.qkv(2, 8, s, d, Hkv=8 // g, dtype=torch.bfloat16, device="cuda")
    ir, bind = VARIANTS[name](2, 8, s, d).trace()
    bm = (attncc.create_block_mask(causal, None, None, s, s, device="cuda")
          if name.endswith("causal") else None)
    _check(q, k, v, ir, bind, bm, g, 64, num_stages=2, PERSISTENT=persistent)


@pytest.mark.gpu
@pytest.mark.parametrize("name,d,s,g,tkv", CASES,
                         ids=[f"{c[0]}-d{c[1]}-s{c[2]}-g{c[3]}-k{c[4]}" for c in CASES])
def test_fa3_matches_reference(name: str, d: int, s: int, g: int, tkv: int, rng: Any) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 prototype needs an sm_90 GPU")
    q, k, v = rng.qkv(2, 2 * g, s, d, Hkv=2, dtype=torch.bfloat16, device="cuda")
    ir, bind = VARIANTS[name](2, 2 * g, s, d).trace()
    _check(q, k, v, ir, bind, None, g, tkv)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["noop", "causal", "softcap_causal"])
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.02, 1.5])
def test_fa3_softmax_scale_of_any_sign(name: str, scale: float, rng: Any) -> None:
    # without a score_mod the kernel applies the scale inside exp2 (max(s) * scale is the scaled
    # maximum only for scale > 0); a scale <= 0 takes the kernel's other branch
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    q, k, v = rng.qkv(1, 2, 700, 128, dtype=torch.bfloat16, device="cuda")
    ir, bind = VARIANTS[name](1, 2, 700, 128).trace()
    _check(q, k, v, ir, bind, None, 1, scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["noop", "causal", "alibi_causal"])
def test_fa3_lazy_rescale_follows_growing_maxima(name: str, rng: Any) -> None:
    # keys grow along the sequence, so a row's maximum logit keeps rising: by less than the lazy
    # threshold (2^8) on most tiles -- kept, exps above 1 -- and by more on some -- rescaled
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    S = 2048
    q, k, v = rng.qkv(1, 2, S, 128, dtype=torch.bfloat16, device="cuda")
    ramp = torch.linspace(0.2, 3.0, S, device="cuda").pow(2)[None, None, :, None]
    k = (k.float() * ramp).bfloat16()
    ir, bind = VARIANTS[name](1, 2, S, 128).trace()
    _check(q, k, v, ir, bind, None, 1, scale=0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(16, 16, 128), (16, 16, 64), (24, 8, 128)])
def test_fa3_l2_sections_cover_every_item(hq: int, hkv: int, d: int) -> None:
    """Long keys (8192: 2-4 MiB of K and V per KV head) split the heads into several L2
    sections of the item order (ATTNCC_FA3_L2_SECTION_BYTES, 12 MiB), the first one partial: every
    (head, query block) is still run exactly once (poisoned output and LSE fully written)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    q = torch.randn(1, hq, 300, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, 8192, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    ir, bind = VARIANTS["softcap"](1, hq, 8192, d).trace()
    _check(q, k, v, ir, bind, None, hq // hkv)


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [0, 8])
def test_fa3_out_view_rows_written_by_16_byte_stores(pad: int, rng: Any) -> None:
    """The epilogue's 16-byte stores (store_rows_v4) into `out` and into a padded view of a
    wider tensor (row stride D + 8: rows stay 16-byte aligned, as gpu_flex requires) write
    every element of the view, the same values, and nothing of the padding."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    d, s = 128, 300
    q, k, v = rng.qkv(2, 4, s, d, Hkv=2, dtype=torch.bfloat16, device="cuda")
    ir, bind = VARIANTS["causal"](2, 4, s, d).trace()
    out = torch.full((2, 4, s, d + pad), float("nan"), device="cuda", dtype=torch.bfloat16)
    view = out[..., :d]
    gpu_flex.gpu_flex_attention(q, k, v, ir, bind, enable_gqa=True, kernel_options=FA3,
                                out=view)
    ref, _ = gpu_flex.gpu_flex_attention(q, k, v, ir, bind, enable_gqa=True,
                                         kernel_options=FA3)
    torch.cuda.synchronize()
    assert not torch.isnan(view).any() and torch.equal(view, ref)
    assert pad == 0 or torch.isnan(out[..., d:]).all()  # the padding is left alone


@pytest.mark.gpu
def test_fa3_dynamic_order_repeats_bitwise_and_in_graphs(rng: Any) -> None:
    """The dynamic item order claims items from a counter that is a fresh zero for every
    launch (a memset node inside a CUDA graph): eager launches and graph replays of a causal
    case with ~9 items per CTA give bitwise the same output, which matches the reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    q, k, v = rng.qkv(2, 72, 1000, 64, Hkv=36, dtype=torch.bfloat16, device="cuda")
    ir, bind = VARIANTS["causal"](2, 72, 1000, 64).trace()
    bm = attncc.create_block_mask(causal, None, None, 1000, 1000, device="cuda")
    out = torch.full_like(q, float("nan"))

    def step() -> None:
        gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=bm, enable_gqa=True,
                                    kernel_options=FA3, out=out)
    step()
    torch.cuda.synchronize()
    first = out.clone()
    _check(q, k, v, ir, bind, bm, 2)
    assert_repeats_bitwise(step, [out], [first])


@pytest.mark.gpu
@pytest.mark.parametrize("prepass", ["none", "kv", "qkv"])
@pytest.mark.parametrize("name,d,s,g,tkv", TRANSFORM_CASES,
                         ids=[f"{c[0]}-d{c[1]}-s{c[2]}-g{c[3]}-k{c[4]}" for c in TRANSFORM_CASES])
def test_fa3_transforms_match_reference(name: str, d: int, s: int, g: int, tkv: int, prepass: str,
                                        rng: Any) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    q, k, v = rng.qkv(2, 2 * g, s, d, Hkv=2, dtype=torch.bfloat16, device="cuda")
    ir, bind = VARIANTS[name](2, 2 * g, s, d).trace()
    pl = gpu_flex.plan_launch(q, k, v, ir, bind, enable_gqa=g > 1,
                              kernel_options={**FA3, "PREPASS": prepass})
    moved = sorted(pl.prepass.hooks) if pl.prepass is not None else []
    assert moved == sorted(h for h in ir.hooks if h in {"none": (), "kv": KV_HOOKS,
                                                        "qkv": PREPASS_HOOKS}[prepass])
    _check(q, k, v, ir, bind, None, g, tkv, PREPASS=prepass)


@pytest.mark.gpu
def test_prepass_leaves_inputs_alone_and_is_chosen_by_reuse(rng: Any) -> None:
    """The pre-pass writes copies (q/k unchanged, strided inputs fine) and is picked by default
    only when the grid loads each K/V row at least twice."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    d = 128
    ir, bind = VARIANTS["rope"](1, 4, 512, d).trace()
    q, k, v = rng.qkv(1, 4, 512, d, Hkv=2, dtype=torch.bfloat16, device="cuda")
    k_strided = torch.empty(1, 512, 2, d, dtype=k.dtype, device="cuda").transpose(1, 2)
    k_strided.copy_(k)
    before = k_strided.clone()
    assert gpu_flex.plan_launch(q, k_strided, v, ir, bind, enable_gqa=True).prepass is not None
    out, _ = gpu_flex.gpu_flex_attention(q, k_strided, v, ir, bind, enable_gqa=True)
    ref, _ = gpu_flex.gpu_flex_attention(q, k, v, ir, bind, enable_gqa=True,
                                         kernel_options={"PREPASS": "none"})
    torch.cuda.synchronize()
    assert torch.equal(k_strided, before)
    assert float((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-2
    q1 = q[:, :2, :1]  # one query row per head, no GQA sharing: each K row is loaded once
    k1, v1 = k[:, :2], v[:, :2]
    assert gpu_flex.plan_launch(q1, k1, v1, ir, bind).prepass is None


@pytest.mark.gpu
@pytest.mark.parametrize("name,d,s,g", [("softcap_causal", 128, 1000, 4), ("alibi_causal", 64, 300, 1),
                                        ("noop", 256, 129, 1)])
def test_fa3_fp16(name: str, d: int, s: int, g: int, rng: Any) -> None:
    """fp16 inputs run the same kernel with f16 wgmma; the default pick takes them too."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    q, k, v = rng.qkv(2, 2 * g, s, d, Hkv=2, dtype=torch.float16, device="cuda")
    ir, bind = GYM[name](2, 2 * g, s, d).trace()
    _check(q, k, v, ir, bind, None, g, 128 if d <= 128 else 64)
    assert gpu_flex.plan_launch(q, k, v, ir, bind, enable_gqa=g > 1).tiles.kernel == "fa3"


@pytest.mark.gpu
def test_fa3_default_takes_transforms(rng: Any) -> None:
    """Transform variants run FA3 by default (q/k/v/o hooks at every head dim)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    for d in (64, 128, 256):
        q, k, v = rng.qkv(1, 2, 256, d, dtype=torch.bfloat16, device="cuda")
        ir, bind = VARIANTS["rope"](1, 2, 256, d).trace()
        assert gpu_flex.plan_launch(q, k, v, ir, bind).tiles.kernel == "fa3", d
        ir, bind = VARIANTS["value_output"](1, 2, 256, d).trace()
        assert gpu_flex.plan_launch(q, k, v, ir, bind).tiles.kernel == "fa3", d


@pytest.mark.gpu
@pytest.mark.parametrize("mask,tkv", [("causal", 128), ("sliding", 128), ("causal", 64)])
def test_fa3_with_block_mask(mask: str, tkv: int, rng: Any) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 prototype needs an sm_90 GPU")
    S, d = 1500, 128
    q, k, v = rng.qkv(1, 4, S, d, dtype=torch.bfloat16, device="cuda")
    fn = causal if mask == "causal" else sliding_window(256)
    bm = attncc.create_block_mask(fn, None, None, S, S, device="cuda")
    ir, bind = attncc.Variant(score_mod=GYM["softcap"](1, 4, S, d).score_mod).trace()
    _check(q, k, v, ir, bind, bm, 1, tkv)


BANDS = {"shifted_causal": lambda b, h, q, kv: q - kv >= 3,
         "window_with_lookahead": lambda b, h, q, kv: (kv - q <= 5) & (q - kv <= 200)}


@pytest.mark.gpu
@pytest.mark.parametrize("band", sorted(BANDS))
@pytest.mark.parametrize("S,block", [(2048, 128), (1500, (128, 256))])
def test_fa3_band_mask_on_partial_tiles(band: str, S: int, block: Any, rng: Any) -> None:
    """A block mask's partial tiles of a mask that is exactly a band (kernels/fa3/fa3_consumer.cuh
    mask_band: one compare a logit against the row's bound) with bounds off the tile grid, a key
    window reaching past the diagonal, rows with no key at all (q < 3), 256-key mask blocks of
    two tiles (one of them wholly outside the band) and a length that leaves edge tiles to the
    checked path."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 prototype needs an sm_90 GPU")
    d = 128
    q, k, v = rng.qkv(2, 4, S, d, dtype=torch.bfloat16, device="cuda")
    bm = attncc.create_block_mask(BANDS[band], None, None, S, S, device="cuda", BLOCK_SIZE=block)
    ir, bind = attncc.Variant(score_mod=GYM["softcap"](2, 4, S, d).score_mod).trace()
    pl = gpu_flex.plan_launch(q, k, v, ir, bind, block_mask=bm, kernel_options=FA3)
    source = generate(gpu_flex.kernel_spec(pl.ir, d, "bfloat16", pl.tiles)).source
    assert "has_kv_window = true" in source  # the kernel takes the band path
    _check(q, k, v, ir, bind, bm, 1)
