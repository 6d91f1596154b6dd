"""The GPU backward's host path without a GPU: the memo of loaded backward kernels (hit only
for the very IR object, forgotten with the kernel cache) and the contiguous fast path that
skips `_dense` / `_tma_strided` (it must return what they would)."""
from __future__ import annotations

import pytest
import torch

from attncc.ir.program import VariantIR
from attncc.runtime.flex import backward
from attncc.runtime.jit import kernels


def test_kernel_memo_hits_only_the_same_ir_object() -> None:
    memo = backward._KernelMemo(4)
    made: list[int] = []

    def make(n: int):
        return lambda: made.append(n) or n
    a, b = VariantIR(name="a"), VariantIR(name="a")  # equal, not the same object
    assert memo.get(a, (128,), make(1)) == 1
    assert memo.get(a, (128,), make(2)) == 1  # hit
    assert memo.get(a, (64,), make(3)) == 3  # another form
    assert memo.get(b, (128,), make(4)) == 4  # another object
    assert made == [1, 3, 4]


def test_kernel_memo_forgets_with_the_kernel_cache() -> None:
    memo = backward._KernelMemo(4)
    ir = VariantIR(name="x")
    assert memo.get(ir, (), lambda: "old") == "old"
    kernels.clear_loaded()  # (ab_kernels swaps templates this way)
    assert memo.get(ir, (), lambda: "new") == "new"


def test_kernel_memo_is_bounded() -> None:
    memo = backward._KernelMemo(2)
    irs = [VariantIR(name=str(i)) for i in range(3)]
    for i, ir in enumerate(irs):
        memo.get(ir, (), lambda i=i: i)
    assert memo.get(irs[0], (), lambda: "again") == "again"  # the oldest was evicted


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(2, 3, 5, 64),
    lambda: torch.zeros(1, 3, 5, 64),  # size-1 batch
    lambda: torch.zeros(2, 1, 1, 64),  # size-1 heads and rows
    lambda: torch.zeros(2, 5, 3, 64).transpose(1, 2),  # not contiguous
    lambda: torch.zeros(1, 5, 64).expand(2, 5, 64)[:, None],  # broadcast batch
    lambda: torch.zeros(2 * 3 * 5 * 64 + 1)[1:].view(2, 3, 5, 64),  # misaligned start
    lambda: torch.zeros(2, 64, 1, 64).transpose(1, 2),  # contiguous, odd size-1 stride
])
def test_plain_tensors_are_what_dense_and_tma_strided_return(make) -> None:
    t = make()
    plain = t.stride() == torch.empty(t.shape).stride() and t.data_ptr() % 16 == 0
    assert backward._plain(t) == plain
    if plain:
        assert backward._dense(t) is t and backward._tma_strided(t) is t
