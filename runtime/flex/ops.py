"""`torch.ops.attncc.flex_attention`: the flex path as a torch.library op, for torch.compile.

Under `torch.compile`, `attncc.flex_attention` hands its work to `compiled_flex_attention`, which
Dynamo traces. The mods are traced to IR outside Dynamo, once per Dynamo trace, by `register`
(marked `torch.compiler.assume_constant_result`: Dynamo calls it with the real function objects
and bakes its result, a tuple of constants, into the graph). That result says where every
captured value lives (closure cell, module global, block mask bindings), so the traced code reads
them the way Dynamo understands: captured tensors become graph inputs, captured scalars become
op arguments, and the graph holds one call of the op. The op finds the traced IR again in a
process registry under `variant_key`, a hash of the IR, so equal variants share an entry across
Dynamo traces and processes. Design and limits: docs/compile.md.

On CPU tensors the op runs the exact reference (as eager `flex_attention` does); on CUDA
bf16/fp16 tensors the compiled kernel (`gpu_flex`); its fake implementation gives shapes and
dtypes only. Gradients: `flex_backward` (docs/compile.md, "Autograd").

Example:
    >>> import torch, attncc
    >>> bias = torch.randn(2)
    >>> def add_bias(score, b, h, q_idx, kv_idx):
    ...     return score + bias[h]
    >>> q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    >>> f = torch.compile(lambda q, k, v: attncc.flex_attention(q, k, v, score_mod=add_bias),
    ...                   fullgraph=True, backend="eager")
    >>> bool(torch.allclose(f(q, k, v), attncc.flex_attention(q, k, v, score_mod=add_bias)))
    True
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import math
import threading
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from attncc.errors import InvalidArgument, TraceError
from attncc.frontend import Variant
from attncc.frontend.trace import trace_mods_guarded
from attncc.ir.program import HOOK_ORDER, Bindings, VariantIR

from ..reference import attention_reference, check_sinks, is_noop_mask, validate_attention_inputs

# A read: (root, path). Roots: 0 the score_mod argument (function or Variant), 1 the block
# mask's mask_mod, 2 the block mask. Steps: ("attr", name), ("closure", i), ("global", name),
# ("item", key).
Read = tuple[int, tuple[tuple[str, Any], ...]]
_MAX_DEPTH = 8  # helper functions called from helper functions ... this deep are followed


@dataclass(frozen=True)
class Entry:
    """A registered variant: its IR, the block mask's traced mask_mod, and op argument order."""

    ir: VariantIR
    mask: tuple[VariantIR, tuple[str, ...], tuple[str, ...]] | None  # IR, scalars, tensors
    scalars: tuple[str, ...]  # the variant's, in op order (float_args then int_args)
    tensors: tuple[str, ...]
    kernel_options: tuple[tuple[str, Any], ...]
    checks: "EagerChecks"


class EagerChecks(NamedTuple):
    """The eager call's argument checks, handed in by `flex_attention` (api.py) so that this
    module does not import it back."""

    kernel_options: Callable[[Any], None]
    sizes: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    static: Callable[[VariantIR, Bindings, torch.Tensor, torch.Tensor, torch.Tensor], None]


_ENTRIES: dict[int, Entry] = {}
_LOCK = threading.Lock()


def _registry() -> dict[int, Entry]:
    """The canonical module's registry. pytest's doctest run imports this file a second time
    (as `runtime.flex.ops`), which defines the op again with that copy's functions: both copies
    must see the entries `attncc.flex_attention` registers."""
    return importlib.import_module("attncc.runtime.flex.ops")._ENTRIES


def entry_for(variant_key: int) -> Entry:
    """The registered variant, or an error saying the key was made in another process."""
    entry = _registry().get(variant_key)
    if entry is None:
        raise InvalidArgument(f"attncc::flex_attention: variant_key {variant_key} is not "
                              f"registered in this process; the key comes from "
                              f"attncc.flex_attention under torch.compile (register), call that "
                              f"instead of the op")
    return entry


# ------------------------------------------------------------------ where captures live
def _code_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _code_names(c)
    return names


class _Paths:
    """Every capture site and tensor reachable from the roots, with the first path to it."""

    def __init__(self) -> None:
        self.sites: dict[tuple, Read] = {}
        self.tensors: dict[int, Read] = {}
        self.values: dict[tuple, Any] = {}  # site -> the value read there

    def function(self, fn: Any, read: Read, depth: int = 0) -> None:
        if not isinstance(fn, types.FunctionType) or depth > _MAX_DEPTH:
            return
        root, path = read
        for i, cell in enumerate(fn.__closure__ or ()):
            here = (root, path + (("closure", i),))
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.site(("cell", id(cell)), here, v, depth)
        glb = fn.__globals__
        for name in dict.fromkeys(_code_names(fn.__code__)):
            if name in glb:
                self.site(("global", id(glb), name), (root, path + (("global", name),)),
                          glb[name], depth)

    def site(self, site: tuple, read: Read, v: Any, depth: int) -> None:
        if site in self.sites:
            return
        self.sites[site] = read
        self.values[site] = v
        self.value(v, read, depth)

    def value(self, v: Any, read: Read, depth: int) -> None:
        root, path = read
        if isinstance(v, torch.Tensor):
            self.tensors.setdefault(id(v), read)
        elif isinstance(v, types.FunctionType):
            self.function(v, read, depth + 1)
        elif isinstance(v, (tuple, list)) and len(v) <= 64:
            for i, x in enumerate(v):
                if isinstance(x, (torch.Tensor, types.FunctionType)):
                    self.value(x, (root, path + (("item", i),)), depth)
        elif isinstance(v, dict) and len(v) <= 64:
            for k, x in v.items():
                if isinstance(k, (str, int)) and isinstance(x, (torch.Tensor, types.FunctionType)):
                    self.value(x, (root, path + (("item", k),)), depth)


def hooks_of(score_mod: Any) -> tuple[tuple[tuple[str, Callable], ...], str, str | None, bool]:
    """(hook functions, normalize, name, whether they are attributes of `score_mod`) of
    flex_attention's argument: a function, a Variant or None. Traced by Dynamo, so `register`
    gets plain functions (which every supported torch converts to constants)."""
    if score_mod is None:
        return (), "softmax", None, False
    if isinstance(score_mod, Variant):
        hooks = tuple((h, getattr(score_mod, h)) for h in HOOK_ORDER
                      if getattr(score_mod, h) is not None)
        return hooks, score_mod.normalize, score_mod.name, True
    if callable(score_mod):
        return (("score_mod", score_mod),), "softmax", None, False
    raise TypeError(f"score_mod must be a function score_mod(score, b, h, q_idx, kv_idx) or an "
                    f"attncc.Variant, got {type(score_mod).__name__}")


def _trace(hooks: dict[str, Callable], normalize: str, name: str | None, paths: _Paths,
           what: str) -> tuple[VariantIR, list[tuple[Read, Any]], list[Read], set[tuple]]:
    """Trace `hooks`; returns the IR, where its scalars (with their traced values) and tensors
    are read, and the sites that became kernel parameters."""
    ir, bindings, guard = trace_mods_guarded(hooks, normalize=normalize, name=name)
    if not guard.cacheable:
        raise TraceError(f"attncc.flex_attention under torch.compile: the {what} cannot be "
                         f"guarded: {guard.reason}; capture plain ints/floats and tensors "
                         f"(closure variables or module globals) instead (docs/compile.md)")
    scalar_reads = []  # (read, the value traced): see _read
    for p, value in bindings.scalars.items():
        read = paths.sites.get(guard.param_sites[p])
        if read is None:
            raise TraceError(f"attncc.flex_attention under torch.compile: cannot tell where the "
                             f"{what}'s captured scalar {p!r} lives; capture it in a closure or "
                             f"module global (docs/compile.md)")
        scalar_reads.append((read, value))
    tensor_reads = []
    for tn, t in bindings.tensors.items():
        read = paths.tensors.get(id(t))
        if read is None:
            raise TraceError(f"attncc.flex_attention under torch.compile: cannot tell where the "
                             f"{what}'s captured tensor {tn!r} lives; capture it in a closure or "
                             f"module global (docs/compile.md)")
        tensor_reads.append(read)
    return ir, scalar_reads, tensor_reads, set(guard.param_sites.values())


def _checks(paths: _Paths, params: set[tuple]) -> list[tuple[Read, Any]]:
    """Scalars baked into the IR (used as Python values): the traced code compares them, so
    Dynamo guards on them and a new value means a new trace."""
    out = []
    for site, read in paths.sites.items():
        v = paths.values[site]
        if site not in params and (v is None or isinstance(v, (bool, int, float, str))):
            out.append((read, v))
    return out


def _simplified(ir: VariantIR) -> VariantIR:
    try:
        from attncc.ir.simplify import simplify_variant
    except ImportError:
        return ir
    return simplify_variant(ir)


@torch.compiler.assume_constant_result
def register(hooks: tuple, normalize: str, name: str | None, hook_attrs: bool, mask_fn: Any,
             options: tuple, mask_bindings: tuple, checks: tuple) -> tuple:
    """Trace the mods (runs at Dynamo trace time, outside Dynamo) and register the variant.

    `hooks`, `normalize`, `name`, `hook_attrs`: `hooks_of(score_mod)`. `mask_bindings`: names
    of the tensors the block mask holds in `.bindings` (attncc's BlockMask: already on the
    mask's device), read there instead of from the function. `checks`: an `EagerChecks`.
    Returns `(variant_key, normalize, float reads, int reads, tensor reads, checks)`: reads of
    the variant's captures, then the block mask mod's, in op argument order.
    """
    checks = EagerChecks(*checks)
    checks.kernel_options(dict(options))
    paths = _Paths()
    for h, fn in hooks:
        paths.function(fn, (0, (("attr", h),) if hook_attrs else ()))
    hooks = dict(hooks)
    ir, sreads, treads, params = _trace(hooks, normalize, name, paths, "score_mod")
    mask = None
    if mask_fn is not None and not is_noop_mask(mask_fn):
        paths.function(mask_fn, (1, ()))
        mir, msreads, mtreads, mparams = _trace({"mask_mod": mask_fn}, "softmax", None, paths,
                                                "block mask's mask_mod")
        mtreads = [(2, (("attr", "bindings"), ("attr", "tensors"), ("item", t.name)))
                   if t.name in mask_bindings else r for t, r in zip(mir.tensors, mtreads)]
        mask = (mir, tuple(s.name for s in mir.scalars), tuple(t.name for t in mir.tensors))
        sreads, treads, params = sreads + msreads, treads + mtreads, params | mparams
    else:
        mir = None
    simple = _simplified(ir)
    floats = [i for i, s in enumerate(ir.scalars + (mir.scalars if mir else ()))
              if s.dtype.value != "i32"]
    ints = [i for i, s in enumerate(ir.scalars + (mir.scalars if mir else ()))
            if s.dtype.value == "i32"]
    entry = Entry(simple, mask, tuple(s.name for s in ir.scalars),
                  tuple(t.name for t in ir.tensors), tuple(options), checks)
    text = repr((simple.format(), mir.format() if mir else None, entry.scalars, entry.tensors,
                 options))
    key = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    with _LOCK:
        _registry().setdefault(key, entry)
    return (key, normalize, tuple(sreads[i] for i in floats), tuple(sreads[i] for i in ints),
            tuple(treads), tuple(_checks(paths, params)))


# ------------------------------------------------------------------ the traced side
def _read(roots: tuple, read: Read, traced_value: Any = None) -> Any:
    """The value at `read`. A function defined inside the compiled region has no `__closure__`
    under Dynamo; it was registered with constant captures only, which Dynamo guards where they
    came from, so the value seen at trace time stands (docs/compile.md)."""
    root, path = read
    obj = roots[root]
    for kind, arg in path:
        if kind == "attr":
            obj = getattr(obj, arg)
        elif kind == "closure":
            try:
                obj = obj.__closure__[arg].cell_contents
            except AttributeError:
                return traced_value
        elif kind == "global":
            obj = obj.__globals__[arg]
        else:
            obj = obj[arg]
    return obj


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def compiled_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            score_mod: Any, block_mask: Any, scale: float | None,
                            enable_gqa: bool, return_lse: bool, kernel_options: Any,
                            checks: EagerChecks, sinks: torch.Tensor | None = None) -> Any:
    """`flex_attention` as Dynamo traces it: captures read in traced code, one op call."""
    mask_fn = None if block_mask is None else block_mask.mask_mod
    names = ()
    if block_mask is not None and getattr(block_mask, "bindings", None) is not None:
        names = tuple(block_mask.bindings.tensors.keys())
    options = () if kernel_options is None else tuple(sorted(kernel_options.items()))
    hooks, normalize, name, hook_attrs = hooks_of(score_mod)
    vkey, normalize, freads, ireads, treads, guards = register(
        hooks, normalize, name, hook_attrs, mask_fn, options, names, tuple(checks))
    if return_lse and normalize == "none":
        raise ValueError("return_lse=True but the variant has normalize='none': there is no "
                         "softmax, so no log-sum-exp; call with return_lse=False")
    roots = (score_mod, mask_fn, block_mask)
    for read, expected in guards:
        if not _same(_read(roots, read, expected), expected):  # never at trace time; Dynamo guards it
            raise TraceError("a captured value used as a Python constant changed")
    tensors = [_read(roots, r) for r in treads]
    floats = [float(_read(roots, r, x)) for r, x in freads]
    ints = [int(_read(roots, r, x)) for r, x in ireads]
    bm: tuple = (None, None, None, None, [0, 0], [0, 0])
    if block_mask is not None:
        bs = block_mask.BLOCK_SIZE
        bs = [bs, bs] if isinstance(bs, int) else [bs[0], bs[1]]
        bm = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices, bs, list(block_mask.seq_lengths))
    out, lse = torch.ops.attncc.flex_attention(query, key, value, *bm, tensors, floats, ints,
                                               vkey, scale, enable_gqa, sinks)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------ the op
class _OpBlockMask:
    """The block mask rebuilt inside the op from its tensors and the registered mask IR; read
    by `gpu_flex` (`mask_ir`, `bindings`) and the reference (`traced_mask`)."""

    def __init__(self, tensors: Sequence[Optional[torch.Tensor]], block_size: Sequence[int],
                 seq_lengths: Sequence[int], traced: tuple[VariantIR, Bindings] | None) -> None:
        (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
         self.full_kv_indices) = tensors
        self.q_num_blocks = self.q_indices = None
        self.full_q_num_blocks = self.full_q_indices = None
        self.BLOCK_SIZE = (int(block_size[0]), int(block_size[1]))
        self.seq_lengths = (int(seq_lengths[0]), int(seq_lengths[1]))
        self.traced_mask = traced
        self.mask_ir = None if traced is None else traced[0].expr("mask_mod")
        self.bindings = None if traced is None else traced[1]
        self.mask_mod = None if traced is None else _registered_mask


def _registered_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Stands for a registered block mask's mask_mod (its IR is `_OpBlockMask.traced_mask`)."""
    raise TraceError("internal: the registered mask_mod is read from its traced IR")


_MASKS: "OrderedDict[tuple, tuple[tuple, _OpBlockMask]]" = OrderedDict()
_MASKS_SIZE = 16


def _unpack(entry: Entry, captured: Sequence[torch.Tensor], float_args: Sequence[float],
            int_args: Sequence[int], bm_tensors: tuple, block_size: Sequence[int],
            seq_lengths: Sequence[int]) -> tuple[Bindings, Any]:
    """The variant's bindings and the block mask object from the op's arguments."""
    mask_scalars = entry.mask[0].scalars if entry.mask else ()
    decls = entry.ir.scalars + mask_scalars
    fi, ii = iter(float_args), iter(int_args)
    vals = [next(ii) if s.dtype.value == "i32" else next(fi) for s in decls]
    ns, nt = len(entry.ir.scalars), len(entry.ir.tensors)
    bindings = Bindings(dict(zip(entry.scalars, vals[:ns])),
                        dict(zip(entry.tensors, captured[:nt])))
    if bm_tensors[0] is None:
        return bindings, None
    # the same mask object for the same tensors and values: gpu_flex caches its launch plan
    # per block mask object
    ckey = (*map(id, bm_tensors), *map(id, captured[nt:]), tuple(vals[ns:]), tuple(block_size),
            tuple(seq_lengths), id(entry))
    hit = _MASKS.get(ckey)
    if hit is not None:  # ids are unique while the entry holds the tensors
        return bindings, hit[1]
    traced = None
    if entry.mask is not None:
        mir, snames, tnames = entry.mask
        traced = (mir, Bindings(dict(zip(snames, vals[ns:])), dict(zip(tnames, captured[nt:]))))
    bm = _OpBlockMask(bm_tensors, block_size, seq_lengths, traced)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return bindings, bm  # the graph's pool must not keep its recording inputs alive
    with _LOCK:
        _MASKS[ckey] = ((*bm_tensors, *captured[nt:]), bm)  # holding the tensors keeps ids
        while len(_MASKS) > _MASKS_SIZE:
            _MASKS.popitem(last=False)
    return bindings, bm


def run_entry(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, entry: Entry,
              bindings: Bindings, block_mask: Any, scale: float | None, enable_gqa: bool,
              sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager `flex_attention`'s checks and run, for a registered variant: (out, lse)."""
    entry.checks.sizes(query, key, value)
    validate_attention_inputs(query, key, value, block_mask, enable_gqa)
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(f"query is on {query.device}; attncc runs on CPU and CUDA tensors")
    ir = entry.ir
    if sinks is not None:
        if not ir.use_softmax:
            raise InvalidArgument("sinks were given but the variant has normalize='none': a "
                                  "sink joins a softmax denominator; drop sinks")
        check_sinks(sinks, query.shape[1], query.device, query.dtype)
    entry.checks.static(ir, bindings, query, key, value)
    B, Hq, Sq, _ = query.shape
    if query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16):
        from .gpu_flex import gpu_flex_attention

        out, lse = gpu_flex_attention(query, key, value, ir, bindings, block_mask=block_mask,
                                      scale=scale, enable_gqa=enable_gqa,
                                      return_lse=ir.use_softmax,
                                      kernel_options=dict(entry.kernel_options) or None,
                                      sinks=sinks)
    else:
        out, lse = attention_reference(query, key, value, ir, bindings, block_mask=block_mask,
                                       scale=scale, enable_gqa=enable_gqa,
                                       float_dtype=torch.float64, sinks=sinks)
        out = out.to(query.dtype)
    if lse is None:  # normalize="none": no softmax; flex_attention never returns this
        lse = torch.zeros(B, Hq, Sq, dtype=torch.float32, device=query.device)
    return out.contiguous(), lse.to(torch.float32).contiguous()


@torch.library.custom_op("attncc::flex_attention", mutates_args=())
def flex_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_num_blocks: Optional[torch.Tensor], kv_indices: Optional[torch.Tensor],
                      full_kv_num_blocks: Optional[torch.Tensor],
                      full_kv_indices: Optional[torch.Tensor], block_size: list[int],
                      seq_lengths: list[int], captured: list[torch.Tensor],
                      float_args: list[float], int_args: list[int], variant_key: int,
                      scale: Optional[float], enable_gqa: bool,
                      sinks: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the registered variant `variant_key` (see the module docstring); `sinks`
    [Hq] or None: attention sinks (the LSE includes them)."""
    entry = entry_for(variant_key)
    bm_tensors = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    bindings, bm = _unpack(entry, captured, float_args, int_args, bm_tensors, block_size,
                           seq_lengths)
    return run_entry(query, key, value, entry, bindings, bm, scale, enable_gqa, sinks)


@flex_attention_op.register_fake
def _flex_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    B, Hq, Sq, _ = query.shape
    out = query.new_empty(B, Hq, Sq, value.shape[-1])
    lse = query.new_empty(B, Hq, Sq, dtype=torch.float32)
    return out, lse


# ------------------------------------------------------------------ autograd
def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    (q, k, v, kvn, kvi, fkvn, fkvi, bs, sl, captured, fa, ia, vkey, scale, gqa, sinks) = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # an unused lse gets None, not zeros: see flex_backward
    ctx.save_for_backward(q, k, v, out, lse, kvn, kvi, fkvn, fkvi, sinks, *captured)
    ctx.args = (bs, sl, fa, ia, vkey, scale, gqa)


def _backward(ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple:
    q, k, v, out, lse, kvn, kvi, fkvn, fkvi, sinks, *captured = ctx.saved_tensors
    bs, sl, fa, ia, vkey, scale, gqa = ctx.args
    gq, gk, gv, gcap, gsinks = flex_attention_backward_op(
        q, k, v, out, lse, grad_out, grad_lse, kvn, kvi, fkvn, fkvi, bs, sl, list(captured), fa,
        ia, vkey, scale, gqa, sinks)
    gcap = [g if c.is_floating_point() else None for g, c in zip(gcap, captured)]
    # custom_op checks the structure: None for a list of numbers, but [] for an empty list
    bs, sl, fa, ia = (None if x else [] for x in (bs, sl, fa, ia))
    grads = (gq, gk, gv, None, None, None, None, bs, sl, gcap, fa, ia, None, None, None)
    # the dispatcher drops a trailing argument equal to its default (sinks=None), and the
    # gradients must have the inputs' structure
    return grads if sinks is None else (*grads, gsinks)


@torch.library.custom_op("attncc::flex_attention_backward", mutates_args=())
def flex_attention_backward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor,
                               grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                               kv_num_blocks: Optional[torch.Tensor],
                               kv_indices: Optional[torch.Tensor],
                               full_kv_num_blocks: Optional[torch.Tensor],
                               full_kv_indices: Optional[torch.Tensor], block_size: list[int],
                               seq_lengths: list[int], captured: list[torch.Tensor],
                               float_args: list[float], int_args: list[int], variant_key: int,
                               scale: Optional[float], enable_gqa: bool,
                               sinks: Optional[torch.Tensor] = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                          list[torch.Tensor], torch.Tensor]:
    """(dq, dk, dv, d captured, d sinks) of `flex_attention_op`; a captured tensor that is not
    floating point gets an empty tensor (no gradient), and so do absent sinks."""
    entry = entry_for(variant_key)
    bm_tensors = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    bindings, bm = _unpack(entry, captured, float_args, int_args, bm_tensors, block_size,
                           seq_lengths)
    dq, dk, dv, dcap, dsinks = flex_backward(query, key, value, out, lse, grad_out, grad_lse,
                                             entry, bindings, bm, scale, enable_gqa, captured,
                                             sinks)
    dcap = [torch.zeros(c.shape, dtype=c.dtype, device=c.device)
            if d is None and c.is_floating_point() else d
            for d, c in zip(dcap, captured)]
    dcap = [query.new_empty(0) if d is None else d for d in dcap]
    grads = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) if g is None else
             g.contiguous() for g, t in ((dq, query), (dk, key), (dv, value))]
    if sinks is None:
        dsinks = query.new_empty(0)
    elif dsinks is None:
        dsinks = torch.zeros(sinks.shape, dtype=sinks.dtype, device=sinks.device)
    return grads[0], grads[1], grads[2], [d.contiguous() for d in dcap], dsinks.contiguous()


@flex_attention_backward_op.register_fake
def _flex_attention_backward_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  *args: Any) -> tuple:
    captured = args[10]
    sinks = args[16] if len(args) > 16 else None
    def like(t: torch.Tensor) -> torch.Tensor:  # contiguous, as the real kernel returns them
        return t.new_empty(t.shape)

    return (like(query), like(key), like(value),
            [like(c) if c.is_floating_point() else query.new_empty(0) for c in captured],
            query.new_empty(0) if sinks is None else like(sinks))


@contextlib.contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """Autograd back on inside an op's kernel, where the dispatcher has switched it off: the
    reference recomputation differentiates with torch.autograd (docs/compile.md, "Autograd")."""
    keys = torch._C.DispatchKey
    with torch._C._PreserveDispatchKeyGuard():
        for k in (keys.AutogradFunctionality, keys.ADInplaceOrView):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
        torch._C._dispatch_tls_set_dispatch_key_included(keys.ADInplaceOrView, False)
        yield


def flex_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None,
                  entry: Entry, bindings: Bindings, bm: Any, scale: float | None, gqa: bool,
                  captured: Sequence[torch.Tensor], sinks: torch.Tensor | None = None) -> tuple:
    """(dq, dk, dv, [d captured], d sinks or None) eagerly: on CUDA bf16/fp16 the FA2-class
    backward kernel (autograd.backward_of_saved; the sinks' gradient from autograd.sinks_grad)
    where it applies, else autograd through the float64 reference recomputed (captured float
    tensors and the sinks get gradients there too). docs/compile.md, "Autograd"."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and grad_out is not None:
        from .autograd import backward_of_saved, sinks_grad

        got = backward_of_saved(q, k, v, out, lse, grad_out, grad_lse, entry.ir, bindings, bm,
                                scale, gqa, dict(entry.kernel_options) or None)
        if got is not None:
            dq, dk, dv, dcap = got
            names = list(entry.tensors)
            dsinks = (None if sinks is None
                      else sinks_grad(sinks, out, lse, grad_out, grad_lse))
            return dq, dk, dv, [dcap.get(names[i]) if i < len(names) else None
                                for i in range(len(captured))], dsinks
    with _autograd_inside_op(), torch.enable_grad():
        qkv = [t.detach().requires_grad_(True) for t in (q, k, v)]
        caps = [t.detach().requires_grad_(t.is_floating_point()) for t in captured]
        sk = None if sinks is None else sinks.detach().requires_grad_(True)
        tensors = dict(zip(entry.tensors, caps[:len(entry.tensors)]))
        o64, l64 = attention_reference(*qkv, entry.ir, Bindings(bindings.scalars, tensors),
                                       block_mask=bm, scale=scale, enable_gqa=gqa,
                                       float_dtype=torch.float64, sinks=sk)
        outs, gouts = [], []
        if grad_out is not None:
            outs.append(o64)
            gouts.append(grad_out.to(o64.dtype))
        if grad_lse is not None and l64 is not None:
            outs.append(l64)
            # a fully masked row's LSE is -inf whatever the inputs: no gradient flows there
            gouts.append(torch.where(torch.isfinite(l64), grad_lse.to(l64.dtype), 0.0))
        wrt = qkv + [c for c in caps if c.requires_grad] + ([sk] if sk is not None else [])
        if not outs:
            return (None, None, None, [None] * len(captured), None)
        g = torch.autograd.grad(outs, wrt, gouts, allow_unused=True)
    dq, dk, dv = (None if gi is None else gi.to(t.dtype) for gi, t in zip(g[:3], (q, k, v)))
    rest = iter(g[3:])
    dcap = [next(rest) if c.requires_grad else None for c in caps]
    dcap = [None if d is None else d.to(c.dtype) for d, c in zip(dcap, captured)]
    dsinks = None
    if sk is not None:
        dsinks = next(rest)
        dsinks = None if dsinks is None else dsinks.to(sinks.dtype)  # type: ignore[union-attr]
    return dq, dk, dv, dcap, dsinks


flex_attention_op.register_autograd(_backward, setup_context=_setup_context)

__all__ = ["EagerChecks", "Entry", "compiled_flex_attention", "entry_for", "hooks_of", "flex_attention_backward_op",
           "flex_attention_op",
           "flex_backward", "register", "run_entry"]
