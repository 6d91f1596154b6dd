"""The FA3 dense kernel's split tail (kernels/fa3/fa3_split.cuh, runtime/flex/fa3_split.py): the last,
partial round of full-length items cut by keys across every CTA, each item's units merged by
the last consumer warp to arrive. Against the fp64 reference, against the unsplit kernel
(kernel_options SPLIT_TAIL False), and for bitwise repeatability (eager and CUDA graph)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from attncc.runtime.flex.fa3_split import tail_split
from attncc.runtime.reference import attention_reference
from attncc.gym import GYM

from tests.helpers.fa3_launch import run_fa3
from tests.helpers.repeats import assert_repeats_bitwise

# (variant, head dim, B, Hq, Hkv, S, tkv): every case has more items than the H200's 132 CTAs,
# a partial last round and at least MIN_SPLIT_KEYS keys; items cut in 2 to 5 units (4 items left
# over: 4 pieces each), odd lengths (a partial last tile), GQA, and a mask_mod with no block
# mask (causal: units whose rows see only masked keys, maximum -inf)
CASES = [
    ("noop", 128, 1, 5, 5, 4100, 128),
    ("causal", 64, 1, 6, 3, 4500, 128),
    ("softcap", 128, 1, 4, 2, 4300, 64),
    ("alibi", 64, 2, 3, 3, 4096, 128),
    ("document_mask", 128, 2, 3, 1, 4099, 128),
    ("rope", 64, 1, 5, 5, 4200, 128),
]


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ir: Any, bind: Any, g: int,
         tkv: int, split: bool, out: torch.Tensor | None = None,
         lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return run_fa3(q, k, v, ir, bind, g, {"BLOCK_N": tkv, "SPLIT_TAIL": split, "PAIRED": False},
                   out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("name,d,B,hq,hkv,s,tkv", CASES, ids=[f"{c[0]}-d{c[1]}" for c in CASES])
def test_fa3_split_tail_matches_reference_and_unsplit(name: str, d: int, B: int, hq: int,
                                                      hkv: int, s: int, tkv: int,
                                                      rng: Any) -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = B * hq * -(-s // 128)
    split = tail_split(items, min(items, sms), s, tkv)
    assert split.pieces > 0, "the case does not split its tail on this GPU"
    g = hq // hkv
    q, k, v = rng.qkv(B, hq, s, d, Hkv=hkv, dtype=torch.bfloat16, device="cuda")
    ir, bind = GYM[name](B, hq, s, d).trace()
    out, lse = _run(q, k, v, ir, bind, g, tkv, split=True)
    whole, whole_lse = _run(q, k, v, ir, bind, g, tkv, split=False)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, ir, bind, enable_gqa=g > 1)
    for o, l_ in ((out, lse), (whole, whole_lse)):
        assert not torch.isnan(o).any()  # every element written (the outputs start as NaN)
        assert float((o.double() - ref).norm() / ref.norm()) < 2e-2
        live = torch.isfinite(ref_lse)
        assert (l_[live].double() - ref_lse[live]).abs().max().item() < 2e-2
        assert torch.equal(torch.isfinite(l_), live)
    # the split ran: merged rows add their units in another order than one pass over the keys.
    # (Not a test for masked variants: a row whose unmasked keys all lie in one unit merges to
    # bitwise its one-pass value -- the other units add 0 and it is scaled by exp2(0) -- and
    # document_mask's rows on the H200 all did.)
    if GYM[name](B, hq, s, d).mask_mod is None:
        assert not (torch.equal(out, whole) and torch.equal(lse, whole_lse))


@pytest.mark.gpu
def test_fa3_split_tail_repeats_bitwise_and_in_graphs(rng: Any) -> None:
    """Whichever unit of an item arrives last merges, reading every unit's state (its own too)
    from the workspace in piece order: eager launches and CUDA-graph replays (the counters are a
    fresh zero per launch, a memset node in the graph) give bitwise the same output and LSE."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 kernel needs an sm_90 GPU")
    B, hq, s, d = 1, 5, 4100, 128
    q, k, v = rng.qkv(B, hq, s, d, dtype=torch.bfloat16, device="cuda")
    ir, bind = GYM["softcap"](B, hq, s, d).trace()
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")

    def step() -> None:
        _run(q, k, v, ir, bind, 1, 128, split=True, out=out, lse=lse)
    step()
    torch.cuda.synchronize()
    first, first_lse = out.clone(), lse.clone()
    ref, _ = attention_reference(q, k, v, ir, bind)
    assert float((first.double() - ref).norm() / ref.norm()) < 2e-2
    assert_repeats_bitwise(step, [out, lse], [first, first_lse], times=5)
