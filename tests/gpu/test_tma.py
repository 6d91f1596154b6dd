"""kernels/hopper/tma.cuh + runtime/jit/tma.py on the GPU: a TMA copy with the 128-byte swizzle lands in
exactly the layout kernels/hopper/wgmma.cuh's descriptors read (sw128_offset), signalled by an mbarrier.
tests/kernels/test_probes_compile.py compiles the probe for sm_90a (NVRTC only)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tma_probe import ARGS, UNUSED, probe_source


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [1, 2])
def test_tma_lands_in_the_sw128_layout(blocks: int) -> None:
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda
    from attncc.runtime.jit.tma import tensor_map_2d

    src = torch.randn(200, 256, device="cuda").bfloat16()
    tmap = tensor_map_2d(src, 64, 64)
    out = torch.zeros(64, 64 * blocks, device="cuda", dtype=torch.bfloat16)
    kl = load_kernel(compile_cuda(probe_source(), arch="sm_90a").cubin, "tma_probe", ARGS, UNUSED)
    vals = {"tmap": tmap.data_ptr(), "out": out.data_ptr(), "row0": 37, "col0": 64,
            "blocks": blocks}
    kl.launch((1, 1, 1), (128, 1, 1), 0, kl.ap.flatten(vals), kl.vp.flatten({"x": 0}),
              stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(out, src[37:101, 64:64 + 64 * blocks])


def test_tensor_map_rejects_bad_input() -> None:
    from attncc.runtime.jit.tma import tensor_map_2d

    with pytest.raises(ValueError, match="2-D bf16/fp16 CUDA tensor"):
        tensor_map_2d(torch.zeros(4, 4), 4, 4)


@pytest.mark.gpu
def test_map_cache_lives_outside_torch_and_survives_churn() -> None:
    """MapCache slots come from the driver, not torch's allocator (a map made while torch
    records a CUDA graph must not sit in the graph's pool), and a slot filled during a capture is
    never reused: a graph replayed after more distinct maps than the cache holds still reads its
    own (docs/compile.md, "CUDA graphs")."""
    import attncc

    def qkv(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(3)]

    opts = {"KERNEL": "fa3"}
    attncc.flex_attention(*qkv(0), kernel_options=opts)  # compile and load outside the capture
    static = qkv(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a first call on these addresses, then the capture
        attncc.flex_attention(*static, kernel_options=opts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attncc.flex_attention(*static, kernel_options=opts)
    for seed in range(2, 80):  # more distinct q/k/v/out addresses than the cache's 64 slots
        attncc.flex_attention(*qkv(seed), kernel_options=opts)
    new = qkv(99)
    for s, n in zip(static, new):
        s.copy_(n)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.double() for t in new)).float()
    err = (out.float() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and err < 2e-2, err


@pytest.mark.gpu
def test_map_cache_reuse_waits_for_the_other_stream() -> None:
    """A slot reused on another stream is filled only after the first stream's work: the maps of
    a launch still queued there are not overwritten under it."""
    from attncc.runtime.jit.tma import MapCache, encode_map

    cache = MapCache(1)
    a = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        first = cache.get("a", a.device, lambda: encode_map(a, (64, 64)))
    with torch.cuda.stream(s2):
        second = cache.get("b", b.device, lambda: encode_map(b, (64, 64)))
    assert second.data_ptr() == first.data_ptr() and second.stream == s2.cuda_stream
    torch.cuda.synchronize()
    got = torch.empty(128, dtype=torch.uint8, device="cuda")
    from attncc.runtime.jit.launcher import driver, driver_check
    d = driver()
    driver_check(d.cuMemcpyDtoD(d.CUdeviceptr(got.data_ptr()), d.CUdeviceptr(second.data_ptr()),
                                128), "cuMemcpyDtoD")
    assert bytes(got.cpu().numpy()) == encode_map(b, (64, 64))


@pytest.mark.gpu
def test_map_cache_hit_on_another_stream_waits_for_the_fill() -> None:
    """A cached slot filled on a busy stream and then read by a launch on another stream: that
    stream waits for the fill's copy, so it never reads the slot's previous maps."""
    from attncc.runtime.jit.launcher import driver, driver_check
    from attncc.runtime.jit.tma import MapCache, encode_map

    cache = MapCache(1)
    x = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16)
    got = torch.zeros(128, dtype=torch.uint8, device="cuda")
    cache.get("x", x.device, lambda: encode_map(x, (64, 64)))  # the slot holds x's map
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the fill's copy queues behind it
        cache.get("a", a.device, lambda: encode_map(a, (64, 64)))
    d = driver()
    with torch.cuda.stream(s2):
        slot = cache.get("a", a.device, lambda: b"")  # a hit: must wait for s1's copy
        driver_check(d.cuMemcpyDtoDAsync(d.CUdeviceptr(got.data_ptr()),
                                         d.CUdeviceptr(slot.data_ptr()), 128,
                                         d.CUstream(s2.cuda_stream)), "cuMemcpyDtoDAsync")
    torch.cuda.synchronize()
    assert bytes(got.cpu().numpy()) == encode_map(a, (64, 64))
