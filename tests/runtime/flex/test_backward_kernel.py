"""The FA2-class backward kernel without a GPU: every form compiles under NVRTC with 0 spills,
its source is deterministic, the KV-major lists match a brute force, and bad inputs raise before
anything launches. The GPU tests of the same kernel are tests/gpu/test_backward_gpu.py;
docs/backward.md, "Kernels", is the design."""
from __future__ import annotations

import re

import pytest
import torch

import attncc
from attncc.codegen.generate import generate_source
from attncc.codegen.layout import BACKWARD_PARAMS
from attncc.codegen.tiles import BackwardTiles, KernelTiles, backward_tiles
from attncc.errors import CodegenError, DifferentiationError, InvalidArgument
from attncc.gym import GYM
from attncc.ir.program import Bindings
from attncc.ir.simplify import simplify_variant
from attncc.runtime.flex.autograd import attention_ir, differentiable_attention, needs_grad
from attncc.runtime.flex.backward import backward_grid, kv_major_lists, run_backward
from tests.helpers.learnable import LEARNABLE


def _ir(name: str, d: int):
    """(attention IR without transforms, captured tensors requiring grad) of a gym or learnable
    variant."""
    if name in LEARNABLE:
        mod, tensors = LEARNABLE[name](8, 512, 512)
        return simplify_variant(attncc.Variant(score_mod=mod).trace()[0]), tuple(tensors)
    return simplify_variant(attention_ir(GYM[name](1, 8, 512, d).trace()[0])), ()


def _no_local_memory(log: str) -> bool:
    """ptxas's report: no stack frame, no spill stores or loads (for every function)."""
    found = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                       r"loads", log)
    return bool(found) and all(x == ("0", "0", "0") for x in found)


def _unit(name: str, d: int, dtype: str = "bfloat16", tiles: BackwardTiles | None = None):
    ir, grads = _ir(name, d)
    return generate_source(ir, head_dim=d, dtype=dtype, kernel="fa2bwd", grad_tensors=grads,
                           tiles=tiles)


def _compiled(name: str, d: int, dtype: str = "bfloat16", block_kv: int | None = None,
              arch: str = "sm_90a"):
    """The form the kernel cache compiles for a backward spec (its fallbacks walked)."""
    from attncc.codegen.tiles import backward_fallbacks
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec

    ir, grads = _ir(name, d)
    forms = backward_fallbacks(d, block_kv)
    return compile_spec(KernelSpec("fa2_backward", ir=ir, head_dim=d, dtype=dtype,
                                   tiles=forms[0], fallbacks=forms[1:], grad_tensors=grads), arch)


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d,dtype,block_kv", [
    ("noop", 64, "bfloat16", None), ("causal", 128, "bfloat16", None),
    ("softcap_causal", 64, "bfloat16", None), ("softcap_causal", 128, "float16", None),
    ("softcap_causal", 256, "bfloat16", None), ("sigmoid", 128, "bfloat16", None),
    ("sliding_window", 128, "bfloat16", None), ("prefix_lm", 128, "bfloat16", None),
    ("document_causal", 64, "bfloat16", None), ("rel_table", 64, "bfloat16", None),
    ("rel_table", 128, "bfloat16", None), ("alibi_slopes", 256, "bfloat16", None),
    ("t5_bucket", 128, "float16", None), ("head_scale", 64, "bfloat16", None),
    ("softcap_causal", 128, "bfloat16", 64)])
def test_backward_kernel_compiles_without_spills(name: str, d: int, dtype: str,
                                                 block_kv: int | None) -> None:
    """Every head dim, both dtypes, masks, score mods, normalize none and captured gradients,
    and the forms a 64-column block mask allows: the form the kernel cache picks has no spills
    and no stack frame for the H200's target (sm_90a; a register array indexed at run time
    would live in the stack frame) -- the kernel runs as written."""
    form = _compiled(name, d, dtype, block_kv)
    assert _no_local_memory(form.result.log), form.result.log
    assert block_kv is None or block_kv % form.spec.tiles.tkv == 0


@pytest.mark.nvrtc
def test_backward_kernel_compiles_for_sm80_without_spills() -> None:
    """The FA2-class kernel is for sm_80+: the A100 target compiles spill-free too."""
    form = _compiled("rel_table", 128, arch="sm_80")
    assert _no_local_memory(form.result.log), form.result.log


def test_backward_source_is_deterministic_and_named_by_its_tiles() -> None:
    a, b = _unit("rel_table", 128), _unit("rel_table", 128)
    assert a.source == b.source and a.kernel_name == b.kernel_name
    assert a.kernel_name.endswith("_fa2bwd_d128_bf16" + backward_tiles(128).suffix)
    assert "ATTNCC_FA2_BWD_ENTRY(" in a.source and "attncc::BackwardParams p" in a.source
    # the grads struct is the third argument and changes the unit; no grads: `int _unused;`
    plain = generate_source(_ir("rel_table", 128)[0], head_dim=128, dtype="bfloat16",
                            kernel="fa2bwd")
    assert plain.source != a.source and a.grads_layout is not None
    assert [f.name for f in plain.grads_layout.fields] == ["_unused"]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_launch_geometry_matches_the_layout(d: int) -> None:
    """Python's threads and shared memory are what the unit static_asserts against BwdConfig,
    and BackwardParams' layout is asserted member by member."""
    gk = _unit("causal", d)
    t = backward_tiles(d)
    assert gk.threads == t.threads(d) and gk.shared_mem_bytes == t.smem_bytes(d)
    assert (f"BwdConfig<{d}, {t.tq}, {t.tkv}, {t.stages}, {t.dsplit}>::kSmemBytes == "
            f"{gk.shared_mem_bytes}") in gk.source
    assert gk.attention_params_layout is BACKWARD_PARAMS
    assert all(f"attncc::BackwardParams, {f.name}) == {f.offset}" in gk.source
               for f in BACKWARD_PARAMS.fields)
    assert gk.shared_mem_bytes <= 227 * 1024


def test_backward_unit_errors() -> None:
    ir, _ = _ir("causal", 128)
    with pytest.raises(CodegenError, match="BackwardTiles"):
        generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa2bwd",
                        tiles=KernelTiles(64, 64, 2, 1))
    with pytest.raises(CodegenError, match="T_q in"):
        BackwardTiles(8, 64, 2)
    with pytest.raises(CodegenError, match="dsplit=2"):
        generate_source(_ir("causal", 256)[0], head_dim=256, dtype="bfloat16", kernel="fa2bwd",
                        tiles=BackwardTiles(16, 64, 2, 1))
    with pytest.raises(CodegenError, match="bfloat16 or float16"):
        generate_source(ir, head_dim=128, dtype="float32", kernel="fa2bwd")
    with pytest.raises(CodegenError, match="head dims"):
        generate_source(ir, head_dim=96, dtype="bfloat16", kernel="fa2bwd")


def _brute(num: torch.Tensor, idx: torch.Tensor, n_kv: int) -> list:
    """For each (b, h, kv block): the sorted q blocks whose list names it."""
    Bm, Hm, nq = num.shape
    out = [[[[] for _ in range(n_kv)] for _ in range(Hm)] for _ in range(Bm)]
    for b in range(Bm):
        for h in range(Hm):
            for q in range(nq):
                for j in range(int(num[b, h, q])):
                    kv = int(idx[b, h, q, j])
                    if kv < n_kv:
                        out[b][h][kv].append(q)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_major_lists_match_brute_force(seed: int) -> None:
    """Random Q-major lists with garbage padding, a mask narrower than the keys (padded rows
    list nothing), partial and full."""
    g = torch.Generator().manual_seed(seed)
    Bm, Hm, nq, w, n_kv = 2, 3, 5, 4, 6
    lists = []
    for _ in range(2):
        num = torch.randint(0, w + 1, (Bm, Hm, nq), generator=g, dtype=torch.int32)
        idx = torch.stack([torch.randperm(w, generator=g) for _ in range(Bm * Hm * nq)]
                          ).view(Bm, Hm, nq, w).to(torch.int32)
        lists.append((num, idx))
    qn, qi, fqn, fqi = kv_major_lists(*lists[0], *lists[1], n_kv_blocks=n_kv)
    for (num, idx), (cn, ci) in zip(lists, ((qn, qi), (fqn, fqi))):
        want = _brute(num, idx, n_kv)
        assert cn.dtype == ci.dtype == torch.int32 and cn.shape == (Bm, Hm, n_kv)
        for b in range(Bm):
            for h in range(Hm):
                for kv in range(n_kv):
                    n = int(cn[b, h, kv])
                    assert sorted(ci[b, h, kv, :n].tolist()) == want[b][h][kv]


def _cta(grid: tuple[int, int, int], x: int, y: int, z: int, num_kv_heads: int,
         kv_tile0: int) -> tuple[int, int, int]:
    """(batch, KV head, KV tile) of CTA (x, y, z): fa2_backward.cuh's bwd_cta, transcribed."""
    c = num_kv_heads // grid[1]
    return z, y * c + x % c, x // c + kv_tile0


@pytest.mark.parametrize("hkv", [1, 2, 3, 4, 6, 8, 12])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_grid_covers_every_tile_once_longest_first(hkv: int, deterministic: bool
                                                            ) -> None:
    """Every (batch, KV head, KV tile) is one CTA's, in the normal launch and over the
    deterministic mode's per-tile launches; in launch order (x fastest) a chunk's heads start
    their tile 0 before any of them starts tile 1."""
    B, n_tiles = 2, 5
    launches = ([(backward_grid(1, hkv, B), t) for t in range(n_tiles)] if deterministic
                else [(backward_grid(n_tiles, hkv, B), 0)])
    seen = []
    for grid, t0 in launches:
        assert grid[1] * (grid[0] // (n_tiles if not deterministic else 1)) == hkv
        for z in range(grid[2]):
            for y in range(grid[1]):
                order = [_cta(grid, x, y, z, hkv, t0) for x in range(grid[0])]
                tiles = [t for _, _, t in order]
                assert tiles == sorted(tiles)  # within a chunk: tile-major, heads fastest
                seen += order
    assert sorted(seen) == [(b, h, t) for b in range(B) for h in range(hkv)
                            for t in range(n_tiles)]


def test_needs_grad_and_attention_ir() -> None:
    q = torch.randn(1, 1, 4, 8)
    bias = torch.randn(4, requires_grad=True)
    assert not needs_grad(q, q, q, Bindings())
    assert needs_grad(q, q, q, Bindings({}, {"bias": bias}))
    with torch.no_grad():
        assert not needs_grad(q.requires_grad_(), q, q, Bindings())
    ir = GYM["rope"](1, 2, 16, 8).trace()[0]
    assert set(ir.hooks) >= {"query_mod", "key_mod"} and not set(attention_ir(ir).hooks) & {
        "query_mod", "key_mod", "value_mod", "output_mod"}
    plain = GYM["causal"](1, 2, 16, 8).trace()[0]
    assert attention_ir(plain) is plain


def test_mask_reading_a_tensor_that_requires_grad_raises_before_launch() -> None:
    """A mask_mod reading a learnable tensor has no gradient to give it: DifferentiationError
    naming the line, before anything runs (CPU tensors here: nothing could launch)."""
    keep = torch.ones(16, requires_grad=True)
    variant = attncc.Variant(mask_mod=lambda b, h, q, kv: keep[kv] > 0)
    ir, bind = variant.trace()
    q = torch.randn(1, 1, 16, 64, requires_grad=True)
    with pytest.raises(DifferentiationError, match="mask_mod"):
        differentiable_attention(q, q, q, ir, bind)


def test_block_sizes_the_backward_cannot_tile_raise() -> None:
    from types import SimpleNamespace

    from attncc.runtime.flex.backward import _mask_params

    num = torch.ones(1, 1, 4, dtype=torch.int32)
    idx = torch.zeros(1, 1, 4, 4, dtype=torch.int32)
    m = SimpleNamespace(num=num, idx=idx, fnum=None, fidx=None, block_q=16, block_kv=16)
    with pytest.raises(InvalidArgument, match="BLOCK_SIZE"):
        _mask_params(m, backward_tiles(128), 64)
    ok = SimpleNamespace(num=num, idx=idx, fnum=None, fidx=None, block_q=128, block_kv=128)
    vals, keep = _mask_params(ok, backward_tiles(128), 512)
    assert vals["block_q"] == 128 and vals["q_num_blocks"] == keep[0].data_ptr()


def test_kv_major_lists_are_memoized_per_list_tensor_and_version() -> None:
    """A backward reuses the KV-major lists of a block mask it ran before (the same list
    tensors, unchanged), recomputes them after an in-place change, and never confuses two
    masks: each entry holds its tensors, so their ids stay unique while cached."""
    from attncc.runtime.flex.backward import _ListsMemo

    memo = _ListsMemo(2)
    num = torch.tensor([[[1, 2, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [1, 0], [1, 0]]]], dtype=torch.int32)
    first = memo.get((num, idx, None, None), 2)
    assert memo.get((num, idx, None, None), 2) is first
    fresh = kv_major_lists(num, idx, None, None, 2)
    assert all(torch.equal(a, b) for a, b in zip(first[:2], fresh[:2]))
    num[0, 0, 0] = 2  # q block 0 now lists kv blocks 0 and 1
    changed = memo.get((num, idx, None, None), 2)
    assert changed is not first and changed[0].tolist() == [[[2, 3]]]
    other = (num.clone(), idx.clone(), None, None)
    assert memo.get(other, 2) is not changed  # equal contents, other tensors: its own entry
    memo.get((num, idx, None, None), 3)  # a third key evicts the oldest (size 2)
    assert len(memo._entries) == 2
