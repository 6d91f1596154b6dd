"""`attncc.compile`: a variant (or a plain mod function, or IR) -> a compiled CUDA kernel.

Pipeline: trace (`Variant.trace`) -> `simplify_variant` -> `generate_source` -> NVRTC through the
kernel cache. The cache key is the generated source plus NVRTC options/arch/version, and captured
values never enter the source (they travel in `Bindings`), so re-compiling a variant whose captured
scalar changed is a cache hit with the very same source. A second, in-process memo keyed by the
traced IR skips simplify/codegen entirely on a repeat call, so a warm `compile()` costs about as
much as the trace.

Example:
    >>> import torch, attncc
    >>> from attncc.runtime.jit.compile import compile
    >>> from attncc.runtime.jit.nvrtc import available
    >>> softcap = lambda score, b, h, q_idx, kv_idx: 30 * torch.tanh(score / 30)
    >>> if available():
    ...     k = compile(softcap, head_dim=128, dtype="bfloat16", arch="sm_90a")
    ...     assert k.cubin[:4] == b"\\x7fELF" and k.kernel_name in k.source
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attncc.codegen.export import export_source
from attncc.codegen.generate import generate_source, use_template_cache
from attncc.errors import CompileError
from attncc.frontend.variant import Variant, as_variant
from attncc.ir.analysis import check_vector_indices
from attncc.ir.program import Bindings, VariantIR

from .cache import KernelCache, cached_compile
from .nvrtc import normalize_arch

# Spellings accepted for `dtype`, mapped to the name codegen understands.
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


def dtype_name(dtype: Any) -> str:
    """Canonical storage dtype name for a string or a torch dtype.

    Example:
        >>> import torch
        >>> dtype_name(torch.bfloat16), dtype_name("fp16"), dtype_name("float16")
        ('bfloat16', 'float16', 'float16')
    """
    text = str(dtype)
    text = text[len("torch."):] if text.startswith("torch.") else text
    name = _DTYPE_ALIASES.get(text.lower())
    if name is None:
        raise CompileError(f"dtype={dtype!r} is not an attention dtype attncc compiles; use "
                           f"'bfloat16', 'float16' or 'float32' (or the torch dtype)")
    return name


def _check_head_dim(head_dim: Any) -> int:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise CompileError(f"head_dim={head_dim!r}: pass the size of the last dimension of q/k/v, "
                           f"a positive int such as 64 or 128")
    return head_dim


# The oldest GPU each kernel template runs on: FA2's cp.async and bf16 mma.sync need sm_80;
# FA3's wgmma, TMA and setmaxnreg exist only on sm_90a (neither sm_90 nor sm_100a has them).
_KERNEL_MIN_SM = {"fa2": 80, "fa2batch": 80}
_SM90A_ONLY = ("fa3", "fa3batch")


def check_kernel_arch(kernel: str, arch: str) -> None:
    """A CompileError, before any NVRTC call, when template `kernel` cannot run on `arch`.

    Example:
        >>> check_kernel_arch("fa3", "sm_90a"); check_kernel_arch("fa2", "sm_100a")
        >>> check_kernel_arch("fa3", "sm_80")
        Traceback (most recent call last):
        ...
        attncc.errors.CompileError: kernel='fa3' runs only on arch='sm_90a' (Hopper: H100/H200), not sm_80: it is built on wgmma, TMA and setmaxnreg, which exist only there; for sm_80 use kernel='fa2' (sm_80 and newer) or kernel='simple' (any GPU)
    """
    sm = int("".join(c for c in arch[3:] if c.isdigit()))
    if kernel in _SM90A_ONLY and arch != "sm_90a":
        fa2 = "kernel='fa2' (sm_80 and newer) or " if sm >= 80 else ""
        raise CompileError(f"kernel={kernel!r} runs only on arch='sm_90a' (Hopper: H100/H200), "
                           f"not {arch}: it is built on wgmma, TMA and setmaxnreg, which exist "
                           f"only there; for {arch} use {fa2}kernel='simple' (any GPU)")
    need = _KERNEL_MIN_SM.get(kernel)
    if need is not None and sm < need:
        raise CompileError(f"kernel={kernel!r} needs sm_{need} or newer (cp.async and bf16 "
                           f"tensor-core MMA), not {arch}; use kernel='simple' there")


def trace_variant(variant: Any) -> tuple[VariantIR, Bindings]:
    """(IR, captured values) for a Variant, a score_mod/mask_mod function, or a VariantIR.

    Example:
        >>> ir, b = trace_variant(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
        >>> sorted(ir.hooks), b.scalars
        (['mask_mod'], {})
    """
    if isinstance(variant, VariantIR):
        return variant, Bindings()
    v = variant if isinstance(variant, Variant) else as_variant(variant)
    return v.trace()


def _memo_key(ir: VariantIR, head_dim: int, dtype: str, arch: str, kernel: str) -> tuple:
    # IR nodes are interned, so the expression objects themselves are an exact structural key
    # (and holding them keeps them alive, so their identity stays stable). Source locations are
    # left out on purpose: the same expression written on another line compiles identically.
    hooks = tuple((name, hook.expr) for name, hook in ir.hooks.items())
    return ("compile", hooks, ir.normalize, ir.name, ir.scalars, ir.tensors, head_dim, dtype,
            arch, kernel)


@dataclass(frozen=True, eq=False)
class CompiledKernel:
    """A compiled attention kernel for one variant, head_dim, dtype, arch and kernel template.

    `ir` is the simplified IR the source was generated from; `bindings` holds the values captured
    at trace time (scalars and tensors, passed at launch in `VariantParams`); `params_layout` and
    `attention_params_layout` describe the two by-value kernel arguments; `log` is NVRTC's log;
    `cache_hit` says whether the cubin came from the cache (memory or disk).

    Example:
        >>> import tempfile
        >>> from attncc.runtime.jit.nvrtc import available
        >>> if available():
        ...     k = compile(lambda b, h, q, kv: q >= kv, head_dim=64, arch="sm_90a")
        ...     assert k.ptx().lstrip().startswith("//") and k.export(tempfile.mkdtemp()).exists()
    """

    ir: VariantIR
    bindings: Bindings
    source: str = field(repr=False)
    cubin: bytes = field(repr=False)
    kernel_name: str
    arch: str
    head_dim: int
    dtype: str
    kernel: str
    params_layout: Any = field(repr=False)
    attention_params_layout: Any = field(repr=False)
    log: str = field(repr=False)
    cache_hit: bool
    options: tuple[str, ...] = field(repr=False, default=())
    _cache: KernelCache | None = field(repr=False, default=None)
    _ptx_text: str | None = field(repr=False, default=None, init=False)

    def ptx(self) -> str:
        """The kernel as PTX for this arch's virtual target (compiled on first call, cached).

        Handy to read what the variant compiled to, or to JIT on a GPU newer than the cubin's.
        """
        if self._ptx_text is None:
            res, _ = cached_compile(self.source, arch=self.arch, emit="ptx",
                                    cache=self._cache if self._cache is not None else False,
                                    name=f"{self.kernel_name}.cu")
            object.__setattr__(self, "_ptx_text", res.ptx)  # frozen: memoize without mutation API
        return self._ptx_text  # type: ignore[return-value]

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Write a standalone .cu for this kernel (`nvcc -c` compiles it); returns the file path.

        A directory as `path` gets `<kernel_name>.cu` inside it.
        """
        p = _target(path, f"{self.kernel_name}.cu")
        p.write_text(export_source(self.ir, head_dim=self.head_dim, dtype=self.dtype,
                                   kernel=self.kernel, filename=p.name))
        return p


def _target(path: str | os.PathLike[str], default_name: str) -> Path:
    """The file an export writes: `path`, or `default_name` inside it if it is a directory
    (parents made), so the text can name the file it is saved as."""
    p = Path(path)
    if p.is_dir():
        p = p / default_name
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def compile(variant: Any, *, head_dim: int, dtype: Any = "bfloat16", arch: str | None = None,
            kernel: str = "simple", cache: KernelCache | bool | None = True) -> CompiledKernel:
    """Compile an attention variant to a cubin with NVRTC (cached on disk and in memory).

    `variant`: an `attncc.Variant`, a score_mod (5 args) or mask_mod (4 args) function, or a
    `VariantIR`. `dtype`: "bfloat16"/"float16" or a torch dtype. `arch`: "sm_80", "sm_90a", ...;
    None compiles for the current GPU. `kernel`: which template ("simple": exact, one warp per
    row; "fa2": the FlashAttention-2-style bf16/fp16 template with its default tiles). `cache`: True
    (default directory, see `attncc.runtime.jit.cache`), a `KernelCache`, or False (always compile).
    Raises TraceError for unsupported Python in a mod and CompileError if NVRTC rejects the code.

    Example:
        >>> import torch
        >>> from attncc import Variant
        >>> from attncc.runtime.jit.nvrtc import available
        >>> cap = 30.0
        >>> v = Variant(score_mod=lambda s, b, h, q, kv: cap * torch.tanh(s / cap),
        ...             mask_mod=lambda b, h, q, kv: q >= kv)
        >>> if available():
        ...     k = compile(v, head_dim=128, dtype=torch.bfloat16, arch="sm_90a")
        ...     assert k.bindings.scalars and k.dtype == "bfloat16" and len(k.cubin) > 0
    """
    ir, bindings = trace_variant(variant)
    head_dim = _check_head_dim(head_dim)
    check_vector_indices(ir, head_dim, bindings.scalars)
    dtype = dtype_name(dtype)
    arch = normalize_arch(arch)
    check_kernel_arch(kernel, arch)
    kc = KernelCache.default() if cache is True or cache is None else (cache or None)

    key = _memo_key(ir, head_dim, dtype, arch, kernel)
    if kc is not None:
        hit = kc.memo.get(key)
        if hit is not None:
            return replace(hit, bindings=bindings, cache_hit=True)

    from attncc.ir.simplified import simplify_variant  # sympy: imported on first compile

    simplified = simplify_variant(ir)
    if kc is not None and kc.dir is not None:
        use_template_cache(Path(kc.dir) / "templates")
    gen = generate_source(simplified, head_dim=head_dim, dtype=dtype, kernel=kernel)
    try:
        res, was_hit = cached_compile(gen.source, arch=arch, cache=kc if kc is not None else False,
                                      name=f"{gen.kernel_name}.cu")
    except CompileError as e:
        what = (f"attncc.compile of variant {ir.name!r} (head_dim={head_dim}, dtype={dtype}, "
                f"arch={arch}, kernel={kernel!r}) failed.\n")
        err = CompileError(what + str(e), log=e.log, line=e.line, source=e.source)
        err.lineno = getattr(e, "lineno", None)  # type: ignore[attr-defined]
        raise err from None
    ck = CompiledKernel(ir=simplified, bindings=bindings, source=gen.source, cubin=res.cubin,
                        kernel_name=gen.kernel_name, arch=arch, head_dim=head_dim, dtype=dtype,
                        kernel=kernel, params_layout=gen.params_layout,
                        attention_params_layout=gen.attention_params_layout, log=res.log,
                        cache_hit=was_hit, options=res.options, _cache=kc)
    if kc is not None:
        kc.memo[key] = replace(ck, bindings=Bindings())  # values are per call, never memoized
    return ck


def export(variant: Any, path: str | os.PathLike[str], *, head_dim: int, dtype: Any = "bfloat16",
           kernel: str = "simple") -> Path:
    """Write the standalone CUDA source of a variant to `path` (pure codegen: no NVRTC, no GPU).

    A directory as `path` gets `attncc_<variant name>.cu` inside it. Returns the written path.

    Example:
        >>> import tempfile, os
        >>> p = export(lambda b, h, q, kv: q >= kv, os.path.join(tempfile.mkdtemp(), "causal.cu"),
        ...            head_dim=64)
        >>> p.name, "__global__" in p.read_text()
        ('causal.cu', True)
    """
    ir, bindings = trace_variant(variant)
    from attncc.ir.simplified import simplify_variant

    head_dim, dtype = _check_head_dim(head_dim), dtype_name(dtype)
    check_vector_indices(ir, head_dim, bindings.scalars)
    p = _target(path, f"attncc_{ir.name}.cu")
    p.write_text(export_source(simplify_variant(ir), head_dim=head_dim, dtype=dtype,
                               kernel=kernel, filename=p.name))
    return p
