"""runtime/jit/kernels.py, the one kernel cache: specs, the generated forms, the fallback and
retry policy (with a fake compiler that spills when told to), the disk cache never holding a
spilled cubin, and the resource check on load (with a fake launcher)."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from attncc.codegen.tiles import KernelTiles, fa3_tiles
from attncc.errors import ResourceError
from attncc.ir.program import VariantIR
from attncc.runtime.jit import cache as cache_mod
from attncc.runtime.jit import kernels
from attncc.runtime.jit.kernels import (KernelRecord, KernelSpec, compile_form, compile_spec,
                                        generate, get_kernel)
from attncc.runtime.jit.nvrtc import NvrtcResult
from attncc.gym import GYM
from tests.helpers.forms import LOW_PRESSURE, PAIRED

ROOT = Path(__file__).resolve().parent.parent
ARCH = "sm_90a"


def _ir(name: str = "causal", d: int = 64) -> VariantIR:
    from attncc.ir.simplify import simplify_variant

    return simplify_variant(GYM[name](1, 4, 256, d).trace()[0])


def _log(spill: int) -> str:
    return (f"ptxas info    : Used 168 registers\nptxas info    : {spill // 2} bytes spill "
            f"stores, {spill - spill // 2} bytes spill loads")


class FakeCompiler:
    """Stands in for NVRTC in all three places the cache compiles (cached_compile, a fresh
    program, a fresh subprocess). `spills(source, attempt)` says how many bytes ptxas
    "spilled"; every call is recorded as (where, which form, attempt)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, spills: Any) -> None:
        self.spills = spills
        self.calls: list[tuple[str, str]] = []
        self.attempts: dict[str, int] = {}
        monkeypatch.setattr(cache_mod, "compile_cuda", self._cached)
        monkeypatch.setattr(kernels, "compile_cuda", self._fresh)
        monkeypatch.setattr(kernels, "_compile_in_subprocess", self._subprocess)
        monkeypatch.setattr(cache_mod, "nvrtc_version", lambda: (0, 0))  # no NVRTC needed
        monkeypatch.setattr(cache_mod, "loaded_version", lambda: (0, 0))

    def _result(self, where: str, source: str) -> NvrtcResult:
        form = _form(source)
        n = self.attempts[source] = self.attempts.get(source, 0) + 1
        self.calls.append((where, form))
        spill = self.spills(form, n)
        return NvrtcResult(f"cubin {form} #{n} spill {spill}".encode(), None, _log(spill),
                           ("--fake",))

    def _cached(self, source: str, **kw: Any) -> NvrtcResult:
        return self._result("cache", source)

    def _fresh(self, source: str, **kw: Any) -> NvrtcResult:
        return self._result("fresh", source)

    def _subprocess(self, source: str, arch: str, name: str, verbose: bool) -> NvrtcResult:
        return self._result("subprocess", source)


def _form(source: str) -> str:
    """'low+pair', 'pair', 'low' or 'plain', and '_m2' for an FA2 two-fragment form."""
    form = "+".join(n for n, m in (("low", LOW_PRESSURE), ("pair", PAIRED))
                    if m in source) or "plain"
    return form + ("_m2" if re.search(r"_fa2_d\d+_\w+_s\d_m2\b", source) else "")


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> cache_mod.KernelCache:
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    kernels.clear_loaded()
    yield cache_mod.KernelCache.default()
    kernels.clear_loaded()
    cache_mod._key.cache_clear()  # keys computed under a fake NVRTC version


def _disk_cubins(kc: cache_mod.KernelCache) -> list[bytes]:
    payloads = (cache_mod.decode_entry(p.read_bytes()) for p in kc.entries())
    return sorted(cache_mod.decode_result(b).cubin for b in payloads
                  if b != cache_mod.CONFIRMED_MARK)


def _fa3(ir: VariantIR | None = None, **kw: Any) -> KernelSpec:
    return KernelSpec("fa3_prefill", ir if ir is not None else _ir("causal", 128), 128,
                      "bfloat16", fa3_tiles(3), **kw)


# ------------------------------------------------------------------------------------ specs
def test_spec_is_keyed_by_the_variant_not_the_ir_object() -> None:
    """Two traces of one variant are one spec (one cache entry); a different variant, head dim,
    tile or form is another; a kind outside KINDS is refused."""
    a, b = _fa3(_ir("causal", 128)), _fa3(_ir("causal", 128))
    assert a.ir is not b.ir and a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != _fa3(_ir("softcap", 128)) and a != replace(a, paired=True)
    assert a != replace(a, low_pressure=True) and a != replace(a, tiles=fa3_tiles(2, 64))
    assert replace(a, ir=_ir("alibi", 128)).ir_key == kernels.variant_key(_ir("alibi", 128))
    with pytest.raises(ValueError, match="kernel kind 'fa4'"):
        KernelSpec("fa4")


def test_generate_matches_each_subsystems_generator() -> None:
    """Each kind's translation unit is byte for byte what its subsystem generated before the
    cache owned it (so every cubin stays the same), and the forms' macros are prepended in
    one place, low-pressure before pair."""
    from attncc.codegen.generate import generate_source
    from attncc.codegen.merge_state import merge_state_source
    from attncc.runtime.flex.prepass import prepass_source
    from attncc.runtime.jit.sources import fa2_source
    from attncc.runtime.serving.fa3_batch import fa3_batch_source, fa3_batch_tiles

    ir = _ir("rope", 64)
    dense = generate_source(ir, head_dim=64, dtype="bfloat16", kernel="fa3", fast_math=True,
                            tiles=fa3_tiles(4))
    spec = KernelSpec("fa3_prefill", ir, 64, "bfloat16", fa3_tiles(4))
    assert generate(spec).source == dense.source
    for paired, low in ((True, False), (False, True), (True, True)):
        form = generate_source(ir, head_dim=64, dtype="bfloat16", kernel="fa3", fast_math=True,
                               tiles=fa3_tiles(4), paired=paired, low_pressure=low)
        assert generate(replace(spec, paired=paired, low_pressure=low)).source == form.source
    with pytest.raises(ValueError, match="no paired"):
        generate(KernelSpec("fa3_batch", ir, 64, "bfloat16", fa3_tiles(4), paired=True))
    batch = KernelSpec("fa3_batch", ir, 64, "bfloat16", fa3_batch_tiles(64))
    assert generate(batch).source == fa3_batch_source(ir, 64, "bfloat16").source
    fa2 = KernelSpec("fa2_prefill", ir, 64, "bfloat16", KernelTiles(128, 64, 2, 2))
    assert generate(fa2).source == fa2_source(ir, head_dim=64, dtype="bfloat16", tq=128,
                                              tkv=64, stages=2, m_frags=2)[0]
    dec = KernelSpec("decode", ir, 64, "bfloat16", KernelTiles(16, 32, 2, 1, 2))
    assert generate(dec).source == fa2_source(ir, head_dim=64, dtype="bfloat16", tq=16,
                                              tkv=32, batch=True, kv_warps=2)[0]
    assert generate(dec).config.threads == 64
    pre = KernelSpec("prepass", ir, 64, "bfloat16")
    assert generate(pre).source == prepass_source(ir, head_dim=64, dtype="bfloat16").source
    assert (generate(KernelSpec("merge", dtype="float16")).source
            == merge_state_source("float16").source)


def test_only_the_kernel_cache_compiles_or_loads_kernels() -> None:
    """No subsystem keeps its own compile-and-load cache: outside runtime/jit/, nothing calls
    cached_compile or load_kernel, or holds a module-level `_KERNELS` dict."""
    offenders = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        if path.parent.name == "jit":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("cached_compile", "load_kernel", "compile_cuda"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {name}")
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id == "_KERNELS":
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {t.id}")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------ retries
def test_a_spill_free_form_that_spills_once_is_recompiled_and_cached_clean(
        fresh_cache: cache_mod.KernelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first compile spills 16 B (what ptxas did on a fresh H200): a fresh NVRTC program
    compiles it again, spill-free; that one is used and written to disk; the spilled cubin
    never is. A later process (memory cleared) reads the clean one without compiling."""
    fake = FakeCompiler(monkeypatch, lambda form, n: 16 if n == 1 else 0)
    form = compile_form(_fa3(), ARCH)
    assert (form.spill_bytes, form.retries) == (0, 1)
    assert [w for w, _ in fake.calls] == ["cache", "fresh"]
    assert _disk_cubins(fresh_cache) == [form.result.cubin] and b"spill 0" in form.result.cubin
    fresh_cache.clear_memory()
    kernels.clear_loaded()
    again = compile_form(_fa3(), ARCH)
    assert again.result.cubin == form.result.cubin and again.retries == 0
    assert len(fake.calls) == 2


def test_a_second_spill_goes_to_a_fresh_subprocess(fresh_cache: cache_mod.KernelCache,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCompiler(monkeypatch, lambda form, n: 16 if n <= 2 else 0)
    form = compile_form(_fa3(), ARCH)
    assert (form.spill_bytes, form.retries) == (0, 2)
    assert [w for w, _ in fake.calls] == ["cache", "fresh", "subprocess"]
    assert _disk_cubins(fresh_cache) == [form.result.cubin]


def test_a_form_that_always_spills_is_cached_once_confirmed(
        fresh_cache: cache_mod.KernelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three compiles, all spilled: asked again in this process, nothing is recompiled; the
    result goes to disk marked confirmed, so a later process (memory cleared) reads it without
    any compile, and one spilled compile alone is never persisted."""
    fake = FakeCompiler(monkeypatch, lambda form, n: 16)
    spec = KernelSpec("decode", _ir(), 64, "bfloat16", KernelTiles(16, 32, 2, 1, 2))
    form = compile_form(spec, ARCH)
    assert (form.spill_bytes, form.retries, form.budget) == (16, 2, 0)
    assert compile_form(spec, ARCH).result == form.result and len(fake.calls) == 3
    assert _disk_cubins(fresh_cache) == [form.result.cubin]
    fresh_cache.clear_memory()
    kernels.clear_loaded()
    again = compile_form(spec, ARCH)
    assert again.result.cubin == form.result.cubin and again.retries == 0
    assert form.confirmed and again.confirmed and len(fake.calls) == 3


def test_a_spilled_entry_already_on_disk_is_not_trusted(fresh_cache: cache_mod.KernelCache,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache written before this rule (or by a build without it) may hold a spilled cubin:
    read back, it is recompiled, and the clean result replaces it."""
    spec = _fa3()
    gen = generate(spec)
    name = f"{gen.kernel_name}.cu"
    bad = NvrtcResult(b"old spilled cubin", None, _log(16), ("--old",))
    cache_mod.store_compile(gen.source, bad, arch=ARCH, name=name, verbose=True)
    fake = FakeCompiler(monkeypatch, lambda form, n: 0)
    form = compile_form(spec, ARCH)
    assert form.spill_bytes == 0 and form.retries == 1 and fake.calls == [("fresh", "plain")]
    assert _disk_cubins(fresh_cache) == [form.result.cubin]


# ------------------------------------------------------------------------------------ fallback
def test_fa3_retries_before_the_low_pressure_form(fresh_cache: cache_mod.KernelCache,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair form that really spills (in all three compiles) falls back to its low-pressure
    form; if that spills too, to the single-CTA form -- each fallback only after the form before
    it was recompiled twice."""
    fake = FakeCompiler(monkeypatch, lambda form, n: 24 if "pair" in form else 0)
    trail: list = []
    form = compile_spec(_fa3(paired=True), ARCH, trail)
    assert not form.spec.paired and not form.spec.low_pressure and form.spill_bytes == 0
    assert [f.spec.low_pressure for f in trail] == [False, True, False]
    assert [f for _, f in fake.calls] == [
        "pair", "pair", "pair", "low+pair", "low+pair", "low+pair", "plain"]
    assert [w for w, _ in fake.calls[:3]] == ["cache", "fresh", "subprocess"]
    # the two confirmed spills (the third compile of each) and the clean single-CTA form
    assert _disk_cubins(fresh_cache) == [b"cubin low+pair #3 spill 24", b"cubin pair #3 spill 24",
                                         b"cubin plain #1 spill 0"]
    # a later process reads all three: no compile at all
    fresh_cache.clear_memory()
    kernels.clear_loaded()
    again = compile_spec(_fa3(paired=True), ARCH)
    assert not again.spec.paired and len(fake.calls) == 7


def test_fa3_keeps_the_first_form_when_a_retry_clears_it(fresh_cache: cache_mod.KernelCache,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 case: the unpaired dense D128 kernel spilled 16 B on the first compile only.
    The cache runs the spill-free first form, not the low-pressure one."""
    fake = FakeCompiler(monkeypatch, lambda form, n: 16 if n == 1 else 0)
    form = compile_spec(_fa3(), ARCH)
    assert not form.spec.low_pressure and (form.spill_bytes, form.retries) == (0, 1)
    assert all(f == "plain" for _, f in fake.calls)


def test_fa3_low_pressure_is_kept_only_when_it_spills_less(
        fresh_cache: cache_mod.KernelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCompiler(monkeypatch, lambda form, n: 8 if form == "low" else 16)
    assert compile_spec(_fa3(), ARCH).spec.low_pressure
    kernels.clear_loaded()
    FakeCompiler(monkeypatch, lambda form, n: 32 if form == "low" else 16)
    form = compile_spec(replace(_fa3(), ir=_ir("softcap", 128)), ARCH)
    assert not form.spec.low_pressure and form.spill_bytes == 16


def test_fa2_two_fragments_within_budget_are_not_retried(
        fresh_cache: cache_mod.KernelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-fragment FA2 form may spill up to FA2_SPILL_BUDGET[2] (no retry, cached); past it
    the form is retried, then the one-fragment form runs."""
    fake = FakeCompiler(monkeypatch, lambda form, n: 112 if form.endswith("_m2") else 0)
    spec = KernelSpec("fa2_prefill", _ir("causal", 128), 128, "bfloat16",
                      KernelTiles(128, 64, 2, 2))
    form = compile_spec(spec, ARCH)
    assert (form.spill_bytes, form.retries, form.spec.tiles.m_frags) == (112, 0, 2)
    assert len(fake.calls) == 1 and len(_disk_cubins(fresh_cache)) == 1
    fake = FakeCompiler(monkeypatch, lambda form, n: 300 if form.endswith("_m2") else 0)
    trail: list = []
    form = compile_spec(replace(spec, ir=_ir("softcap", 128)), ARCH, trail)
    assert form.spec.tiles.m_frags == 1 and form.spill_bytes == 0
    assert [f.spec.tiles.m_frags for f in trail] == [2, 1] and trail[0].retries == 2


def test_fa2_forced_tiles_are_compiled_as_given(fresh_cache: cache_mod.KernelCache,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCompiler(monkeypatch, lambda form, n: 300)
    spec = KernelSpec("fa2_prefill", _ir("causal", 128), 128, "bfloat16",
                      KernelTiles(128, 64, 2, 2), forced=True)
    trail: list = []
    assert compile_spec(spec, ARCH, trail).spec == spec and len(trail) == 1


@pytest.mark.nvrtc
def test_the_subprocess_recompile_gives_the_same_cubin() -> None:
    """The fresh-process compile (importing only jit/nvrtc.py and attncc/errors.py) returns
    the cubin and ptxas report an in-process compile gives."""
    from attncc.runtime.jit.nvrtc import compile_cuda

    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = expf(x[threadIdx.x]); }'
    here = compile_cuda(src, arch=ARCH, name="k.cu", verbose=True)
    there = kernels._compile_in_subprocess(src, ARCH, "k.cu", True)
    assert there.cubin == here.cubin and there.options == here.options
    assert "registers" in there.log and kernels.spill_bytes(there.log) == 0


# ------------------------------------------------------------------------------------ load
@dataclass
class FakeLauncher:
    kernel_name: str
    local_bytes: int
    num_regs: int = 168
    max_threads: int = 1024


def _fake_load(monkeypatch: pytest.MonkeyPatch, local_bytes: int) -> list[str]:
    from attncc.runtime.jit import launcher

    loaded: list[str] = []

    def load(cubin: bytes, name: str, *a: Any, **kw: Any) -> FakeLauncher:
        loaded.append(name)
        return FakeLauncher(name, local_bytes)

    monkeypatch.setattr(launcher, "load_kernel", load)
    monkeypatch.setattr(kernels, "_arch", lambda device: ARCH)
    return loaded


def test_get_kernel_loads_each_spec_once(fresh_cache: cache_mod.KernelCache,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One entry per spec (a second trace of the variant hits it); the batch kinds load their
    merge kernel too; the record carries spills, local bytes, registers and recompiles."""
    FakeCompiler(monkeypatch, lambda form, n: 16 if n == 1 else 0)
    loaded = _fake_load(monkeypatch, 0)
    spec = KernelSpec("fa3_batch", _ir("causal", 128), 128, "bfloat16", fa3_tiles(3), device=0)
    k = get_kernel(spec)
    assert get_kernel(replace(spec, ir=_ir("causal", 128))) is k
    assert loaded == [k.record.kernel_name, k.record.kernel_name + "_merge"]
    assert k.record == KernelRecord(k.record.kernel_name, 0, 0, 168, 1, 0, 0, False)
    assert k.merge is not None and k.config.threads == 384


def test_a_kernel_loaded_with_local_memory_is_an_error_in_strict_mode(
        fresh_cache: cache_mod.KernelCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver reports local memory for a form expected to have none: ResourceError naming
    the kernel, the bytes and the fix (strict, as the test suite runs), nothing is kept, and
    the next call tries again; outside strict mode a RuntimeWarning and the kernel."""
    monkeypatch.setenv(kernels.STRICT_ENV, "1")  # as tests/conftest.py sets it
    FakeCompiler(monkeypatch, lambda form, n: 0)
    loaded = _fake_load(monkeypatch, 8)
    spec = KernelSpec("merge", dtype="bfloat16", device=0)
    with pytest.raises(ResourceError, match=r"attncc_merge_state_bf16: .*8 B of local memory.*"
                                            r"ATTNCC_CACHE_DIR"):
        get_kernel(spec)
    with pytest.raises(ResourceError):
        get_kernel(spec)
    assert len(loaded) == 2
    monkeypatch.setenv(kernels.STRICT_ENV, "0")
    with pytest.warns(RuntimeWarning, match="8 B of local memory"):
        assert get_kernel(spec).record.local_bytes == 8


def test_resource_rules() -> None:
    """What cannot be: driver local bytes above ptxas's stack frame (a local array within its
    frame is fine), or a spill past the budget that was never recompiled. A spill past the
    budget that every compile confirmed is not a problem but warns (check_resources); FA2
    two-fragment forms within their budget and tiles the user forced are neither."""
    assert KernelRecord("k", 112, 96, 255, 0, 192, 96).problem() is None
    assert "300 B" in KernelRecord("k", 300, 256, 255, 2, 192, 256).problem()
    assert KernelRecord("k", 300, 256, 255, 2, 192, 256, True).problem() is None
    assert KernelRecord("k", 300, 256, 255, 2, 192, 256, True).over_budget()
    assert "8 B of local" in KernelRecord("k", 0, 8, 168, 0, 0, 0).problem()
    assert KernelRecord("k", 0, 32, 168, 0, 0, 32).problem() is None  # rope's local array
    assert KernelRecord("k", 300, 256, 255, 0, None, 256).problem() is None
    assert not KernelRecord("k", 300, 256, 255, 0, None, 256).over_budget()
    assert KernelRecord("k", 0, 0, 168, 0, 0).problem() is None
    # the FA2 batch kernels share the prefill mainloop, and its two-fragment budget
    assert kernels.spill_budget(KernelSpec("fa2_batch", tiles=KernelTiles(128, 64, 2, 2))) == 192
    assert kernels.spill_budget(KernelSpec("decode", tiles=KernelTiles(16, 32, 2, 1, 2))) == 0


def test_a_confirmed_spill_warns_even_outside_strict_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A form the compiler cannot fit (every compile spilled) runs, with a RuntimeWarning
    naming the kernel and the bytes, in strict mode too."""
    monkeypatch.setenv(kernels.STRICT_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"attncc_k runs with 420 B of register spills"):
        kernels.check_resources(KernelRecord("attncc_k", 420, 192, 168, 2, 0, 192, True))


# ------------------------------------------------------------------------------------ launch args
def test_flex_launch_arguments_fill_every_attention_param() -> None:
    """gpu_flex's launch-argument builders give every AttentionParams member the prefill
    kernels read (the packer accepts them as they are), with the block mask's lists and, for a
    persistent FA3 launch with a split tail, a zeroed counter and a partial-state workspace
    held until the launch."""
    import torch

    import attncc
    from attncc.runtime.flex import gpu_flex
    from attncc.runtime.flex.fa3_split import tail_split
    from attncc.runtime.jit.launcher import StructPacker

    q, k, v = (torch.zeros(2, 4, 300, 64, dtype=torch.bfloat16) for _ in "qkv")
    out, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    layout = generate(KernelSpec("fa2_prefill", _ir(), 64, "bfloat16",
                                 KernelTiles(128, 64, 2, 1))).attention_layout
    args = gpu_flex._attention_args(q, k, v, out, lse, 0.125, None)
    flat = StructPacker(layout).flatten(args)
    assert len(flat) == len(StructPacker(layout).names) and args["lse_stride_h"] == 300
    assert (args["tma"], args["item_counter"], args["split_partials"]) == (0, 0, 0)
    whole = gpu_flex._fa3_split_args(tail_split(24, 5, 300, 128), 64, torch.device("cpu"),
                                     dict(args))
    assert len(whole) == 1 and whole[0].dtype == torch.int32 and not whole[0].any()
    split = tail_split(24, 5, 4096, 128)  # 4 items in the last round of 5 CTAs: split
    keep = gpu_flex._fa3_split_args(split, 64, torch.device("cpu"), args)
    assert split.pieces and len(keep) == 2 and not keep[0].any()
    assert (args["item_counter"], args["split_partials"]) == tuple(t.data_ptr() for t in keep)
    assert keep[0].numel() == split.counter_ints()
    assert keep[1].numel() == split.partial_floats(64)
    bm = attncc.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                  300, 300, BLOCK_SIZE=128)
    m = gpu_flex._mask_args(bm, False, 2, 4, 300, 300, torch.device("cpu"))
    masked = gpu_flex._attention_args(q, k, v, out, lse, 0.125, m)
    assert masked["kv_indices"] == m.idx.data_ptr() and masked["block_q"] == 128
    assert len(StructPacker(layout).flatten(masked)) == len(flat)
