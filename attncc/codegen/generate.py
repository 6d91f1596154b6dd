"""VariantIR -> one self-contained CUDA translation unit for a kernel template.

`generate_variant` turns the hooks into `VariantParams_<name>` / `Variant_<name>` C++ structs;
`generate_source` inlines the shipped kernel templates (attncc.kernels), appends the variant, the
layout static_asserts and an `extern "C" __global__` entry point. The output is deterministic:
the same VariantIR gives byte-identical text (no ids, timestamps or absolute paths), so the text
can key a compile cache; captured values are kernel arguments and never change it.

Example:
    >>> import torch, attncc
    >>> ir, _ = attncc.Variant(score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30),
    ...                        name="softcap").trace()
    >>> gk = generate_source(ir, head_dim=128, dtype="bfloat16")
    >>> gk.kernel_name
    'attncc_softcap_simple_d128_bf16'
    >>> "return 30.0f * tanhf(score / 30.0f);" in gk.source
    True
    >>> gk.grid(q_len=1000, num_q_heads=8, batch=2), gk.block
    ((250, 8, 2), (128, 1, 1))
"""
from __future__ import annotations

import os

from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping, Sequence

import jinja2

from ..ir.program import HOOK_ORDER, TRANSFORM_HOOKS, VariantIR
from .constants import (FA3_SPLIT_HEAD_DIMS, FA3_THREADS, static_asserts,
                        tile_static_asserts)
from .errors import CodegenError
from .hooks import (EMITTERS, HookCode, captured_grad, diag_grads, diagonal_read, logits_grad,
                    tile_grads, tile_uniform)
from .tiles import (FA2_HEAD_DIMS, padded_head_dim, FA3_BACKWARD_TILES, FA3_TKV_CHOICES,
                    BackwardTiles, fa3_backward_geometry, KernelTiles, backward_tiles,
                    default_tiles, fa3_smem_bytes, fa3_tiles, FA3_PADDED_MIN_DIM)
from .layout import (ATTENTION_PARAMS, BACKWARD_PARAMS, BATCH_PARAMS, PREPASS_PARAMS, StructLayout,
                     c_identifier, plan_header_static_asserts, variant_grads_layout,
                     variant_params_layout)

__all__ = ["KernelSpec", "KERNELS", "DTYPES", "VariantCode", "GeneratedKernel",
           "generate_variant", "generate_source", "render", "form_text", "with_form",
           "PRESSURE_LEVELS", "pressure_levels"]

# Shipped templates every translation unit starts with, in this order.
COMMON_TEMPLATES = ("common/attncc_types.cuh", "common/attention_params.cuh")
# templates compiled in forms (form_text precedes them)
FORM_KERNELS = ("fa3", "fa3batch", "fa3bwd")


def form_text(*, paired: bool = False, low_pressure: int = 0) -> str:
    """The kernel form as C++: the block codegen puts ahead of the FA3 templates, which read
    it with `if constexpr` (docs/kernel-interface.md, section 4). Constexpr functions, not
    variables: a namespace-scope constexpr variable is a symbol in the cubin. `low_pressure` is
    the form's pressure level: 0 as written, 1 (or True) the low-pressure form, 2 the FA3-class
    backward's lowest (its 16-column sub-tiles); `low_pressure()` says whether it is above 0.

    Example:
        >>> print(form_text(paired=True).splitlines()[2])
        __host__ __device__ __forceinline__ constexpr bool paired() { return true; }
        >>> print(form_text(low_pressure=True).splitlines()[3])
        __host__ __device__ __forceinline__ constexpr int pressure_level() { return 1; }
    """
    return ("namespace attncc {\nnamespace form {\n"
            f"__host__ __device__ __forceinline__ constexpr bool paired() {{ return "
            f"{str(bool(paired)).lower()}; }}\n"
            + _LEVEL.format(int(low_pressure)) + "\n"
            "__host__ __device__ __forceinline__ constexpr bool low_pressure() { return "
            "pressure_level() > 0; }\n"
            "}  // namespace form\n}  // namespace attncc\n")


_LEVEL = "__host__ __device__ __forceinline__ constexpr int pressure_level() {{ return {}; }}"
PRESSURE_LEVELS = (0, 1, 2)  # the forms' levels; 2 only for the FA3-class backward


def pressure_levels(backward: bool) -> tuple[int, ...]:
    """The pressure levels a form kernel takes: the FA3-class backward's all, the forward FA3
    kernels' 0 and 1 (codegen and the kernel cache's KernelSpec check against it).

    Example:
        >>> pressure_levels(True), pressure_levels(False)
        ((0, 1, 2), (0, 1))
    """
    return PRESSURE_LEVELS if backward else PRESSURE_LEVELS[:2]


def with_form(source: str, *, low_pressure: int) -> str:
    """A generated FA3 unit in another pressure level: the same text but the form block's
    line (the kernel cache generates each form from its spec; scripts and tests swap a unit's).

    Example:
        >>> src = generate_source(VariantIR(name="plain"), head_dim=64, dtype="bfloat16",
        ...                       kernel="fa3").source
        >>> with_form(with_form(src, low_pressure=True), low_pressure=False) == src
        True
        >>> with_form("not a unit", low_pressure=True)
        Traceback (most recent call last):
        ...
        attncc.errors.CodegenError: with_form: the source has no form block (generate it with kernel='fa3' or 'fa3batch')
    """
    found = [lv for lv in PRESSURE_LEVELS if _LEVEL.format(lv) in source]
    if len(found) != 1 or source.count(_LEVEL.format(found[0])) != 1:
        raise CodegenError("with_form: the source has no form block (generate it with "
                           "kernel='fa3' or 'fa3batch')")
    return source.replace(_LEVEL.format(found[0]), _LEVEL.format(int(low_pressure)))


@dataclass(frozen=True)
class KernelSpec:
    """A shipped kernel template: its files, entry function and launch geometry."""

    name: str
    files: tuple[str, ...]  # shipped templates after COMMON_TEMPLATES
    function: str  # template <Variant, DType, HEAD_DIM> __device__ void f(p, vp)
    threads: int  # block size
    rows_per_cta: int  # query rows per CTA (grid.x = ceil(q_len / rows_per_cta))
    head_dim_multiple: int  # HEAD_DIM must be a multiple of this ...
    head_dim_max: int  # ... and at most this
    head_dims: tuple[int, ...] = ()  # if set: exactly these head dims
    entry_macro: str = ""  # tiled templates: the macro that defines the entry point(s)
    batch: bool = False  # first argument attncc::BatchParams (serving kernel + merge kernel)
    prepass: bool = False  # first argument attncc::PrepassParams (attncc.ir.hoist)
    # a backward template: first argument attncc::BackwardParams; the variant gets LogitsGrad /
    # CapturedGrad and VariantGrads_<name>, the kernel's third argument (docs/backward.md)
    backward: bool = False

    @property
    def first_arg(self) -> StructLayout:
        """The layout of the kernel's first argument (the second is the VariantParams)."""
        if self.batch:
            return BATCH_PARAMS
        if self.backward:
            return BACKWARD_PARAMS
        return PREPASS_PARAMS if self.prepass else ATTENTION_PARAMS

    def check_head_dim(self, head_dim: int) -> None:
        """Raise CodegenError unless the template supports `head_dim`.

        Example:
            >>> KERNELS["simple"].check_head_dim(96)
            >>> KERNELS["simple"].check_head_dim(100)
            Traceback (most recent call last):
            ...
            attncc.errors.CodegenError: the 'simple' kernel supports head dims that are multiples of 32 up to 256; got 100
        """
        if self.head_dims:
            if head_dim not in self.head_dims:
                raise CodegenError(f"the {self.name!r} kernel supports head dims "
                                   f"{self.head_dims}; got {head_dim!r}")
            return
        m = self.head_dim_multiple
        ok = isinstance(head_dim, int) and head_dim % m == 0 and m <= head_dim <= self.head_dim_max
        if not ok:
            raise CodegenError(f"the {self.name!r} kernel supports head dims that are multiples "
                               f"of {m} up to {self.head_dim_max}; got {head_dim!r}")


KERNELS: dict[str, KernelSpec] = {
    "simple": KernelSpec("simple", ("small/simple_attention.cuh",), "attncc::simple_attention",
                         threads=128, rows_per_cta=4, head_dim_multiple=32, head_dim_max=256),
    # FlashAttention-2-style prefill (dense or BlockMask-sparse): threads / rows come from tiles
    "fa2": KernelSpec("fa2", ("common/common.cuh", "fa2/fa2_config.cuh", "fa2/fa2_kv8.cuh",
                              "fa2/fa2_attend.cuh", "fa2/fa2_prefill.cuh"),
                      "attncc::fa2::fa2_prefill", threads=0, rows_per_cta=0,
                      head_dim_multiple=64, head_dim_max=256, head_dims=FA2_HEAD_DIMS,
                      entry_macro="ATTNCC_FA2_ENTRY"),
    # the FA2-class backward (dQ, dK, dV, captured gradients; kernels/fa2/fa2_backward.cuh):
    # one CTA per KV tile, tiles from attncc.codegen.tiles.backward_tiles
    "fa2bwd": KernelSpec("fa2bwd", ("common/backward_params.cuh", "common/common.cuh",
                                    "common/exact_grad.cuh", "fa2/fa2_config.cuh",
                                    "fa2/fa2_backward.cuh"),
                         "attncc::fa2::fa2_backward", threads=0, rows_per_cta=0,
                         head_dim_multiple=64, head_dim_max=256, head_dims=FA2_HEAD_DIMS,
                         entry_macro="ATTNCC_FA2_BWD_ENTRY", backward=True),
    # the FA3-class backward for sm_90a (wgmma; kernels/fa3/fa3_backward.cuh): the FA2-class
    # kernel's grid and arguments, two warpgroups of 64 KV rows, tiles BackwardTiles(64, 128)
    "fa3bwd": KernelSpec("fa3bwd", ("common/backward_params.cuh", "common/common.cuh",
                                    "common/exact_grad.cuh", "fa2/fa2_config.cuh",
                                    "fa2/fa2_backward.cuh",
                                    "hopper/wgmma.cuh", "hopper/tma.cuh",
                                    "fa3/fa3_backward.cuh"),
                         "attncc::fa3bwd::fa3_backward", threads=0, rows_per_cta=0,
                         head_dim_multiple=64, head_dim_max=128, head_dims=(64, 128),
                         entry_macro="ATTNCC_FA3_BWD_ENTRY", backward=True),
    # Hopper: TMA + wgmma, warp-specialized, 64 query rows per consumer warpgroup
    # (kernels/fa3/fa3_prefill.cuh)
    "fa3": KernelSpec("fa3", ("common/common.cuh", "hopper/wgmma.cuh", "hopper/tma.cuh",
                              "fa3/fa3_consumer.cuh", "fa3/fa3_store.cuh", "fa3/fa3_split.cuh",
                              "fa3/fa3_prefill.cuh"),
                      "attncc::fa3::fa3_prefill", threads=0, rows_per_cta=0,
                      head_dim_multiple=64, head_dim_max=256, head_dims=(64, 128, 256),
                      entry_macro="ATTNCC_FA3_ENTRY"),
    # the persistent serving kernel over a plan (runtime/serving/batch.py) and its merge kernel
    "fa2batch": KernelSpec("fa2batch", ("common/batch_params.cuh", "common/common.cuh",
                                        "fa2/fa2_config.cuh", "fa2/fa2_kv8.cuh",
                                        "fa2/fa2_attend.cuh",
                                        "fa2/fa2_batch.cuh"),
                           "attncc::fa2::fa2_batch", threads=0, rows_per_cta=0,
                           head_dim_multiple=64, head_dim_max=256, head_dims=FA2_HEAD_DIMS,
                           entry_macro="ATTNCC_FA2_BATCH_ENTRY", batch=True),
    # the same plans run by the FA3 pipeline (sm_90a; prefill-shaped batches)
    "fa3batch": KernelSpec("fa3batch", ("common/batch_params.cuh", "common/common.cuh",
                                        "fa2/fa2_config.cuh", "fa2/fa2_kv8.cuh",
                                        "fa2/fa2_attend.cuh",
                                        "fa2/fa2_batch.cuh", "hopper/wgmma.cuh", "hopper/tma.cuh",
                                        "fa3/fa3_consumer.cuh", "fa3/fa3_store.cuh",
                                        "fa3/fa3_batch.cuh"),
                           "attncc::fa3::fa3_batch", threads=0, rows_per_cta=0,
                           head_dim_multiple=64, head_dim_max=128, head_dims=(64, 128),
                           entry_macro="ATTNCC_FA3_BATCH_ENTRY", batch=True),
    # a variant's Query/Key/ValueTransform applied once per q/k/v row before attention
    # (kernels/small/prepass.cuh; attncc.ir.hoist splits the hooks off); 8 warps of 16 rows a CTA
    "prepass": KernelSpec("prepass", ("small/prepass.cuh",), "attncc::prepass::prepass",
                          threads=256, rows_per_cta=128, head_dim_multiple=64,
                          head_dim_max=256, prepass=True),
}

# dtype name -> (C storage type, short name used in kernel names)
DTYPES: dict[str, tuple[str, str]] = {
    "bfloat16": ("attncc::bf16", "bf16"),
    "float16": ("attncc::f16", "f16"),
    "float32": ("float", "f32"),
}

# An fp8 KV cache's dtype name (torch's) -> (C tag type, kernel-name suffix): the FA2 batch
# kernel reads it as bytes and widens them to q's dtype (kernels/fa2/fa2_kv8.cuh).
KV8_DTYPES: dict[str, tuple[str, str]] = {
    "float8_e4m3fn": ("attncc::fa2::kv_e4m3", "_kve4m3"),
    "float8_e5m2": ("attncc::fa2::kv_e5m2", "_kve5m2"),
}


@dataclass(frozen=True)
class VariantCode:
    """The generated C++ of one variant and what a kernel template needs to know about it."""

    name: str  # C-safe variant name
    struct_name: str  # Variant_<name>
    params_name: str  # VariantParams_<name>
    params_struct: str  # C++ text of the params struct
    variant_struct: str  # C++ text of the Variant struct
    normalize: str
    use_softmax: bool
    has_query_transform: bool
    has_key_transform: bool
    has_value_transform: bool
    has_logits_transform: bool
    has_logits_mask: bool
    has_output_transform: bool
    params_layout: StructLayout
    tensor_fields: Mapping[str, str]  # captured tensor -> C member base name
    scalar_fields: Mapping[str, str]  # captured scalar -> C member name
    hooks: tuple[HookCode, ...]
    # the score or mask hook reads a captured tensor at an index computed from q_idx / kv_idx
    # (a document-id table): the kernels must then give those hooks only real positions
    loads_at_positions: bool = False
    # mask_mod is exactly lo <= kv_idx - q_idx <= hi (attncc.ir.kv_bound.kv_window; None: an
    # unbounded side), or None: a batch kernel then skips the mask on tiles inside the band
    kv_window: tuple[int | None, int | None] | None = None
    # otherwise exactly such a band with bounds that read captured scalars (a sliding window
    # of a captured width): each bound's C expression over `vp`, None an unbounded side
    kv_window_runtime: tuple[str | None, str | None] | None = None
    # backward translation units only (generate_variant(backward=True)): the gradient hooks,
    # VariantGrads_<name> (grads_layout, packed by the launcher with
    # attncc.codegen.layout.variant_grad_values) and its member per tensor requiring grad
    backward: bool = False
    grad_tensors: tuple[str, ...] = ()
    grads_name: str = ""
    grads_layout: StructLayout | None = None
    grad_fields: Mapping[str, str] = field(default_factory=dict)
    has_logits_grad: bool = False
    has_captured_grad: bool = False
    # reads of a captured tensor requiring grad at a tile-uniform index (hooks.tile_uniform):
    # summed per warp through TileGradTerms / TileGradFlush, not atomics per element
    tile_grads: int = 0
    # reads at an index that moves with the positions only through q_idx - kv_idx
    # (hooks.diagonal_read): summed per diagonal through DiagGradTerms / DiagGradAdd
    diag_grads: int = 0
    backward_hooks: tuple[HookCode, ...] = ()
    # the deterministic mode's CapturedGrad: exact integer sums (kernels/common/exact_grad.cuh)
    exact_grads: bool = False

    @property
    def has_tile_grads(self) -> bool:
        """Whether TileGradTerms / TileGradFlush do anything (`tile_grads` > 0)."""
        return self.tile_grads > 0

    @property
    def has_diag_grads(self) -> bool:
        """Whether DiagGradTerms / DiagGradAdd do anything (`diag_grads` > 0)."""
        return self.diag_grads > 0

    @property
    def kv_window_bounds(self) -> tuple[int, int]:
        """kv_window as C integers, an unbounded side as -+2^62 (never reached by positions)."""
        lo, hi = self.kv_window or (None, None)
        return (-(1 << 62) if lo is None else lo), ((1 << 62) if hi is None else hi)

    @property
    def text(self) -> str:
        """Both structs, as they appear in the translation unit."""
        return self.params_struct + "\n" + self.variant_struct


@dataclass(frozen=True)
class GeneratedKernel:
    """One compilable translation unit and everything needed to launch its kernel."""

    source: str
    kernel_name: str
    params_layout: StructLayout  # VariantParams_<name>
    attention_params_layout: StructLayout  # attncc::AttentionParams
    variant: VariantCode
    kernel: str
    head_dim: int
    dtype: str
    threads: int
    rows_per_cta: int
    shared_mem_bytes: int = 0  # dynamic shared memory to request at launch
    # VariantGrads_<name>, a backward kernel's third argument (None for forward kernels)
    grads_layout: StructLayout | None = None

    @property
    def block(self) -> tuple[int, int, int]:
        """CUDA block dimensions."""
        return (self.threads, 1, 1)

    def grid(self, q_len: int, num_q_heads: int, batch: int) -> tuple[int, int, int]:
        """CUDA grid for a problem: (ceil(q_len / rows_per_cta), num_q_heads, batch).

        Example:
            >>> from attncc.ir.program import VariantIR
            >>> generate_source(VariantIR(), head_dim=64, dtype="float16").grid(5, 2, 3)
            (2, 2, 3)
        """
        return (-(-q_len // self.rows_per_cta), num_q_heads, batch)


_TEMPLATE_CACHE_DIR: list[str] = []  # set by use_template_cache(); empty = no bytecode cache


def use_template_cache(directory: str | os.PathLike[str] | None) -> None:
    """Keep jinja2's compiled templates in `directory` (None: don't).

    Compiling the two templates costs ~50 ms per process, most of a warm `attncc.compile`; the
    bytecode cache (keyed by template source checksum, so edits invalidate it) makes it ~1 ms.

    Example:
        >>> import tempfile
        >>> use_template_cache(tempfile.mkdtemp()); use_template_cache(None)
    """
    wanted = [os.fspath(directory)] if directory is not None else []
    if wanted != _TEMPLATE_CACHE_DIR:  # keep the in-memory templates when nothing changes
        _TEMPLATE_CACHE_DIR[:] = wanted
        _env.cache_clear()


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    folder = resources.files(__package__).joinpath("templates")
    bytecode = None
    if _TEMPLATE_CACHE_DIR:
        try:
            os.makedirs(_TEMPLATE_CACHE_DIR[0], exist_ok=True)
            bytecode = jinja2.FileSystemBytecodeCache(_TEMPLATE_CACHE_DIR[0])
        except OSError:  # unwritable cache dir: templates still compile, only slower
            bytecode = None
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)),
                              undefined=jinja2.StrictUndefined, autoescape=False,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                              bytecode_cache=bytecode)


def render(template: str, **context: Any) -> str:
    """Render one of attncc/codegen/templates/*.j2.

    Example:
        >>> render("variant.cuh.j2", v=generate_variant(VariantIR()), hooks=()).startswith("//")
        True
    """
    return _env().get_template(template).render(**context)


def loads_at_positions(ir: VariantIR) -> bool:
    """Whether the score_mod or mask_mod of `ir` loads from a captured tensor at an index that
    depends on q_idx or kv_idx (then a kernel must not evaluate it at positions past the
    sequence: the load would read past the tensor).

    Example:
        >>> from attncc.gym import GYM
        >>> [loads_at_positions(GYM[n](1, 4, 64, 64).trace()[0])
        ...  for n in ("alibi_causal", "document_causal")]
        [False, True]
    """
    from ..ir.nodes import free_vars, walk

    for name in ("score_mod", "mask_mod"):
        if name in ir.hooks:
            for n in walk(ir.hook(name).expr):
                if n.op == "load" and any({"q_idx", "kv_idx"} & free_vars(i) for i in n.args):
                    return True
    return False


def _mask_window(ir: VariantIR) -> tuple[int | None, int | None] | None:
    """attncc.ir.kv_bound.kv_window of the mask_mod of `ir` (None without one)."""
    from ..ir.kv_bound import kv_window

    if "mask_mod" not in ir.hooks or ir.hook("mask_mod").is_identity:
        return None
    return kv_window(ir.hook("mask_mod").expr)


def _mask_window_runtime(ir: VariantIR, scalars: Mapping[str, str]
                         ) -> tuple[str | None, str | None] | None:
    """A band mask_mod's bounds that read captured scalars (attncc.ir.kv_bound.kv_window_params)
    as C expressions over the variant's params `vp` (`scalars`: captured scalar -> member), or
    None when the mask is no such band or a constant one (kv_window then has it)."""
    from ..ir.kv_bound import kv_window_params

    if "mask_mod" not in ir.hooks or ir.hook("mask_mod").is_identity:
        return None
    w = kv_window_params(ir.hook("mask_mod").expr)
    if w is None or not any(b is not None and b[1] for b in w):
        return None

    def c(b: Any) -> str | None:
        if b is None:
            return None
        return " + ".join([f"{b[0]}LL"] + [f"{coef}LL * (long long)vp.{scalars[name]}"
                                           for name, coef in b[1]])
    return c(w[0]), c(w[1])


def generate_variant(ir: VariantIR, *, fast_math: bool = False, backward: bool = False,
                     grad_tensors: Sequence[str] = (), exact_grads: bool = False
                     ) -> VariantCode:
    """The VariantParams_<name> and Variant_<name> structs for `ir` (`fast_math`: hooks use
    hardware approximations of exp/log/tanh/sigmoid and reciprocal multiplies, see
    `cuda_expr.emit`). `backward=True` adds VariantGrads_<name> and the gradient hooks
    LogitsGrad / CapturedGrad (docs/backward.md); `grad_tensors` names the captured tensors that
    require grad (backward only); `exact_grads` makes CapturedGrad's sums exact and
    order-independent (the deterministic mode; kernels/common/exact_grad.cuh).

    Example:
        >>> from attncc.ir.nodes import var
        >>> from attncc.ir.program import Hook
        >>> vc = generate_variant(VariantIR(hooks={"mask_mod": Hook("mask_mod",
        ...                                   var("q_idx") >= var("kv_idx"))}, name="causal"))
        >>> vc.struct_name, vc.has_logits_mask, vc.has_logits_transform
        ('Variant_causal', True, False)
    """
    if ir.normalize not in ("softmax", "none"):
        raise CodegenError(f"normalize={ir.normalize!r}: use 'softmax' or 'none'")
    unknown = sorted(set(ir.hooks) - set(HOOK_ORDER))
    if unknown:
        raise CodegenError(f"unknown hook(s) {', '.join(unknown)}; hooks are "
                           f"{', '.join(HOOK_ORDER)}")
    name = c_identifier(ir.name)
    params_name, struct_name = f"VariantParams_{name}", f"Variant_{name}"
    try:
        pl = variant_params_layout(params_name, ir.scalars, ir.tensors)
    except ValueError as e:
        raise CodegenError(str(e)) from None
    ndims = {t.name: t.ndim for t in ir.tensors}
    hooks = tuple(EMITTERS[h](ir.hook(h), tensors=pl.tensor_fields, scalars=pl.scalar_fields,
                              tensor_ndims=ndims, fast_math=fast_math) for h in HOOK_ORDER)
    flags = {h.spec.flag: h.enabled for h in hooks}
    if grad_tensors and not backward:
        raise CodegenError("grad_tensors is for backward translation units (backward=True)")
    if exact_grads and not backward:
        raise CodegenError("exact_grads is for backward translation units (backward=True)")
    bwd = _backward_parts(ir, name, pl, grad_tensors, fast_math, exact_grads) if backward else {}
    vc = VariantCode(name=name, struct_name=struct_name, params_name=params_name,
                     params_struct="", variant_struct="", normalize=ir.normalize,
                     use_softmax=ir.use_softmax, **flags, params_layout=pl.layout,
                     tensor_fields=dict(pl.tensor_fields), scalar_fields=dict(pl.scalar_fields),
                     hooks=hooks, loads_at_positions=loads_at_positions(ir),
                     kv_window=_mask_window(ir),
                     kv_window_runtime=_mask_window_runtime(ir, pl.scalar_fields), **bwd)
    # One template renders both structs (so they read as one unit); split at the blank line.
    params_text, _, variant_text = render("variant.cuh.j2", v=vc, hooks=hooks).partition("\n\n")
    return replace(vc, params_struct=params_text + "\n", variant_struct=variant_text)


def _backward_parts(ir: VariantIR, name: str, pl: Any, grad_tensors: Sequence[str],
                    fast_math: bool, exact: bool) -> dict[str, Any]:
    """The VariantCode fields of a backward unit: derivatives (attncc.ir.autodiff) as hooks."""
    from ..ir.autodiff import score_mod_grad

    grad = score_mod_grad(ir, grad_tensors)
    grad_names = tuple(t.name for t in ir.tensors if t.name in set(grad_tensors))
    exact = exact and bool(grad_names)  # the form exists only where there is a sum to take
    gl = variant_grads_layout(f"VariantGrads_{name}", ir.tensors, grad_names, pl.tensor_fields,
                              exact=exact)
    hook = ir.hook("score_mod")
    kw = dict(tensors=pl.tensor_fields, scalars=pl.scalar_fields, fast_math=fast_math)
    hooks = (logits_grad(hook, grad, **kw),
             captured_grad(hook, grad, gl.tensor_fields, exact=exact, **kw),
             *tile_grads(hook, grad, gl.tensor_fields, exact=exact, **kw),
             *diag_grads(hook, grad, gl.tensor_fields, exact=exact, **kw))
    return dict(backward=True, grad_tensors=grad_names, grads_name=gl.layout.name,
                grads_layout=gl.layout, grad_fields=dict(gl.tensor_fields),
                has_logits_grad=hooks[0].enabled, has_captured_grad=hooks[1].enabled,
                tile_grads=sum(tile_uniform(r) for r in grad.reads),
                diag_grads=sum(diagonal_read(r) for r in grad.reads),
                backward_hooks=hooks, exact_grads=exact)


def _version() -> str:
    from ..version import __version__

    return __version__


def kernel_name(variant: str, kernel: str, head_dim: int, dtype: str) -> str:
    """The deterministic entry-point name.

    Example:
        >>> kernel_name("softcap", "simple", 128, "bfloat16")
        'attncc_softcap_simple_d128_bf16'
    """
    return f"attncc_{c_identifier(variant)}_{kernel}_d{head_dim}_{DTYPES[dtype][1]}"


def _check_options(head_dim: int, dtype: str, kernel: str) -> KernelSpec:
    if kernel not in KERNELS:
        raise CodegenError(f"unknown kernel template {kernel!r}; available: "
                           f"{', '.join(sorted(KERNELS))}")
    if dtype not in DTYPES:
        raise CodegenError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)} (the dtype of q, k, "
                           f"v and o)")
    spec = KERNELS[kernel]
    spec.check_head_dim(head_dim)
    return spec


def _check_form(kernel: str, head_dim: int, paired: bool, low_pressure: int) -> None:
    if (paired or low_pressure) and kernel not in FORM_KERNELS:
        raise CodegenError(f"paired / low_pressure are forms of the FA3 kernels "
                           f"{FORM_KERNELS}, not of {kernel!r}")
    levels = pressure_levels(kernel == "fa3bwd")
    if int(low_pressure) not in levels:
        raise CodegenError(f"low_pressure={low_pressure!r}: the levels of a {kernel!r} kernel "
                           f"are {levels} (or bools)")
    if paired and (kernel != "fa3" or head_dim not in FA3_SPLIT_HEAD_DIMS):
        raise CodegenError(f"paired=True: CTA pairs are a form of the dense 'fa3' kernel at "
                           f"head dims {FA3_SPLIT_HEAD_DIMS}; got kernel="
                           f"{kernel!r}, head dim {head_dim}")


def _check_kv_dtype(kv_dtype: str | None, kernel: str, ir: VariantIR) -> None:
    """An fp8 `kv_dtype` (KV8_DTYPES) is the 'fa2batch' kernel's, for variants without a
    key / value transform (they would see the cache's unscaled values)."""
    if kv_dtype is None:
        return
    if kv_dtype not in KV8_DTYPES:
        raise CodegenError(f"kv_dtype={kv_dtype!r}: use None (q's dtype) or one of "
                           f"{', '.join(KV8_DTYPES)}")
    if kernel != "fa2batch":
        raise CodegenError(f"an fp8 KV cache (kv_dtype={kv_dtype!r}) runs on the 'fa2batch' "
                           f"kernel, not {kernel!r}")
    if "key_mod" in ir.hooks or "value_mod" in ir.hooks:
        raise CodegenError(f"variant {ir.name!r} has a key_mod / value_mod: an fp8 cache holds "
                           f"keys and values already transformed (append_paged_kv_cache's "
                           f"key_mod=); read it with a variant without them")


# The kernels with a padded form (a head dim below its tile width; docs/flex-api.md, "Head dims")
PADDED_KERNELS = ("fa2", "fa2batch", "fa3")


def _entry_extras(kernel: str, dtype: str, kv_dtype: str | None, head_dim: int, dqk: int,
                  dv: int) -> tuple[str, str]:
    """The FA2 and FA3 entry macros' trailing arguments and the kernel name's suffix:
    "fa2batch"'s cache element type (q's, or an fp8 tag: `_kve4m3`), then the padded kernels'
    real head dims (a padded form's, smaller than `head_dim`: `_dqk<Dqk>_dv<Dv>`)."""
    arg, suffix = "", ""
    if kernel == "fa2batch":
        arg = f", {KV8_DTYPES[kv_dtype][0] if kv_dtype else DTYPES[dtype][0]}"
        suffix = KV8_DTYPES[kv_dtype][1] if kv_dtype else ""
    if kernel in PADDED_KERNELS:
        arg += f", {dqk}, {dv}"
        suffix += f"_dqk{dqk}_dv{dv}" if (dqk, dv) != (head_dim, head_dim) else ""
    return arg, suffix


def _check_padded(head_dims: tuple[int, int] | None, head_dim: int, kernel: str, ir: VariantIR,
                  kv_dtype: str | None) -> tuple[int, int]:
    """The real (query/key, value) head dims; CodegenError unless they are `head_dim` or a
    padded form of a kernel that has one (`head_dim` their padded width), for a variant without
    row hooks (they would see the padding columns) and a 16-bit cache."""
    if head_dims is None or tuple(head_dims) == (head_dim, head_dim):
        return head_dim, head_dim
    if kernel not in PADDED_KERNELS:
        raise CodegenError(f"the {kernel!r} kernel has no padded form; {PADDED_KERNELS} have")
    from ..ir.hoist import transforms_in

    rows = transforms_in(ir, TRANSFORM_HOOKS)
    if rows or kv_dtype is not None:
        raise CodegenError(f"a padded head dim runs no {', '.join(rows) or 'fp8 cache'}: "
                           f"those see whole rows, padding columns included; use head dim "
                           f"64, 128 or 256")
    if padded_head_dim(*head_dims) != (head_dim, True):
        raise CodegenError(f"head_dims={tuple(head_dims)} pad to "
                           f"{padded_head_dim(*head_dims)[0]}, not head_dim={head_dim}")
    if kernel == "fa3" and min(head_dims) < FA3_PADDED_MIN_DIM:
        raise CodegenError(f"head_dims={tuple(head_dims)}: the 'fa3' kernel's padded form takes "
                           f"real head dims of {FA3_PADDED_MIN_DIM} or more; use 'fa2'")
    return head_dims[0], head_dims[1]

def _build(ir: VariantIR, head_dim: int, dtype: str, kernel: str, export: bool,
           fast_math: bool | None = None, tiles: KernelTiles | None = None,
           paired: bool = False, low_pressure: int = 0,
           grad_tensors: Sequence[str] = (), kv_dtype: str | None = None,
           head_dims: tuple[int, int] | None = None, exact_grads: bool = False
           ) -> GeneratedKernel:
    from ..kernels import read_template

    spec = _check_options(head_dim, dtype, kernel)
    _check_kv_dtype(kv_dtype, kernel, ir)
    dqk, dv = _check_padded(head_dims, head_dim, kernel, ir, kv_dtype)
    _check_form(kernel, head_dim, paired, low_pressure)
    if fast_math is None:  # the performance templates approximate, the simple one is exact
        fast_math = bool(spec.entry_macro)
    if grad_tensors and not spec.backward:
        raise CodegenError(f"grad_tensors is for backward kernels; {kernel!r} is a forward one")
    if exact_grads and not spec.backward:
        raise CodegenError(f"exact_grads is for backward kernels; {kernel!r} is a forward one")
    vc = generate_variant(ir, fast_math=fast_math, backward=spec.backward,
                          grad_tensors=grad_tensors, exact_grads=exact_grads)
    name = kernel_name(vc.name, kernel, head_dim, dtype)
    threads, rows, smem, entry = spec.threads, spec.rows_per_cta, 0, ""
    first_arg = spec.first_arg
    if spec.entry_macro:  # a tiled FA2 template
        if dtype not in ("bfloat16", "float16"):
            raise CodegenError(f"dtype={dtype!r}: the {kernel!r} kernel runs bfloat16 or float16")
        if spec.batch and export:
            raise CodegenError(f"the {kernel!r} serving kernel runs from a plan made by "
                               f"attncc.BatchAttention and is not exported; export 'fa2' or "
                               f"'simple'")
        if spec.backward:
            return _build_backward(ir, vc, spec, name, head_dim, dtype, export, tiles,
                                   low_pressure)
        if kernel in ("fa3", "fa3batch"):
            tiles = tiles if tiles is not None else fa3_tiles()
            rows = (128, 64) if kernel == "fa3batch" else (128,)  # (64: fa3batch's pair form)
            if tiles.tkv not in FA3_TKV_CHOICES or tiles.tq not in rows or \
                    tiles != fa3_tiles(tiles.stages, tiles.tkv, tiles.tq):
                raise CodegenError(f"the {kernel!r} kernel has {' or '.join(map(str, rows))}-"
                                   f"row tiles (two consumer warpgroups) of {FA3_TKV_CHOICES} "
                                   f"keys; got {tiles}")
        tiles = tiles if tiles is not None else default_tiles(head_dim)
        name += tiles.suffix
        threads, rows, smem = tiles.threads, tiles.tq, tiles.smem_bytes(head_dim)
        if kernel in ("fa3", "fa3batch"):  # producer + 2 consumer warpgroups
            threads = FA3_THREADS
            smem = fa3_smem_bytes(head_dim, tiles)
        kv_arg, suffix = _entry_extras(kernel, dtype, kv_dtype, head_dim, dqk, dv)
        if kernel == "fa2batch":
            kv_arg += f", {'true' if tiles.half_rows else 'false'}"
        elif tiles.half_rows:
            raise CodegenError(f"half_rows is a form of the 'fa2batch' decode kernel, not of "
                               f"{kernel!r}")
        name += suffix
        entry = (f"{spec.entry_macro}({name}, {vc.struct_name}, {DTYPES[dtype][0]}, {head_dim}, "
                 f"{tiles.tq}, {tiles.tkv}, {tiles.stages}, {tiles.m_frags}, {tiles.kv_warps}"
                 f"{kv_arg})")
    elif tiles is not None:
        raise CodegenError(f"tiles are for the 'fa2' / 'fa2batch' kernels, not {kernel!r}")
    if spec.prepass:
        if dtype not in ("bfloat16", "float16"):
            raise CodegenError(f"dtype={dtype!r}: the {kernel!r} pre-pass transforms bfloat16 or "
                               f"float16 K/V for the FA2/FA3 kernels")
        if export:
            raise CodegenError(f"the {kernel!r} pre-pass runs inside attncc's launches and is "
                               f"not exported; export 'fa2' or 'simple' (they apply key/value "
                               f"transforms in-kernel)")
    shipped: list[tuple[str, str]] = [(f, read_template(f).rstrip("\n") + "\n")
                                      for f in (*COMMON_TEMPLATES, *spec.files)]
    if kernel in FORM_KERNELS:
        shipped.insert(len(COMMON_TEMPLATES), ("kernel form", form_text(
            paired=paired, low_pressure=low_pressure)))
    asserts = (ATTENTION_PARAMS.static_asserts() + vc.params_layout.static_asserts()
               + (first_arg.static_asserts() if first_arg is not ATTENTION_PARAMS else [])
               + (plan_header_static_asserts() if spec.batch else [])
               + (vc.grads_layout.static_asserts() if vc.grads_layout is not None else [])
               + static_asserts(kernel, head_dim))
    if tiles is not None:
        asserts += tile_static_asserts(kernel, head_dim, threads, smem, (
            tiles.tq, tiles.tkv, tiles.stages, tiles.m_frags, tiles.kv_warps))
    source = render("translation_unit.cu.j2", version=_version(), v=vc, spec=spec,
                    head_dim=head_dim, dtype=dtype, dtype_ctype=DTYPES[dtype][0],
                    kernel_name=name, shipped=shipped, variant_text=vc.text, asserts=asserts,
                    ap_layout=ATTENTION_PARAMS, export=export, entry=entry, threads=threads,
                    rows_per_cta=rows, smem=smem)
    return GeneratedKernel(source=source, kernel_name=name, params_layout=vc.params_layout,
                           attention_params_layout=first_arg, variant=vc, kernel=kernel,
                           head_dim=head_dim, dtype=dtype, threads=threads,
                           rows_per_cta=rows, shared_mem_bytes=smem,
                           grads_layout=vc.grads_layout)


def _build_backward(ir: VariantIR, vc: VariantCode, spec: KernelSpec, name: str,
                    head_dim: int, dtype: str, export: bool, tiles: Any,
                    low_pressure: int = 0) -> GeneratedKernel:
    """A backward unit (kernels/fa2/fa2_backward.cuh): BackwardParams first, then the variant's
    Params and Grads; grid (ceil(kv_len / tiles.tkv), num_kv_heads, batch). `low_pressure`: the
    FA3-class kernel's query sub-tiles, 64 >> level columns (fa3_backward.cuh)."""
    from ..kernels import read_template

    if export:
        raise CodegenError(f"the {spec.name!r} backward kernel runs inside attncc's autograd "
                           f"and is not exported; export 'fa2' or 'simple'")
    fa3 = spec.name == "fa3bwd"
    tiles = tiles if tiles is not None else (FA3_BACKWARD_TILES if fa3 else
                                             backward_tiles(head_dim))
    if not isinstance(tiles, BackwardTiles):
        raise CodegenError(f"the {spec.name!r} kernel takes attncc.codegen.tiles.BackwardTiles, "
                           f"got {tiles!r}")
    tiles.check(head_dim)
    if fa3 and tiles != FA3_BACKWARD_TILES:
        raise CodegenError(f"the 'fa3bwd' kernel has one form, {FA3_BACKWARD_TILES}; got {tiles}")
    name += tiles.suffix + ("_exact" if vc.exact_grads else "")
    threads, smem = (fa3_backward_geometry(head_dim) if fa3 else
                     (tiles.threads(head_dim), tiles.smem_bytes(head_dim)))
    shipped = [(f, read_template(f).rstrip("\n") + "\n") for f in (*COMMON_TEMPLATES, *spec.files)]
    if fa3:  # wgmma.cuh and fa3_backward.cuh read the form (never paired here)
        shipped.insert(len(COMMON_TEMPLATES), ("kernel form",
                                               form_text(low_pressure=low_pressure)))
    asserts = (ATTENTION_PARAMS.static_asserts() + BACKWARD_PARAMS.static_asserts()
               + vc.params_layout.static_asserts()
               + (vc.grads_layout.static_asserts() if vc.grads_layout is not None else [])
               + static_asserts(spec.name, head_dim)
               + tile_static_asserts(spec.name, head_dim, threads, smem,
                                     (tiles.tq, tiles.tkv, tiles.stages, tiles.dsplit, 1)))
    entry = (f"{spec.entry_macro}({name}, {vc.struct_name}, {DTYPES[dtype][0]}, {head_dim}, "
             f"{tiles.tq}, {tiles.tkv}, {tiles.stages}, {tiles.dsplit})")
    source = render("translation_unit.cu.j2", version=_version(), v=vc, spec=spec,
                    head_dim=head_dim, dtype=dtype, dtype_ctype=DTYPES[dtype][0],
                    kernel_name=name, shipped=shipped, variant_text=vc.text, asserts=asserts,
                    ap_layout=ATTENTION_PARAMS, export=False, entry=entry, threads=threads,
                    rows_per_cta=tiles.tkv, smem=smem)
    return GeneratedKernel(source=source, kernel_name=name, params_layout=vc.params_layout,
                           attention_params_layout=BACKWARD_PARAMS, variant=vc,
                           kernel=spec.name, head_dim=head_dim, dtype=dtype, threads=threads,
                           rows_per_cta=tiles.tkv, shared_mem_bytes=smem,
                           grads_layout=vc.grads_layout)


def generate_source(ir: VariantIR, *, head_dim: int, dtype: str, kernel: str = "simple",
                    fast_math: bool | None = None, tiles: KernelTiles | None = None,
                    paired: bool = False, low_pressure: int = 0,
                    grad_tensors: Sequence[str] = (), kv_dtype: str | None = None,
                    head_dims: tuple[int, int] | None = None, exact_grads: bool = False
                    ) -> GeneratedKernel:
    """One self-contained translation unit (for NVRTC) running `ir` on a kernel template.

    `dtype` is the storage type of q, k, v and o: "bfloat16", "float16" or "float32".
    `kernel`: "simple" (one warp per query row, any dtype), "fa2" (the FlashAttention-2-style
    prefill template, bf16/fp16, `tiles` or `fa2.default_tiles`) or "fa2batch" (the persistent
    serving kernel and its merge kernel), "fa3" / "fa3batch" (sm_90a). The FA3 kernels come in
    forms: `paired` (dense "fa3" at a persistent head dim: CTA pairs) and `low_pressure` (fewer
    registers; the spill fallback; a level), emitted as `attncc::form` (form_text). A backward
    kernel (KernelSpec.backward) also gets the gradient hooks; `grad_tensors` names the captured tensors
    that require grad (docs/backward.md), `exact_grads` sums their gradients exactly, in any
    order the same (the deterministic mode; the name ends in `_exact`). `fast_math=True` spells the hooks' math with
    one-instruction approximations (see `cuda_expr.emit`); None (default) means True for the
    FA2 templates, False for "simple". `kv_dtype` ("fa2batch" only): an fp8 KV cache's dtype
    (KV8_DTYPES; None: q's dtype). `head_dims` ("fa2" / "fa2batch" / "fa3"): the real (query/key,
    value) head dims when they are not both `head_dim`; `head_dim` is then their padded width
    (64/128/256, attncc.codegen.tiles.padded_head_dim) and the kernel zero-fills the columns
    past them and does not store them (docs/flex-api.md, "Head dims"); the name ends in
    `_dqk<Dqk>_dv<Dv>`.

    Example:
        >>> gk = generate_source(VariantIR(name="plain"), head_dim=64, dtype="float16")
        >>> gk.variant.has_logits_transform, gk.params_layout.size
        (False, 4)
        >>> 'extern "C" __global__' in gk.source and "#include" not in gk.source
        True
        >>> fa = generate_source(VariantIR(name="plain"), head_dim=128, dtype="bfloat16",
        ...                      kernel="fa2", tiles=KernelTiles(64, 64, 2, 1))
        >>> fa.kernel_name, fa.block, fa.shared_mem_bytes
        ('attncc_plain_fa2_d128_bf16_q64_k64_s2', (128, 1, 1), 81920)
    """
    return _build(ir, head_dim, dtype, kernel, export=False, fast_math=fast_math, tiles=tiles,
                  paired=paired, low_pressure=low_pressure, grad_tensors=grad_tensors,
                  kv_dtype=kv_dtype, head_dims=head_dims, exact_grads=exact_grads)


def export_kernel(ir: VariantIR, *, head_dim: int, dtype: str, kernel: str = "simple",
                  fast_math: bool | None = None, tiles: KernelTiles | None = None
                  ) -> GeneratedKernel:
    """Like generate_source, plus a documented header and a host launcher (for nvcc users).

    Example:
        >>> gk = export_kernel(VariantIR(name="plain"), head_dim=64, dtype="float16")
        >>> "attncc_plain_simple_d64_f16_launch" in gk.source
        True
    """
    return _build(ir, head_dim, dtype, kernel, export=True, fast_math=fast_math, tiles=tiles)


def variant_param_values(layout: StructLayout, scalars: Mapping[str, Any],
                         tensors: Mapping[str, tuple[int, Sequence[int], Sequence[int]]]
                         ) -> dict[str, Any]:
    """Member values of VariantParams_<name> from captured values, ready for `layout.pack`.

    `scalars` maps captured scalar names to numbers; `tensors` maps captured tensor names to
    (device address, strides in elements, sizes).

    Example:
        >>> from attncc.ir.nodes import I32
        >>> from attncc.ir.program import ScalarParam
        >>> lay = generate_variant(VariantIR(scalars=(ScalarParam("n", I32),))).params_layout
        >>> lay.pack(variant_param_values(lay, {"n": 7}, {})).hex()
        '07000000'
    """
    out: dict[str, Any] = {}
    for f in layout.fields:
        if f.role == "scalar":
            if f.ref not in scalars:
                raise KeyError(f"no value for captured scalar {f.ref!r}")
            out[f.name] = scalars[f.ref]
        elif f.role in ("ptr", "stride", "size"):
            if f.ref not in tensors:
                raise KeyError(f"no value for captured tensor {f.ref!r}")
            ptr, strides, sizes = tensors[f.ref]
            out[f.name] = ptr if f.role == "ptr" else list(strides if f.role == "stride" else sizes)
    return out
