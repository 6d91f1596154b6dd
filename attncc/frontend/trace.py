"""Trace user mods (plain Python functions) into a `VariantIR` plus runtime `Bindings`.

Captured Python scalars (closure cells and module globals the mod reads) are swapped for kernel
parameters before the call, so a new value changes only the bindings, never the IR. A captured
scalar that the mod uses as a concrete Python value (`range(n)`, `if flag:`, `math.sqrt(D)`) is
retried as a baked-in constant instead. Captured tensors are recognised when indexed.

Example:
    >>> import torch
    >>> slopes = torch.rand(4)
    >>> def alibi(score, b, h, q_idx, kv_idx):
    ...     return score - slopes[h] * (q_idx - kv_idx)
    >>> ir, bind = trace_mods({"score_mod": alibi})
    >>> print(ir.format().splitlines()[1:])
    ['tensor slopes: float32[_] -> f32', 'score_mod -> f32:', '  return score - slopes[h] * f32(q_idx - kv_idx)']
"""
from __future__ import annotations

import inspect
import numbers
import os
import sys
import types
from typing import Any, Callable, Mapping

import torch

from ..errors import TraceError
from ..ir import nodes as N
from ..ir.nodes import BOOL, F32, I32, Node
from ..ir.program import (HOOK_ORDER, HOOK_SIGNATURES, Bindings, Hook, ScalarParam, SourceLoc,
                          TensorParam, VariantIR, ir_dtype_for_elem)
from .proxy import (_PKG_DIR, _REGISTRY, NeedsStatic, Proxy, TensorRegistry, VectorProxy,
                    _elem_name, to_node)

_MAX_STATIC_RETRIES = 16
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _is_user_function(f: Any) -> bool:
    if not isinstance(f, types.FunctionType):
        return False
    fn = os.path.abspath(f.__code__.co_filename)
    return not fn.startswith(_TORCH_DIR)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


class _Captures:
    """Turns what a mod captured into parameters, shared by all hooks of one variant."""

    def __init__(self, frozen: set[tuple]) -> None:
        self.frozen = frozen  # capture sites to bake as constants (see NeedsStatic)
        self.site_of: dict[str, tuple] = {}  # param name -> capture site
        self.param_by_site: dict[tuple, Proxy] = {}
        self.values: dict[str, Any] = {}
        self.dtypes: dict[str, N.DType] = {}
        self.tensor_names: dict[int, str] = {}
        self.fn_memo: dict[int, Callable] = {}

    def capture(self, site: tuple, name: str, value: Any) -> Any:
        if isinstance(value, bool) or value is None:
            return value
        if isinstance(value, numbers.Integral) or isinstance(value, numbers.Real) and \
                not isinstance(value, torch.Tensor):
            if site in self.frozen:
                return value
            hit = self.param_by_site.get(site)
            if hit is not None:
                return hit
            if isinstance(value, numbers.Integral):
                if not -(2**31) <= int(value) < 2**31:
                    return value  # too large for i32: keep as a Python constant
                dtype, value = I32, int(value)
            else:
                dtype, value = F32, float(value)
            pname = _safe_name(name)
            i = 0
            unique = pname
            while unique in self.values:
                i += 1
                unique = f"{pname}_{i}"
            self.values[unique] = value
            self.dtypes[unique] = dtype
            self.site_of[unique] = site
            proxy = Proxy(N.param(unique, dtype))
            self.param_by_site[site] = proxy
            return proxy
        if isinstance(value, torch.Tensor):
            self.tensor_names.setdefault(id(value), _safe_name(name))
            return value
        if _is_user_function(value):
            return self.function(value)
        if isinstance(value, (tuple, list)) and value and all(_is_user_function(f) for f in value):
            return type(value)(self.function(f) for f in value)
        return value

    def function(self, fn: Callable) -> Callable:
        """A copy of `fn` whose captured scalars are parameters (recursing into helpers)."""
        if id(fn) in self.fn_memo:
            return self.fn_memo[id(fn)]
        code = fn.__code__
        self.fn_memo[id(fn)] = fn  # recursion guard
        cells = []
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # empty cell
                cells.append(cell)
                continue
            cells.append(types.CellType(self.capture(("cell", id(cell)), name, contents)))
        glb = fn.__globals__
        new_globals = dict(glb)
        for name in _global_names(code):
            if name in glb:
                new_globals[name] = self.capture(("global", id(glb), name), name, glb[name])
        new = types.FunctionType(code, new_globals, fn.__name__, fn.__defaults__, tuple(cells))
        new.__kwdefaults__ = fn.__kwdefaults__
        self.fn_memo[id(fn)] = new
        return new


def _safe_name(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not out or out[0].isdigit():
        out = "p_" + out
    return out


def source_loc(fn: Callable) -> SourceLoc:
    code = getattr(fn, "__code__", None)
    if code is None:
        return SourceLoc("<builtin>", 0, getattr(fn, "__name__", "?"))
    path = os.path.abspath(code.co_filename)
    parts = path.split(os.sep)
    short = os.sep.join(parts[-2:]) if len(parts) > 1 else path
    return SourceLoc(short, code.co_firstlineno, fn.__name__)


def _check_arity(fn: Callable, hook: str, n: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    required = [p for p in params if p.default is p.empty]
    if not var_pos and not (len(required) <= n <= len(params)):
        args = ", ".join(("score", "b", "h", "q_idx", "kv_idx") if hook == "score_mod" else
                         ("b", "h", "q_idx", "kv_idx") if hook == "mask_mod" else
                         (HOOK_SIGNATURES[hook][2], "b", "h", HOOK_SIGNATURES[hook][1][2], "d"))
        loc = source_loc(fn)
        raise TraceError(f"{loc.file}:{loc.line}: {hook} {fn.__name__!r} takes {len(params)} "
                         f"argument(s), but a {hook} is called with {n}\n  hint: define it as "
                         f"def {fn.__name__}({args})")


def _user_tb_location(tb: types.TracebackType | None) -> tuple[str, int]:
    where = ("<unknown>", 0)
    while tb is not None:
        fn = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not fn.startswith(_PKG_DIR) and not fn.startswith(_TORCH_DIR):
            where = (fn, tb.tb_lineno)
        tb = tb.tb_next
    return where


def _result_node(hook: str, out: Any, fn: Callable) -> Node:
    loc = source_loc(fn)
    if out is None:
        raise TraceError(f"{loc.file}:{loc.line}: {hook} {fn.__name__!r} returned None\n"
                         f"  hint: return the new value (did you forget `return`?)")
    n = to_node(out)
    want = HOOK_SIGNATURES[hook][0]
    if want is BOOL:
        if n.dtype is not BOOL:
            raise TraceError(f"{loc.file}:{loc.line}: mask_mod {fn.__name__!r} returned a "
                             f"{n.dtype.value} value, not a boolean\n  hint: return a comparison, "
                             f"e.g. q_idx >= kv_idx")
        return n
    if n.dtype is BOOL:
        raise TraceError(f"{loc.file}:{loc.line}: {hook} {fn.__name__!r} returned a boolean\n"
                         f"  hint: a {hook} returns a number; masks belong in mask_mod")
    return N.cast(n, F32)


def _call_hook(hook: str, fn: Callable, caps: _Captures) -> Node:
    _, argnames, vecname = HOOK_SIGNATURES[hook]
    if hook in ("score_mod", "mask_mod"):
        args: list[Any] = [Proxy(N.var(a)) for a in argnames]
    else:
        args = [VectorProxy(vecname)] + [Proxy(N.var(a)) for a in argnames]  # type: ignore[arg-type]
    _check_arity(fn, hook, len(args))
    traced_fn = caps.function(fn) if _is_user_function(fn) else fn
    try:
        out = traced_fn(*args)
    except (TraceError, NeedsStatic):
        raise
    except Exception as e:  # a Python error inside the user's mod: point at their line
        file, line = _user_tb_location(e.__traceback__)
        import linecache

        text = linecache.getline(file, line).strip()
        raise TraceError(f"{file}:{line}: {type(e).__name__} while tracing {hook} "
                         f"{getattr(fn, '__name__', '?')!r}: {e}\n    {text}\n  hint: mods may use "
                         f"arithmetic, comparisons, & | ~, torch.where and elementwise torch "
                         f"functions on their arguments and captured values") from e
    return _result_node(hook, out, fn)


def trace_mods(mods: Mapping[str, Callable | None], normalize: str = "softmax",
               name: str | None = None) -> tuple[VariantIR, Bindings]:
    """Trace the given hooks (keys from HOOK_ORDER) into IR and the values they captured."""
    for k in mods:
        if k not in HOOK_SIGNATURES:
            raise TraceError(f"unknown hook {k!r}; hooks are {', '.join(HOOK_ORDER)}")
    if normalize not in ("softmax", "none"):
        raise TraceError(f"normalize={normalize!r}: use 'softmax' (default) or 'none' "
                         f"(e.g. sigmoid attention: output = sum of weights * v)")
    frozen: set[tuple] = set()
    for _ in range(_MAX_STATIC_RETRIES):
        caps = _Captures(frozen)
        registry = TensorRegistry(caps.tensor_names)
        _REGISTRY.append(registry)
        try:
            hooks: dict[str, Hook] = {}
            for hook in HOOK_ORDER:
                fn = mods.get(hook)
                if fn is None:
                    continue
                if not callable(fn):
                    raise TraceError(f"{hook} must be a function, got {type(fn).__name__}")
                hooks[hook] = Hook(hook, _call_hook(hook, fn, caps), source_loc(fn))
        except NeedsStatic as need:
            frozen |= {caps.site_of[n] for n in need.names}
            continue
        finally:
            _REGISTRY.pop()
        break
    else:  # pragma: no cover - needs >16 distinct control-flow scalars
        raise TraceError("too many captured scalars are used as Python values; pass them as "
                         "constants")
    # keep only what the traced IR reads, in first-use order for deterministic structs
    used_params: list[str] = []
    used_tensors: list[str] = []
    for h in hooks.values():
        for n in N.walk(h.expr):
            if n.op == "param" and n.attr not in used_params:
                used_params.append(n.attr)
            if n.op == "load" and n.attr not in used_tensors:
                used_tensors.append(n.attr)
    tensors_by_name = {nm: t for nm, t in registry.by_id.values()}
    scalars = tuple(ScalarParam(p, caps.dtypes[p]) for p in used_params)
    tparams = []
    for tn in used_tensors:
        t = tensors_by_name[tn]
        elem = _elem_name(t)
        tparams.append(TensorParam(tn, elem, t.dim(), ir_dtype_for_elem(elem)))  # type: ignore[arg-type]
    if name is None:
        name = "_".join(getattr(mods[h], "__name__", h) for h in HOOK_ORDER if mods.get(h)) or \
            "identity"
        name = _safe_name(name.replace("<lambda>", "lambda"))
    ir = VariantIR(hooks=hooks, normalize=normalize, name=name, scalars=scalars,
                   tensors=tuple(tparams))
    bindings = Bindings(scalars={p: caps.values[p] for p in used_params},
                        tensors={tn: tensors_by_name[tn] for tn in used_tensors})
    return ir, bindings
