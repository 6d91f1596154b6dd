"""The kernel cache (runtime/jit/kernels.py) on a real GPU: the driver's local bytes of loaded
kernels, the strict resource check on a kernel that really uses local memory, and the dense FA3
D128 unpaired kernel (the one ptxas once spilled on a fresh H200) running spill-free and right
in a process that first ran SDPA and FlexAttention."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import attncc
from attncc.errors import ResourceError
from attncc.runtime.flex import gpu_flex
from attncc.runtime.jit import kernels
from attncc.gym import GYM

# a per-thread array indexed at run time: nvcc keeps it in local memory (a stack frame)
_LOCAL_SOURCE = r'''
extern "C" __global__ void attncc_local_probe(float* x, int n) {
    float a[64];
    for (int i = 0; i < 64; ++i) a[i] = x[(threadIdx.x + i) % n];
    x[threadIdx.x] = a[(threadIdx.x * 7 + n) % 64];
}
'''


def _needs_sm90() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FA3 kernel needs an sm_90 GPU")


@pytest.mark.gpu
def test_driver_local_bytes_match_ptxas_stack_frame_and_strict_mode_refuses_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel with a stack frame (a local array, no spill) loads with the driver's
    LOCAL_SIZE_BYTES equal to ptxas's stack frame: not a problem. A record whose local bytes
    exceed the stack frame ptxas reported (a cubin that is not the one compiled) is a
    ResourceError under ATTNCC_STRICT_RESOURCES=1 and a warning without it."""
    from attncc.codegen.layout import struct_layout
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda, device_arch
    from attncc.runtime.jit.policy import stack_frame

    res = compile_cuda(_LOCAL_SOURCE, arch=device_arch(), name="probe.cu", verbose=True)
    layout = struct_layout("P", [("x", "float*"), ("n", "int")])
    kl = load_kernel(res.cubin, "attncc_local_probe", layout, None)
    assert kl.local_bytes > 0 and kl.local_bytes == stack_frame(res.log), res.log
    ok = kernels.KernelRecord("attncc_local_probe", kernels.spill_bytes(res.log),
                              kl.local_bytes, kl.num_regs, 0, 0, stack_frame(res.log))
    assert ok.problem() is None
    bad = kernels.KernelRecord("attncc_local_probe", 0, kl.local_bytes, kl.num_regs, 0, 0, 0)
    monkeypatch.setenv(kernels.STRICT_ENV, "1")
    kernels.check_resources(ok)
    with pytest.raises(ResourceError, match=f"attncc_local_probe: .*{kl.local_bytes} B of local"):
        kernels.check_resources(bad)
    monkeypatch.setenv(kernels.STRICT_ENV, "0")
    with pytest.warns(RuntimeWarning, match="local memory"):
        kernels.check_resources(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("paired", [False, True])
def test_dense_fa3_d128_runs_without_local_memory_after_other_libraries(
        paired: bool, rng: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unpaired dense FA3 D128 kernel (attncc_identity_fa3_d128_bf16_q128_k128_s3 in
    bench/prefill.py) and its pair form, compiled into an empty cache in a process that first
    ran cuDNN / flash SDPA and FlexAttention, load with 0 spill and 0 local bytes, and their
    output on fresh inputs into a poisoned buffer matches the float64 reference."""
    import tempfile

    from attncc.runtime.reference import attention_reference

    _needs_sm90()
    monkeypatch.setenv("ATTNCC_CACHE_DIR", tempfile.mkdtemp(prefix="attncc-kc-"))
    kernels.clear_loaded()
    gpu_flex._CALLS.clear()
    B, H, S, D = 1, 8, 2048, 128
    q, k, v = rng.qkv(B, H, S, D, dtype=torch.bfloat16, device="cuda")
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex_attention(q, k, v)
    except Exception:  # torch without FlexAttention on this machine: SDPA alone ran first
        pass
    torch.cuda.synchronize()
    opts = {"KERNEL": "fa3", "PAIRED": paired}
    ir, bind = attncc.Variant().trace()
    out = torch.full_like(q, float("nan"))
    got, _ = gpu_flex.gpu_flex_attention(q, k, v, ir, bind, kernel_options=opts, out=out)
    ref, _ = attention_reference(q, k, v, ir, bind)  # float64
    assert not torch.isnan(got).any()
    err = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-2, err
    info = gpu_flex.compiled_kernel_info(q, k, v, ir, bind, kernel_options=opts)
    assert info["paired"] is paired and info["kernel"].endswith("_fa3_d128_bf16_q128_k128_s3")
    assert (info["spill_bytes"], info["local_bytes"]) == (0, 0), info
    assert info["retries"] >= 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "softcap", "document_causal"])
def test_serving_and_merge_kernels_record_no_local_memory(name: str) -> None:
    """BatchAttention's kernel (FA3 batch on sm_90 for this prefill batch, FA2 elsewhere) and
    the merge kernel come from the kernel cache with records of 0 spill and 0 local bytes, and
    the batch's output matches the float64 reference."""
    from attncc.runtime.serving.merge_kernel import merge_state_cuda

    from .test_batch import _batch, _check

    hkv, g, d = 2, 4, 128
    b = _batch("NHD", 16, [300, 1000], [300, 4096], hkv, g, d, torch.bfloat16, seed=len(name))
    variant = GYM[name](2, hkv * g, 4096, d, seed=3)
    ba = attncc.BatchAttention(variant, kv_layout="NHD")
    ba.plan(b["qo"], b["kv_indptr"], b["kv_indices"], b["last"], num_qo_heads=hkv * g,
            num_kv_heads=hkv, head_dim=d, page_size=16, q_data_type=torch.bfloat16)
    assert ba.kernel_record() is None
    _check(ba, b, variant, "NHD", 16)
    rec = ba.kernel_record()
    assert rec is not None and rec.problem() is None, rec
    if name != "document_causal":  # (its FA3 forms spill on NVRTC 13: a confirmed spill)
        assert (rec.spill_bytes, rec.local_bytes) == (0, 0), rec
    o = torch.randn(64, 4, d, device="cuda").to(torch.bfloat16)
    lse = torch.randn(64, 4, device="cuda")
    merge_state_cuda(o, lse, o, lse)
    merge = kernels.get_kernel(kernels.KernelSpec("merge", dtype="bfloat16",
                                                  device=torch.cuda.current_device()))
    assert (merge.record.spill_bytes, merge.record.local_bytes) == (0, 0), merge.record
