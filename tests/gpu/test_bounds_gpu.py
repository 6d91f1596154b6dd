"""Issue 27, finding 4 on the GPU: captured-tensor reads never leave their tensor.

A read that can leave its tensor only at masked positions runs clamped (same result as the fp64
reference, which accepts it like torch); one that leaves it at a kept position is an error before
any launch, naming the hook's line; one the analysis cannot decide runs clamped, and with
ATTNCC_CHECK_BOUNDS=1 the kernel reports the first violation after the launch. The NVRTC checks
that the clamped kernels stay spill-free are in tests/runtime/flex/test_kernel_spills.py and
tests/runtime/serving/test_kernel_spills.py.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import attncc
from attncc.ir.analysis import CapturedReadError, Shapes
from attncc.runtime.flex import gpu_flex
from attncc.runtime.reference import attention_reference
from attncc.gym import causal

FA2 = {"KERNEL": "fa2"}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _distance_bias(table: torch.Tensor) -> Any:
    def distance_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx]

    return distance_bias


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernel_options", [None, FA2], ids=["default", "fa2"])
@pytest.mark.parametrize("S", [300, 1024])
def test_short_table_under_causal_runs_clamped_and_matches_reference(S: int,
                                                                    kernel_options: Any) -> None:
    """table[h, q_idx - kv_idx] with S entries per head: past its end only where causal masks."""
    g = torch.Generator(device="cuda").manual_seed(S)
    B, H, D = 2, 4, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    table = torch.randn(H, S, device="cuda", generator=g)
    var = attncc.Variant(score_mod=_distance_bias(table), mask_mod=causal)
    out = torch.full_like(q, float("nan"))
    gpu_out, _ = gpu_flex.gpu_flex_attention(q, k, v, var.trace()[0], var.trace()[1], out=out,
                                             kernel_options=kernel_options)
    torch.cuda.synchronize()
    ir, bind = var.trace()
    ref, _ = attention_reference(q, k, v, ir, bind)
    assert _rel(gpu_out, ref) < 2e-2
    via_api = attncc.flex_attention(q, k, v, score_mod=var, kernel_options=kernel_options)
    assert _rel(via_api, ref) < 2e-2


@pytest.mark.gpu
def test_short_table_without_mask_is_an_error_before_launch() -> None:
    S, H, D = 256, 2, 64
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    table = torch.randn(H, S, device="cuda")
    out = torch.full_like(q, 7.0)
    ir, bind = attncc.Variant(score_mod=_distance_bias(table)).trace()
    with pytest.raises(CapturedReadError, match=r"test_bounds_gpu.py:\d+ \(distance_bias\): "
                       r"score_mod reads table\[h, q_idx - kv_idx\]"):
        gpu_flex.gpu_flex_attention(q, k, v, ir, bind, out=out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())  # nothing was launched


def _indirect(S: int, bad_row: int | None, device: str = "cuda") -> attncc.Variant:
    """tbl[pos[q_idx] - kv_idx] under causal: reads the analysis cannot decide (pos is data).
    pos is the identity, or sends `bad_row` S past the table's end at kept positions."""
    pos = torch.arange(S, device=device)
    if bad_row is not None:
        pos[bad_row] += S
    tbl = torch.randn(S, device=device)

    def indirect_bias(score, b, h, q_idx, kv_idx):
        return score + tbl[pos[q_idx] - kv_idx]

    return attncc.Variant(score_mod=indirect_bias, mask_mod=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_options", [None, FA2], ids=["default", "fa2"])
def test_undecided_reads_run_clamped(kernel_options: Any, monkeypatch) -> None:
    """Undecided reads run clamped: with every kept read inside, the result is the reference's;
    with some outside, the kernel still reads only inside the tensor and computes exactly the
    clamped variant (its reference), and nothing is raised without the checked mode."""
    from attncc.runtime.flex.api import _trace

    monkeypatch.delenv("ATTNCC_CHECK_BOUNDS", raising=False)
    S, H, D = 384, 2, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    good = _indirect(S, None)
    out = attncc.flex_attention(q, k, v, score_mod=good, kernel_options=kernel_options)
    ref, _ = attention_reference(q, k, v, *good.trace())
    assert _rel(out, ref) < 2e-2
    bad = _indirect(S, 200)
    out = attncc.flex_attention(q, k, v, score_mod=bad, kernel_options=kernel_options)
    torch.cuda.synchronize()
    ir, bind = _trace(bad)
    clamped, sizes = gpu_flex._clamped(ir, Shapes(1, H, H, S, S, D, D), bind.tensors,
                                       bind.scalars)
    from attncc.ir.program import Bindings

    ref, _ = attention_reference(q, k, v, clamped, Bindings({**bind.scalars, **sizes},
                                                            bind.tensors))
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
def test_checked_mode_reports_a_kept_violation_naming_the_line(monkeypatch) -> None:
    monkeypatch.setenv("ATTNCC_CHECK_BOUNDS", "1")
    S, H, D = 384, 2, 128
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.full_like(q, 7.0)
    ir, bind = _indirect(S, 200).trace()
    with pytest.raises(CapturedReadError, match=r"test_bounds_gpu.py:\d+ \(indirect_bias\): "
                       r"score_mod reads tbl\[pos\[q_idx\] - kv_idx\] = tbl\[584\] at "
                       r"\(b=0, h=0, q_idx=200, kv_idx=0\)"):
        gpu_flex.gpu_flex_attention(q, k, v, ir, bind, out=out)
    torch.cuda.synchronize()
    assert bool((out == 7.0).all())  # reported before the launch
    ok_ir, ok_bind = _indirect(S, None).trace()
    gpu_flex.gpu_flex_attention(q, k, v, ok_ir, ok_bind, out=out)  # checked, and fine
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, ok_ir, ok_bind)
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_serving_short_table_under_causal_runs_clamped(kernel: str) -> None:
    """BatchAttention with table[h, q_idx - kv_idx] as long as the longest request: past its
    start only above the diagonal (masked); clamped, equal to the fp64 batch reference."""
    import itertools

    from attncc.runtime.reference import batch_attention_reference
    from attncc.runtime.serving.batch import BatchAttention

    if kernel == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FA3 batch kernel needs sm_90")
    d, Hkv, g, page = 128, 2, 2, 16
    q_lens, kv_lens = [130, 1, 70], [700, 5, 70]
    qo = torch.tensor([0, *itertools.accumulate(q_lens)])
    n_pages = [-(-n // page) for n in kv_lens]
    kv_indptr = torch.tensor([0, *itertools.accumulate(n_pages)])
    ids = torch.randperm(sum(n_pages) + 3)[:sum(n_pages)]
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, n_pages)])
    q = torch.randn(int(qo[-1]), Hkv * g, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(n_pages) + 3, page, Hkv, d, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")
    table = torch.randn(Hkv * g, max(kv_lens), device="cuda")
    variant = attncc.Variant(score_mod=_distance_bias(table), mask_mod=causal)
    ba = BatchAttention(variant, kv_layout="NHD", kernel=kernel)
    ba.plan(qo, kv_indptr, ids, last, num_qo_heads=Hkv * g, num_kv_heads=Hkv, head_dim=d,
            page_size=page)
    out = torch.full_like(q, float("nan"))
    ba.run(q, (k, v), out=out)
    torch.cuda.synchronize()
    ref, _ = batch_attention_reference(q, (k, v), qo, kv_indptr, ids, last, kv_layout="NHD",
                                       page_size=page, variant=variant)
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
def test_head_vector_reads_past_the_head_dim_are_errors_before_launch() -> None:
    """Finding 3 on the GPU: a static index (q[d + 1000]) and a position-dependent one
    (q[(d + q_idx) % 80] at head dim 64) are TraceErrors before anything runs."""
    from attncc.errors import TraceError

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for fn, text in ((lambda q, b, h, qi, d: q[d + 1000], r"q\[d \+ 1000\]"),
                     (lambda q, b, h, qi, d: q[(d + qi) % 80], r"q\[\(d \+ q_idx\) % 80\]")):
        with pytest.raises(TraceError, match=text + r".*\[0, 64\)"):
            attncc.flex_attention(q, k, v, score_mod=attncc.Variant(query_mod=fn))
