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
from .errors import (AttnccError, AttnSyntaxError, CapturedReadError, CodegenError, CompileError,
                     DeviceError, IndexOverflowWarning, InvalidArgument, InvalidArgumentType,
                     ResourceError, TraceError)
from .frontend import Variant, and_masks, noop_mask, or_masks
from .runtime.serving.append import (append_paged_kv_cache, get_batch_indices_positions,
                                     get_seq_lens)
from .runtime.serving.batch import BatchAttention
from .runtime.flex.block_mask import BlockMask, create_block_mask, create_mask
from .runtime.flex.torch_compat import AuxOutput, AuxRequest
from .runtime.serving.cascade import CascadeAttention
from .runtime.jit.compile import CompiledKernel, compile, export
from .runtime.flex.api import flex_attention
from .runtime.serving.merge import merge_state, merge_states
from .version import __version__
from .runtime.jit.launcher import preload_driver

preload_driver()  # on a CUDA build, the driver bindings load while the caller sets up

__all__ = ["AttnccError", "AttnSyntaxError", "AuxOutput", "AuxRequest", "BatchAttention",
           "BlockMask", "CapturedReadError", "CascadeAttention", "CodegenError", "CompileError",
           "DeviceError", "IndexOverflowWarning", "InvalidArgument", "InvalidArgumentType",
           "ResourceError", "CompiledKernel", "TraceError", "Variant", "and_masks",
           "append_paged_kv_cache", "compile", "get_batch_indices_positions", "get_seq_lens",
           "create_block_mask", "create_mask", "export", "flex_attention", "merge_state",
           "merge_states", "noop_mask", "or_masks"]
