"""The form memo: `compile_spec`'s answer for a spec, remembered in the cache directory, so a warm
start neither renders the translation unit nor hashes its text (docs/jit.md, "Warm start").

An entry is the pickled `CompiledForm` (the form compile_spec chose, fallbacks included, with
its source, cubin and ptxas report) under a sha256 key over the memo format, the sources that
turn a spec into a form (the IR and codegen packages, the CUDA templates, this package's rules),
the arch, the NVRTC version and the spec itself (its fields and its IR's canonical text). Any
change to those sources (seen as a new size or modification time) or to NVRTC gives new keys;
an unreadable entry is a miss. The cubin cache below stays the authority: the memo only skips
the work of finding its key.

Example:
    >>> import tempfile
    >>> from attncc.runtime.jit.kernels import KernelSpec
    >>> memo = FormMemo(tempfile.mkdtemp())
    >>> key = memo.key(KernelSpec("merge", dtype="float16"), "sm_90a")
    >>> memo.load(key) is None
    True
    >>> memo.save(key, {"any": "picklable form"}); memo.load(key)
    {'any': 'picklable form'}
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

from attncc.ir.digest import tree_digest

from .cache import KernelCache, default_cache_dir
from .nvrtc import nvrtc_version

__all__ = ["FormMemo", "FORMAT"]

FORMAT = 1


def _package_dirs() -> list[Path]:
    import attncc.codegen
    import attncc.ir
    import attncc.kernels

    return [Path(attncc.codegen.__file__).parent, Path(attncc.ir.__file__).parent,
            Path(attncc.kernels.__file__).parent, Path(__file__).parent]


def sources_digest() -> str:
    """The digest (`attncc.ir.digest.tree_digest`: names, sizes and modification times) of
    every source tree that takes part in turning a spec into a compiled form."""
    return tree_digest(_package_dirs())


def ir_text(ir: Any) -> str:
    """A canonical text of a VariantIR: its declarations and, per hook, its source line and
    its DAG in walk order, each node as (op, dtype, argument numbers, attribute with its type:
    floats by their bits). Equal for equal IRs in any process, unlike a pickle, whose bytes
    depend on how the objects were built (a freshly simplified IR against one read back)."""
    if ir is None:
        return "-"
    from attncc.ir.nodes import walk

    out = [ir.name, ir.normalize, repr(ir.scalars), repr(ir.tensors)]
    for name, hook in ir.hooks.items():
        out.append(f"hook {name} {hook.source}")
        num: dict[int, int] = {}
        for n in walk(hook.expr):
            num[id(n)] = len(num)
            a = n.attr
            attr = a.hex() if isinstance(a, float) else repr(a)
            out.append(f"{n.op} {n.dtype} {[num[id(x)] for x in n.args]} "
                       f"{type(a).__name__}:{attr}")
    return "\n".join(out)


class FormMemo:
    """Compiled forms by spec, in `dir` (default: `forms/` inside the kernel cache directory)."""

    def __init__(self, dir: str | Path | None = None) -> None:
        self.store = KernelCache.shared(Path(dir) if dir is not None
                                        else default_cache_dir() / "forms")

    @staticmethod
    def default() -> "FormMemo":
        return FormMemo()

    @staticmethod
    def key(spec: Any, arch: str) -> str:
        """The entry's key: the same for the same spec in any process (`ir_text`)."""
        h = hashlib.sha256(b"attncc-form\0%d\0" % FORMAT)
        fields = repr(replace(spec, device=None))  # the form does not depend on the device
        for part in (sources_digest(), arch, repr(nvrtc_version()), fields, ir_text(spec.ir)):
            h.update(part.encode() + b"\0")
        return h.hexdigest()

    def load(self, key: str) -> Any:
        """The object saved under `key` (compile_spec checks its type), or None."""
        data = self.store.get(key)
        if data is None:
            return None
        try:
            return pickle.loads(data)
        except Exception:  # an unreadable entry is a miss: compile_spec overwrites it
            return None

    def save(self, key: str, form: Any) -> None:
        try:
            self.store.put(key, pickle.dumps(form, protocol=4))
        except (OSError, RecursionError, pickle.PicklingError):
            pass  # only the next process's warm start is lost
