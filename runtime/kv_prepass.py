"""The key/value pre-pass: a variant's key_mod / value_mod applied once per K/V row on the GPU.

`attncc.ir.hoist.split_kv_transforms` splits the hooks off a variant; `prepass_kernel` compiles
them into kernels/kv_transform.cuh (cached like the attention kernels) and `run_prepass` writes
transformed, contiguous copies of K and/or V on the current stream, which the attention kernel
then reads with identity key/value hooks. The copies are new tensors from torch's allocator (so
a CUDA-graph capture takes them from its private pool); K/V themselves are never written.

Example (compiling and launching need a GPU):
    >>> from attncc.ir.program import VariantIR
    >>> prepass_grid(kv_len=1000, num_kv_heads=8, batch=2)
    (125, 8, 2)
"""
from __future__ import annotations

import threading
from typing import Any, Mapping

import torch

from attncc.ir.program import VariantIR

ROWS_PER_CTA = 8  # kernels/kv_transform.cuh kRowsPerCta
THREADS = 32 * ROWS_PER_CTA

_KERNELS: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def prepass_grid(*, kv_len: int, num_kv_heads: int, batch: int) -> tuple[int, int, int]:
    """The pre-pass grid: one warp per (b, h_kv, kv_idx) row, ROWS_PER_CTA rows per CTA.

    Example:
        >>> prepass_grid(kv_len=8, num_kv_heads=1, batch=1)
        (1, 1, 1)
    """
    return (-(-kv_len // ROWS_PER_CTA), num_kv_heads, batch)


def prepass_source(pre: VariantIR, *, head_dim: int, dtype: str, fast_math: bool = True) -> Any:
    """Codegen's translation unit (a GeneratedKernel) for the hoisted hooks `pre` (simplified).

    Example:
        >>> from attncc.ir.nodes import var, vec
        >>> from attncc.ir.program import Hook
        >>> gk = prepass_source(VariantIR(hooks={"value_mod": Hook("value_mod",
        ...                     vec("v", var("d")) * 0.5)}, name="half_v"),
        ...                     head_dim=128, dtype="bfloat16")
        >>> gk.kernel_name, gk.block
        ('attncc_half_v_kvtransform_d128_bf16', (256, 1, 1))
    """
    from attncc.codegen.generate import generate_source

    return generate_source(pre, head_dim=head_dim, dtype=dtype, kernel="kvtransform",
                           fast_math=fast_math)


def prepass_kernel(pre: VariantIR, *, head_dim: int, dtype: str, fast_math: bool,
                   device: int) -> Any:
    """The loaded pre-pass kernel (a KernelLauncher) for `pre` (simplified), compiled once per
    (hooks, captures, head dim, dtype, fast_math, device) and kept."""
    key = (tuple((n, h.expr) for n, h in pre.hooks.items()), pre.name, pre.scalars, pre.tensors,
           head_dim, dtype, fast_math, device)
    hit = _KERNELS.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        hit = _KERNELS.get(key)
        if hit is None:
            from .cache import cached_compile
            from .launcher import load_kernel
            from .nvrtc import device_arch

            with torch.cuda.device(device):
                arch = device_arch()
            gk = prepass_source(pre, head_dim=head_dim, dtype=dtype, fast_math=fast_math)
            res, _ = cached_compile(gk.source, arch=arch, name=f"{gk.kernel_name}.cu",
                                    verbose=True)
            hit = _KERNELS[key] = load_kernel(res.cubin, gk.kernel_name,
                                              gk.attention_params_layout, gk.params_layout,
                                              device=device)
        return hit


def _strides(prefix: str, t: torch.Tensor | None) -> dict[str, int]:
    s = t.stride()[:3] if t is not None else (0, 0, 0)
    return {f"{prefix}_stride_{d}": s[i] for i, d in enumerate("bhs")}


def run_prepass(kernel: Any, pre: VariantIR, key: torch.Tensor, value: torch.Tensor,
                captured: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the pre-pass on the current stream: `(key', value')`, a transformed contiguous
    copy where `pre` has that hook and the input itself where it has not. `captured` is the
    VariantParams values of `pre` (gpu_flex._captured)."""
    from attncc.codegen.generate import variant_param_values

    B, Hkv, Skv, D = key.shape
    k_out = torch.empty(B, Hkv, Skv, D, dtype=key.dtype, device=key.device) \
        if "key_mod" in pre.hooks else None
    v_out = torch.empty(B, Hkv, Skv, D, dtype=value.dtype, device=value.device) \
        if "value_mod" in pre.hooks else None
    if key.numel() == 0:
        return (k_out if k_out is not None else key), (v_out if v_out is not None else value)
    ap = {"k": key.data_ptr(), "v": value.data_ptr(),
          "k_out": k_out.data_ptr() if k_out is not None else 0,
          "v_out": v_out.data_ptr() if v_out is not None else 0,
          **_strides("k", key), **_strides("v", value), **_strides("k_out", k_out),
          **_strides("v_out", v_out), "batch": B, "num_kv_heads": Hkv, "kv_len": Skv}
    vp = variant_param_values(kernel.vp.layout, captured["scalars"], captured["tensors"])
    kernel.launch(prepass_grid(kv_len=Skv, num_kv_heads=Hkv, batch=B), (THREADS, 1, 1), 0,
                  kernel.ap.flatten(ap), kernel.vp.flatten(vp),
                  stream=torch.cuda.current_stream(key.device).cuda_stream)
    return (k_out if k_out is not None else key), (v_out if v_out is not None else value)
