"""Frontend: trace Python mods (and `.attn` text) into attncc IR."""
from .trace import trace_mods
from .variant import Variant, and_masks, as_variant, noop_mask, or_masks

__all__ = ["Variant", "and_masks", "as_variant", "noop_mask", "or_masks", "trace_mods"]
