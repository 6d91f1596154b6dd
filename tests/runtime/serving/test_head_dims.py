"""BatchAttention at head dims other than 64/128/256 and with a value head dim other than the
query's (issue 31): plan's head-dim arguments (FlashInfer's head_dim_qk / head_dim_vo), what a
padded plan runs, run()'s operand checks and the cache strides the kernels get, and the fp64
batch reference with Dv != Dqk. The GPU runs are tests/gpu/test_head_dims_gpu.py."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc.gym import GYM
from attncc.errors import InvalidArgument
from attncc.runtime.reference import batch_attention_reference
from attncc.runtime.serving.batch import BatchAttention
from attncc.runtime.serving.cascade import CascadeAttention
from attncc.runtime.serving.operands import (PlannedShape, cache_views, check_out,
                                             plan_head_dims)

ARGS = ([0, 1, 3], [0, 1, 3], [4, 0, 2], [5, 16])


def _plan(ba: BatchAttention, **kw) -> BatchAttention:
    ba.plan(*ARGS, num_qo_heads=8, num_kv_heads=2, page_size=16, **kw)
    return ba


@pytest.mark.parametrize("kw,dims", [(dict(head_dim=128), (128, 128, 128)),
                                     (dict(head_dim_qk=192, head_dim_vo=128), (192, 128, 256)),
                                     (dict(head_dim=80), (80, 80, 128)),
                                     (dict(head_dim=64, head_dim_qk=64, head_dim_vo=128),
                                      (64, 128, 128))])
def test_plan_head_dims(kw: dict, dims: tuple[int, int, int]) -> None:
    assert tuple(plan_head_dims(kw.get("head_dim"), kw.get("head_dim_qk"),
                                kw.get("head_dim_vo"))) == dims
    ba = _plan(BatchAttention(device="cpu"), **kw)
    assert (ba.head_dim, ba.head_dim_vo, ba._width) == dims
    assert ba._padded_plan == (None if dims[:2] == (dims[2], dims[2]) else dims[:2])
    assert ba.tiles.kernel == "fa2"
    # the partial states (split rows) are padded-width fp32 rows
    narrow = _plan(BatchAttention(device="cpu"), head_dim=dims[2])
    assert ba.workspace_bytes() == narrow.workspace_bytes()


@pytest.mark.parametrize("kw,msg", [(dict(), "needs head_dim"),
                                    (dict(head_dim=100), "head_dim 100: the GPU kernels"),
                                    (dict(head_dim_qk=24), "head_dim_qk 24"),
                                    (dict(head_dim=96, head_dim_vo=300), "head_dim_vo 300"),
                                    (dict(head_dim=96, head_dim_qk=80), "disagree"),
                                    (dict(head_dim=96.0), "head_dim")])
def test_plan_refuses_bad_head_dims(kw: dict, msg: str) -> None:
    with pytest.raises((InvalidArgument, TypeError), match=msg):
        _plan(BatchAttention(device="cpu"), **kw)


def test_padded_plans_refuse_what_the_padded_form_does_not_run() -> None:
    with pytest.raises(InvalidArgument, match="kernel='fa3'"):
        _plan(BatchAttention(kernel="fa3", device="cpu"), head_dim=96)
    rope = BatchAttention(GYM["rope"](1, 8, 64, 96), device="cpu")
    with pytest.raises(InvalidArgument, match="query_mod, key_mod"):
        _plan(rope, head_dim=96)
    with pytest.raises(InvalidArgument, match="kv_data_type=torch.float8_e4m3fn"):
        _plan(BatchAttention(device="cpu"), head_dim=96, kv_data_type=torch.float8_e4m3fn)


def test_cache_strides_in_head_rows() -> None:
    """Dv != Dqk: the kernels get the caches' strides in head rows (both caches step alike in
    rows of their own head dims); a V cache laid out otherwise is refused."""
    s = PlannedShape("NHD", torch.device("cpu"), 8, 2, 192, 16, 3, head_dim_vo=128)
    k = torch.zeros(3, 16, 2, 192, dtype=torch.bfloat16)
    v = torch.zeros(3, 16, 2, 128, dtype=torch.bfloat16)
    assert cache_views((k, v), s)[2] == (16 * 2, 2, 1)
    with pytest.raises(ValueError, match=r"v_cache has shape \(3, 16, 2, 192\)"):
        cache_views((k, k), s)
    hnd_v = torch.zeros(3, 2, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match="same strides in rows of their head dims"):
        cache_views((k, hnd_v), s)
    same = PlannedShape("HND", torch.device("cpu"), 8, 2, 80, 16, 3)
    k80 = torch.zeros(3, 2, 16, 80, dtype=torch.bfloat16)
    assert cache_views((k80, k80.clone()), same)[2] == (2 * 16 * 80, 80, 16 * 80)
    q = torch.zeros(5, 8, 192)
    assert check_out(None, q, 128).shape == (5, 8, 128)
    with pytest.raises(ValueError, match=r"out must be a \(5, 8, 128\)"):
        check_out(torch.zeros(5, 8, 192), q, 128)


def test_batch_reference_value_head_dim() -> None:
    """The oracle with Dv != Dqk equals one request's attention written out."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 192, generator=g, dtype=torch.float64)
    k = torch.randn(2, 16, 2, 192, generator=g, dtype=torch.float64)
    v = torch.randn(2, 16, 2, 128, generator=g, dtype=torch.float64)
    out, lse = batch_attention_reference(q, (k, v), [0, 1, 3], [0, 1, 2], [1, 0], [10, 16],
                                         page_size=16)
    assert out.shape == (3, 4, 128)
    kk, vv = k[0, :16].repeat_interleave(2, 1), v[0, :16].repeat_interleave(2, 1)  # request 1
    s = torch.einsum("thd,khd->htk", q[1:], kk) / 192 ** 0.5
    torch.testing.assert_close(out[1:], torch.einsum("htk,khd->thd", s.softmax(-1), vv))
    torch.testing.assert_close(lse[1:], torch.logsumexp(s, -1).T)


def test_cascade_plans_value_head_dims() -> None:
    ca = CascadeAttention(None, device="cpu")
    ca.plan([0, 1, 2], prefix_indices=[7, 8], prefix_last_page_len=16, suffix_indptr=[0, 1, 2],
            suffix_indices=[3, 4], suffix_last_page_len=[5, 16], num_qo_heads=8,
            num_kv_heads=2, head_dim_qk=192, head_dim_vo=128, page_size=16)
    assert (ca.prefix.head_dim_vo, ca.suffix.head_dim_vo, ca.suffix._width) == (128, 128, 256)
