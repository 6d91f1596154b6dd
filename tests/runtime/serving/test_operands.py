"""runtime/serving/operands.py: run()'s checks of q, the KV cache, out and lse against the plan,
each raising a ValueError naming the argument (CPU tensors on a CPU plan; tests/gpu/test_batch.py
test_invalid_input_raises_before_launch pins them through run())."""
from __future__ import annotations

import pytest
import torch

from attncc.runtime.serving.operands import (PlannedShape, cache_views, check_kv_dtype, check_lse,
                                             check_out, check_q)

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _shape(layout: str, max_page: int = 3) -> PlannedShape:
    return PlannedShape(layout, CPU, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                        max_page=max_page)


def _cache(layout: str, pages: int = 3) -> torch.Tensor:
    dims = {"NHD": (pages, 16, 2, 64), "HND": (pages, 2, 16, 64), "ragged": (pages, 2, 64)}
    return torch.zeros(dims[layout], dtype=BF16)


@pytest.mark.parametrize("layout,want", [("NHD", (2048, 128, 64)), ("HND", (2048, 64, 1024)),
                                         ("ragged", (128, 128, 64))])
def test_cache_views_strides(layout: str, want: tuple) -> None:
    """(page, slot, head) strides in elements: HND swaps slot and head, a ragged cache's token
    is both its page and its slot; a longer cache than the plan needs is fine."""
    k = _cache(layout, pages=5)
    got_k, got_v, strides = cache_views((k, k.clone()), _shape(layout))
    assert got_k is k and strides == want


def test_one_tensor_cache_is_split_into_k_and_v() -> None:
    kv = torch.zeros(3, 2, 16, 2, 64, dtype=BF16)
    k, v, strides = cache_views(kv, _shape("NHD"))
    assert k.data_ptr() == kv.data_ptr() and v.data_ptr() == kv[:, 1].data_ptr()
    assert strides == (kv.stride(0), kv.stride(2), kv.stride(3))
    with pytest.raises(ValueError, match="kv_cache must be"):  # ragged takes no one tensor
        cache_views(torch.zeros(3, 2, 2, 64, dtype=BF16), _shape("ragged"))


@pytest.mark.parametrize("make,match", [
    (lambda k: torch.zeros(3, 3, 16, 2, 64, dtype=BF16), r"as one tensor must be \[num_pages, 2"),
    (lambda k: [k], "kv_cache must be"),
    (lambda k: (k, "v"), "v_cache must be a tensor on cpu"),
    (lambda k: (k[:2], k), r"k_cache has shape \(2, 16, 2, 64\); the plan needs \[>=3, 16, 2, "
                           r"64\] \(NHD layout"),
    (lambda k: (k, k[..., :32]), "v_cache has shape"),
    (lambda k: (k, torch.zeros(3, 16, 2, 64, 2, dtype=BF16)[..., 0]), "v_cache needs a contiguous"),
    (lambda k: (k, torch.zeros(3, 16, 2, 65, dtype=BF16)[..., 1:]), "v_cache needs a contiguous"),
    (lambda k: (k, torch.zeros(3, 16, 4, 64, dtype=BF16)[:, :, ::2]), "same strides"),
])
def test_bad_caches_raise_naming_the_argument(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cache_views(make(_cache("NHD")), _shape("NHD"))


def test_q_checks() -> None:
    s = _shape("NHD")
    check_q(torch.zeros(7, 8, 64, dtype=BF16), 5, s)         # more rows than planned: fine
    check_q(torch.zeros(5, 8, 64, dtype=torch.float16), 5, s)
    bad = [torch.zeros(4, 8, 64, dtype=BF16), torch.zeros(5, 4, 64, dtype=BF16),
           torch.zeros(5, 8, 64, dtype=torch.float32), torch.zeros(5, 64, 8, dtype=BF16).mT,
           torch.zeros(5, 8, 65, dtype=BF16)[..., 1:], "q"]
    for q in bad:
        with pytest.raises(ValueError, match=r"q must be a bf16/fp16 CUDA tensor \[5, 8, 64\]"):
            check_q(q, 5, s)


def test_kv_dtype_must_be_qs() -> None:
    q = torch.zeros(5, 8, 64, dtype=BF16)
    check_kv_dtype(q, _cache("NHD"), _cache("NHD"))
    with pytest.raises(ValueError, match="kv_cache dtype torch.float16 != q dtype torch.bfloat16"):
        check_kv_dtype(q, _cache("NHD").half(), _cache("NHD"))
    with pytest.raises(ValueError, match="kv_cache dtype"):
        check_kv_dtype(q, _cache("NHD"), _cache("NHD").half())


def test_out_and_lse() -> None:
    q = torch.zeros(5, 8, 64, dtype=BF16)
    out = check_out(None, q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    given = torch.empty_like(q)
    assert check_out(given, q) is given
    for bad in (torch.empty(5, 8, 64), torch.empty(4, 8, 64, dtype=BF16),
                torch.empty(5, 8, 128, dtype=BF16)[..., ::2]):
        with pytest.raises(ValueError, match=r"out must be a \(5, 8, 64\) torch.bfloat16 tensor"):
            check_out(bad, q)
    assert check_lse(None, False, q, CPU) is None
    made = check_lse(None, True, q, CPU)
    assert made is not None and made.shape == (5, 8) and made.dtype == torch.float32
    lse = torch.empty(5, 8)
    assert check_lse(lse, False, q, CPU) is lse
    for bad in (torch.empty(5, 8, dtype=torch.float64), torch.empty(8, 5).T, torch.empty(5, 7)):
        with pytest.raises(ValueError, match=r"lse must be a \(5, 8\) float32 tensor"):
            check_lse(bad, True, q, CPU)
