"""Frontend: trace Python mods (and `.attn` text) into attncc IR."""
from .text import load_attn, parse_attn
from .trace import trace_mods
from .variant import Variant, and_masks, as_variant, noop_mask, or_masks

__all__ = ["Variant", "and_masks", "as_variant", "load_attn", "noop_mask", "or_masks",
           "parse_attn", "trace_mods"]
