"""NVRTC only (no GPU): the serving kernels compile spill-free -- the FA2 and FA3 batch kernels
of the clamped captured-read variant, and the attention-state merge kernel for each storage
type. tests/gpu/test_bounds_gpu.py and test_merge_kernel.py run them."""
from __future__ import annotations

import pytest

from attncc.codegen.merge_state import merge_state_source
from attncc.runtime.jit.policy import spill_bytes
from attncc.runtime.jit.sources import fa2_source
from tests.helpers.clamped import clamped_ir


@pytest.mark.nvrtc
def test_clamped_serving_kernels_compile_without_spills() -> None:
    """The FA2 and FA3 batch kernels of a clamped variant, as BatchAttention compiles them
    (FA3 through the kernel cache: its low-pressure form if the first spills)."""
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.jit.nvrtc import compile_cuda
    from attncc.runtime.serving.fa3_batch import fa3_batch_tiles

    ir = simplify_variant(clamped_ir(700, 8, 128))
    src, _, _, _ = fa2_source(ir, head_dim=128, dtype="bfloat16", tq=16, tkv=64,
                              batch=True, kv_warps=2)
    assert spill_bytes(compile_cuda(src, arch="sm_90a", verbose=True).log) == 0
    res = compile_spec(KernelSpec("fa3_batch", ir, 128, "bfloat16", fa3_batch_tiles(128)),
                       "sm_90a").result
    assert spill_bytes(res.log) == 0, res.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_merge_kernel_compiles_without_spills(dtype: str) -> None:
    from attncc.runtime.jit.nvrtc import compile_cuda

    mk = merge_state_source(dtype)
    res = compile_cuda(mk.source, arch="sm_90a", name=f"{mk.kernel_name}.cu", verbose=True)
    assert f"Compiling entry function '{mk.kernel_name}'" in res.log
    assert "0 bytes spill stores, 0 bytes spill loads" in res.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d", [("causal", 128), ("softcap_causal", 64)])
def test_batch_kernels_with_the_sink_epilogue_compile_without_spills(name: str, d: int) -> None:
    """Every batch kernel form carries the attention-sink code (common.cuh join_sink: the
    write-through epilogue of FA2 and FA3, the merge kernel): the decode form with 2 and 4 KV
    warps and the FA3 batch kernel as the kernel cache compiles it stay spill-free, and their
    source reads BatchParams::sinks."""
    from attncc.gym import GYM
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.jit.nvrtc import compile_cuda
    from attncc.runtime.serving.fa3_batch import fa3_batch_tiles

    ir = simplify_variant(GYM[name](1, 8, 4096, d).trace()[0])
    for kv_warps in (2, 4):
        src, _, _, _ = fa2_source(ir, head_dim=d, dtype="bfloat16", tq=16, tkv=64, batch=True,
                                  kv_warps=kv_warps)
        assert "p.sinks" in src and "join_sink(" in src
        log = compile_cuda(src, arch="sm_90a", verbose=True).log
        assert spill_bytes(log) == 0, (kv_warps, log)
    res = compile_spec(KernelSpec("fa3_batch", ir, d, "bfloat16", fa3_batch_tiles(d)),
                       "sm_90a").result
    assert spill_bytes(res.log) == 0, res.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("rows", [32, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_multi_token_decode_kernels_compile_without_spills(rows: int, head_dim: int) -> None:
    """The FA2 batch kernel at the tiles choose_batch_tiles gives multi-token decode (4 and 8
    tokens x a GQA group of 8 = 32 and 64 fused rows; tree-mask checks included, as every
    batch kernel carries them) for a causal variant and a softcap one compiles spill-free.
    (16 tokens x 8 = 128 rows take the prefill tiles: FA3 on sm_90, FA2's 128-row tiles with
    a tree mask.) tests/gpu/test_multitoken_gpu.py runs them."""
    import torch

    from attncc.frontend import Variant
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.nvrtc import compile_cuda
    from attncc.runtime.serving.tiles import choose_batch_tiles

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcap(score, b, h, q_idx, kv_idx):
        return 30 * torch.tanh(score / 30)

    t = choose_batch_tiles(head_dim, rows, 132)
    assert t.kernel == "fa2" and t.tq == rows
    for var in (Variant(mask_mod=causal, name="mtd_causal"),
                Variant(score_mod=softcap, mask_mod=causal, name="mtd_softcap")):
        ir = simplify_variant(var.trace()[0])
        src, _, _, _ = fa2_source(ir, head_dim=head_dim, dtype="bfloat16", tq=t.tq, tkv=t.tkv,
                                  stages=t.stages, m_frags=t.m_frags, batch=True,
                                  kv_warps=t.kv_warps)
        log = compile_cuda(src, arch="sm_90a", verbose=True).log
        assert spill_bytes(log) == 0, log


@pytest.mark.nvrtc
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fa3_pair_forms_compile_without_spills(head_dim: int) -> None:
    """The FA3 batch kernel's pair form (64-row units, kernels/fa3/fa3_batch.cuh) at the tiles
    choose_batch_tiles gives multi-token decode, for a causal variant, a per-head captured
    slope with the sink epilogue, sigmoid attention and an output transform, as the kernel
    cache compiles them. tests/gpu/test_fa3_pair_gpu.py runs them."""
    import torch

    from attncc.frontend import Variant
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.serving.fa3_batch import fa3_batch_tiles
    from attncc.runtime.serving.tiles import choose_batch_tiles

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    slopes = torch.linspace(0.1, 0.5, 16)
    t = choose_batch_tiles(head_dim, 64, 132, fa3="auto", pair=True)
    assert (t.kernel, t.tq) == ("fa3", 64) and t.stages % 2 == 0
    for var in (Variant(mask_mod=causal, name="pair_causal"),
                Variant(score_mod=lambda s, b, h, q, kv: s - slopes[h] * (q - kv),
                        mask_mod=causal, name="pair_alibi"),
                Variant(score_mod=lambda s, b, h, q, kv: torch.sigmoid(s), normalize="none",
                        name="pair_sigmoid"),
                Variant(mask_mod=causal, output_mod=lambda o, b, h, q, d: o[d] * 2.0,
                        name="pair_output")):
        ir = simplify_variant(var.trace()[0])
        form = compile_spec(KernelSpec("fa3_batch", ir, head_dim, "bfloat16",
                                       fa3_batch_tiles(head_dim, 64)), "sm_90a")
        assert form.spill_bytes == 0, (var.name, form.result.log)


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,d", [("relative_bias", 128), ("document_causal", 64)])
def test_fa3_batch_low_pressure_variants_with_sinks_have_no_spills(name: str, d: int) -> None:
    """The variants whose FA3 batch kernel needs the low-pressure form (tests/gpu/test_batch.py)
    stay spill-free with the sink epilogue, as the kernel cache compiles them."""
    from attncc.gym import GYM
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.serving.fa3_batch import fa3_batch_tiles

    ir = simplify_variant(GYM[name](4, 8, 4096, d, seed=5).trace()[0])
    form = compile_spec(KernelSpec("fa3_batch", ir, d, "bfloat16", fa3_batch_tiles(d)),
                        "sm_90a")
    assert form.spill_bytes == 0, form.result.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("long_kv", [False, True])
def test_decode_forms_compile_without_spills(d: int, long_kv: bool) -> None:
    """The 16-bit decode forms BatchAttention picks, with and without the third stage of long
    batches (tiles.long_kv_batch), load with no spills or local memory."""
    from attncc.codegen.tiles import KernelTiles
    from attncc.ir.program import VariantIR
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.serving.tiles import choose_batch_tiles

    t = choose_batch_tiles(d, 8, 132, long_kv=long_kv)
    assert t.stages == (3 if long_kv else 2)
    form = compile_spec(KernelSpec("decode", VariantIR(name="plain"), d, "bfloat16",
                                   KernelTiles(t.tq, t.tkv, t.stages, t.m_frags, t.kv_warps)),
                        "sm_90a")
    assert form.spill_bytes == 0, form.result.log
