"""Analyses of a variant's hooks: what each reads, which are identities, static index checks.

Codegen and the runtime use these to specialise: a mask that never reads `b` or `h` needs one
block mask for all batches and heads; an identity hook produces no code; a transform that reads
its head vector out of range is a user error caught before any kernel runs.

Example:
    >>> from attncc.ir.nodes import var
    >>> from attncc.ir.program import Hook, VariantIR
    >>> info = analyze(VariantIR(hooks={"mask_mod": Hook("mask_mod", var("q_idx") >= var("kv_idx"))}))
    >>> info.mask_depends_on_bh, sorted(info.reads["mask_mod"]), info.identity["score_mod"]
    (False, ['kv_idx', 'q_idx'], True)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ..errors import CapturedReadError, IndexOverflowWarning, TraceError
from .evaluator import EvalError, evaluate
from .nodes import Node, free_vars, walk
from .printer import format_expr
from .program import (HOOK_ORDER, HOOK_SIGNATURES, TRANSFORM_HOOKS, Hook, VariantIR,
                      identity_expr)

if TYPE_CHECKING:
    from .intervals import Domain

INDEX_ORDER = ("b", "h", "q_idx", "kv_idx", "d")
Computed = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]

__all__ = ["VariantInfo", "analyze", "check_vector_indices", "reads", "CapturedReadError",
           "load_guards", "bounds_message", "read_text", "Shapes", "ReadCheck",
           "check_captured_reads", "clamp_reads", "IndexOverflowWarning", "index_overflows",
           "check_vector_reads"]


def reads(expr: Node) -> frozenset[str]:
    """The index variables (b, h, q_idx, kv_idx, d) and `score` that `expr` reads.

    Indices of captured-tensor loads count: `doc_ids[b, q_idx]` reads b and q_idx.

    Example:
        >>> from attncc.ir.nodes import var, load, binary, I32
        >>> sorted(reads(binary("eq", load("doc_ids", (var("b"), var("q_idx")), I32), var("kv_idx"))))
        ['b', 'kv_idx', 'q_idx']
    """
    return free_vars(expr)


@dataclass(frozen=True)
class VariantInfo:
    """Facts about a simplified variant, for codegen and the runtime.

    `reads` and `identity` have an entry for each of the six hooks (a missing hook is its
    identity). The `*_depends_on_*` flags are False when the hook is absent.
    """

    reads: dict[str, frozenset[str]]
    identity: dict[str, bool]
    mask_depends_on_bh: bool
    mask_depends_on_b: bool
    mask_depends_on_h: bool
    score_depends_on_bh: bool


def analyze(ir: VariantIR) -> VariantInfo:
    """Simplify `ir` and report what each hook reads and which hooks are identities.

    Example:
        >>> from attncc.ir.nodes import var, load, binary, I32
        >>> from attncc.ir.program import Hook, VariantIR
        >>> doc = lambda i: load("doc_ids", (var("b"), var(i)), I32)
        >>> m = binary("eq", doc("q_idx"), doc("kv_idx"))
        >>> info = analyze(VariantIR(hooks={"mask_mod": Hook("mask_mod", m)}))
        >>> info.mask_depends_on_b, info.mask_depends_on_h, info.mask_depends_on_bh
        (True, False, True)
    """
    from .simplified import simplify_variant  # sympy: loaded only when nothing remembers it

    simple = simplify_variant(ir)
    exprs = {h: simple.expr(h) for h in HOOK_ORDER}
    read = {h: reads(e) for h, e in exprs.items()}
    identity = {h: exprs[h] is identity_expr(h) for h in HOOK_ORDER}
    mask_b = not identity["mask_mod"] and "b" in read["mask_mod"]
    mask_h = not identity["mask_mod"] and "h" in read["mask_mod"]
    score_bh = not identity["score_mod"] and bool({"b", "h"} & read["score_mod"])
    return VariantInfo(reads=read, identity=identity, mask_depends_on_bh=mask_b or mask_h,
                       mask_depends_on_b=mask_b, mask_depends_on_h=mask_h,
                       score_depends_on_bh=score_bh)


def _static_index(idx: Node, params: Mapping[str, int | float]) -> bool:
    """Whether `idx` can be evaluated for every d knowing only d, constants and `params`."""
    for n in walk(idx):
        if n.op in ("load", "vec"):
            return False
        if n.op == "var" and n.attr != "d":
            return False
        if n.op == "param" and n.attr not in params:
            return False
    return True


def check_vector_indices(ir: VariantIR, head_dim: int,
                         params: Mapping[str, int | float] | None = None,
                         v_head_dim: int | None = None) -> None:
    """Raise TraceError if a transform reads its head vector outside [0, head_dim).

    Each `q[idx]` / `k[idx]` / `v[idx]` / `o[idx]` whose index depends only on `d`, constants and
    captured scalars given in `params` is evaluated for every d in range(head_dim). Indices that
    read b, h, q_idx, kv_idx or tensors cannot be checked statically and are skipped.
    `v_head_dim` is the head dim of value_mod/output_mod when it differs from q/k's.

    Example:
        >>> from attncc.ir.nodes import var, vec, const, binary
        >>> from attncc.ir.program import Hook, VariantIR
        >>> wrapped = binary("mod", var("d") + 1, const(64))
        >>> ok = VariantIR(hooks={"query_mod": Hook("query_mod", vec("q", wrapped))})
        >>> check_vector_indices(ok, 64)
        >>> bad = VariantIR(hooks={"query_mod": Hook("query_mod", vec("q", var("d") + 1))})
        >>> check_vector_indices(bad, 64)
        Traceback (most recent call last):
          ...
        attncc.errors.TraceError: query_mod reads q[d + 1] at index 64 (for d = 63), outside the head vector [0, 64)
          hint: use `% D` to wrap (D = 64 here), e.g. q[(d + D // 2) % D]
    """
    params = dict(params or {})
    for hook_name in TRANSFORM_HOOKS:
        hook = ir.hooks.get(hook_name)
        if hook is None:
            continue
        dim = head_dim if hook_name in ("query_mod", "key_mod") or v_head_dim is None \
            else v_head_dim
        d = torch.arange(dim)
        where = f"{hook.source}: " if hook.source is not None else ""
        vecname = HOOK_SIGNATURES[hook_name][2]
        for n in walk(hook.expr):
            if n.op != "vec" or not _static_index(n.args[0], params):
                continue
            text = f"{n.attr}[{format_expr(n.args[0])}]"
            try:
                got = evaluate(n.args[0], {"d": d}, params=params).expand(dim)
            except EvalError as e:
                raise TraceError(f"{where}{hook_name} reads {text}, whose index cannot be "
                                 f"computed: {e}\n  hint: index the head vector with an integer "
                                 f"expression of d in [0, {dim}), e.g. "
                                 f"{vecname}[(d + D // 2) % D]") from None
            bad = (got < 0) | (got >= dim)
            if not bool(bad.any()):
                continue
            ds = d[bad]
            vals = got[bad]
            at = (f"index {int(vals[0])} (for d = {int(ds[0])})" if len(ds) == 1 else
                  f"indices {int(vals.min())}..{int(vals.max())} (for d in "
                  f"{int(ds.min())}..{int(ds.max())})")
            raise TraceError(f"{where}{hook_name} reads {text} at {at}, outside the head vector "
                             f"[0, {dim})\n  hint: use `% D` to wrap (D = {dim} here), e.g. "
                             f"{n.attr}[(d + D // 2) % D]")


# ----------------------------------------------------------------------------- captured reads


def load_guards(expr: Node, ops: tuple[str, ...] = ("load",)) -> dict[int, tuple[Node, Node]]:
    """id(load) -> (load, guard): the condition under which `expr` evaluates each captured-tensor
    load, as the generated code does (C's lazy `?:`, `&&`, `||`; codegen keeps a conditional
    load inline). An unconditional load's guard is the constant True. `ops=("vec",)` gives the
    head-vector reads' guards instead.

    Example:
        >>> from attncc.ir.nodes import var, load, where, const, F32
        >>> i = var("q_idx") - var("kv_idx")
        >>> e = where(i >= 0, load("tbl", (i,), F32), const(0.0))
        >>> [format_expr(g) for _, g in load_guards(e).values()]
        ['q_idx - kv_idx >= 0']
    """
    from .nodes import BOOL, binary, const, unary

    guard: dict[int, Node] = {id(expr): const(True)}
    true = const(True)

    def both(g: Node, c: Node) -> Node:
        return c if g is true else binary("and", g, c)

    for n in reversed(list(walk(expr))):  # parents before children
        g = guard.get(id(n))
        if g is None:  # pragma: no cover - walk reaches children only through parents
            continue
        conds: list[Node] = [g] * len(n.args)
        if n.op == "where":
            conds = [g, both(g, n.args[0]), both(g, unary("not", n.args[0]))]
        elif n.op == "and" and n.dtype is BOOL:
            conds = [g, both(g, n.args[0])]
        elif n.op == "or":
            conds = [g, both(g, unary("not", n.args[0]))]
        for a, c in zip(n.args, conds):
            old = guard.get(id(a))
            guard[id(a)] = c if old is None or c is true else (
                old if old is true else binary("or", old, c))
    return {id(n): (n, guard[id(n)]) for n in walk(expr) if n.op in ops}


def read_text(load_node: Node, dim: int | None = None) -> str:
    """How a captured read is named in messages: `tbl[q_idx - kv_idx]`.

    Example:
        >>> from attncc.ir.nodes import var, load, I32
        >>> read_text(load("doc", (var("b"), var("q_idx")), I32))
        'doc[b, q_idx]'
    """
    return f"{load_node.attr}[{', '.join(format_expr(i) for i in load_node.args)}]"


def bounds_message(hook: str, source: object, load_node: Node, dim: int, value: int,
                   size: int, where: Mapping[str, int], fix: str) -> str:
    """The error for a captured read outside its tensor at a position that counts.

    Example:
        >>> from attncc.ir.nodes import var, load, F32
        >>> print(bounds_message("score_mod", None, load("tbl", (var("q_idx") - var("kv_idx"),),
        ...       F32), 0, -5, 10, {"b": 0, "h": 0, "q_idx": 0, "kv_idx": 5}, "mask it"))
        score_mod reads tbl[q_idx - kv_idx] = tbl[-5] at (b=0, h=0, q_idx=0, kv_idx=5), outside dim 0 of tbl [0, 10); mask it
    """
    at = f"{source}: " if source is not None else ""
    pos = ", ".join(f"{k}={v}" for k, v in where.items())
    dims = load_node.args
    shown = (f"{load_node.attr}[{value}]" if len(dims) == 1 else
             f"index {format_expr(dims[dim])} = {value}")
    return (f"{at}{hook} reads {read_text(load_node)} = {shown} at ({pos}), outside dim {dim} "
            f"of {load_node.attr} [0, {size}); {fix}")


@dataclass(frozen=True)
class Shapes:
    """A call's sizes: the index variables' ranges for each hook (`hook_sizes`)."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Skv: int
    D: int
    Dv: int

    def hook_sizes(self, hook: str) -> dict[str, int]:
        """Sizes of the variables `hook` sees (key/value transforms see the kv head as h).

        Example:
            >>> Shapes(1, 8, 2, 16, 32, 64, 64).hook_sizes("key_mod")
            {'b': 1, 'h': 2, 'kv_idx': 32, 'd': 64}
        """
        kv_heads = hook in ("key_mod", "value_mod")
        sizes = {"b": self.B, "h": self.Hkv if kv_heads else self.Hq}
        if hook in ("score_mod", "mask_mod", "query_mod", "output_mod"):
            sizes["q_idx"] = self.Sq
        if hook in ("score_mod", "mask_mod", "key_mod", "value_mod"):
            sizes["kv_idx"] = self.Skv
        if hook in TRANSFORM_HOOKS:
            sizes["d"] = self.D if hook in ("query_mod", "key_mod") else self.Dv
        return sizes


@dataclass(frozen=True)
class ReadCheck:
    """What the interval analysis found for the captured reads of one variant at one call's
    shapes: `clamp` maps each load that must be clamped -- it may leave its tensor, but only at
    masked positions, or the analysis cannot decide -- to the dims to clamp; `undecided` lists
    the loads the analysis could neither prove nor refute at kept positions (the checked mode's
    business). Loads in neither are proven inside their tensor everywhere."""

    clamp: Mapping[Node, tuple[int, ...]]
    undecided: tuple[Node, ...] = ()


def _dims_outside(load_node: Node, sizes: Sequence[int], domain: "Domain") -> tuple[int, ...]:
    """The dims of `load_node` whose index is not proven inside [0, size) on `domain`."""
    from .intervals import interval

    out = []
    for k, idx in enumerate(load_node.args):
        r = interval(idx, domain)
        if r is None or r[0] < 0 or r[1] >= sizes[k]:
            out.append(k)
    return tuple(out)


def _candidates(domain: "Domain") -> dict[str, torch.Tensor]:
    """Positions where a witness is looked for: the domain's corners, and for (q_idx, kv_idx)
    the vertices of the box cut by the band (where a linear index takes its extremes)."""
    from .intervals import band_points

    sizes = domain.sizes
    axes: dict[str, list[int]] = {v: sorted({0, n - 1}) for v, n in sizes.items()
                                  if v not in ("q_idx", "kv_idx")}
    if "q_idx" in sizes and "kv_idx" in sizes:
        pairs = band_points(domain)
    else:
        v = "q_idx" if "q_idx" in sizes else "kv_idx" if "kv_idx" in sizes else None
        pairs = [(x, 0) for x in sorted({0, sizes[v] - 1})] if v else [(0, 0)]
    points: list[dict[str, int]] = []
    for q, kv in pairs:
        base = [{}]
        for v, vals in axes.items():
            base = [{**p, v: x} for p in base for x in vals]
        for p in base:
            if "q_idx" in sizes:
                p["q_idx"] = q
            if "kv_idx" in sizes:
                p["kv_idx"] = kv if "q_idx" in sizes else q
            points.append(p)
    return {v: torch.tensor([p[v] for p in points], dtype=torch.int64) for v in sizes}


def _witness(hook: Hook, load_node: Node, guard: Node, keep: Node | None, sizes: Sequence[int],
             domain: "Domain", tensors: Mapping[str, torch.Tensor],
             params: Mapping[str, Any], computed: Computed | None = None) -> str | None:
    """The error message for a position of `domain` where `load_node` is evaluated (its guard
    holds, and `computed` says the kernel computes it), kept (`keep`, None: always) and
    outside its tensor; None if no candidate is one."""
    env = _candidates(domain)
    if not env or not len(next(iter(env.values()))):
        return None
    host = {k: t.detach().cpu() for k, t in tensors.items() if isinstance(t, torch.Tensor)}

    def ev(e: Node) -> torch.Tensor:
        return evaluate(e, env, host, params, torch.float64, oob={})

    hit = ev(guard).bool()
    if keep is not None:
        hit = hit & ev(keep).bool()
    if computed is not None and hook.name in ("score_mod", "mask_mod"):
        hit = hit & computed(env)
    n = len(next(iter(env.values())))
    for dim, idx in enumerate(load_node.args):
        vals = ev(idx).expand(n)
        bad = hit.expand(n) & ((vals < 0) | (vals >= sizes[dim]))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            where = {v: int(env[v][i]) for v in INDEX_ORDER if v in env}
            return bounds_message(hook.name, hook.source, load_node, dim, int(vals[i]),
                                  sizes[dim], where,
                                  "make the tensor longer or mask that position")
    return None


def _with_values(expr: Node, params: Mapping[str, Any]) -> Node:
    """`expr` with its i32 captured scalars replaced by their values."""
    from .nodes import I32, const, rebuild, rewrite

    def fn(n: Node, args: tuple[Node, ...]) -> Node:
        v = params.get(n.attr) if n.op == "param" and n.dtype is I32 else None
        if isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31:
            return const(v, I32)
        return rebuild(n, args)

    return rewrite(expr, fn)


def check_captured_reads(ir: VariantIR, shapes: Shapes, tensors: Mapping[str, torch.Tensor],
                         params: Mapping[str, Any] | None = None,
                         computed: Computed | None = None) -> ReadCheck:
    """Check every captured-tensor read of `ir` (simplified) against a call's shapes.

    Per load, interval analysis (attncc.ir.intervals) over b in [0, B), h, q_idx in [0, Sq),
    kv_idx in [0, Skv), d (cut by the band the load's guard implies) decides:

    - inside its tensor everywhere: nothing to do (the kernel reads it as written);
    - inside only where the mask keeps the position (score_mod under a band mask such as
      causal): clamped -- the kernel evaluates masked positions of partial tiles too;
    - outside at a kept position the search finds (corners and band vertices of the domain,
      evaluated exactly): CapturedReadError naming the line, the read and the position;
    - otherwise undecided: clamped.

    `computed(env)` (1-D b, h, q_idx, kv_idx tensors -> bool), when given, says which positions
    the kernel evaluates score_mod / mask_mod at (a block mask's absent blocks: none); a witness
    must be one of them.

    Example:
        >>> import torch
        >>> from attncc.frontend import Variant
        >>> tbl = torch.zeros(16)
        >>> v = Variant(score_mod=lambda s, b, h, q, kv: s + tbl[q - kv],
        ...             mask_mod=lambda b, h, q, kv: q >= kv)
        >>> ir, bind = v.trace()
        >>> sh = Shapes(B=1, Hq=2, Hkv=2, Sq=16, Skv=16, D=64, Dv=64)
        >>> [(n.attr, dims) for n, dims in check_captured_reads(ir, sh, bind.tensors).clamp.items()]
        [('tbl', (0,))]
        >>> check_captured_reads(ir, replace(sh, Sq=17, Skv=17), bind.tensors)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
          ...
        attncc.errors.CapturedReadError: ...(<lambda>): score_mod reads tbl[q_idx - kv_idx] = tbl[16] at (b=0, h=0, q_idx=16, kv_idx=0), outside dim 0 of tbl [0, 16); make the tensor longer or mask that position
    """
    from .intervals import Domain, implied_band

    params = dict(params or {})
    clamp: dict[Node, tuple[int, ...]] = {}
    undecided: list[Node] = []
    mask = ir.hook("mask_mod")

    def band(cond: Node) -> Any:  # with the call's i32 scalars as constants (a window width)
        return implied_band(_with_values(cond, params))

    mask_band = None if mask.is_identity else band(mask.expr)
    for name in HOOK_ORDER:
        hook = ir.hooks.get(name)
        if hook is None or hook.is_identity or min(shapes.hook_sizes(name).values()) <= 0:
            continue  # an empty domain (a zero-length call) reads nothing
        for node, guard in load_guards(hook.expr).values():
            if guard.op == "const" and not guard.attr:
                continue
            t = tensors.get(node.attr)
            if not isinstance(t, torch.Tensor) or t.dim() != len(node.args):
                continue  # the launch's own checks name a missing or mis-shaped tensor
            sizes = tuple(int(s) for s in t.shape)
            dom = Domain(shapes.hook_sizes(name), params=params).with_band(
                None if guard.op == "const" else band(guard))
            outside = _dims_outside(node, sizes, dom)
            if not outside:
                continue
            kept = dom.with_band(mask_band) if name == "score_mod" else dom
            keep = mask.expr if name == "score_mod" and not mask.is_identity else None
            if 0 in sizes or _dims_outside(node, sizes, kept):
                msg = _witness(hook, node, guard, keep, sizes, kept, tensors, params, computed)
                if msg is not None or 0 in sizes:
                    raise CapturedReadError(msg or f"{hook.source}: {name} reads "
                                            f"{read_text(node)} but {node.attr} is empty "
                                            f"(shape {tuple(sizes)}); pass a non-empty tensor")
                undecided.append(node)
            clamp[node] = outside
    return ReadCheck(clamp, tuple(undecided))


def clamp_reads(ir: VariantIR, clamp: Mapping[Node, Sequence[int]],
                tensors: Mapping[str, Any]) -> tuple[VariantIR, dict[str, int]]:
    """`ir` with the indices `clamp` lists clamped into their tensor, `max(min(i, n - 1), 0)`,
    and the values of the i32 parameters `n` it adds (one per tensor dim clamped, so a new size
    never changes the IR or the kernel). Returns `ir` itself when `clamp` is empty.

    Example:
        >>> import torch
        >>> from attncc.ir.nodes import var, load, F32
        >>> from attncc.ir.program import Hook, TensorParam
        >>> t = load("tbl", (var("q_idx") - var("kv_idx"),), F32)
        >>> ir = VariantIR(hooks={"score_mod": Hook("score_mod", var("score") + t)},
        ...                tensors=(TensorParam("tbl", "float32", 1, F32),))
        >>> out, sizes = clamp_reads(ir, {t: (0,)}, {"tbl": torch.zeros(8)})
        >>> print(format_expr(out.expr("score_mod")), sizes)
        score + tbl[max(min(q_idx - kv_idx, tbl_size0 - 1), 0)] {'tbl_size0': 8}
    """
    from .nodes import I32, binary, const, load, param, rebuild, rewrite
    from .program import ScalarParam

    if not clamp:
        return ir, {}
    taken = {s.name for s in ir.scalars} | {t.name for t in ir.tensors}
    names: dict[tuple[str, int], str] = {}
    sizes: dict[str, int] = {}

    def size_param(tensor: str, dim: int) -> Node:
        key = (tensor, dim)
        if key not in names:
            name = f"{tensor}_size{dim}"
            while name in taken:
                name += "_"
            taken.add(name)
            names[key] = name
            sizes[name] = min(int(tensors[tensor].shape[dim]), 2**31 - 1)
        return param(names[key], I32)

    def fn(n: Node, args: tuple[Node, ...]) -> Node:
        if n.op != "load" or n not in clamp:
            return rebuild(n, args)
        dims = set(clamp[n])
        idx = tuple(binary("max", binary("min", a, size_param(n.attr, k) - 1), const(0))
                    if k in dims else a for k, a in enumerate(args))
        return load(n.attr, idx, n.dtype)

    exprs = {name: rewrite(h.expr, fn) for name, h in ir.hooks.items()}
    out = ir.with_exprs(exprs)
    out = replace(out, scalars=ir.scalars + tuple(ScalarParam(nm, I32) for nm in sizes))
    return out, sizes


def index_overflows(ir: VariantIR, shapes: Shapes, params: Mapping[str, Any] | None = None
                    ) -> list[str]:
    """Messages for the i32 expressions of `ir` whose interval at `shapes` (every position,
    masked or not: the kernels evaluate masked positions of partial tiles too) leaves
    [-2**31, 2**31 - 1]; only the innermost such expression of each chain is named.

    Example:
        >>> from attncc.ir.nodes import var, const, binary, load, F32
        >>> from attncc.ir.program import Hook
        >>> pos = binary("mul", var("q_idx"), const(70000))
        >>> e = var("score") + binary("mul", pos + 1, const(70000))
        >>> ir = VariantIR(hooks={"score_mod": Hook("score_mod", e)})
        >>> index_overflows(ir, Shapes(1, 1, 1, 4, 4, 64, 64))
        ['score_mod computes (q_idx * 70000 + 1) * 70000 in 32-bit integers, which reaches [70000, 14700070000] at these shapes (b < 1, h < 1, q_idx < 4, kv_idx < 4): past 2**31 - 1 it wraps around on the GPU; compute it in float (e.g. with 1.0 * ...) or keep it within 32 bits']
    """
    from .intervals import INT32_MAX, INT32_MIN, Domain, ranges

    out = []
    for name in HOOK_ORDER:
        hook = ir.hooks.get(name)
        sizes = shapes.hook_sizes(name)
        if hook is None or hook.is_identity or min(sizes.values()) <= 0:
            continue
        got = ranges(hook.expr, Domain(sizes, params=dict(params or {})))

        def over(n: Node) -> bool:
            r = got.get(id(n))
            return r is not None and (r[0] < INT32_MIN or r[1] > INT32_MAX)

        where = f"{hook.source}: " if hook.source is not None else ""
        dims = ", ".join(f"{v} < {n}" for v, n in sizes.items())
        for n in walk(hook.expr):
            if over(n) and not any(over(a) for a in n.args):
                lo, hi = got[id(n)]  # type: ignore[misc]
                out.append(f"{where}{name} computes {format_expr(n)} in 32-bit integers, which "
                           f"reaches [{lo}, {hi}] at these shapes ({dims}): past 2**31 - 1 it "
                           f"wraps around on the GPU; compute it in float (e.g. with 1.0 * ...) "
                           f"or keep it within 32 bits")
    return out


# Exact checks of a head-vector read evaluate its index on every combination of the variables it
# reads; past this many combinations the read is left unchecked.
_EXACT_LIMIT = 1 << 22


def check_vector_reads(ir: VariantIR, shapes: Shapes, tensors: Mapping[str, torch.Tensor],
                       params: Mapping[str, Any] | None = None) -> None:
    """TraceError when a transform reads its head vector outside [0, head dim) at a call's
    shapes, for the indices `check_vector_indices` cannot evaluate alone (they read b, h, a
    position or a captured tensor, e.g. `q[(d + q_idx) % 1000]`): proven inside by the interval
    analysis, else evaluated exactly on every combination of the variables the index reads (up
    to 4M of them) where its guard holds. The error names the line, the index and the first
    position.

    Example:
        >>> import torch
        >>> from attncc.frontend import Variant
        >>> ir, _ = Variant(query_mod=lambda q, b, h, qi, d: q[(d + qi) % 80]).trace()
        >>> check_vector_reads(ir, Shapes(1, 1, 1, 8, 8, 64, 64), {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
          ...
        attncc.errors.TraceError: ...query_mod reads q[(d + q_idx) % 80] = q[64] at (q_idx=1, d=63), outside the head vector [0, 64)...
    """
    from .intervals import Domain, interval

    params = dict(params or {})
    host: dict[str, torch.Tensor] = {}
    for name in TRANSFORM_HOOKS:
        hook = ir.hooks.get(name)
        sizes = shapes.hook_sizes(name)
        if hook is None or hook.is_identity or min(sizes.values()) <= 0:
            continue
        dim = sizes["d"]
        for node, guard in load_guards(hook.expr, ("vec",)).values():
            idx = node.args[0]
            if _static_index(idx, params):
                continue  # check_vector_indices' business
            r = interval(idx, Domain(sizes, params=params))
            if r is not None and 0 <= r[0] and r[1] < dim:
                continue
            names = [v for v in INDEX_ORDER if v in sizes and v in free_vars(idx) | free_vars(
                guard)]
            count = 1
            for v in names:
                count *= sizes[v]
            if count > _EXACT_LIMIT:
                continue
            grids = torch.meshgrid(*(torch.arange(sizes[v]) for v in names), indexing="ij") \
                if names else ()
            env = {v: g.reshape(-1) for v, g in zip(names, grids)}
            if not host:  # the captured tensors, read to the host once
                host.update((k, t.detach().cpu()) for k, t in tensors.items()
                            if isinstance(t, torch.Tensor))
            got = evaluate(idx, env, host, params, torch.float64, oob={}).expand(count)
            bad = (got < 0) | (got >= dim)
            if guard.op != "const":
                bad = bad & evaluate(guard, env, host, params, torch.float64,
                                     oob={}).bool().expand(count)
            if not bool(bad.any()):
                continue
            i = int(bad.nonzero()[0])
            pos = ", ".join(f"{v}={int(env[v][i])}" for v in names)
            where = f"{hook.source}: " if hook.source is not None else ""
            vecname = HOOK_SIGNATURES[name][2]
            raise TraceError(f"{where}{name} reads {node.attr}[{format_expr(idx)}] = "
                             f"{node.attr}[{int(got[i])}] at ({pos}), outside the head vector "
                             f"[0, {dim})\n  hint: wrap the index into the head vector, e.g. "
                             f"{vecname}[(...) % {dim}]")
