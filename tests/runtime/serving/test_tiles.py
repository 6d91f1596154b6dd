"""runtime/serving/tiles.py: the rules that pick a batch's kernel and tiles and the plan config
that follows from them (CPU, pure)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attncc.runtime.serving.plan import planner, scheduler
from attncc.runtime.serving.tiles import (BatchTiles, batch_tiles, choose_batch_tiles, fa3_mode,
                                          keep_captured_tiles, plan_config, plan_layout)

FA2_DECODE = choose_batch_tiles(128, 8, 132)
FA2_PREFILL = choose_batch_tiles(128, 4096, 132)
FA3 = choose_batch_tiles(128, 4096, 132, fa3="on")


@pytest.mark.parametrize("current,new,fa3,kept", [
    (None, FA2_DECODE, "off", False),            # nothing captured yet
    (FA2_PREFILL, FA2_DECODE, "off", True),      # a decode step fits the prefill tiles
    (FA2_DECODE, FA2_PREFILL, "off", False),     # a prefill does not fit decode tiles
    (FA2_PREFILL, dataclasses.replace(FA2_PREFILL, num_ctas=7), "off", False),  # same rows
    (FA3, FA2_DECODE, "off", False),             # FA3 tiles are not kept where FA3 cannot run
    (FA3, FA2_DECODE, "auto", True),             # ... and are where it can
    (FA2_PREFILL, FA3, "auto", False),           # equal rows: the new kernel
])
def test_keep_captured_tiles(current: BatchTiles | None, new: BatchTiles, fa3: str,
                             kept: bool) -> None:
    """A captured kernel's tiles stay while the new batch fits them (so a CUDA graph keeps
    replaying one kernel), never an FA3 kernel for a batch FA3 cannot run."""
    got = keep_captured_tiles(current, new, fa3)
    assert got is (current if kept else new)


PAIR = choose_batch_tiles(128, 64, 132, fa3="auto", pair=True)


@pytest.mark.parametrize("rows,fa3,pair,want", [
    (64, "auto", True, ("fa3", 64)), (17, "auto", True, ("fa3", 64)),
    (16, "auto", True, ("fa2", 16)),      # decode rows keep FA2's decode tiles
    (65, "auto", True, ("fa2", 128)),     # under 128 rows and over 64: FA2's prefill tiles
    (128, "auto", True, ("fa3", 128)),
    (64, "auto", False, ("fa2", 64)),     # a variant with q/k/v mods has no pair form
    (64, "off", True, ("fa2", 64)), (32, "on", True, ("fa3", 64)), (8, "on", True, ("fa3", 128)),
])
def test_the_pair_form_runs_17_to_64_fused_rows(rows: int, fa3: str, pair: bool,
                                                 want: tuple) -> None:
    t = choose_batch_tiles(128, rows, 132, fa3=fa3, pair=pair)
    assert (t.kernel, t.tq) == want
    if t.tq == 64 and t.kernel == "fa3":
        assert t.stages % 2 == 0 and (t.tkv, t.ctas_per_sm, t.num_ctas) == (64, 1, 132)


def test_tree_masks_take_fa3_only_in_the_pair_form() -> None:
    """Only FA2 and the pair form read tree masks: a tree plan of 128 rows runs FA2 (or raises
    with kernel='fa3'), and a 128-row FA3 kernel is not kept for a tree plan."""
    assert choose_batch_tiles(128, 64, 132, fa3="auto", pair=True, tree=True) == PAIR
    assert choose_batch_tiles(128, 128, 132, fa3="auto", pair=True, tree=True).kernel == "fa2"
    with pytest.raises(ValueError, match=r"kernel='fa3'\) with a tree mask: .* pair form"):
        choose_batch_tiles(128, 128, 132, fa3="on", pair=True, tree=True)
    with pytest.raises(ValueError, match="no query/key/value mods"):
        choose_batch_tiles(128, 64, 132, fa3="on", pair=False, tree=True)
    assert keep_captured_tiles(FA3, PAIR, "auto") is FA3
    assert keep_captured_tiles(FA3, PAIR, "auto", tree=True) is PAIR
    assert keep_captured_tiles(PAIR, FA2_DECODE, "auto", tree=True) is PAIR


@pytest.mark.parametrize("kernel,forced,why,want", [
    (None, None, None, "auto"), (None, None, "sm_90", "off"), (None, (64, 64, 2), None, "off"),
    ("fa2", None, None, "off"), ("fa3", None, None, "on"), ("fa3", (64, 64, 2), None, "on"),
])
def test_fa3_mode(kernel: str | None, forced: tuple | None, why: str | None, want: str) -> None:
    assert fa3_mode(kernel, forced, why) == want


def test_fa3_mode_forced_where_it_cannot_run_says_why() -> None:
    with pytest.raises(ValueError, match=r"BatchAttention\(kernel='fa3'\) needs an sm_90 GPU; "
                                         r"use kernel=None or 'fa2'"):
        fa3_mode("fa3", None, "an sm_90 GPU")


def test_batch_tiles_is_choose_batch_tiles_memoised() -> None:
    for args in ((128, 8, 132, None, "off"), (64, 300, 80, (32, 32, 2), "off"),
                 (128, 4096, 132, None, "auto")):
        assert batch_tiles(*args) == choose_batch_tiles(*args)
        assert batch_tiles(*args) is batch_tiles(*args)


def test_plan_layout_is_one_object_per_shape() -> None:
    """plan() stages into a buffer it resizes only when the layout object changes: equal
    arguments must give the identical layout."""
    a = plan_layout(8, 64, 16, 8, 2, 16)
    assert a is plan_layout(8, 64, 16, 8, 2, 16)
    assert a == scheduler.PlanLayout(8, 64, 16, 8, 2, 16)
    assert plan_layout(9, 64, 16, 8, 2, 16) is not a


def _config(tiles: BatchTiles, lq: list[int], kv: list[int], **kw: object):
    qo = np.concatenate([[0], np.cumsum(lq)])
    args = dict(num_qo_heads=8, num_kv_heads=2, max_batch=16, max_qo_tokens=4096,
                balance=True, min_kv_chunk=None, compiled=False)
    return plan_config(tiles, qo, np.array(kv), **{**args, **kw})


def test_balanced_config_keeps_the_grid_and_floors_chunks() -> None:
    cfg = _config(FA2_DECODE, [1, 1, 1], [900, 40, 7])
    assert cfg.tiles is FA2_DECODE and cfg.problem is None
    assert cfg.kwargs == dict(kv_chunk_align=FA2_DECODE.tkv, min_kv_chunk=128, head_span=True)
    assert cfg.layout is plan_layout(16, 4096, FA2_DECODE.num_ctas, 8, 2, FA2_DECODE.tq)
    assert _config(FA2_DECODE, [1], [9], min_kv_chunk=48).kwargs["min_kv_chunk"] == 48


def test_fa3_units_run_one_kv_head() -> None:
    assert _config(FA3, [300], [300]).kwargs["head_span"] is False


@pytest.mark.parametrize("tiles", [FA2_DECODE, FA2_PREFILL, FA3])
def test_unbalanced_config_is_one_cta_per_work_item(tiles: BatchTiles) -> None:
    """balance=False: one CTA per (request, KV head, query tile) -- counted here request by
    request -- each with its request's whole KV range (the floor is the longest KV length)."""
    lq, kv = [1, 300, 17, 0], [50, 300, 900, 3]
    cfg = _config(tiles, lq, kv, balance=False)
    group = 8 // 2
    items = sum(2 * -(-n * group // tiles.tq) for n in lq)
    assert cfg.tiles == dataclasses.replace(tiles, num_ctas=items)
    assert cfg.kwargs["min_kv_chunk"] == 900 and cfg.layout.max_ctas == items
    empty = _config(tiles, [0], [0], balance=False)
    assert empty.tiles.num_ctas == 1 and empty.kwargs["min_kv_chunk"] == 1


def test_compiled_config_carries_the_planners_arguments() -> None:
    if not planner.available():
        pytest.skip("no C compiler to build the planner")
    cfg = _config(FA2_PREFILL, [300, 20], [300, 900], compiled=True)
    assert cfg.problem is not None
    assert cfg.layout is _config(FA2_PREFILL, [300, 20], [300, 900]).layout
    with pytest.raises(ValueError):  # scheduler.plan's own checks, before the planner runs
        _config(dataclasses.replace(FA2_PREFILL, num_ctas=0), [3], [3], compiled=True)


@pytest.mark.parametrize("fused_rows,half", [(1, False), (4, False), (8, True), (16, False),
                                             (64, False)])
def test_half_rows_form_is_planned_for_eight_fused_rows(fused_rows: int, half: bool) -> None:
    """Decode batches whose longest request fuses exactly 8 rows (one token of a GQA group of
    8, or 2 tokens of a group of 4) get the 8-row form; MHA (1 row), GQA-4 and multi-token
    tiles keep the plain decode form, so their kernels are unchanged; forced tiles never
    get it."""
    assert choose_batch_tiles(128, fused_rows, 132).half_rows is half
    assert not choose_batch_tiles(128, fused_rows, 132, force=(16, 32, 2, 2)).half_rows


def test_a_captured_graph_keeps_its_decode_form() -> None:
    """The 8-row form and the plain decode form run any decode batch: a graph captured with
    either keeps replaying when a step's longest request changes between 8 and other rows."""
    from attncc.runtime.serving.tiles import keep_captured_depth

    half, plain = choose_batch_tiles(128, 8, 132), choose_batch_tiles(128, 16, 132)
    assert half.half_rows and not plain.half_rows
    assert keep_captured_depth(half, plain) is half and keep_captured_depth(plain, half) is plain


def test_half_rows_is_a_decode_form() -> None:
    from attncc.codegen.tiles import KernelTiles
    from attncc.errors import CodegenError

    assert KernelTiles(16, 32, 2, 1, 2, half_rows=True).suffix.endswith("_w2_h8")
    with pytest.raises(CodegenError, match="kv_warps"):
        KernelTiles(64, 64, 2, 1, 1, half_rows=True)
