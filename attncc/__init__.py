"""attncc: a compiler for attention variants.

Write FlexAttention-style mods in Python; attncc traces them into a typed IR, simplifies it,
generates CUDA and compiles it with NVRTC. On a CPU the same API computes the exact result.

Example:
    >>> import torch, attncc
    >>> q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    >>> out = attncc.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s)
    >>> out.shape
    torch.Size([1, 2, 8, 16])
"""
from .errors import (AttnccError, AttnSyntaxError, CapturedReadError, CompileError, DeviceError,
                     IndexOverflowWarning, InvalidArgument, InvalidArgumentType, TraceError)
from .frontend import Variant, and_masks, noop_mask, or_masks
from .runtime.batch import BatchAttention
from .runtime.block_mask import BlockMask, create_block_mask
from .runtime.cascade import CascadeAttention
from .runtime.compile import CompiledKernel, compile, export
from .runtime.flex import flex_attention
from .runtime.merge import merge_state, merge_states

__all__ = ["AttnccError", "AttnSyntaxError", "BatchAttention", "BlockMask", "CapturedReadError",
           "CascadeAttention", "CompileError", "DeviceError", "IndexOverflowWarning",
           "InvalidArgument", "InvalidArgumentType",
           "CompiledKernel", "TraceError", "Variant", "and_masks", "compile", "create_block_mask",
           "export", "flex_attention", "merge_state", "merge_states", "noop_mask", "or_masks"]
__version__ = "0.1.0"
