"""runtime/serving/launch.py: the BatchParams each batch kernel kind gets, and the workspace
pointers a CUDA graph's kernels keep across plans (CPU: CPU tensors stand in for the operands;
the launches themselves are pinned by tests/gpu/test_batch.py and test_serving_roles_gpu.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attncc.codegen.layout import BATCH_PARAMS
from attncc.runtime.jit.launcher import StructPacker
from attncc.runtime.serving import launch
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.serving.plan import scheduler



def _member_names() -> set[str]:
    return set(StructPacker(BATCH_PARAMS).names)


def _operands(tokens: int = 6, hq: int = 4, hkv: int = 2, d: int = 64, pages: int = 5,
              page: int = 16) -> tuple:
    q = torch.zeros(tokens, hq, d, dtype=torch.bfloat16)
    k = torch.zeros(pages, page, hkv, d, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    lse = torch.zeros(tokens, hq, dtype=torch.float32)
    return q, k, k.clone(), out, lse


def test_workspace_pointers_follow_the_word_map() -> None:
    """Plan and tables at their word offsets; the fp32 partial O right after the int words and
    the LSEs 256-byte aligned after every slot's O; all inside workspace_bytes."""
    lay = scheduler.PlanLayout(16, 512, 40, 8, 2, 32)
    o = {"qo_indptr": lay.size, "kv_page_indptr": lay.size + 20, "kv_lens": lay.size + 40,
         "kv_pos": lay.size + 60, "q_pos": lay.size + 80, "pages": lay.size + 600}
    words, base, d = lay.size + 900, 1 << 20, 128
    p = launch.workspace_pointers(base, words, lay, o, head_dim=d, q_positions=True,
                                  kv_positions=True)
    assert p["plan"] == base + 4 * lay.offsets["header"]
    for member, table in (("qo_indptr", "qo_indptr"), ("kv_page_indptr", "kv_page_indptr"),
                          ("kv_lens", "kv_lens"), ("kv_page_indices", "pages"),
                          ("kv_pos_offset", "kv_pos"), ("q_positions", "q_pos")):
        assert p[member] == base + 4 * o[table], member
    rows = lay.max_partial_slots * lay.tile_q
    assert p["partial_o"] == base + 4 * words
    lse_at = p["partial_lse"] - p["partial_o"]
    assert lse_at >= rows * d * 4 and lse_at % 256 == 0 and lse_at - rows * d * 4 < 256
    total = 4 * words + scheduler.workspace_bytes(lay, d, 8, 4)
    assert p["partial_lse"] + 4 * rows <= base + total
    none = launch.workspace_pointers(base, words, lay, o, head_dim=d, q_positions=False,
                                     kv_positions=False)
    assert none["q_positions"] == none["kv_pos_offset"] == 0
    assert {k: v for k, v in none.items() if v} == {k: v for k, v in p.items()
                                                     if k not in ("q_positions", "kv_pos_offset")}


@pytest.mark.parametrize("build", [launch.fa2_batch_args, launch.decode_args])
def test_fa2_and_decode_args_fill_every_batch_params_member(build) -> None:
    """Every BatchParams member, no other key (the packer's fast path), the operands' pointers
    and strides, the cache strides as given, null LSE without one, and no tensor maps."""
    q, k, v, out, lse = _operands()
    lay = scheduler.PlanLayout(4, 64, 2, 4, 2, 16)
    ptrs = launch.workspace_pointers(4096, lay.size + 100, lay, dict.fromkeys(
        ("qo_indptr", "kv_page_indptr", "kv_lens", "kv_pos", "q_pos", "pages"), lay.size),
        head_dim=64, q_positions=False, kv_positions=False)
    args = build(ptrs, q, k, v, out, lse, (2048, 128, 64), num_kv_heads=2, page_size=16,
                 page_shift=4, sm_scale=0.125)
    assert set(args) == _member_names()
    assert StructPacker(BATCH_PARAMS).flatten(args)
    assert (args["q"], args["k"], args["v"], args["o"], args["lse"]) == tuple(
        t.data_ptr() for t in (q, k, v, out, lse))
    assert (args["q_stride_tok"], args["q_stride_h"], args["o_stride_tok"],
            args["o_stride_h"], args["lse_stride_tok"]) == (256, 64, 256, 64, 4)
    assert (args["kv_stride_page"], args["kv_stride_slot"], args["kv_stride_h"]) == (2048, 128,
                                                                                      64)
    assert (args["num_q_heads"], args["num_kv_heads"], args["page_size"], args["page_shift"],
            args["sm_scale"], args["tma"]) == (4, 2, 16, 4, 0.125, 0)
    assert all(args[k] == v for k, v in ptrs.items())
    no_lse = build(ptrs, q, k, v, out, None, (2048, 128, 64), num_kv_heads=2, page_size=16,
                   page_shift=4, sm_scale=0.125)
    assert no_lse["lse"] == no_lse["lse_stride_tok"] == 0


def test_merge_grid_is_at_most_one_cta_per_sm() -> None:
    lay = scheduler.PlanLayout(16, 512, 40, 8, 2, 32)
    assert lay.max_merges > 0
    assert launch.merge_grid(lay, 1 << 20) == lay.max_merges
    assert launch.merge_grid(lay, 3) == 3


def _planned(batches: list[tuple]) -> tuple[BatchAttention, list[dict]]:
    """A CPU BatchAttention planned with each batch in turn, and its launch arguments after
    each (a workspace allocated at the first, as on CUDA)."""
    ba = BatchAttention(None, kv_layout="NHD", device="cpu", max_batch=8, max_qo_tokens=512,
                        max_pages=64)
    q, k, v, out, lse = _operands(tokens=300, hq=8, hkv=2, d=128, pages=64)
    got = []
    for qo, kvp, last in batches:
        ba.plan(qo, kvp, list(range(kvp[-1])), last, num_qo_heads=8, num_kv_heads=2,
                head_dim=128, page_size=16)
        if ba.workspace is None:
            ba.workspace = torch.empty(ba.workspace_bytes(), dtype=torch.uint8)
        got.append(ba._launch_args(q, k, v, out, lse, (k.stride(0), k.stride(1), k.stride(2)),
                                   None))
    return ba, got


def test_run_args_keep_every_address_across_plans() -> None:
    """A captured graph replays run()'s arguments: after a prefill plan, decode and mixed plans
    that keep its tiles give the kernel the same workspace pointers, so the replay reads each
    new plan (and the default scale is 1/sqrt(D))."""
    prefill = ([0, 300], [0, 20], [12])
    decode = ([0, 1, 2, 3], [0, 5, 9, 30], [3, 16, 1])
    mixed = ([0, 1, 40, 41], [0, 5, 9, 30], [3, 16, 1])
    ba, got = _planned([prefill, decode, mixed, prefill])
    assert ba.tiles is not None and ba.tiles.tq == 128
    pointer_keys = set(launch.workspace_pointers(0, 0, ba.layout, ba._offsets, head_dim=128,
                                                 q_positions=True, kv_positions=True))
    first = {k: got[0][k] for k in pointer_keys}
    for args in got[1:]:
        assert {k: args[k] for k in pointer_keys} == first
    base = ba.workspace.data_ptr()
    assert first["plan"] == base and first["kv_page_indices"] == base + 4 * ba._offsets["pages"]
    assert got[0]["sm_scale"] == pytest.approx(1 / math.sqrt(128))
    assert np.all([a["tma"] == 0 for a in got])
