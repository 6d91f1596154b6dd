"""One Variant hook -> the C++ member function the kernel templates call.

Each IR hook maps to one static member of `Variant_<name>` (docs/kernel-interface.md):
query_mod -> QueryTransform, key_mod -> KeyTransform, value_mod -> ValueTransform,
score_mod -> LogitsTransform, mask_mod -> LogitsMask, output_mod -> OutputTransform.
An identity hook still gets its function (`return score;`, `return true;`, `return q[d];`) but
its `has_*` flag is false, so templates compile it out with `if constexpr`.

Example:
    >>> from attncc.ir.program import Hook
    >>> from attncc.ir.nodes import var
    >>> code = logits_mask(Hook("mask_mod", var("q_idx") >= var("kv_idx")))
    >>> code.enabled, code.body
    (True, ('return q_idx >= kv_idx;',))
    >>> logits_transform(Hook("score_mod", var("score"))).body
    ('return score;',)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..ir.nodes import Node, walk
from ..ir.printer import format_expr
from ..ir.program import HOOK_SIGNATURES, Hook, identity_expr
from .cuda_expr import ExprNames, emit
from .errors import CodegenError

if TYPE_CHECKING:
    from ..ir.autodiff import CapturedRead, ScoreModGrad


@dataclass(frozen=True)
class HookSpec:
    """The C++ shape of one hook: method, flag, return type and parameter list."""

    hook: str  # IR hook name, e.g. "score_mod"
    method: str  # member function name, e.g. "LogitsTransform"
    flag: str  # constexpr flag, e.g. "has_logits_transform"
    ret: str  # C return type
    vector: str | None  # head-vector parameter name (a `Vec` template parameter), or None
    params: tuple[str, ...]  # C parameters after `const Params& p`
    var_names: tuple[tuple[str, str], ...] = ()  # IR variable -> C parameter renames


SPECS: dict[str, HookSpec] = {
    "query_mod": HookSpec("query_mod", "QueryTransform", "has_query_transform", "float", "q",
                          ("const Vec& q", "int b", "int h", "int q_idx", "int d")),
    "key_mod": HookSpec("key_mod", "KeyTransform", "has_key_transform", "float", "k",
                        ("const Vec& k", "int b", "int h_kv", "int kv_idx", "int d"),
                        (("h", "h_kv"),)),
    "value_mod": HookSpec("value_mod", "ValueTransform", "has_value_transform", "float", "v",
                          ("const Vec& v", "int b", "int h_kv", "int kv_idx", "int d"),
                          (("h", "h_kv"),)),
    "score_mod": HookSpec("score_mod", "LogitsTransform", "has_logits_transform", "float", None,
                          ("float score", "int b", "int h", "int q_idx", "int kv_idx")),
    "mask_mod": HookSpec("mask_mod", "LogitsMask", "has_logits_mask", "bool", None,
                         ("int b", "int h", "int q_idx", "int kv_idx")),
    "output_mod": HookSpec("output_mod", "OutputTransform", "has_output_transform", "float", "o",
                           ("const Vec& o", "int b", "int h", "int q_idx", "int d")),
}


@dataclass(frozen=True)
class HookCode:
    """A hook ready for the variant template: signature parts, comments and body lines."""

    spec: HookSpec
    enabled: bool  # the has_* flag: false for identity hooks
    comments: tuple[str, ...]  # `//` comment lines (without the `// `)
    body: tuple[str, ...]  # statements, unindented; the last one returns

    @property
    def signature(self) -> str:
        """`float LogitsTransform(const Params& p, float score, ...)` (no qualifiers)."""
        return f"{self.spec.ret} {self.spec.method}(const Params& p, {', '.join(self.spec.params)})"


def comment_text(text: str) -> str:
    """`text` made safe for a `//` comment: one ASCII line that cannot splice the next line.

    Example:
        >>> comment_text("a\\nb α \\\\")
        'a b \\\\u03b1 \\\\ (end)'
    """
    text = " ".join(text.split())
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    # A trailing backslash would join the next source line onto this comment.
    return text + " (end)" if text.endswith("\\") else text


def _check(hook: Hook, allowed: Mapping[str, object]) -> None:
    """Reject IR that reads what this hook has no access to, naming the hook and the value."""
    want, variables, vector = HOOK_SIGNATURES[hook.name]
    if hook.expr.dtype is not want:
        raise CodegenError(f"{hook.name} must compute a {want.value} value, but its IR computes "
                           f"{hook.expr.dtype.value}")
    for n in walk(hook.expr):
        if n.op == "var" and n.attr not in variables:
            raise CodegenError(f"{hook.name} reads {n.attr!r}, which is not one of its "
                               f"arguments ({', '.join(variables)})")
        if n.op == "vec" and n.attr != vector:
            have = f"only {vector}[...]" if vector else "no head vector"
            raise CodegenError(f"{hook.name} reads {n.attr}[...], but it can read {have}")
        if n.op == "load":
            ndim = allowed.get(n.attr)
            if ndim is not None and ndim != len(n.args):
                raise CodegenError(f"{hook.name} indexes captured tensor {n.attr!r} with "
                                   f"{len(n.args)} index(es), but it has {ndim} dim(s)")


def hook_code(hook: Hook, tensors: Mapping[str, str] | None = None,
              scalars: Mapping[str, str] | None = None,
              tensor_ndims: Mapping[str, int] | None = None, fast_math: bool = False
              ) -> HookCode:
    """The C++ of any hook; `tensors` / `scalars` map captured names to params members;
    `fast_math` as in `cuda_expr.emit`.

    Example:
        >>> from attncc.ir.nodes import var
        >>> hook_code(Hook("key_mod", var("h") * 1.0 + 0.0)).body  # h is spelled h_kv here
        ('return (float)h_kv * 1.0f + 0.0f;',)
    """
    if hook.name not in SPECS:
        raise CodegenError(f"unknown hook {hook.name!r}; hooks are {', '.join(SPECS)}")
    spec = SPECS[hook.name]
    _check(hook, tensor_ndims or {})
    enabled = hook.expr is not identity_expr(hook.name)
    names = ExprNames(vars=dict(spec.var_names), tensors=dict(tensors or {}),
                      scalars=dict(scalars or {}))
    code = emit(hook.expr, names, fast_math=fast_math)
    where = str(hook.source) if hook.source is not None else "(no source location)"
    if enabled:
        comments = (comment_text(f"{hook.name}: {where}"),
                    comment_text(f"IR: {format_expr(hook.expr)}"))
    else:
        comments = (comment_text(f"{hook.name}: identity (not given or simplified away); "
                                 f"{spec.flag} = false"),)
    return HookCode(spec, enabled, comments, tuple(code.lines()))


def _as_hook(name: str, hook: Hook | Node | None) -> Hook:
    if hook is None:
        return Hook(name, identity_expr(name))
    if isinstance(hook, Node):
        return Hook(name, hook)
    if hook.name != name:
        raise CodegenError(f"{SPECS[name].method} is generated from a {name} hook, not from "
                           f"{hook.name}")
    return hook


def query_transform(hook: Hook | Node | None = None, **names: Mapping) -> HookCode:
    """QueryTransform from a query_mod Hook (or its IR; None = identity). See hook_code.

    Example:
        >>> query_transform().body
        ('return q[d];',)
    """
    return hook_code(_as_hook("query_mod", hook), **names)


def key_transform(hook: Hook | Node | None = None, **names: Mapping) -> HookCode:
    """KeyTransform from a key_mod Hook (or its IR; None = identity). See hook_code.

    Example:
        >>> key_transform().body, key_transform().enabled
        (('return k[d];',), False)
    """
    return hook_code(_as_hook("key_mod", hook), **names)


def value_transform(hook: Hook | Node | None = None, **names: Mapping) -> HookCode:
    """ValueTransform from a value_mod Hook (or its IR; None = identity). See hook_code.

    Example:
        >>> from attncc.ir.nodes import var, vec
        >>> value_transform(vec("v", var("d")) * 2.0).body
        ('return v[d] * 2.0f;',)
    """
    return hook_code(_as_hook("value_mod", hook), **names)


def logits_transform(hook: Hook | Node | None = None, **names: Mapping) -> HookCode:
    """LogitsTransform from a score_mod Hook (or its IR; None = identity). See hook_code.

    Example:
        >>> logits_transform().body
        ('return score;',)
    """
    return hook_code(_as_hook("score_mod", hook), **names)


def logits_mask(hook: Hook | Node | None = None, **names: Mapping) -> HookCode:
    """LogitsMask from a mask_mod Hook (or its IR; None = keep everything). See hook_code.

    Example:
        >>> logits_mask().body
        ('return true;',)
    """
    return hook_code(_as_hook("mask_mod", hook), **names)


def output_transform(hook: Hook | Node | None = None, **names: Mapping) -> HookCode:
    """OutputTransform from an output_mod Hook (or its IR; None = identity). See hook_code.

    Example:
        >>> output_transform().signature
        'float OutputTransform(const Params& p, const Vec& o, int b, int h, int q_idx, int d)'
    """
    return hook_code(_as_hook("output_mod", hook), **names)


EMITTERS: dict[str, Callable[..., HookCode]] = {
    "query_mod": query_transform, "key_mod": key_transform, "value_mod": value_transform,
    "score_mod": logits_transform, "mask_mod": logits_mask, "output_mod": output_transform,
}


# ----------------------------------------------------------------------------- backward hooks
# The backward translation unit's extra members of Variant_<name> (docs/backward.md, section 2;
# docs/kernel-interface.md): d score_mod / d score, and the scatter of d score_mod / d t[idx]
# into the fp32 gradient buffers of the captured tensors that require grad.
_SCORE_ARGS = ("float score", "int b", "int h", "int q_idx", "int kv_idx")
LOGITS_GRAD = HookSpec("score_mod", "LogitsGrad", "has_logits_grad", "float", None, _SCORE_ARGS)
CAPTURED_GRAD = HookSpec("score_mod", "CapturedGrad", "has_captured_grad", "void", None,
                         ("const Grads& g", "float dlogit", *_SCORE_ARGS))
# Reads at an index no position changes (`slopes[h]`): each element's term is summed into a
# register, the kernel sums a warp's registers, and one lane adds the total (docs/backward.md,
# "Tile-uniform captured reads").
TILE_GRAD_TERMS = HookSpec("score_mod", "TileGradTerms", "has_tile_grads", "void", None,
                           ("float (&acc)[kTileGradSlots]", "float dlogit", *_SCORE_ARGS))
TILE_GRAD_FLUSH = HookSpec("score_mod", "TileGradFlush", "has_tile_grads", "void", None,
                           ("const Grads& g", "const float (&acc)[kTileGradSlots]", "int b",
                            "int h"))
_POSITIONS = frozenset({"q_idx", "kv_idx", "score"})
# Reads at an index that depends on the positions only through q_idx - kv_idx (a relative
# table, T5 buckets): one address per diagonal. The kernel sums the terms of each diagonal over
# a lane's elements and the lanes that share it, and one lane adds the total (docs/backward.md,
# "Diagonal captured reads").
DIAG_GRAD_TERMS = HookSpec("score_mod", "DiagGradTerms", "has_diag_grads", "void", None,
                           ("float (&acc)[kDiagGradSlots]", "float dlogit", *_SCORE_ARGS))
DIAG_GRAD_ADD = HookSpec("score_mod", "DiagGradAdd", "has_diag_grads", "void", None,
                         ("const Grads& g", "const float (&acc)[kDiagGradSlots]", "int b",
                          "int h", "int q_idx", "int kv_idx"))


def logits_grad(hook: Hook, grad: "ScoreModGrad", *, tensors: Mapping[str, str] | None = None,
                scalars: Mapping[str, str] | None = None, fast_math: bool = False) -> HookCode:
    """LogitsGrad: `d score_mod / d score` at `score` (already multiplied by sm_scale).

    Example:
        >>> from attncc.ir.autodiff import score_mod_grad
        >>> from attncc.ir.nodes import var, unary
        >>> from attncc.ir.program import VariantIR
        >>> h = Hook("score_mod", unary("tanh", var("score")))
        >>> code = logits_grad(h, score_mod_grad(VariantIR(hooks={"score_mod": h})))
        >>> code.enabled, code.body
        (True, ('const float t0 = tanhf(score);', 'return 1.0f - t0 * t0;'))
    """
    names = ExprNames(tensors=dict(tensors or {}), scalars=dict(scalars or {}))
    code = emit(grad.logits, names, fast_math=fast_math)
    where = str(hook.source) if hook.source is not None else "(no source location)"
    comments = (comment_text(f"d score_mod / d score; score_mod: {where}"),
                comment_text(f"IR: {format_expr(grad.logits)}"))
    return HookCode(LOGITS_GRAD, grad.has_logits_grad, comments, tuple(code.lines()))


def tile_uniform(read: "CapturedRead") -> bool:
    """Whether a read's index is the same at every element of a tile: it uses no position and
    not the score (b, h and captured values are fixed per tile). `slopes[h]` is; a
    relative-position table `t[h, q_idx - kv_idx]` is not.

    Example:
        >>> from attncc.ir.autodiff import CapturedRead
        >>> from attncc.ir.nodes import var, const
        >>> tile_uniform(CapturedRead("s", (var("h"),), const(1.0)))
        True
        >>> tile_uniform(CapturedRead("t", (var("h"), var("q_idx") - var("kv_idx")), const(1.0)))
        False
    """
    from ..ir.nodes import free_vars

    return not any(_POSITIONS & free_vars(x) for x in read.indices)


def _diagonal_only(n: Node) -> bool:
    """Whether `n` uses q_idx and kv_idx only as `q_idx - kv_idx` or `kv_idx - q_idx`, and not
    the score."""
    if n.op == "sub" and all(a.op == "var" for a in n.args) and \
            {a.attr for a in n.args} == {"q_idx", "kv_idx"}:
        return True
    if n.op == "var":
        return n.attr not in _POSITIONS
    return all(_diagonal_only(a) for a in n.args)


def diagonal_read(read: "CapturedRead") -> bool:
    """Whether a read's index depends on the positions, and only through q_idx - kv_idx: the
    same address along every diagonal of a tile (`t[h, q_idx - kv_idx + C]`, T5 buckets).

    Example:
        >>> from attncc.ir.autodiff import CapturedRead
        >>> from attncc.ir.nodes import var, const
        >>> rel = CapturedRead("t", (var("h"), var("q_idx") - var("kv_idx") + 7), const(1.0))
        >>> diagonal_read(rel), diagonal_read(CapturedRead("s", (var("h"),), const(1.0)))
        (True, False)
        >>> diagonal_read(CapturedRead("t", (var("q_idx"),), const(1.0)))
        False
    """
    return not tile_uniform(read) and all(_diagonal_only(x) for x in read.indices)


def diag_grads(hook: Hook, grad: "ScoreModGrad", grad_fields: Mapping[str, str], *,
               tensors: Mapping[str, str] | None = None,
               scalars: Mapping[str, str] | None = None, fast_math: bool = False,
               exact: bool = False) -> tuple[HookCode, HookCode]:
    """DiagGradTerms and DiagGradAdd for the diagonal reads (`diagonal_read`), in order: Terms
    sets `acc[j]` to an element's `dlogit * d score_mod / d t[idx]`; Add adds summed `acc[j]`
    at the index of position (q_idx, kv_idx), any position of the diagonal the sum came from
    (a float atomicAdd, or `exact`, attncc::exact_grad_add).

    Example:
        >>> import torch, attncc
        >>> from attncc.ir.autodiff import score_mod_grad
        >>> bias = torch.zeros(4, 63)
        >>> ir, _ = attncc.Variant(score_mod=lambda s, b, h, q, kv: s + bias[h, q - kv + 31]
        ...                        ).trace()
        >>> t = ir.tensors[0].name
        >>> terms, add = diag_grads(ir.hook("score_mod"), score_mod_grad(ir, (t,)),
        ...                         {t: t + "_grad"}, tensors={t: t})
        >>> [line for line in terms.body if "acc" in line]
        ['    acc[0] = dlogit;']
        >>> [line.strip() for line in add.body if "atomicAdd" in line]
        ['atomicAdd(g.bias_grad + (attncc::i64)h * g.bias_grad_stride[0] + (attncc::i64)(q_idx - kv_idx + 31) * g.bias_grad_stride[1], acc[0]);']
    """
    return _summed_reads(hook, [r for r in grad.reads if diagonal_read(r)], grad_fields,
                         (DIAG_GRAD_TERMS, DIAG_GRAD_ADD), "=", "diagonal",
                         "summed per diagonal", tensors, scalars, fast_math, exact)


def _read_target(i: int, r: "CapturedRead", names: ExprNames, grad_fields: Mapping[str, str],
                 fast_math: bool) -> tuple[list[str], str, str]:
    """(index temporaries, buffer, element offset) of read `i`'s gradient element."""
    idx = [emit(x, names, fast_math=fast_math, temp_prefix=f"i{i}_{k}_")
           for k, x in enumerate(r.indices)]
    base = f"g.{grad_fields[r.tensor]}"
    terms = [f"(attncc::i64){_atom(c.value)} * {base}_stride[{k}]"
             for k, (x, c) in enumerate(zip(r.indices, idx))
             if not (x.op == "const" and x.attr == 0)]
    return [t for c in idx for t in c.temps], base, " + ".join(terms) if terms else "0"


def _scaled(r: "CapturedRead", d: Any) -> str:
    """`dlogit * d score_mod / d read` as C (`d`: the derivative emitted), `dlogit` alone where
    the derivative is exactly 1."""
    return "dlogit" if r.grad.op == "const" and r.grad.attr == 1.0 else f"dlogit * {_atom(d.value)}"


def _add(base: str, offset: str, value: str, exact: bool) -> str:
    """The statement adding `value` to element `offset` of gradient buffer `base`."""
    if exact:
        return f"attncc::exact_grad_add({base}, {offset}, {value});"
    return f"atomicAdd({base} + {offset}, {value});" if offset != "0" else \
        f"atomicAdd({base}, {value});"


def tile_grads(hook: Hook, grad: "ScoreModGrad", grad_fields: Mapping[str, str], *,
               tensors: Mapping[str, str] | None = None,
               scalars: Mapping[str, str] | None = None, fast_math: bool = False,
               exact: bool = False) -> tuple[HookCode, HookCode]:
    """TileGradTerms and TileGradFlush for the tile-uniform reads (`tile_uniform`), in order:
    Terms adds each element's `dlogit * d score_mod / d t[idx]` into `acc[j]` (register j of
    the kernel's sum), Flush adds a warp's summed `acc[j]` into `g.<t>_grad[idx]` (a float
    atomicAdd, or `exact`, attncc::exact_grad_add). Same-address atomics from every element
    of a tile become one per warp and tile.

    Example:
        >>> import torch, attncc
        >>> from attncc.ir.autodiff import score_mod_grad
        >>> slopes = torch.zeros(4)
        >>> ir, _ = attncc.Variant(score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
        ...                        ).trace()
        >>> t = ir.tensors[0].name
        >>> terms, flush = tile_grads(ir.hook("score_mod"), score_mod_grad(ir, (t,)),
        ...                           {t: t + "_grad"}, tensors={t: t})
        >>> [line for line in terms.body if "acc" in line]
        ['    acc[0] += dlogit * ((float)(kv_idx - q_idx));']
        >>> [line for line in flush.body if "Add" in line]
        ['    atomicAdd(g.slopes_grad + (attncc::i64)h * g.slopes_grad_stride[0], acc[0]);']
    """
    return _summed_reads(hook, [r for r in grad.reads if tile_uniform(r)], grad_fields,
                         (TILE_GRAD_TERMS, TILE_GRAD_FLUSH), "+=", "tile-uniform",
                         "summed per warp", tensors, scalars, fast_math, exact)


def _summed_reads(hook: Hook, reads: list["CapturedRead"], grad_fields: Mapping[str, str],
                  specs: tuple[HookSpec, HookSpec], assign: str, kind: str, how: str,
                  tensors: Mapping[str, str] | None, scalars: Mapping[str, str] | None,
                  fast_math: bool, exact: bool) -> tuple[HookCode, HookCode]:
    """The (terms, add) hook pair of `tile_grads` / `diag_grads`: terms `acc[j] <assign>
    dlogit * d score_mod / d read j`; add: `acc[j]` into read j's gradient element."""
    names = ExprNames(tensors=dict(tensors or {}), scalars=dict(scalars or {}))
    where = str(hook.source) if hook.source is not None else "(no source location)"
    terms: list[str] = []
    adds: list[str] = []
    notes = [comment_text(f"{kind} reads' terms, {how}; score_mod: {where}")]
    for j, r in enumerate(reads):
        d = emit(r.grad, names, fast_math=fast_math, temp_prefix=f"d{j}_")
        terms += ["{", *(f"    {s}" for s in d.temps), f"    acc[{j}] {assign} {_scaled(r, d)};",
                  "}"]
        temps, base, offset = _read_target(j, r, names, grad_fields, fast_math)
        adds += ["{", *(f"    {s}" for s in temps), f"    {_add(base, offset, f'acc[{j}]', exact)}",
                 "}"]
        notes.append(comment_text(f"acc[{j}]: {r.tensor}"
                                  f"[{', '.join(format_expr(x) for x in r.indices)}], "
                                  f"d/d read = {format_expr(r.grad)}"))
    if not reads:
        terms = [f"(void)acc; (void)dlogit;  // no {kind} read requires grad"]
        adds = [f"(void)g; (void)acc;  // no {kind} read requires grad"]
    return (HookCode(specs[0], bool(reads), tuple(notes), tuple(terms)),
            HookCode(specs[1], bool(reads), (notes[0],), tuple(adds)))


def captured_grad(hook: Hook, grad: "ScoreModGrad", grad_fields: Mapping[str, str], *,
                  tensors: Mapping[str, str] | None = None,
                  scalars: Mapping[str, str] | None = None, fast_math: bool = False,
                  exact: bool = False) -> HookCode:
    """CapturedGrad: for every read `t[idx...]` of a captured tensor requiring grad whose index
    depends on the positions other than through q_idx - kv_idx (the others are `tile_grads`'
    and `diag_grads`'),
    `g.<t>_grad[idx...] += dlogit * d score_mod / d t[idx...]` (a float atomicAdd; `exact`,
    the deterministic mode: `attncc::exact_grad_add`, an order-independent integer sum,
    kernels/common/exact_grad.cuh). Each read is one C++ block, so the temporaries of its index
    and derivative expressions stay local.

    Example:
        >>> import torch, attncc
        >>> from attncc.ir.autodiff import score_mod_grad
        >>> bias = torch.zeros(4, 64)
        >>> ir, _ = attncc.Variant(score_mod=lambda s, b, h, q, kv: s * bias[h, q]).trace()
        >>> t = ir.tensors[0].name
        >>> code = captured_grad(ir.hook("score_mod"), score_mod_grad(ir, (t,)), {t: t + "_grad"},
        ...                      tensors={t: t})
        >>> code.body[1]
        '    atomicAdd(g.bias_grad + (attncc::i64)h * g.bias_grad_stride[0] + (attncc::i64)q_idx * g.bias_grad_stride[1], dlogit * score);'
        >>> captured_grad(ir.hook("score_mod"), score_mod_grad(ir, (t,)), {t: t + "_grad"},
        ...               tensors={t: t}, exact=True).body[1]
        '    attncc::exact_grad_add(g.bias_grad, (attncc::i64)h * g.bias_grad_stride[0] + (attncc::i64)q_idx * g.bias_grad_stride[1], dlogit * score);'
    """
    names = ExprNames(tensors=dict(tensors or {}), scalars=dict(scalars or {}))
    where = str(hook.source) if hook.source is not None else "(no source location)"
    comments = [comment_text(f"d score_mod / d (captured tensor read); score_mod: {where}")]
    body: list[str] = []
    reads = [r for r in grad.reads if not tile_uniform(r) and not diagonal_read(r)]
    for i, r in enumerate(reads):
        d = emit(r.grad, names, fast_math=fast_math, temp_prefix=f"d{i}_")
        temps, base, offset = _read_target(i, r, names, grad_fields, fast_math)
        scaled = _scaled(r, d)
        comments.append(comment_text(
            f"read {i}: {r.tensor}[{', '.join(format_expr(x) for x in r.indices)}], "
            f"d/d read = {format_expr(r.grad)}"))
        body += ["{", *(f"    {s}" for s in temps), *(f"    {s}" for s in d.temps),
                 f"    {_add(base, offset, scaled, exact)}", "}"]
    if not body:
        body = ["(void)g; (void)dlogit;  // no position-dependent read requires grad"]
    return HookCode(CAPTURED_GRAD, bool(reads), tuple(comments), tuple(body))


def _atom(text: str) -> str:
    """`text` parenthesized unless it is a name, a call or a number (safe as an operand).

    Example:
        >>> _atom("score"), _atom("q_idx - kv_idx"), _atom("0x1.8p-3f"), _atom("-1.0f")
        ('score', '(q_idx - kv_idx)', '0x1.8p-3f', '(-1.0f)')
    """

    name = r"[A-Za-z_][\w:.]*(\[[^\[\]]*\])?"
    number = r"(0x[0-9a-fA-F.]+p[+-]?\d+|[\d.]+(e[+-]?\d+)?)f?"
    if re.fullmatch(rf"{name}|{number}|[\w:]+\([^()]*\)", text):
        return text
    return f"({text})"
