"""The FA3 dense kernel on CTA pairs (kernel_options PAIRED; runtime/gpu_flex.fa3_pairs,
kernels/fa3/fa3_prefill.cuh produce_pairs): clusters of two CTAs run two query blocks of one head
over the same K/V tiles, each tile multicast into both CTAs' rings. Against the fp64
reference, bitwise against the unpaired kernel (each item's arithmetic is the same), and for
bitwise repeats eagerly and in a CUDA graph."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from attncc.runtime.flex import gpu_flex
from attncc.runtime.reference import attention_reference
from attncc.gym import GYM

from tests.helpers.fa3_launch import run_fa3
from tests.helpers.repeats import assert_repeats_bitwise

# (variant, head dim, B, Hq, Hkv, q_len, kv_len): fewer pairs than clusters and several rounds
# of them (2 x 12 x 16 items: 192 pairs on the H200's 66 clusters), a partial last query block
# and K/V tile, more keys than queries, GQA, a key transform inside the kernel (rope), and
# mask_mods with no block mask (every tile evaluated: the pairs' tile lists stay equal)
CASES = [
    ("noop", 128, 2, 4, 2, 1024, 1024),
    ("causal", 64, 2, 12, 4, 2048, 2048),
    ("softcap", 128, 1, 6, 6, 2000, 2000),
    ("alibi", 128, 1, 8, 2, 512, 3000),
    ("document_mask", 64, 2, 3, 1, 768, 768),
    ("rope", 64, 1, 4, 4, 1280, 1280),
]

def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: Any, bind: Any, g: int,
         paired: bool, out: torch.Tensor | None = None,
         lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return run_fa3(q, k, v, ir, bind, g, {"PAIRED": paired, "SPLIT_TAIL": False}, out, lse)


def _inputs(B: int, hq: int, hkv: int, sq: int, skv: int, d: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(B, hq, sq, d, device="cuda").bfloat16()
    k = torch.randn(B, hkv, skv, d, device="cuda").bfloat16()
    v = torch.randn(B, hkv, skv, d, device="cuda").bfloat16()
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("name,d,B,hq,hkv,sq,skv", CASES,
                         ids=[f"{c[0]}-d{c[1]}" for c in CASES])
def test_fa3_pairs_match_reference_and_unpaired(name: str, d: int, B: int, hq: int, hkv: int,
                                                sq: int, skv: int) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    g = hq // hkv
    q, k, v = _inputs(B, hq, hkv, sq, skv, d)
    ir, bind = GYM[name](B, hq, skv, d).trace()
    pl = gpu_flex.plan_launch(q, k, v, ir, bind, enable_gqa=g > 1,
                              kernel_options={"KERNEL": "fa3", "PAIRED": True})
    assert pl.tiles.paired, "the case does not run on CTA pairs"
    out, lse = _run(q, k, v, ir, bind, g, paired=True)
    alone, alone_lse = _run(q, k, v, ir, bind, g, paired=False)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, ir, bind, enable_gqa=g > 1)
    assert not torch.isnan(out).any()  # every element written (the outputs start as NaN)
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
    live = torch.isfinite(ref_lse)
    assert (lse[live].double() - ref_lse[live]).abs().max().item() < 2e-2
    assert torch.equal(torch.isfinite(lse), live)
    assert torch.equal(out, alone) and torch.equal(lse, alone_lse)


@pytest.mark.gpu
def test_fa3_pairs_repeat_bitwise_and_in_graphs() -> None:
    """Pairs in a CUDA graph (the cluster launch attribute is captured with the launch):
    eager launches and replays give bitwise the same output and LSE."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    B, hq, s, d = 2, 16, 2048, 128  # 512 items: ~3.9 rounds of pairs
    q, k, v = _inputs(B, hq, hq, s, s, d)
    ir, bind = GYM["noop"](B, hq, s, d).trace()
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")

    def step() -> None:
        _run(q, k, v, ir, bind, 1, paired=True, out=out, lse=lse)
    step()
    torch.cuda.synchronize()
    first, first_lse = out.clone(), lse.clone()
    ref, _ = attention_reference(q[:, :2], k[:, :2], v[:, :2], ir, bind)
    assert float((first[:, :2].double() - ref).norm() / ref.norm()) < 2e-2
    assert_repeats_bitwise(step, [out, lse], [first, first_lse], times=4)


def test_fa3_pairs_need_even_query_blocks_and_no_block_mask() -> None:
    """fa3_pairs: an odd number of 128-row query blocks, a block mask, head dim 256 (one CTA
    per item), PAIRED False or, by default, more than FA3_PAIRED_MAX_KEYS keys leave the launch
    unpaired."""
    from attncc.runtime.flex.tile_choice import TilePlan

    fa3 = TilePlan(128, 128, 3, 1, kernel="fa3")
    on = {"PAIRED": True}
    assert gpu_flex.fa3_pairs(fa3, False, 256, 256, 128, on)
    assert gpu_flex.fa3_pairs(fa3, False, 256, 256, 128, None)  # the default
    assert not gpu_flex.fa3_pairs(fa3, False, 300, 300, 128, on)      # 3 query blocks
    assert not gpu_flex.fa3_pairs(fa3, True, 256, 256, 128, on)       # block mask
    assert not gpu_flex.fa3_pairs(fa3, False, 256, 256, 256, on)      # not persistent
    assert not gpu_flex.fa3_pairs(fa3, False, 256, 256, 128, {"PAIRED": False})
    assert not gpu_flex.fa3_pairs(fa3, False, 256, 256, 128,
                                  {"PAIRED": True, "PERSISTENT": False})
    assert not gpu_flex.fa3_pairs(TilePlan(64, 64, 2, 1), False, 256, 256, 128, on)  # FA2
    long = gpu_flex.FA3_PAIRED_MAX_KEYS + 128
    assert not gpu_flex.fa3_pairs(fa3, False, 256, long, 128, None)
    assert gpu_flex.fa3_pairs(fa3, False, 256, long, 128, on)
