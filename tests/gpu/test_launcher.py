"""runtime/jit/launcher.py: struct packing (CPU), and on a GPU: every field type reaches the kernel,
host launch cost, CUDA graph capture/replay, the module cache and checked driver errors."""
from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

from attncc.codegen.layout import ATTENTION_PARAMS, struct_layout
from attncc.runtime.jit.launcher import LaunchError, StructPacker, load_kernel

# Two by-value structs covering every field type the layouts use: pointers, int, i64, float,
# arrays, and padding between them (int before pointer, float before i64).
_A = struct_layout("ProbeA", [("out", "double*"), ("i", "int"), ("p", "const void*"),
                              ("f", "float"), ("l", "attncc::i64"), ("arr", "attncc::i64", 3),
                              ("tail", "int")])
_B = struct_layout("ProbeB", [("g", "float"), ("n", "int"), ("q", "const float*"),
                              ("s", "attncc::i64", 2)])

# a 1-d captured tensor: one-element stride/size arrays still take sequences
_C = struct_layout("ProbeC", [("t", "const float*", None, "ptr", "t"),
                              ("t_stride", "attncc::i64", 1, "stride", "t"),
                              ("t_size", "attncc::i64", 1, "size", "t"),
                              ("cap", "float", None, "scalar", "cap")])

_PROBE = r"""
struct ProbeA { double* out; int i; const void* p; float f; long long l; long long arr[3]; int tail; };
struct ProbeB { float g; int n; const float* q; long long s[2]; };
extern "C" __global__ void probe(ProbeA a, ProbeB b) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double* o = a.out;
    o[0] = (double)a.i; o[1] = (double)(unsigned long long)a.p; o[2] = (double)a.f;
    o[3] = (double)a.l; o[4] = (double)a.arr[0]; o[5] = (double)a.arr[1]; o[6] = (double)a.arr[2];
    o[7] = (double)a.tail; o[8] = (double)b.g; o[9] = (double)b.n; o[10] = (double)b.q[1];
    o[11] = (double)b.s[0]; o[12] = (double)b.s[1];
}
"""


def test_packer_matches_layout_pack() -> None:
    """The fast packer produces exactly StructLayout.pack's bytes (AttentionParams and probes)."""
    import random

    rnd = random.Random(5)
    for lay in (ATTENTION_PARAMS, _A, _B, _C):
        vals: dict[str, Any] = {}
        for f in lay.fields:
            if f.ctype.endswith("*"):
                v: Any = rnd.randrange(0, 2**48) * 16
            elif f.ctype == "float":
                v = rnd.uniform(-1e3, 1e3)
            elif f.ctype == "int":
                v = rnd.randrange(-2**31, 2**31)
            else:
                v = rnd.randrange(-2**63, 2**63)
            vals[f.name] = [v] * f.count if f.is_array else v
        pk = StructPacker(lay)
        assert pk.pack(vals) == lay.pack(vals)
        assert pk.size == lay.size


@pytest.fixture(scope="module")
def probe() -> Any:
    from attncc.runtime.jit.nvrtc import compile_cuda, device_arch

    res = compile_cuda(_PROBE, arch=device_arch())
    return res.cubin


@pytest.mark.gpu
def test_every_field_type_reaches_the_kernel(probe: bytes) -> None:
    kl = load_kernel(probe, "probe", _A, _B)
    out = torch.full((13,), float("nan"), dtype=torch.float64, device="cuda")
    qv = torch.tensor([0.0, -2.75], device="cuda")
    a = {"out": out.data_ptr(), "i": -123456, "p": 0x7F0012345670, "f": 3.25,
         "l": -(2**40) - 3, "arr": [2**33, -7, 11], "tail": 99}
    b = {"g": -0.125, "n": 2**31 - 1, "q": qv.data_ptr(), "s": [5, -(2**35)]}
    kl.launch((1, 1, 1), (32, 1, 1), 0, kl.ap.flatten(a), kl.vp.flatten(b))
    torch.cuda.synchronize()
    got = out.tolist()
    want = [-123456, 0x7F0012345670, 3.25, -(2**40) - 3, 2**33, -7, 11, 99, -0.125, 2**31 - 1,
            -2.75, 5, -(2**35)]
    assert got == want


@pytest.mark.gpu
def test_module_cache_and_driver_errors(probe: bytes) -> None:
    k1 = load_kernel(probe, "probe", _A, _B)
    k2 = load_kernel(probe, "probe", _A, _B)
    assert k1._module is k2._module  # one module per (cubin, device)
    with pytest.raises(LaunchError, match="cuModuleGetFunction"):
        load_kernel(probe, "no_such_kernel", _A, _B)
    out = torch.zeros(13, dtype=torch.float64, device="cuda")
    a = k1.ap.flatten({"out": out.data_ptr(), "i": 0, "p": 0, "f": 0.0, "l": 0,
                       "arr": [0, 0, 0], "tail": 0})
    b = k1.vp.flatten({"g": 0.0, "n": 0, "q": out.data_ptr(), "s": [0, 0]})
    with pytest.raises(LaunchError, match="cuLaunchKernel.*CUDA_ERROR_INVALID_VALUE"):
        k1.launch((1, 1, 1), (4096, 1, 1), 0, a, b)  # more threads than a block may have
    with pytest.raises(LaunchError, match="shared memory"):
        k1.set_dynamic_smem(10 * 1024 * 1024)


@pytest.mark.gpu
@pytest.mark.speed
def test_host_launch_cost(probe: bytes) -> None:
    """A launch of a cached kernel costs <= 15 us of host time (median over batches)."""
    kl = load_kernel(probe, "probe", _A, _B)
    out = torch.zeros(13, dtype=torch.float64, device="cuda")
    a = kl.ap.flatten({"out": out.data_ptr(), "i": 1, "p": 0, "f": 1.0, "l": 1,
                       "arr": [1, 2, 3], "tail": 1})
    b = kl.vp.flatten({"g": 1.0, "n": 1, "q": out.data_ptr(), "s": [1, 2]})
    stream = torch.cuda.current_stream().cuda_stream
    per_launch = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):  # < the launch queue depth: host time only, never blocked
            kl.launch((1, 1, 1), (32, 1, 1), 0, a, b, stream=stream)
        per_launch.append((time.perf_counter() - t0) / 200 * 1e6)
    torch.cuda.synchronize()
    med = statistics.median(per_launch)
    print(f"\nhost cost per KernelLauncher.launch: median {med:.2f} us "
          f"(min {min(per_launch):.2f})")
    assert med <= 15.0


@pytest.mark.gpu
def test_flex_call_host_cost_and_cuda_graph() -> None:
    """gpu_flex_attention is capturable in torch.cuda.graph; replays see in-place input updates.
    Also prints the host cost of a whole cached gpu_flex_attention call."""
    import attncc
    from attncc.runtime.flex import gpu_flex
    from attncc.gym import causal

    B, H, S, D = 2, 8, 512, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(B, H, S, D, generator=g, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
    ir, bind = attncc.Variant(score_mod=lambda s, b, h, qi, ki: 20 * torch.tanh(s / 20)).trace()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile + module load) outside the capture
        gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=bm, return_lse=True, out=out,
                                    lse_out=lse)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    t = []
    for _ in range(200):
        t0 = time.perf_counter()
        gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=bm, return_lse=True,
                                    out=out, lse_out=lse)
        t.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    print(f"\nhost cost per cached gpu_flex_attention call: median {statistics.median(t):.1f} us")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=bm, return_lse=True, out=out,
                                    lse_out=lse)
    for seed in (11, 12):
        g.manual_seed(seed)
        for t_ in (q, k, v):
            t_.copy_(torch.randn(t_.shape, generator=g, device="cuda").to(t_.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager, eager_lse = gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=bm,
                                                       return_lse=True)
        assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
