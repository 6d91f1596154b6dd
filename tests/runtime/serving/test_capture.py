"""Re-plans after a CUDA graph captured BatchAttention.run, on the CPU (runtime/serving/capture.py;
docs/serving.md, "CUDA graphs and re-plans"): plans the captured kernel and launch arguments run
pass, and every plan that would need another kernel or other arguments raises before it becomes
current. The capture is noted by hand here (`_note_capture`, what run() calls while a stream
captures); tests/gpu/test_batch.py::test_replan_after_capture_* capture and replay on the GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import attncc
from attncc.runtime.serving.batch import BatchAttention


def _plan(ba: BatchAttention, q_lens: list[int], kv_lens: list[int], *, page: int = 16,
          hq: int = 8, hkv: int = 2, d: int = 128, **kw) -> None:
    n = [-(-k // page) for k in kv_lens]
    ba.plan(np.concatenate([[0], np.cumsum(q_lens)]), np.concatenate([[0], np.cumsum(n)]),
            np.arange(sum(n)), np.array([k - (p - 1) * page for k, p in zip(kv_lens, n)]),
            num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, **kw)


def _captured(q_lens: list[int], kv_lens: list[int], variant=None) -> BatchAttention:
    ba = BatchAttention(variant, device="cpu", max_batch=16, max_qo_tokens=256)
    _plan(ba, q_lens, kv_lens)
    ba._note_capture()
    return ba


def test_decode_loop_replans_within_the_capture() -> None:
    """Other batch sizes and KV lengths (decode), and fewer query rows than a captured
    multi-token tile, keep the captured kernel: no error."""
    ba = _captured([1] * 4, [100, 200, 3, 40])
    tiles = ba.tiles
    for q_lens, kv_lens in (([1] * 9, [1000] * 9), ([1], [1]), ([1] * 16, list(range(1, 17)))):
        _plan(ba, q_lens, kv_lens)
        assert ba.tiles is tiles
    multi = _captured([8] * 4, [300] * 4)
    tiles = multi.tiles
    assert tiles is not None and tiles.tq == 32  # 8 tokens x a group of 4
    _plan(multi, [1] * 3, [50, 60, 70])  # 4 fused rows: the captured 32-row tiles take them
    assert multi.tiles is tiles


@pytest.mark.parametrize("change, match", [
    ({"q_lens": [8] * 4}, "tiles / form"),        # multi-token after a decode capture
    ({"q_lens": [200]}, "tiles / form"),          # prefill after a decode capture
    ({"page": 32}, "page_size: captured 16, this plan 32"),
    ({"kv_data_type": torch.float8_e4m3fn}, "kv_data_type: captured None"),
    ({"hq": 4}, r"\(num_qo_heads, num_kv_heads\): captured \(8, 2\), this plan \(4, 2\)"),
    ({"hkv": 4}, "num_kv_heads"),
    ({"d": 64}, r"head_dim_vo\): captured \(128, 128\)"),
])
def test_a_plan_the_capture_cannot_run_raises(change: dict, match: str) -> None:
    """Each plan a captured decode kernel cannot run raises, naming what changed, and leaves
    the last plan current (its tiles, lengths and layout)."""
    ba = _captured([1] * 4, [100, 200, 3, 40])
    before = (ba.tiles, ba.layout, ba.kv_lens.tolist(), ba.page_size, ba.kv_data_type)
    kw = dict(change)
    q_lens = kw.pop("q_lens", [1] * 4)
    with pytest.raises(ValueError, match=f"CUDA graph captured run.*{match}"):
        _plan(ba, q_lens, [300] * len(q_lens), **kw)
    assert (ba.tiles, ba.layout, ba.kv_lens.tolist(), ba.page_size, ba.kv_data_type) == before
    _plan(ba, [1] * 2, [7, 9])  # a compatible plan still plans


def test_without_a_capture_any_plan_goes() -> None:
    ba = BatchAttention(None, device="cpu", max_batch=16, max_qo_tokens=256)
    _plan(ba, [1] * 4, [100] * 4)
    _plan(ba, [200], [300], page=32)
    assert ba.tiles is not None and ba.tiles.tq == 128


def test_a_plan_whose_reads_need_other_clamps_raises() -> None:
    """A variant reading a captured table by kv_idx: the captured plan's positions prove the
    reads in bounds (no clamp in the kernel); a plan with longer requests needs the clamped
    kernel, which the graph does not hold."""
    bias = torch.linspace(0.0, 1.0, 64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    ba = _captured([1] * 2, [40, 64], attncc.Variant(score_mod=score_mod, name="cap_bias"))
    _plan(ba, [1] * 3, [10, 64, 5])  # still within the table
    with pytest.raises(ValueError, match="clamps of the variant's captured-tensor reads"):
        _plan(ba, [1] * 2, [40, 100])


def test_padded_head_dims_keep_their_capture_and_a_new_value_dim_raises() -> None:
    """A plan at a padded head dim (80: the width-128 kernel) re-plans within its capture; a
    new value head dim needs another kernel and raises, naming both dims."""
    ba = BatchAttention(None, device="cpu", max_batch=16, max_qo_tokens=256)
    _plan(ba, [1] * 4, [100, 200, 3, 40], d=80)
    ba._note_capture()
    _plan(ba, [1] * 3, [7, 9, 300], d=80)
    with pytest.raises(ValueError, match=r"head_dim_vo\): captured \(80, 80\), this plan "
                                         r"\(80, 64\)"):
        _plan(ba, [1] * 3, [7, 9, 300], d=80, head_dim_vo=64)


def test_long_requests_take_a_third_stage_and_a_capture_keeps_its_depth() -> None:
    """Decode batches averaging LONG_KV_KEYS keys or more get three-stage tiles, shorter ones
    two; without a capture the depth follows each batch, after one the captured depth stays
    (a decode loop growing past the threshold keeps replaying its graph)."""
    from attncc.runtime.serving.tiles import LONG_KV_KEYS

    ba = BatchAttention(None, device="cpu", max_batch=16, max_qo_tokens=256)
    depth = []
    for kv in (1000, LONG_KV_KEYS, 1000):
        _plan(ba, [1] * 4, [kv] * 4)
        depth.append(ba.tiles.stages)
    assert depth == [2, 3, 2]
    _plan(ba, [1] * 2, [LONG_KV_KEYS * 2 - 100, 100])  # the mean decides
    assert ba.tiles.stages == 3
    short = _captured([1] * 4, [1000] * 4)
    tiles = short.tiles
    _plan(short, [1] * 4, [4 * LONG_KV_KEYS] * 4)
    assert short.tiles is tiles and tiles.stages == 2
    long = _captured([1] * 4, [2 * LONG_KV_KEYS] * 4)
    assert long.tiles.stages == 3
    _plan(long, [1] * 2, [10, 20])
    assert long.tiles.stages == 3 and long.tiles.num_ctas == long.layout.max_ctas
