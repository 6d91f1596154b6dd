"""The deterministic mode's exact captured-gradient sums without a GPU: a Python model of
kernels/common/exact_grad.cuh's `exact_grad_add` writes the words, `exact_grad_value` reads
them back; the sums are exact (against math.fsum), independent of the terms' order, and follow
IEEE for non-finite terms; the exact form's codegen and its NVRTC compile (no spills, both
backward templates). docs/backward.md, "Deterministic mode"."""
from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest
import torch

from attncc.codegen.constants import EXACT_GRAD_WORDS
from attncc.runtime.flex.exact_grad import (exact_grad_buffer, exact_grad_strides,
                                            exact_grad_value)

MASK64 = (1 << 64) - 1


def _add(words: list[int], x: float) -> None:
    """exact_grad_add on one element's words (Python ints as the kernel's u64, wrapping)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    e = (bits >> 23) & 0xFF
    if e == 0xFF:
        words[-1] |= 1 if bits & 0x7FFFFF else 4 if bits >> 31 else 2
        return
    m = (bits & 0x7FFFFF) | (0x800000 if e else 0)
    if m == 0:
        return
    p = e - 1 if e else 0
    k = p // 24
    v = m << (p - 24 * k)
    lo, hi = v & 0xFFFFFF, v >> 24
    if bits >> 31:
        lo, hi = (-lo) & MASK64, (-hi) & MASK64
    words[k] = (words[k] + lo) & MASK64
    words[k + 1] = (words[k + 1] + hi) & MASK64


def _read(terms: list[float]) -> float:
    w = [0] * EXACT_GRAD_WORDS
    for x in terms:
        _add(w, x)
    signed = [x - (1 << 64) if x >> 63 else x for x in w]
    return exact_grad_value(torch.tensor([signed], dtype=torch.int64)).item()


def _f32(xs) -> list[float]:
    return [float(v) for v in np.asarray(xs, dtype=np.float32)]


@pytest.mark.parametrize("seed", range(6))
def test_sums_are_exact_and_order_free(seed: int) -> None:
    """Terms over many binades and both signs, cancelling ones, subnormals: the read-back is
    math.fsum's correctly rounded sum rounded to fp32 (one ulp of slack for the fp64 step), and
    every order of the same terms reads back the same bits."""
    rng = np.random.default_rng(seed)
    n = 3000
    terms = _f32(rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n)))
    terms += _f32([1e-42, -3e-44, 2.5e30, -2.5e30, 7.0])  # subnormals, an exact cancellation
    want = np.float32(math.fsum(terms))
    got = _read(terms)
    assert got == want or abs(got - want) <= np.spacing(np.float32(abs(want))), (got, want)
    order = list(terms)
    for _ in range(3):
        random.Random(seed).shuffle(order)
        assert struct.pack("<f", _read(order)) == struct.pack("<f", got)


def test_extremes_and_non_finite_terms() -> None:
    big = float(np.finfo(np.float32).max)
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    assert _read([big, big]) == math.inf  # overflows fp32 as the float sum would
    assert _read([big, big, -big]) == big  # but the exact sum comes back
    assert _read([tiny] * 5) == 5 * tiny
    assert _read([-tiny, 0.0, -0.0]) == -tiny
    assert _read([]) == 0.0
    assert _read([1.0, math.inf]) == math.inf and _read([-math.inf, 3.0]) == -math.inf
    assert math.isnan(_read([math.inf, -math.inf]))
    assert math.isnan(_read([1.0, math.nan]))


def test_buffer_layout() -> None:
    w = exact_grad_buffer((3, 5), torch.device("cpu"))
    assert w.shape == (3, 5, EXACT_GRAD_WORDS) and w.dtype == torch.int64
    assert exact_grad_strides(w) == [5, 1]
    assert exact_grad_strides(exact_grad_buffer((), torch.device("cpu"))) == []
    assert exact_grad_value(w).shape == (3, 5)


def _exact_unit(kernel: str, name: str, d: int):
    from attncc.codegen.generate import generate_source
    from tests.runtime.flex.test_backward_kernel import _ir

    ir, grads = _ir(name, d)
    return generate_source(ir, head_dim=d, dtype="bfloat16", kernel=kernel, grad_tensors=grads,
                           exact_grads=True)


def test_exact_form_codegen() -> None:
    """The exact form adds through exact_grad_add into u64 words, is named `_exact`, pins
    EXACT_GRAD_WORDS, and exists only where a gradient is captured; the default form is as
    before."""
    from attncc.codegen.generate import generate_source
    from attncc.errors import CodegenError
    from tests.runtime.flex.test_backward_kernel import _ir

    u = _exact_unit("fa2bwd", "rel_table", 128)
    assert u.kernel_name.endswith("_exact") and "attncc::u64* bias_grad" in u.source
    assert "attncc::exact_grad_add(g.bias_grad, " in u.source
    assert "atomicAdd(g.bias_grad" not in u.source
    assert f"attncc::kExactGradWords) == {EXACT_GRAD_WORDS}" in u.source
    plain = _exact_unit("fa2bwd", "causal", 128)  # nothing captured: the ordinary form
    assert not plain.kernel_name.endswith("_exact")
    ir, grads = _ir("rel_table", 128)
    default = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2bwd",
                              grad_tensors=grads)
    assert "atomicAdd(g.bias_grad" in default.source and "float* bias_grad" in default.source
    with pytest.raises(CodegenError, match="exact_grads"):
        generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2", exact_grads=True)


@pytest.mark.nvrtc
@pytest.mark.parametrize("kind,name,d", [
    ("fa3_backward", "rel_table", 128), ("fa3_backward", "alibi_slopes", 64),
    ("fa3_backward", "t5_bucket", 128), ("fa2_backward", "rel_table", 128),
    ("fa2_backward", "head_scale", 256)])
def test_exact_form_compiles_without_spills(kind: str, name: str, d: int) -> None:
    """The kernel cache's first form of each template takes the exact adds with no local memory
    (an FA3-class form that spilled would quietly run FA2); for the FA3-class kernel, its first
    or its low-pressure form (docs/backward.md, "Warp specialization")."""
    from attncc.runtime.flex.backward import backward_spec
    from attncc.runtime.jit.kernels import compile_spec
    from tests.runtime.flex.test_backward_kernel import _ir, _no_local_memory

    ir, grads = _ir(name, d)
    spec = backward_spec("fa3" if kind == "fa3_backward" else "fa2", ir, d, "bfloat16", None,
                         fast_math=True, device=None, grad_tensors=grads, exact_grads=True)
    trail: list = []
    form = compile_spec(spec, "sm_90a", trail)
    assert form.spec.kind == kind and form.spec.exact_grads
    assert len(trail) == 1 + form.spec.low_pressure
    assert form.gen.kernel_name.endswith("_exact")
    assert _no_local_memory(form.result.log), form.result.log
