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

`trace_mods_guarded` also returns a `TraceGuard`: a record of every capture the trace read, which
tells later whether the same IR still holds (and with which values), so callers can skip tracing.
"""
from __future__ import annotations

import enum
import functools
import inspect
import math
import numbers
import os
import site
import sys
import sysconfig
import types
import weakref
from typing import Any, Callable, Mapping

import torch
from torch.overrides import TorchFunctionMode

from ..errors import TraceError
from ..ir import nodes as N
from ..ir.nodes import BOOL, F32, I32, Node
from ..ir.program import (HOOK_ORDER, HOOK_SIGNATURES, Bindings, Hook, ScalarParam, SourceLoc,
                          TensorParam, VariantIR, ir_dtype_for_elem)
from .proxy import (_PKG_DIR, _REGISTRY, NeedsStatic, PartialIndex, Proxy, TensorRegistry,
                    VectorProxy, _elem_name, to_node)

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


# ----------------------------------------------------------------------- capture snapshots
# A snapshot records one value a trace depended on, in a form `_matches` can check a later value
# against: (_IS, obj) the same object; (_EQ, type, v) an equal value of the same type; (_FLOAT,
# type, v) the same, with the sign of zero too (NaN never matches); (_SEQ, type, snaps) a
# tuple/list whose items match; (_MAP, type, keys, snaps) a dict; (_TENSOR, t, dtype, shape)
# the same tensor object with the same dtype and shape. (_PARAM, type, name, is_int) marks a
# scalar that became kernel parameter `name`: any value of the same type (in i32 range for an
# int) traces to the same IR.
_IS, _EQ, _FLOAT, _SEQ, _MAP, _TENSOR, _PARAM = range(7)
_ABSENT = object()  # an empty closure cell, or a global name the code reads that is not defined
_I32_MIN, _I32_MAX = -(2**31), 2**31
_IMMUTABLE = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)


class _Uncacheable(Exception):
    """A captured value whose relevant state a guard cannot check (e.g. an arbitrary object)."""


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    roots = {_TORCH_DIR, _PKG_DIR}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            roots.add(os.path.abspath(paths[key]))
    try:
        roots.update(os.path.abspath(p) for p in site.getsitepackages())
        roots.add(os.path.abspath(site.getusersitepackages()))
    except (AttributeError, TypeError):  # pragma: no cover - old virtualenv's site module
        pass
    return tuple(r.rstrip(os.sep) + os.sep for r in roots)


def _is_library_module(m: Any) -> bool:
    """A module of Python, torch, attncc or an installed package (not the user's own code)."""
    if not isinstance(m, types.ModuleType):
        return False
    top = m.__name__.partition(".")[0]
    if top in sys.builtin_module_names or top in sys.stdlib_module_names or \
            top in ("torch", "attncc"):
        return True
    f = getattr(m, "__file__", None)
    return bool(f) and os.path.abspath(f).startswith(_library_roots())


def _is_library_object(v: Any) -> bool:
    """Objects a guard may compare by identity: library modules, classes and functions, dtypes.

    Their state is not the user's to change between calls. A user module or class may have its
    attributes reassigned (`config.SCALE = 2`) and an instance is arbitrary state: a mod reading
    them bakes what it read, and identity says nothing about that.
    """
    if isinstance(v, types.ModuleType):
        return _is_library_module(v)
    if isinstance(v, type):
        return _is_library_module(sys.modules.get(v.__module__))
    if isinstance(v, _IMMUTABLE):
        return True
    if isinstance(v, types.BuiltinFunctionType):
        owner = v.__self__
        return owner is None or _is_library_object(owner)
    if isinstance(v, (types.MethodDescriptorType, types.WrapperDescriptorType,
                      types.ClassMethodDescriptorType)):
        return True
    return isinstance(v, types.FunctionType) and not _is_user_function(v)


def _scalar_snapshot(v: Any) -> tuple:
    return (_FLOAT if isinstance(v, float) else _EQ, type(v), v)


def _snapshot(v: Any, tensors: dict[int, torch.Tensor], depth: int = 0) -> tuple:
    """A snapshot of a value the trace baked in or used as-is; raises _Uncacheable when the
    value's relevant state cannot be checked later. Captured tensors are added to `tensors`."""
    t = type(v)
    if v is None or t is bool or v is _ABSENT:
        return (_IS, v)
    if t in (int, float, complex, str, bytes) or t is torch.Size:
        return _scalar_snapshot(v)
    if t in (tuple, list, dict) and depth >= 8:
        raise _Uncacheable("a container nested too deeply to check")
    if t is tuple or t is list:
        return (_SEQ, t, tuple(_snapshot(x, tensors, depth + 1) for x in v))
    if t is dict:
        keys = tuple(v)
        if not all(type(k) in (str, int, bool) or k is None for k in keys):
            raise _Uncacheable("a dict with keys of other types than str and int")
        return (_MAP, t, keys, tuple(_snapshot(v[k], tensors, depth + 1) for k in keys))
    if isinstance(v, torch.Tensor):
        tensors[id(v)] = v
        return (_TENSOR, v, v.dtype, v.shape)
    if isinstance(v, numbers.Real) and t.__module__ == "numpy":  # numpy scalars are immutable
        return _scalar_snapshot(v)
    if _is_library_object(v):
        return (_IS, v)
    if isinstance(v, types.FunctionType):
        raise _Uncacheable(f"a function ({v.__name__}) that is not traced through")
    if isinstance(v, types.ModuleType):
        raise _Uncacheable(f"module {v.__name__} (user code: its attributes may change)")
    if isinstance(v, type):
        raise _Uncacheable(f"class {v.__qualname__} (user code: its attributes may change)")
    raise _Uncacheable(f"a {t.__qualname__} object (its attributes may change)")


def _matches(snap: tuple, v: Any) -> bool:
    """Whether `v`, read again, would trace exactly like the value `snap` recorded."""
    kind = snap[0]
    if kind == _IS:
        return v is snap[1]
    if kind == _TENSOR:
        return v is snap[1] and v.dtype is snap[2] and v.shape == snap[3]
    if type(v) is not snap[1]:
        return False
    if kind == _EQ:
        return bool(v == snap[2])
    if kind == _FLOAT:  # 0.0 == -0.0, but they are different constants (1 / x); NaN: never
        return bool(v == snap[2]) and math.copysign(1.0, v) == math.copysign(1.0, snap[2])
    if kind == _SEQ:
        items = snap[2]
        return len(v) == len(items) and all(_matches(s, x) for s, x in zip(items, v))
    if kind == _MAP:
        keys, items = snap[2], snap[3]
        return len(v) == len(keys) and all(k in v and _matches(s, v[k])
                                           for k, s in zip(keys, items))
    raise AssertionError(f"unknown snapshot kind {kind}")  # pragma: no cover


# Tensor metadata a mod may read from a captured tensor: the guard checks dtype and shape.
_TENSOR_META = {torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.size, torch.Tensor.numel,
                torch.Tensor.nelement, torch.Tensor.__len__, torch.Tensor.is_floating_point,
                torch.Tensor.element_size, torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
                torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__}  # type: ignore[attr-defined]
_TRACED_TYPES = (Proxy, VectorProxy, PartialIndex)


def _reads_tensor(args: Any, watched: Mapping[int, torch.Tensor]) -> bool:
    """Whether a torch call on `args` computes with a watched tensor's values (not a traced load:
    a call that involves a traced value only builds IR)."""
    stack = [args]
    hit = False
    while stack:
        x = stack.pop()
        if isinstance(x, _TRACED_TYPES):
            return False
        if isinstance(x, torch.Tensor):
            hit = hit or id(x) in watched
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return hit


class _TensorReads(TorchFunctionMode):
    """Active while a mod runs: notes a torch call that reads a captured tensor's values at trace
    time (`table.max().item()`, `table.float()`, `table[0]`). What it computed is baked into the
    IR or the bindings, and a guard cannot see in-place changes to the tensor, so such a trace is
    never reused."""

    def __init__(self, watched: Mapping[int, torch.Tensor]) -> None:
        super().__init__()
        self.watched = watched
        self.read: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.read is None and func not in _TENSOR_META and \
                _reads_tensor((args, kwargs), self.watched):
            self.read = getattr(func, "__name__", None) or repr(func)
        return func(*args, **kwargs)


class _Captures:
    """Turns what a mod captured into parameters, shared by all hooks of one variant.

    It also records every capture it reads (for `TraceGuard`): the site, how to read it again and
    what was seen, plus each traced function's code and defaults.
    """

    def __init__(self, frozen: set[tuple]) -> None:
        self.frozen = frozen  # capture sites to bake as constants (see NeedsStatic)
        self.site_of: dict[str, tuple] = {}  # param name -> capture site
        self.param_by_site: dict[tuple, Proxy] = {}
        self.values: dict[str, Any] = {}
        self.dtypes: dict[str, N.DType] = {}
        self.tensor_names: dict[int, str] = {}
        self.fn_memo: dict[int, Callable] = {}
        # -- for TraceGuard
        # site -> (cell or globals dict, global name or None, snapshot)
        self.sites: dict[tuple, tuple[Any, str | None, tuple | None]] = {}
        self.functions: dict[int, tuple] = {}  # id -> (weakref, code, defaults, kwdefaults, snaps)
        self.watched: dict[int, torch.Tensor] = {}  # captured tensors (values must not be read)
        self.uncacheable: str | None = None  # why no guard can vouch for this trace

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
        self.functions[id(fn)] = (weakref.ref(fn), code, fn.__defaults__, fn.__kwdefaults__,
                                  self.snapshot(fn.__defaults__, "a default argument value"),
                                  self.snapshot(fn.__kwdefaults__, "a default argument value"))
        cells = []
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            site = ("cell", id(cell))
            try:
                contents = cell.cell_contents
            except ValueError:  # empty cell
                self.note(site, cell, None, name, _ABSENT, _ABSENT)
                cells.append(cell)
                continue
            new = self.capture(site, name, contents)
            self.note(site, cell, None, name, contents, new)
            cells.append(types.CellType(new))
        glb = fn.__globals__
        new_globals = dict(glb)
        for name in _global_names(code):
            site = ("global", id(glb), name)
            if name in glb:
                value = glb[name]
                new_globals[name] = new = self.capture(site, name, value)
                self.note(site, glb, name, name, value, new)
            else:  # a builtin, an attribute name, or undefined: defining it later changes the trace
                self.note(site, glb, name, name, _ABSENT, _ABSENT)
        new = types.FunctionType(code, new_globals, fn.__name__, fn.__defaults__, tuple(cells))
        new.__kwdefaults__ = fn.__kwdefaults__
        self.fn_memo[id(fn)] = new
        return new

    # -- recording for TraceGuard
    def note(self, site: tuple, where: Any, key: str | None, name: str, value: Any,
             result: Any) -> None:
        """Record capture `site` of variable `name` (cell `where`, or globals dict `where` at
        `key`): `value` was read and `capture` turned it into `result`."""
        if site in self.sites:
            return
        if isinstance(result, Proxy):  # a kernel parameter: any value of the same kind will do
            snap: tuple | None = (_PARAM, type(value), result.node.attr,
                                  isinstance(value, numbers.Integral))
        elif value is _ABSENT:
            snap = (_IS, _ABSENT)
        elif _is_user_function(value):  # traced by `function` (code and defaults recorded there)
            snap = (_IS, value)
        elif isinstance(value, (tuple, list)) and value and all(_is_user_function(f)
                                                                 for f in value):
            snap = (_SEQ, type(value), tuple((_IS, f) for f in value))
        elif isinstance(value, numbers.Real) and not isinstance(value, (bool, torch.Tensor)):
            snap = _scalar_snapshot(value)  # frozen (NeedsStatic) or too wide for i32: baked in
        else:
            snap = self.snapshot(value, repr(name))
        self.sites[site] = (where, key, snap)

    def snapshot(self, value: Any, what: str) -> tuple | None:
        """`_snapshot(value)`, or None after marking this trace uncacheable."""
        try:
            return _snapshot(value, self.watched)
        except _Uncacheable as e:
            if self.uncacheable is None:
                self.uncacheable = f"{what} is {e}"
            return None


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


def _check_returned_scalar(hook: str, out: Any, fn: Callable, loc: SourceLoc) -> None:
    """A hook returns one scalar per position; a tensor of values or a tuple is the user's
    mistake in the hook, so the error names the hook (not the line that called the tracer)."""
    what = None
    if isinstance(out, torch.Tensor) and out.dim() > 0:
        what = f"a tensor of shape {tuple(out.shape)}"
    elif isinstance(out, (tuple, list, dict, set)):
        what = f"a {type(out).__name__} of {len(out)} values"
    elif isinstance(out, PartialIndex):
        what = (f"a captured tensor indexed in {len(out.indices)} of its {out.tensor.dim()} "
                f"dims")
    elif isinstance(out, VectorProxy):
        what = f"the whole head vector {out.name}"
    elif not isinstance(out, (Proxy, bool, int, float, torch.Tensor)):
        what = f"a value of type {type(out).__name__}"
    if what is not None:
        raise TraceError(f"{loc.file}:{loc.line}: {hook} {getattr(fn, '__name__', '?')!r} "
                         f"returned {what}\n  hint: a {hook} returns one value for the single "
                         f"position it is called with, e.g. `return score * 2` or a comparison")


def _result_node(hook: str, out: Any, fn: Callable) -> Node:
    loc = source_loc(fn)
    if out is None:
        raise TraceError(f"{loc.file}:{loc.line}: {hook} {fn.__name__!r} returned None\n"
                         f"  hint: return the new value (did you forget `return`?)")
    _check_returned_scalar(hook, out, fn, loc)
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
    watch = _TensorReads(caps.watched) if caps.watched else None
    try:
        if watch is None:
            out = traced_fn(*args)
        else:
            with watch:
                out = traced_fn(*args)
            if watch.read is not None and caps.uncacheable is None:
                caps.uncacheable = (f"a captured tensor's values are read while tracing "
                                    f"({watch.read})")
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
    ir, bindings, _ = trace_mods_guarded(mods, normalize=normalize, name=name)
    return ir, bindings


def trace_mods_guarded(mods: Mapping[str, Callable | None], normalize: str = "softmax",
                       name: str | None = None) -> tuple[VariantIR, Bindings, "TraceGuard"]:
    """`trace_mods`, plus a `TraceGuard` that says later whether the IR still holds.

    Example:
        >>> import torch
        >>> cap = 30.0
        >>> def softcap(score, b, h, q_idx, kv_idx):
        ...     return cap * torch.tanh(score / cap)
        >>> ir, bind, guard = trace_mods_guarded({"score_mod": softcap})
        >>> bind.scalars
        {'cap': 30.0}
        >>> cap = 50.0                  # a new value for a kernel parameter: same IR
        >>> guard.rebind().scalars
        {'cap': 50.0}
        >>> cap = 50                    # an int now: the IR would change (i32 parameter)
        >>> guard.rebind() is None
        True
    """
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
    return ir, bindings, TraceGuard(mods, caps, bindings)


class TraceGuard:
    """What one trace read from the user's code, to tell whether a new trace would give the same IR.

    `rebind()` re-reads every capture (closure cells, module globals, also of helper functions)
    and returns fresh `Bindings` when the IR still holds, else None:

    - a scalar that became a kernel parameter may take any value of the same type (an int within
      i32); its new value goes into the bindings;
    - a baked-in scalar (used as a Python value, e.g. in `if`), bool, None, str must be equal
      and of the same type; tuples/lists/dicts of those must match item by item;
    - a tensor, helper function, library module or class must be the same object (a tensor
      also of the same dtype and shape); a cell emptied or a global defined/deleted fails;
    - every traced function keeps its `__code__`, `__defaults__` and `__kwdefaults__`.

    A trace that read state no guard can check never validates (`cacheable` is False, `reason`
    says why): an arbitrary object or a user module/class was captured (a mod may read its
    attributes), or the mod computed with a captured tensor's values while tracing.

    Example:
        >>> import torch
        >>> slopes = torch.rand(4)
        >>> def alibi(score, b, h, q_idx, kv_idx):
        ...     return score - slopes[h] * (q_idx - kv_idx)
        >>> ir, bind, guard = trace_mods_guarded({"score_mod": alibi})
        >>> guard.rebind().tensors["slopes"] is slopes
        True
        >>> slopes = torch.rand(4)      # another tensor object: trace again
        >>> guard.rebind() is None
        True
        >>> class Config:
        ...     scale = 2.0
        >>> cfg = Config()
        >>> def scaled(score, b, h, q_idx, kv_idx):
        ...     return score * cfg.scale    # 2.0 is baked in; cfg.scale = 3.0 is invisible
        >>> guard = trace_mods_guarded({"score_mod": scaled})[2]
        >>> guard.cacheable, guard.reason
        (False, "'cfg' is a Config object (its attributes may change)")
    """

    __slots__ = ("reason", "param_sites", "_mods", "_functions", "_sites", "_used", "_tensors")

    def __init__(self, mods: Mapping[str, Callable | None], caps: _Captures,
                 bindings: Bindings) -> None:
        reason = caps.uncacheable
        top: list[tuple[str, Callable[[], Any], str | None]] = []
        for hook in HOOK_ORDER:
            fn = mods.get(hook)
            if fn is None:
                continue
            if _is_user_function(fn):  # recorded in caps.functions; weak: caches must not pin it
                top.append((hook, weakref.ref(fn), fn.__name__))
            elif _is_library_object(fn):
                top.append((hook, (lambda f=fn: f), None))
            elif reason is None:
                reason = f"the {hook} is a {type(fn).__qualname__}, not a plain function"
        for tn, t in bindings.tensors.items():
            if reason is None and id(t) not in caps.watched:
                reason = f"tensor {tn!r} is computed while tracing, not captured"
        self.reason: str | None = reason
        # kernel parameter name -> its capture site, ("cell", id(cell)) or ("global", id(globals
        # dict), name): where torch.compile's path reads the value (docs/compile.md)
        self.param_sites: dict[str, tuple] = {p: caps.site_of[p] for p in bindings.scalars}
        self._mods = tuple(top)
        self._functions = tuple(caps.functions.values())
        self._sites = tuple(caps.sites.values())
        self._used = tuple(bindings.scalars)
        self._tensors = dict(bindings.tensors)

    @property
    def cacheable(self) -> bool:
        """False when `rebind()` always returns None (see `reason`)."""
        return self.reason is None

    def same_mods(self, mods: Mapping[str, Callable | None]) -> bool:
        """Whether `mods` are the very functions this trace was made from.

        Example:
            >>> f = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
            >>> guard = trace_mods_guarded({"mask_mod": f})[2]
            >>> guard.same_mods({"mask_mod": f}), guard.same_mods({"mask_mod": lambda *a: True})
            (True, False)
        """
        n = 0
        for hook, ref, _ in self._mods:
            if mods.get(hook) is not ref():
                return False
            n += 1
        return n == sum(1 for f in mods.values() if f is not None)

    def rebind(self) -> Bindings | None:
        """Bindings with the captures' current values if the traced IR still holds, else None.

        Tensors are the same objects as in the traced bindings; scalars are read anew.
        """
        if self.reason is not None:
            return None
        for _, ref, fname in self._mods:
            f = ref()
            if f is None or fname is not None and f.__name__ != fname:  # names go into the IR
                return None
        for ref, code, defaults, kwdefaults, dsnap, ksnap in self._functions:
            f = ref()
            if f is None or f.__code__ is not code or f.__defaults__ is not defaults or \
                    f.__kwdefaults__ is not kwdefaults:
                return None
            if defaults is not None and not _matches(dsnap, defaults):
                return None
            if kwdefaults is not None and not _matches(ksnap, kwdefaults):
                return None
        values: dict[str, Any] = {}
        for where, name, snap in self._sites:
            if name is None:
                try:
                    v = where.cell_contents
                except ValueError:
                    v = _ABSENT
            else:
                v = where.get(name, _ABSENT)
            if snap[0] == _PARAM:
                if type(v) is not snap[1]:
                    return None
                if snap[3]:
                    v = int(v)
                    if not _I32_MIN <= v < _I32_MAX:
                        return None
                else:
                    v = float(v)
                values[snap[2]] = v
            elif not _matches(snap, v):
                return None
        return Bindings(scalars={p: values[p] for p in self._used}, tensors=dict(self._tensors))

    def __repr__(self) -> str:
        state = "cacheable" if self.reason is None else f"uncacheable: {self.reason}"
        return (f"<TraceGuard {len(self._sites)} captures, {len(self._functions)} functions, "
                f"{state}>")
