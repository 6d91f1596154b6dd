"""A whole variant in IR: one expression per hook plus the declarations of what it captured.

`VariantIR` is pure data (no tensors, no values): it is what simplification, analysis and codegen
consume, and what keys the compile cache. Runtime values of captured scalars and tensors travel
separately in `Bindings`, so new values never change the IR or the generated source.

Example:
    >>> from attncc.ir.nodes import var
    >>> v = VariantIR(hooks={"mask_mod": Hook("mask_mod", var("q_idx") >= var("kv_idx"))})
    >>> print(v.format())
    variant anonymous (normalize=softmax)
    mask_mod -> bool:
      return q_idx >= kv_idx
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .nodes import BOOL, F32, I32, DType, Node, const, var, vec
from .printer import format_hook

# The hooks, their IR result type, the index variables they may read and their head vector.
HOOK_SIGNATURES: dict[str, tuple[DType, tuple[str, ...], str | None]] = {
    "query_mod": (F32, ("b", "h", "q_idx", "d"), "q"),
    "key_mod": (F32, ("b", "h", "kv_idx", "d"), "k"),
    "value_mod": (F32, ("b", "h", "kv_idx", "d"), "v"),
    "score_mod": (F32, ("score", "b", "h", "q_idx", "kv_idx"), None),
    "mask_mod": (BOOL, ("b", "h", "q_idx", "kv_idx"), None),
    "output_mod": (F32, ("b", "h", "q_idx", "d"), "o"),
}
HOOK_ORDER = tuple(HOOK_SIGNATURES)
# The hooks that transform a head vector (q, k, v before attention; o after it).
TRANSFORM_HOOKS = ("query_mod", "key_mod", "value_mod", "output_mod")


def identity_expr(hook: str) -> Node:
    """What a hook computes when the user gives none: the identity / the all-true mask."""
    if hook == "score_mod":
        return var("score")
    if hook == "mask_mod":
        return const(True)
    return vec(HOOK_SIGNATURES[hook][2], var("d"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class SourceLoc:
    """Where a hook came from in the user's code (printed as a comment in generated CUDA)."""

    file: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.name})"


@dataclass(frozen=True)
class Hook:
    name: str
    expr: Node
    source: SourceLoc | None = None

    @property
    def is_identity(self) -> bool:
        return self.expr is identity_expr(self.name)


@dataclass(frozen=True)
class ScalarParam:
    """A captured Python scalar, passed to the kernel by value."""

    name: str
    dtype: DType  # I32 or F32


@dataclass(frozen=True)
class TensorParam:
    """A captured tensor, passed as pointer + strides; `elem` is its storage dtype name."""

    name: str
    elem: str  # "float32" | "float16" | "bfloat16" | "float64" | "int32" | "int64" | ... | "bool"
    ndim: int
    dtype: DType  # what a load yields in the IR


@dataclass(frozen=True)
class VariantIR:
    hooks: Mapping[str, Hook] = field(default_factory=dict)
    normalize: str = "softmax"  # "softmax" | "none"
    name: str = "anonymous"
    scalars: tuple[ScalarParam, ...] = ()
    tensors: tuple[TensorParam, ...] = ()

    def hook(self, name: str) -> Hook:
        """The hook, or its identity when the user gave none."""
        if name in self.hooks:
            return self.hooks[name]
        return Hook(name, identity_expr(name))

    def expr(self, name: str) -> Node:
        return self.hook(name).expr

    def with_exprs(self, exprs: Mapping[str, Node]) -> "VariantIR":
        hooks = {n: replace(self.hook(n), expr=e) for n, e in exprs.items()}
        merged = {**self.hooks, **hooks}
        return replace(self, hooks={n: merged[n] for n in HOOK_ORDER if n in merged})

    @property
    def use_softmax(self) -> bool:
        return self.normalize == "softmax"

    def format(self) -> str:
        lines = [f"variant {self.name} (normalize={self.normalize})"]
        for p in self.scalars:
            lines.append(f"param {p.name}: {p.dtype.value}")
        for t in self.tensors:
            lines.append(f"tensor {t.name}: {t.elem}[{', '.join('_' * t.ndim)}] -> {t.dtype.value}")
        for n in HOOK_ORDER:
            if n in self.hooks:
                lines.append(format_hook(n, self.hooks[n].expr))
        return "\n".join(lines)


@dataclass
class Bindings:
    """Runtime values for a VariantIR's captured scalars and tensors."""

    scalars: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)


INT_ELEMS = ("int8", "uint8", "int16", "int32", "int64")
FLOAT_ELEMS = ("float16", "bfloat16", "float32", "float64")


def ir_dtype_for_elem(elem: str) -> DType | None:
    """The IR type a load of this storage dtype yields, or None if it cannot be read."""
    if elem in FLOAT_ELEMS:
        return F32
    if elem in INT_ELEMS:
        return I32
    if elem == "bool":
        return BOOL
    return None
