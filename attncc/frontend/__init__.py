"""Frontend: trace Python mods (and `.attn` text) into attncc IR."""
from typing import Any

from .trace import trace_mods
from .variant import Variant, and_masks, as_variant, noop_mask, or_masks

__all__ = ["Variant", "and_masks", "as_variant", "load_attn", "noop_mask", "or_masks",
           "parse_attn", "trace_mods"]


def __getattr__(name: str) -> Any:
    """`load_attn` / `parse_attn` on first use: the `.attn` language's parser (lark) costs
    ~25 ms of `import attncc` that Python mods never need (docs/jit.md, "Warm start")."""
    if name in ("load_attn", "parse_attn"):
        from .text import load_attn, parse_attn

        return load_attn if name == "load_attn" else parse_attn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
