"""The FA3-class backward kernel (kernels/fa3/fa3_backward.cuh) without a GPU: its one form
compiles under NVRTC for sm_90a with no spills and no stack frame for every AttentionGym and
learnable-bias variant (else the kernel cache would quietly run the FA2-class kernel instead),
the fallback to the FA2-class forms, the unit's geometry, the shape of its register-A products,
and the choice of template. The GPU tests are tests/gpu/test_backward_gpu.py (every case on
both templates); docs/backward.md, "The FA3-class kernel", is the design."""
from __future__ import annotations


import pytest

from attncc.codegen.generate import generate_source
from attncc.codegen.tiles import FA3_BACKWARD_TILES, BackwardTiles, fa3_backward_geometry
from attncc.errors import CodegenError, InvalidArgument
from attncc.gym import GYM
from attncc.runtime.flex.backward import backward_kernel, backward_spec
from tests.helpers.learnable import LEARNABLE
from tests.runtime.flex.test_backward_kernel import _ir, _no_local_memory


def _reported(spec, log: str):
    """A CompiledForm of `spec` as if ptxas had printed `log`: its spill bytes and wgmma notes
    read from it as the kernel cache reads them (the fallback tests' stand-in compiles)."""
    import attncc.runtime.jit.kernels as K

    res = K.NvrtcResult(b"", None, log, ())
    return K.CompiledForm(K.generate(spec), res, K.spill_bytes(log), tuple(K.wgmma_notes(log)),
                          0, 0)


def _spec(name: str, d: int, dtype: str = "bfloat16"):
    ir, grads = _ir(name, d)
    return backward_spec("fa3", ir, d, dtype, None, fast_math=True, device=None,
                         grad_tensors=grads)


@pytest.mark.nvrtc
@pytest.mark.parametrize("name", [*sorted(GYM), *sorted(LEARNABLE)])
def test_fa3_backward_form_compiles_without_spills_at_head_dim_128(name: str) -> None:
    """Head dim 128 is the tight one (dK and dV take 128 of a consumer's 240 registers): every
    variant's FA3-class form at one of its sub-tile widths is what the kernel cache returns,
    with no local memory and its wgmma pipeline intact (no C751x note)."""
    from attncc.runtime.jit.kernels import compile_spec

    trail: list = []
    form = compile_spec(_spec(name, 128), "sm_90a", trail)
    assert form.spec.kind == "fa3_backward", [t.gen.kernel_name for t in trail]
    assert len(trail) == 1 + form.spec.low_pressure, [t.spec.low_pressure for t in trail]
    assert _no_local_memory(form.result.log), form.result.log
    assert not form.notes, form.notes


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,dtype", [("noop", "bfloat16"), ("softcap_causal", "float16"),
                                        ("document_causal", "bfloat16"),
                                        ("rel_table", "bfloat16"), ("sigmoid", "float16")])
def test_fa3_backward_form_compiles_without_spills_at_head_dim_64(name: str, dtype: str) -> None:
    from attncc.runtime.jit.kernels import compile_spec
    from attncc.runtime.jit.policy import wgmma_notes

    form = compile_spec(_spec(name, 64, dtype), "sm_90a")
    assert form.spec.kind == "fa3_backward"
    assert _no_local_memory(form.result.log) and not wgmma_notes(form.result.log), form.result.log


@pytest.mark.nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_fa3_backward_products_from_registers_span_the_head_dim(d: int) -> None:
    """dV += P^T dO and dK += dS^T Q (A from registers) run as one m64n128 chain at head dim 128
    (the N-major descriptor's LBO stepping between the two 64-column blocks) and as m64n64 at
    64; the register-A wgmmas of the PTX are those and no others (docs/backward.md)."""
    import re

    from attncc.runtime.jit import nvrtc

    ir, _ = _ir("noop", d)
    gk = generate_source(ir, head_dim=d, dtype="bfloat16", kernel="fa3bwd")
    ptx = nvrtc.compile_cuda(gk.source, arch="sm_90a", emit="ptx").ptx or ""
    # a register A operand is a braced list right after the braced accumulators
    rs = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16\s*"
                    r"\{[^}]*\},\s*\{", ptx)
    assert rs and set(rs) == {str(min(d, 128))}, sorted(set(rs))


def test_fa3_backward_falls_back_to_the_fa2_forms_when_its_form_spills(monkeypatch,
                                                                       tmp_path) -> None:
    """A spilled FA3-class form (here: reported so) hands over to its forms with 32- and then
    16-column sub-tiles, and those to the FA2-class forms, in order; the caller launches the kind and tiles of the
    returned form. An empty form memo: a warm one (scripts/backward_resources.py fills it)
    would answer without compiling."""
    import attncc.runtime.jit.kernels as K

    monkeypatch.setattr(K.FormMemo, "default", staticmethod(lambda: K.FormMemo(tmp_path)))

    compiled: list = []

    def fake(spec, arch):
        compiled.append((spec.kind, spec.tiles, spec.low_pressure))
        log = ("ptxas . 0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"
               if spec.kind == "fa3_backward" else
               "ptxas . 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
        return _reported(spec, log)

    monkeypatch.setattr(K, "compile_form", fake)
    spec = _spec("causal", 128)
    form = K.compile_spec(spec, "sm_90a")
    assert compiled[:3] == [("fa3_backward", FA3_BACKWARD_TILES, level) for level in (0, 1, 2)]
    assert form.spec.kind == "fa2_backward" and form.spec.tiles == spec.fallbacks[0]
    assert not form.spec.low_pressure and len(compiled) == 4


@pytest.mark.parametrize("serialized,want", [((0,), 1), ((0, 1, 2), 0)])
def test_fa3_backward_prefers_a_level_whose_wgmmas_are_not_serialized(
        monkeypatch, tmp_path, serialized: tuple[int, ...], want: int) -> None:
    """A spill-free level whose wgmmas ptxas serialized (its C7512 note) gives way to the next
    level that compiles clean; where every spill-free level is serialized, the first of them
    runs (speed lost, not correctness), not the FA2-class forms."""
    import attncc.runtime.jit.kernels as K

    monkeypatch.setattr(K.FormMemo, "default", staticmethod(lambda: K.FormMemo(tmp_path)))
    note = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions "
            "are serialized due to insufficient register resources")
    compiled: list = []

    def fake(spec, arch):
        compiled.append(spec.low_pressure)
        log = "ptxas . 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
        if spec.low_pressure in serialized:
            log += "\n" + note
        return _reported(spec, log)

    monkeypatch.setattr(K, "compile_form", fake)
    form = K.compile_spec(_spec("causal", 128), "sm_90a")
    assert form.spec.kind == "fa3_backward" and form.spec.low_pressure == want
    assert compiled == ([0, 1] if want == 1 else [0, 1, 2])


def test_fa3_backward_unit_geometry_and_errors() -> None:
    ir, _ = _ir("causal", 128)
    gk = generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa3bwd")
    t = FA3_BACKWARD_TILES
    assert gk.kernel_name.endswith("_fa3bwd_d128_bf16" + t.suffix)
    assert (gk.threads, gk.shared_mem_bytes) == fa3_backward_geometry(128) == (384, 198800)
    assert (f"fa3bwd::BwdConfig<128, 64, 128, 2, 1>::kSmemBytes == {gk.shared_mem_bytes}"
            in gk.source)
    assert "ATTNCC_FA3_BWD_ENTRY(" in gk.source and gk.shared_mem_bytes <= 227 * 1024
    with pytest.raises(CodegenError, match="one form"):
        generate_source(ir, head_dim=128, dtype="bfloat16", kernel="fa3bwd",
                        tiles=BackwardTiles(16, 128, 2, 1))
    with pytest.raises(CodegenError, match="head dims"):
        generate_source(_ir("causal", 256)[0], head_dim=256, dtype="bfloat16",
                        kernel="fa3bwd")


class _Mask:
    def __init__(self, block_q: int, block_kv: int) -> None:
        self.block_q, self.block_kv = block_q, block_kv


def test_backward_kernel_choice() -> None:
    """sm_90 takes FA3 where it fits (head dims 64/128, blocks of (64k, 128k)), FA2 elsewhere;
    BACKWARD_KERNEL forces one, and 'fa3' where it cannot run is an error naming why."""
    assert backward_kernel(None, 64, _Mask(128, 128), sm90=True) == "fa3"
    assert backward_kernel(None, 128, _Mask(128, 64), sm90=True) == "fa2"
    assert backward_kernel(None, 128, None, sm90=False) == "fa2"
    assert backward_kernel("fa2", 64, None, sm90=True) == "fa2"
    with pytest.raises(InvalidArgument, match="head dim 256"):
        backward_kernel("fa3", 256, None, sm90=True)
    with pytest.raises(InvalidArgument, match="sm_90"):
        backward_kernel("fa3", 128, None, sm90=False)
    with pytest.raises(InvalidArgument, match="BLOCK_SIZE"):
        backward_kernel("fa3", 128, _Mask(128, 64), sm90=True)
    with pytest.raises(InvalidArgument, match="'fa2' or 'fa3'"):
        backward_kernel("fa4", 128, None, sm90=True)


def test_fa3_spec_keeps_the_fa2_forms_a_mask_allows() -> None:
    ir, _ = _ir("causal", 128)
    spec = backward_spec("fa3", ir, 128, "bfloat16", _Mask(128, 128), fast_math=True,
                         device=None, grad_tensors=())
    assert spec.kind == "fa3_backward" and spec.tiles == FA3_BACKWARD_TILES
    assert spec.fallbacks and all(128 % f.tkv == 0 for f in spec.fallbacks)


@pytest.mark.nvrtc
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["bwd_rows", "bwd_dq"])
def test_backward_helper_kernels_compile_without_spills(kind: str, dtype: str) -> None:
    """The backward's row kernel (kernels/small/bwd_rows.cuh: LSE base 2 and delta per query
    tile, what the FA3-class kernel's producer copies) and its dQ conversion (bwd_dq.cuh:
    dq_accum's staging order to dQ rows), for each 16-bit type; tests/gpu/test_fa3_backward_gpu.py
    checks them against torch."""
    from attncc.codegen import merge_state
    from attncc.runtime.jit.nvrtc import compile_cuda

    source = getattr(merge_state, f"{kind}_source")
    mk = source(dtype)
    res = compile_cuda(mk.source, arch="sm_90a", name=f"{mk.kernel_name}.cu", verbose=True)
    assert f"Compiling entry function '{mk.kernel_name}'" in res.log
    assert "0 bytes spill stores, 0 bytes spill loads" in res.log
    with pytest.raises(CodegenError, match="bfloat16 or float16"):
        source("float32")
