"""BatchAttention's launch roles on the GPU (runtime/serving/launch.py, operands.py, staging.py):
each kernel kind's arguments (FA2 batch, decode, FA3 batch and their merge) drive a run whose
planned rows match the fp64 reference and whose other rows keep their poison; an explicit scale
and lse; plans uploaded on two streams in turn. Fresh random inputs, NaN-poisoned outputs.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

import attncc
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention

pytestmark = pytest.mark.gpu

HKV, D, PAGE = 2, 128, 16
CAUSAL = attncc.Variant(mask_mod=lambda b, h, q, kv: q >= kv, name="roles_causal")

# kernel kind -> (BatchAttention kernel=, GQA group, q_lens, kv_lens, the tiles' kernel and
# whether its decode tiles split KV tiles between warps)
KINDS = {
    "fa2-prefill": ("fa2", 4, [300, 1, 77], [300, 2000, 900], "fa2", False),
    "decode": ("fa2", 8, [1] * 9, [1, 16, 17, 300, 4000, 12000, 5, 64, 2048], "fa2", True),
    "fa3-prefill": ("fa3", 4, [512, 129, 1], [4000, 129, 3000], "fa3", False),
}


def _cache(kv_lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A random NHD cache with shuffled page ids (unused pages between) and the plan arrays."""
    n_pages = [-(-n // PAGE) for n in kv_lens]
    total = sum(n_pages)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (2 * total + 5, PAGE, HKV, D)
    k = torch.randn(*shape, generator=gen, device="cuda").bfloat16()
    v = torch.randn(*shape, generator=gen, device="cuda").bfloat16()
    ids = torch.randperm(shape[0], generator=torch.Generator().manual_seed(seed))[:total]
    indptr = torch.tensor([0] + list(itertools.accumulate(n_pages)))
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, n_pages)])
    return k, v, dict(kv_indptr=indptr, kv_indices=ids, last=last)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo: torch.Tensor,
               arrays: dict[str, Any], variant: Any, scale: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    return batch_attention_reference(q, (k, v), qo, arrays["kv_indptr"], arrays["kv_indices"],
                                     arrays["last"], kv_layout="NHD", page_size=PAGE,
                                     variant=variant, scale=scale)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("kind", KINDS)
def test_each_kernel_kind_writes_exactly_the_planned_rows(kind: str) -> None:
    """q, out and lse are static buffers with 40 rows past the plan: the planned rows match the
    reference (out and lse), the rows past them keep their NaN poison, and the tiles are the
    kind's (so its launch-argument builder ran)."""
    kernel, g, q_lens, kv_lens, tiles_kernel, split_kv = KINDS[kind]
    if tiles_kernel == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FA3 batch kernel needs an sm_90 GPU")
    k, v, arrays = _cache(kv_lens, seed=len(kind))
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
    n = int(qo[-1])
    gen = torch.Generator(device="cuda").manual_seed(7 + len(kind))
    q = torch.randn(n + 40, HKV * g, D, generator=gen, device="cuda").bfloat16()
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    ba = BatchAttention(CAUSAL, kv_layout="NHD", kernel=kernel)
    ba.plan(qo, arrays["kv_indptr"], arrays["kv_indices"], arrays["last"],
            num_qo_heads=HKV * g, num_kv_heads=HKV, head_dim=D, page_size=PAGE)
    assert ba.tiles is not None and ba.tiles.kernel == tiles_kernel
    assert (ba.tiles.kv_warps > 1) == split_kv
    got = ba.run(q, (k, v), out=out, lse=lse)
    torch.cuda.synchronize()
    assert got is out
    ref, ref_lse = _reference(q[:n], k, v, qo, arrays, CAUSAL)
    assert not torch.isnan(out[:n]).any() and _rel(out[:n], ref) < 2e-2
    assert ref_lse is not None
    assert (lse[:n].double() - ref_lse).abs().max().item() < 2e-2
    assert torch.isnan(out[n:]).all() and torch.isnan(lse[n:]).all()


def test_explicit_scale_and_returned_lse() -> None:
    """scale= reaches the kernel's sm_scale (FA2 batch); return_lse makes the lse."""
    k, v, arrays = _cache([700, 33], seed=3)
    qo = torch.tensor([0, 200, 201])
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(201, HKV * 2, D, generator=gen, device="cuda").bfloat16()
    ba = BatchAttention(None, kv_layout="NHD", kernel="fa2")
    ba.plan(qo, arrays["kv_indptr"], arrays["kv_indices"], arrays["last"],
            num_qo_heads=HKV * 2, num_kv_heads=HKV, head_dim=D, page_size=PAGE)
    scale = 0.3 / math.sqrt(D)
    out, lse = ba.run(q, (k, v), return_lse=True, scale=scale)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, k, v, qo, arrays, None, scale=scale)
    assert _rel(out, ref) < 2e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-2
    default, _ = _reference(q, k, v, qo, arrays, None)
    assert _rel(out, default) > 5e-2  # (the scale made a difference the check can see)


def test_plans_uploaded_on_two_streams_in_turn() -> None:
    """plan() copies its words on the current stream; switching streams between plans waits
    for the last plan's copies first, so each run (on the plan's stream) reads its own plan."""
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    ba = BatchAttention(CAUSAL, kv_layout="NHD", kernel="fa2")
    batches = [([1] * 4, [900, 17, 3000, 64]), ([40, 1], [400, 5000]), ([1] * 6, [2] * 6),
               ([300], [300])]
    for i, (q_lens, kv_lens) in enumerate(batches):
        k, v, arrays = _cache(kv_lens, seed=20 + i)
        qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
        gen = torch.Generator(device="cuda").manual_seed(30 + i)
        q = torch.randn(int(qo[-1]), HKV * 4, D, generator=gen, device="cuda").bfloat16()
        torch.cuda.synchronize()
        with torch.cuda.stream(streams[i % 2]):
            ba.plan(qo, arrays["kv_indptr"], arrays["kv_indices"], arrays["last"],
                    num_qo_heads=HKV * 4, num_kv_heads=HKV, head_dim=D, page_size=PAGE)
            out = ba.run(q, (k, v))
        torch.cuda.synchronize()
        ref, _ = _reference(q, k, v, qo, arrays, CAUSAL)
        assert not torch.isnan(out).any() and _rel(out, ref) < 2e-2, i


def test_own_workspace_grows_until_a_graph_captures_it() -> None:
    """The workspace BatchAttention allocates grows when a later plan's layout needs more (a
    decode plan, then a prefill plan); once a CUDA graph has captured run() with it, a plan that
    needs more -- a prefill plan after a decode capture, whose tiles the captured kernel does
    not have either -- raises before anything is uploaded (runtime/serving/capture.py)."""
    ba = BatchAttention(CAUSAL, kv_layout="NHD", kernel="fa2")
    small, large = ([1] * 4, [900, 17, 3000, 64]), ([40, 1], [400, 5000])
    for q_lens, kv_lens in (small, large, small):
        k, v, arrays = _cache(kv_lens, seed=50)
        qo = torch.tensor([0] + list(itertools.accumulate(q_lens)))
        q = torch.randn(int(qo[-1]), HKV * 4, D, device="cuda").bfloat16()
        ba.plan(qo, arrays["kv_indptr"], arrays["kv_indices"], arrays["last"],
                num_qo_heads=HKV * 4, num_kv_heads=HKV, head_dim=D, page_size=PAGE)
        out = ba.run(q, (k, v))
        ref, _ = _reference(q, k, v, qo, arrays, CAUSAL)
        assert not torch.isnan(out).any() and _rel(out, ref) < 2e-2
    torch.cuda.synchronize()

    fresh = BatchAttention(CAUSAL, kv_layout="NHD", kernel="fa2")
    k, v, arrays = _cache(small[1], seed=51)
    qo = torch.tensor([0] + list(itertools.accumulate(small[0])))
    q = torch.randn(int(qo[-1]), HKV * 4, D, device="cuda").bfloat16()
    kw = dict(num_qo_heads=HKV * 4, num_kv_heads=HKV, head_dim=D, page_size=PAGE)
    fresh.plan(qo, arrays["kv_indptr"], arrays["kv_indices"], arrays["last"], **kw)
    fresh.run(q, (k, v))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fresh.run(q, (k, v))
    k, v, arrays = _cache(large[1], seed=52)
    qo = torch.tensor([0] + list(itertools.accumulate(large[0])))
    with pytest.raises(ValueError, match="CUDA graph captured run.*tiles / form"):
        fresh.plan(qo, arrays["kv_indptr"], arrays["kv_indices"], arrays["last"], **kw)
