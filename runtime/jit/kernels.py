"""The one kernel cache: every kernel attncc launches (flex FA2 / FA3 prefill, the transform
pre-pass, serving FA2 / FA3 batch and decode, the merge kernel) comes from `get_kernel(spec)`.

A `KernelSpec` (kernel kind, the variant's IR key, head dim, dtype, tiles, form, fast_math,
device) -> `generate` (one function per kind: the translation unit) -> `compile_spec` (the disk
cache of `jit/cache.py`, and the single place where a spill or a ptxas wgmma note picks the
fallback form) -> `launcher.load_kernel`. One dict, one lock, one double-checked lookup.

ptxas's output is not always a pure function of its input (a fresh H200 machine returned a
spilled cubin for a source that compiles spill-free everywhere else:
docs/kernel-interface.md#8-the-kernel-cache), so a form that spills past what it is expected
to (`spill_budget`) is compiled again in a fresh NVRTC program, then once in a fresh
subprocess, before a fallback form is considered; a spilled cubin reaches the disk cache only
when all three compiles agree (marked confirmed, so later processes trust it); and a kernel loaded with local memory where none was expected is a `ResourceError`
under ATTNCC_STRICT_RESOURCES=1 (a warning otherwise).

Example (generating needs neither NVRTC nor a GPU):
    >>> spec = KernelSpec("merge", dtype="bfloat16")
    >>> generate(spec).kernel_name
    'attncc_merge_state_bf16'
    >>> spill_budget(KernelSpec("fa2_prefill", tiles=KernelTiles(128, 64, 2, 2)))
    192
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from attncc.codegen.generate import PRESSURE_LEVELS, pressure_levels, use_template_cache
from attncc.codegen.tiles import BackwardTiles, KernelTiles
from attncc.errors import ResourceError
from attncc.ir.program import VariantIR

from .cache import KernelCache, cached_compile, is_confirmed, store_compile
from .forms import FormMemo
from .nvrtc import NvrtcResult, compile_cuda
from .policy import spill_bytes, stack_frame, wgmma_notes
from .tiles import LaunchConfig, fa2_config

_LOG = logging.getLogger("attncc")
# seconds a compile runs before it says so (compile_form)
SLOW_COMPILE_S = 1.0

__all__ = ["KINDS", "FA2_SPILL_BUDGET", "STRICT_ENV",
           "KernelSpec", "Generated", "CompiledForm", "KernelRecord", "LoadedKernel",
           "variant_key", "generate", "spill_budget", "compile_form", "compile_spec",
           "get_kernel", "check_resources", "clear_loaded", "loaded_generation", "KernelTiles"]

KINDS = ("fa2_prefill", "fa3_prefill", "fa2_batch", "decode", "fa3_batch", "prepass", "merge",
         "fa2_backward", "fa3_backward", "bwd_rows", "bwd_dq")

# Spill bytes (stores + loads, ptxas -v) an FA2 form may have before the prefill path falls back
# to smaller tiles. One fragment per warp: none. Two: ptxas at the 255-register cap spills a few
# words for some hooks, and those kernels still beat the spill-free one-fragment fallback
# (docs/fa2.md, "Two fragments per warp").
FA2_SPILL_BUDGET = {1: 0, 2: 192}

STRICT_ENV = "ATTNCC_STRICT_RESOURCES"


def variant_key(ir: VariantIR | None) -> tuple:
    """What identifies a variant's kernels: its hooks' (interned) expressions, normalization,
    name and captured declarations.

    Example:
        >>> variant_key(VariantIR(name="plain")) == variant_key(VariantIR(name="plain"))
        True
    """
    if ir is None:
        return ()
    return (tuple((n, h.expr) for n, h in ir.hooks.items()), ir.normalize, ir.name, ir.scalars,
            ir.tensors)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel to build: hashable, compared by the variant's key (`ir_key`), not the IR object.

    `kind` is one of KINDS; `tiles` the FA2/FA3 tiles (None for prepass and merge); `paired` /
    `low_pressure` the FA3 forms; `fast_math` the hooks' math (the FA3 batch kernel uses the
    template's default); `forced` marks FA2 tiles the user gave (kernel_options): compiled as
    given, no fallback, no resource check; `device` the CUDA device (None: compile only).
    "fa2_backward" takes `BackwardTiles`, `fallbacks` (the forms compile_spec tries after
    them, attncc.codegen.tiles.backward_fallbacks) and `grad_tensors`, the captured tensors whose
    gradients its CapturedGrad hook accumulates (docs/backward.md, "Kernels"); `exact_grads`
    (both backward kinds): in exact, order-independent integer sums (the deterministic mode). "fa3_backward"
    (sm_90a, `attncc.codegen.tiles.FA3_BACKWARD_TILES`) takes the FA2-class forms as its
    `fallbacks`: a variant whose FA3-class form spills runs the FA2-class kernel. `kv_dtype`: an
    fp8 KV cache's dtype name ("float8_e4m3fn" / "float8_e5m2"; the FA2 batch and decode kinds
    only), None when the cache holds `dtype`. `head_dims` (the FA2 kinds): the real (query/key,
    value) head dims of a padded form, whose `head_dim` is their padded width
    (attncc.codegen.tiles.padded_head_dim); None: both `head_dim`.

    Example:
        >>> a = KernelSpec("prepass", ir=VariantIR(name="x"), head_dim=64)
        >>> a == replace(a, ir=VariantIR(name="x")), a == replace(a, head_dim=128)
        (True, False)
    """

    kind: str
    ir: VariantIR | None = field(default=None, compare=False, repr=False)
    head_dim: int = 0
    dtype: str = "bfloat16"
    tiles: KernelTiles | BackwardTiles | None = None
    paired: bool = False
    low_pressure: int = 0
    fast_math: bool = True
    forced: bool = False
    device: int | None = None
    grad_tensors: tuple[str, ...] = ()
    fallbacks: tuple[BackwardTiles, ...] = ()
    kv_dtype: str | None = None
    head_dims: tuple[int, int] | None = None
    exact_grads: bool = False
    ir_key: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kernel kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if (self.paired and self.kind != "fa3_prefill") or (
                self.low_pressure and self.kind not in ("fa3_prefill", "fa3_batch",
                                                        "fa3_backward")):
            raise ValueError(f"a {self.kind} kernel has no paired / low-pressure form")
        levels = pressure_levels(self.kind == "fa3_backward")
        if int(self.low_pressure) not in levels:
            raise ValueError(f"low_pressure={self.low_pressure!r}: a {self.kind} kernel's "
                             f"levels are {levels}")
        if self.kv_dtype is not None and self.kind not in ("fa2_batch", "decode"):
            raise ValueError(f"kv_dtype={self.kv_dtype!r}: fp8 KV caches run on the fa2_batch "
                             f"and decode kernels, not {self.kind}")
        if self.exact_grads and self.kind not in ("fa2_backward", "fa3_backward"):
            raise ValueError(f"exact_grads: a form of the backward kernels, not of {self.kind}")
        if self.head_dims is not None and self.kind not in ("fa2_prefill", "fa2_batch",
                                                            "decode", "fa3_prefill"):
            raise ValueError(f"a {self.kind} kernel has no padded head-dim form")
        object.__setattr__(self, "ir_key", variant_key(self.ir))


@dataclass(frozen=True)
class Generated:
    """A spec's translation unit (in its form) and what launching it needs."""

    spec: KernelSpec
    source: str
    kernel_name: str
    attention_layout: Any  # the first argument struct (AttentionParams / BatchParams / ...)
    params_layout: Any  # VariantParams_<name>, None for the merge kernel
    threads: int
    smem_bytes: int  # dynamic shared memory to request
    config: LaunchConfig | None  # the attention kernels' tiles as launched
    grads_layout: Any = None  # a backward kernel's VariantGrads_<name> (its third argument)


# ------------------------------------------------------------------------------- generate
def _fa2(spec: KernelSpec) -> Generated:
    from .sources import fa2_source

    t = spec.tiles
    cfg = fa2_config(spec.head_dim, t.tq, t.tkv, t.stages, t.m_frags, t.kv_warps)
    src, name, vp, ap = fa2_source(spec.ir, head_dim=spec.head_dim, dtype=spec.dtype, tq=t.tq,
                                   tkv=t.tkv, stages=t.stages, m_frags=t.m_frags,
                                   fast_math=spec.fast_math, batch=spec.kind != "fa2_prefill",
                                   kv_warps=t.kv_warps, kv_dtype=spec.kv_dtype,
                                   head_dims=spec.head_dims, half_rows=t.half_rows)
    return Generated(spec, src, name, ap, vp, cfg.threads, cfg.smem_bytes, cfg)


def _fa3(spec: KernelSpec) -> Generated:
    from attncc.codegen.generate import generate_source

    t = spec.tiles
    if spec.kind == "fa3_batch":  # the batch kernel's hooks use the template's default math
        gk = generate_source(spec.ir, head_dim=spec.head_dim, dtype=spec.dtype,
                             kernel="fa3batch", tiles=t, low_pressure=spec.low_pressure)
    else:
        gk = generate_source(spec.ir, head_dim=spec.head_dim, dtype=spec.dtype, kernel="fa3",
                             fast_math=spec.fast_math, tiles=t, paired=spec.paired,
                             low_pressure=spec.low_pressure, head_dims=spec.head_dims)
    cfg = LaunchConfig(spec.head_dim, t.tq, t.tkv, t.stages, 1, gk.threads // 32, gk.threads,
                    gk.shared_mem_bytes)
    return Generated(spec, gk.source, gk.kernel_name, gk.attention_params_layout,
                     gk.params_layout, gk.threads, gk.shared_mem_bytes, cfg)


def _prepass(spec: KernelSpec) -> Generated:
    from attncc.codegen.generate import generate_source

    gk = generate_source(spec.ir, head_dim=spec.head_dim, dtype=spec.dtype, kernel="prepass",
                         fast_math=spec.fast_math)
    return Generated(spec, gk.source, gk.kernel_name, gk.attention_params_layout,
                     gk.params_layout, gk.threads, 0, None)


def _fa2_backward(spec: KernelSpec) -> Generated:
    from attncc.codegen.generate import generate_source

    t = spec.tiles
    kernel = "fa3bwd" if spec.kind == "fa3_backward" else "fa2bwd"
    gk = generate_source(spec.ir, head_dim=spec.head_dim, dtype=spec.dtype, kernel=kernel,
                         fast_math=spec.fast_math, tiles=t, grad_tensors=spec.grad_tensors,
                         exact_grads=spec.exact_grads, low_pressure=spec.low_pressure)
    cfg = LaunchConfig(spec.head_dim, t.tq, t.tkv, t.stages, 1, gk.threads // 32, gk.threads,
                       gk.shared_mem_bytes)
    return Generated(spec, gk.source, gk.kernel_name, gk.attention_params_layout,
                     gk.params_layout, gk.threads, gk.shared_mem_bytes, cfg, gk.grads_layout)


def _merge(spec: KernelSpec) -> Generated:
    from attncc.codegen.merge_state import bwd_dq_source, bwd_rows_source, merge_state_source

    mk = {"merge": merge_state_source, "bwd_rows": bwd_rows_source,
          "bwd_dq": bwd_dq_source}[spec.kind](spec.dtype)
    return Generated(spec, mk.source, mk.kernel_name, mk.params_layout, None, 0, 0, None)


_GENERATORS: dict[str, Callable[[KernelSpec], Generated]] = {
    "fa2_prefill": _fa2, "fa2_batch": _fa2, "decode": _fa2, "fa3_prefill": _fa3,
    "fa3_batch": _fa3, "prepass": _prepass, "merge": _merge, "bwd_rows": _merge,
    "bwd_dq": _merge, "fa2_backward": _fa2_backward,
    "fa3_backward": _fa2_backward}


def generate(spec: KernelSpec) -> Generated:
    """The translation unit of `spec` (its IR as given: callers simplify). The FA3 forms are
    codegen parameters (`generate_source(paired=, low_pressure=)`: constexpr in the unit).

    Example:
        >>> from attncc.codegen.generate import form_text
        >>> from attncc.codegen.tiles import fa3_tiles
        >>> g = generate(KernelSpec("fa3_prefill", ir=VariantIR(name="p"), head_dim=128,
        ...                         tiles=fa3_tiles(3), paired=True, low_pressure=True))
        >>> form_text(paired=True, low_pressure=True) in g.source, g.kernel_name
        (True, 'attncc_p_fa3_d128_bf16_q128_k128_s3')
    """
    return _GENERATORS[spec.kind](spec)


# ------------------------------------------------------------------------------- compile
def spill_budget(spec: KernelSpec) -> int:
    """Spill bytes `spec`'s form is expected to stay within: FA2 two-fragment forms (prefill
    and batch) FA2_SPILL_BUDGET[2], every other form none (it is the spill-free form)."""
    if spec.kind in ("fa2_prefill", "fa2_batch") and spec.tiles is not None:
        return FA2_SPILL_BUDGET[spec.tiles.m_frags]  # one mainloop (kernels/fa2/fa2_attend.cuh)
    return 0


@dataclass(frozen=True)
class CompiledForm:
    """One compiled form: what NVRTC returned and what ptxas reported."""

    gen: Generated
    result: NvrtcResult
    spill_bytes: int
    notes: tuple[str, ...]  # ptxas wgmma serialization notes (policy.wgmma_notes)
    retries: int  # recompiles because the form spilled past its budget
    budget: int
    confirmed: bool = False  # spilled past its budget in every compile (here or in a cache)

    @property
    def spec(self) -> KernelSpec:
        return self.gen.spec

    @property
    def pressure(self) -> tuple[int, int]:
        """(spill bytes, wgmma notes): what the FA3 fallback compares."""
        return self.spill_bytes, len(self.notes)


def _verbose(spec: KernelSpec) -> bool:
    # the variant-free kernels are compiled without ptxas's report
    return spec.kind not in ("merge", "bwd_rows", "bwd_dq")


def compile_form(spec: KernelSpec, arch: str) -> CompiledForm:
    """Compile exactly `spec`'s form (through the disk cache). A result that spills past
    `spill_budget(spec)` is compiled again in a fresh NVRTC program, then once in a fresh
    subprocess. A spilled result is written to the disk cache only once all three agree, marked
    confirmed; an unconfirmed spilled entry read from disk (an older cache) is recompiled. A
    compile still running after `SLOW_COMPILE_S` says so once (`_announced`)."""
    # jinja's compiled templates beside the cubins: a warm start does not compile them again
    use_template_cache(KernelCache.default().dir / "templates")
    gen = generate(spec)
    with _announced(f"kernel {gen.kernel_name} for variant {spec.ir.name if spec.ir else '-'} "
                    f"({arch})"):
        return _compile_generated(spec, arch, gen)


@contextlib.contextmanager
def _announced(what: str) -> Iterator[None]:
    """Log one line (logger "attncc", WARNING: shown without any logging setup) if the body
    is still running after SLOW_COMPILE_S, so a first call's compile does not look like a
    hang (docs/jit.md, "Cold start")."""
    timer = threading.Timer(SLOW_COMPILE_S, _LOG.warning, (
        "attncc: compiling %s; the first use of a kernel form compiles it (seconds), later "
        "calls and processes read it from %s", what, KernelCache.default().dir))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _compile_generated(spec: KernelSpec, arch: str, gen: Generated) -> CompiledForm:
    """compile_form's work once `spec` is rendered."""
    budget, verbose, name = spill_budget(spec), _verbose(spec), f"{gen.kernel_name}.cu"

    def within(r: NvrtcResult) -> bool:
        return spill_bytes(r.log) <= budget

    res, hit = cached_compile(gen.source, arch=arch, name=name, verbose=verbose, keep=within)
    retries, confirmed = 0, False
    if not within(res):
        if hit and is_confirmed(gen.source, arch=arch, name=name, verbose=verbose):
            confirmed = True
        else:
            for again in (_compile_fresh, _compile_in_subprocess):
                retries += 1
                res = again(gen.source, arch, name, verbose) or res
                if within(res):
                    store_compile(gen.source, res, arch=arch, name=name, verbose=verbose)
                    break
            else:  # three compiles agree: later lookups (this process too) trust it
                confirmed = True
                store_compile(gen.source, res, arch=arch, name=name, verbose=verbose,
                              confirmed=True)
    return CompiledForm(gen, res, spill_bytes(res.log), tuple(wgmma_notes(res.log)), retries,
                        budget, confirmed)


def _compile_fresh(source: str, arch: str, name: str, verbose: bool) -> NvrtcResult:
    """A new NVRTC program in this process (no cache)."""
    return compile_cuda(source, arch=arch, name=name, verbose=verbose)


_SUBPROCESS = r"""
import importlib.util, json, sys, types
errors_py, nvrtc_py, work = sys.argv[1:4]
pkg = types.ModuleType("attncc"); pkg.__path__ = []; sys.modules["attncc"] = pkg
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod
    spec.loader.exec_module(mod); return mod
load("attncc.errors", errors_py)
nv = load("attncc_nvrtc_only", nvrtc_py)
args = json.load(open(work + "/args.json"))
r = nv.compile_cuda(open(work + "/source.cu").read(), **args)
open(work + "/cubin", "wb").write(r.cubin)
json.dump({"log": r.log, "options": list(r.options)}, open(work + "/result.json", "w"))
"""


def _compile_in_subprocess(source: str, arch: str, name: str,
                           verbose: bool) -> NvrtcResult | None:
    """A compile in a fresh Python process that imports only jit/nvrtc.py (and the errors it
    raises): no torch, no CUDA context, nothing this process did before. None (and a warning)
    if that process fails: the spilled result then stands and the fallback forms follow."""
    import attncc.errors

    with tempfile.TemporaryDirectory(prefix="attncc-recompile-") as work:
        Path(work, "source.cu").write_text(source)
        Path(work, "args.json").write_text(json.dumps(
            {"arch": arch, "name": name, "verbose": verbose}))
        cmd = [sys.executable, "-c", _SUBPROCESS, attncc.errors.__file__,
               str(Path(__file__).with_name("nvrtc.py")), work]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            warnings.warn(f"attncc: {name} spilled where its form is expected not to, and the "
                          f"recompile in a fresh process failed:\n{done.stderr[-2000:]}",
                          RuntimeWarning, stacklevel=3)
            return None
        meta = json.loads(Path(work, "result.json").read_text())
        return NvrtcResult(Path(work, "cubin").read_bytes(), None, meta["log"],
                           tuple(meta["options"]))


def _fa2_fallback(spec: KernelSpec, arch: str, trail: list[CompiledForm]) -> CompiledForm:
    """One fragment per warp (half the accumulators per thread), then smaller KV tiles (fewer S
    accumulators), then smaller query tiles (more CTAs, same registers per thread), until a
    form is within its budget; tiles the user forced are compiled as given."""
    t = spec.tiles
    tiles = [(t.tq, t.tkv, t.m_frags)]
    tiles += [(t.tq, t.tkv, 1)] if t.m_frags > 1 else []
    tiles += [(t.tq, k, 1) for k in (32,) if k < t.tkv]
    tiles += [(q, min(t.tkv, 64), 1) for q in (64,) if q < t.tq]
    for i, (tq, tkv, mf) in enumerate(tiles):
        fa2_config(spec.head_dim, tq, tkv, t.stages, mf)  # ValueError naming a bad tile
        form = compile_form(replace(spec, tiles=replace(t, tq=tq, tkv=tkv, m_frags=mf)), arch)
        trail.append(form)
        if form.spill_bytes <= form.budget or i == len(tiles) - 1 or spec.forced:
            return form
    raise AssertionError("unreachable: the last tile returns")


def _backward_fallback(spec: KernelSpec, arch: str, trail: list[CompiledForm]) -> CompiledForm:
    """The backward form of `spec.tiles`, then each of `spec.fallbacks`, until ptxas reports
    neither spills nor a stack frame (its forms sit a few registers under 255 and which one fits
    depends on the hooks: docs/backward.md, "Kernels"); the last one otherwise."""
    forms = (spec.tiles, *spec.fallbacks)
    for i, tiles in enumerate(forms):
        form = compile_form(replace(spec, tiles=tiles, fallbacks=()), arch)
        trail.append(form)
        if (form.spill_bytes == 0 and stack_frame(form.result.log) == 0) or i == len(forms) - 1:
            return form
    raise AssertionError("unreachable: the last form returns")


def _fa3_backward_fallback(spec: KernelSpec, arch: str,
                           trail: list[CompiledForm]) -> CompiledForm:
    """The FA3-class backward's forms by pressure level (query sub-tiles of 64, 32, then 16
    columns): the first with neither spills, a stack frame nor serialized wgmmas (ptxas's
    C751x notes); else the first with neither spills nor a stack frame (serialized wgmmas cost
    speed, not correctness, and keep the FA3-class form); else the FA2-class forms of
    `spec.fallbacks` (docs/backward.md, "The FA3-class kernel"). The caller launches the
    returned form's spec, whichever kind it is."""
    unspilled = None
    for low in PRESSURE_LEVELS:
        form = compile_form(replace(spec, fallbacks=(), low_pressure=low), arch)
        trail.append(form)
        if form.spill_bytes == 0 and stack_frame(form.result.log) == 0:
            if not form.notes:
                return form
            unspilled = unspilled or form
    if unspilled is not None:
        return unspilled
    if not spec.fallbacks:
        return form
    fa2 = replace(spec, kind="fa2_backward", tiles=spec.fallbacks[0],
                  fallbacks=spec.fallbacks[1:], low_pressure=False)
    return _backward_fallback(fa2, arch, trail)


def _fa3_low_pressure(spec: KernelSpec, arch: str, trail: list[CompiledForm]) -> CompiledForm:
    """The form as it is and, if it spills or loses its wgmma pipeline, its low-pressure form,
    kept only if that does better."""
    first = compile_form(spec, arch)
    trail.append(first)
    if first.pressure == (0, 0):
        return first
    low = compile_form(replace(spec, low_pressure=True), arch)
    trail.append(low)
    return low if low.pressure < first.pressure else first


def _fa3_fallback(spec: KernelSpec, arch: str, trail: list[CompiledForm]) -> CompiledForm:
    """A CTA pair whose forms all spill (where the single-CTA form does not: document_causal
    at head dim 128, NVRTC 12.9) runs unpaired: the caller launches the returned spec."""
    form = _fa3_low_pressure(spec, arch, trail)
    if spec.paired and form.pressure != (0, 0):
        form = _fa3_low_pressure(replace(spec, paired=False), arch, trail)
    return form


def compile_spec(spec: KernelSpec, arch: str,
                 trail: list[CompiledForm] | None = None) -> CompiledForm:
    """The form attncc runs for `spec` (IR simplified), compiled: FA2 prefill walks its
    fallback tiles, FA3 (dense and batch) its low-pressure and unpaired forms, every other kind
    is one form. `trail`, if given, receives every form compiled, in order. Needs NVRTC only.

    Example (compiling needs NVRTC):
        >>> from attncc.runtime.jit.nvrtc import available
        >>> if available():
        ...     f = compile_spec(KernelSpec("merge", dtype="float16"), "sm_90a")
        ...     assert f.spill_bytes == 0 and f.spec.kind == "merge"
    """
    if trail is not None:  # the caller wants every form compiled: no memo
        return _walk_forms(spec, arch, trail)
    memo = FormMemo.default()
    key = memo.key(spec, arch)
    form = memo.load(key)  # a warm start: no rendering, no hashing of the source
    if isinstance(form, CompiledForm):  # re-pointed at the caller's IR object and device
        own = replace(form.gen.spec, ir=spec.ir, device=spec.device)
        return replace(form, gen=replace(form.gen, spec=own))
    form = _walk_forms(spec, arch, [])
    memo.save(key, form)
    return form


def _walk_forms(spec: KernelSpec, arch: str, trail: list[CompiledForm]) -> CompiledForm:
    """compile_spec's search over a kind's forms, each through the cubin cache."""
    if spec.kind == "fa2_prefill" and spec.tiles is not None:
        return _fa2_fallback(spec, arch, trail)
    if spec.kind == "fa2_backward":
        return _backward_fallback(spec, arch, trail)
    if spec.kind == "fa3_backward":
        return _fa3_backward_fallback(spec, arch, trail)
    if spec.kind in ("fa3_prefill", "fa3_batch"):
        return _fa3_fallback(spec, arch, trail)
    form = compile_form(spec, arch)
    trail.append(form)
    return form


# ------------------------------------------------------------------------------- load
@dataclass(frozen=True)
class KernelRecord:
    """The resources of a loaded kernel: ptxas's spill bytes, the driver's local bytes (the
    largest of its functions), registers, recompiles, the spill budget of its form (None:
    tiles forced by the user, not checked), ptxas's stack frame (the largest of its functions:
    what the driver's local bytes must match) and whether a spill past the budget was
    confirmed (the compiler returned it in every compile the cache made, here or earlier)."""

    kernel_name: str
    spill_bytes: int
    local_bytes: int
    registers: int
    retries: int
    spill_budget: int | None
    stack_bytes: int = 0
    confirmed: bool = False

    def problem(self) -> str | None:
        """What cannot be (None: nothing): a loaded kernel with more local memory than ptxas
        reported for the cubin, or a spill past the budget that was never recompiled.

        Example:
            >>> print(KernelRecord("k", 16, 8, 168, 0, 0, 8).problem())
            ptxas spilled 16 B (budget 0 B) and the result was not recompiled
            >>> print(KernelRecord("k", 0, 32, 168, 0, 0, 0).problem())
            the loaded kernel uses 32 B of local memory where ptxas reported a 0 B stack frame
            >>> KernelRecord("k", 0, 32, 168, 0, 0, 32).problem() is None  # a local array
            True
        """
        parts = []
        if self.local_bytes > self.stack_bytes:
            parts.append(f"the loaded kernel uses {self.local_bytes} B of local memory where "
                         f"ptxas reported a {self.stack_bytes} B stack frame")
        if self.over_budget() and not self.confirmed:
            parts.append(f"ptxas spilled {self.spill_bytes} B (budget {self.spill_budget} B) "
                         f"and the result was not recompiled")
        return " and ".join(parts) or None

    def over_budget(self) -> bool:
        """Whether ptxas spilled past the form's budget (a forced tile has none)."""
        return self.spill_budget is not None and self.spill_bytes > self.spill_budget


@dataclass
class LoadedKernel:
    """A spec's kernel as loaded: the form compiled (`spec`: the fallback applied), its
    launcher (and the batch kernels' merge kernel), tiles, simplified IR, log and record."""

    spec: KernelSpec
    launcher: Any  # launcher.KernelLauncher
    merge: Any | None
    config: LaunchConfig | None
    ir: VariantIR | None
    log: str
    record: KernelRecord

    @property
    def paired(self) -> bool:
        return self.spec.paired


def check_resources(record: KernelRecord) -> None:
    """What cannot be (`KernelRecord.problem`) raises ResourceError under
    ATTNCC_STRICT_RESOURCES=1 and warns otherwise; a spill past the budget that every compile
    confirmed (a form the compiler cannot fit: docs/kernel-interface.md#8-the-kernel-cache)
    always warns, so a benchmark or a user sees that the kernel runs with local memory.

    Example:
        >>> import os
        >>> saved = os.environ.get(STRICT_ENV)
        >>> os.environ[STRICT_ENV] = "1"
        >>> try:
        ...     check_resources(KernelRecord("attncc_k", 0, 8, 168, 0, 0, 0))
        ... except ResourceError as e:
        ...     print(str(e)[:60])
        attncc_k: the loaded kernel uses 8 B of local memory where p
        >>> _ = os.environ.pop(STRICT_ENV) if saved is None else os.environ.update(
        ...     {STRICT_ENV: saved})
    """
    problem = record.problem()
    if problem is not None:
        msg = (f"{record.kernel_name}: {problem}, after {record.retries} recompile(s). The "
               f"kernel cache should make this impossible (docs/kernel-interface.md#8-the-"
               f"kernel-cache); clear the kernel cache (ATTNCC_CACHE_DIR) and run again, and "
               f"report it with the NVRTC version if it stays")
        if os.environ.get(STRICT_ENV, "0") not in ("", "0"):
            raise ResourceError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    elif record.over_budget():
        warnings.warn(f"{record.kernel_name} runs with {record.spill_bytes} B of register "
                      f"spills ({record.local_bytes} B of local memory; budget "
                      f"{record.spill_budget} B): every compile of every fallback form spilled "
                      f"with this NVRTC (docs/kernel-interface.md#8-the-kernel-cache)",
                      RuntimeWarning, stacklevel=3)


_LOADED: dict[KernelSpec, LoadedKernel] = {}
_LOCK = threading.Lock()


def get_kernel(spec: KernelSpec) -> LoadedKernel:
    """The loaded kernel of `spec` (its device must be set), compiled and loaded on first use.

    Example:
        >>> import torch
        >>> if torch.cuda.is_available():  # doctest: +SKIP
        ...     k = get_kernel(KernelSpec("merge", dtype="bfloat16", device=0))
    """
    hit = _LOADED.get(spec)
    if hit is not None:
        return hit
    with _LOCK:
        hit = _LOADED.get(spec)
        if hit is None:
            hit = _load(spec)
            _LOADED[spec] = hit
        return hit


_GENERATION = [0]  # clear_loaded calls so far (`loaded_generation`)


def clear_loaded() -> None:
    """Forget every loaded kernel (the next use rebuilds)."""
    with _LOCK:
        _LOADED.clear()
        _GENERATION[0] += 1


def loaded_generation() -> int:
    """How many times `clear_loaded` ran: memos of loaded kernels outside this cache (the
    backward's, runtime/flex/backward.py) key on it, so they forget with it."""
    return _GENERATION[0]


def _arch(device: int) -> str:
    import torch

    from .nvrtc import device_arch

    with torch.cuda.device(device):
        return device_arch()


def _load(spec: KernelSpec) -> LoadedKernel:
    from .launcher import load_kernel

    if spec.device is None:
        raise ValueError(f"{spec.kind} kernel spec has device=None: get_kernel loads onto a "
                         f"device; use compile_spec to compile only")
    arch = _arch(spec.device)
    if spec.kind == "fa3_prefill" and not arch.startswith("sm_90"):
        raise ValueError(f"kernel_options['KERNEL']='fa3' needs an sm_90 (Hopper) GPU; this one "
                         f"is {arch}")
    if spec.kind == "fa3_backward" and not arch.startswith("sm_90"):
        raise ValueError(f"kernel_options['BACKWARD_KERNEL']='fa3' needs an sm_90 (Hopper) GPU; "
                         f"this one is {arch}")
    ir = spec.ir
    if ir is not None and spec.kind != "prepass":  # the pre-pass's IR comes simplified (hoist)
        from attncc.ir.simplified import simplify_variant

        ir = simplify_variant(ir)
    form = compile_spec(replace(spec, ir=ir), arch)
    gen = form.gen
    kl = load_kernel(form.result.cubin, gen.kernel_name, gen.attention_layout, gen.params_layout,
                     device=spec.device, dynamic_smem=gen.smem_bytes,
                     grads_layout=gen.grads_layout)
    merge = None
    if spec.kind in ("fa2_batch", "decode", "fa3_batch"):
        merge = load_kernel(form.result.cubin, gen.kernel_name + "_merge", gen.attention_layout,
                            gen.params_layout, device=spec.device)
    if gen.config is not None and kl.max_threads < gen.config.threads:
        raise RuntimeError(f"{gen.kernel_name}: the module allows {kl.max_threads} threads per "
                           f"block but the config needs {gen.config.threads}; the Python tiles "
                           f"and the kernel's Config disagree")
    local = max(kl.local_bytes, merge.local_bytes if merge is not None else 0)
    as_given = spec.forced and spec.kind == "fa2_prefill"  # the user's tiles, no fallback
    record = KernelRecord(gen.kernel_name, form.spill_bytes, local, kl.num_regs, form.retries,
                          None if as_given else form.budget, stack_frame(form.result.log),
                          form.confirmed)
    check_resources(record)
    return LoadedKernel(gen.spec, kl, merge, gen.config, ir, form.result.log, record)
