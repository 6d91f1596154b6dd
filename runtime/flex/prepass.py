"""The transform pre-pass: a variant's query_mod / key_mod / value_mod applied once per row on the
GPU, before attention.

`attncc.ir.hoist.split_transforms` splits the hooks off a variant; `choose_prepass` decides which
to move for a launch, `prepass_kernel` compiles them into kernels/small/prepass.cuh (from the kernel
cache, like the attention kernels) and `run_prepass` writes transformed, contiguous copies of q, k and/or v on
the current stream, which the attention kernel then reads with identity hooks. The copies are
new tensors from torch's allocator (so a CUDA-graph capture takes them from its private pool);
the inputs are never written.

Example (compiling and launching need a GPU):
    >>> prepass_grid(warps=(0, 100, 100))
    (25, 1, 1)
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from attncc.codegen import constants
from attncc.ir.hoist import KV_HOOKS, PREPASS_HOOKS, kv_loads_per_row, transforms_in
from attncc.ir.program import VariantIR

from ..jit.launcher import current_raw_stream

WARPS = constants.PREPASS_WARPS  # kernels/small/prepass.cuh kWarps
ROWS_PER_WARP = 16  # kRowsPerWarp
THREADS = 32 * WARPS
# kernel_options PREPASS: which hooks the pre-pass takes ("auto": decided per launch)
PREPASS_CHOICES = {"none": (), "kv": KV_HOOKS, "qkv": PREPASS_HOOKS}


def choose_prepass(ir: VariantIR, *, option: str | None, q_len: int, num_q_heads: int,
                   num_kv_heads: int, rows_per_cta: int, head_fusion: int) -> tuple[str, ...]:
    """The transform hooks of `ir` to run in the pre-pass for one launch. `option` is
    kernel_options['PREPASS'] ("none", "kv", "qkv"; None or "auto": decide): when the grid loads
    each K/V row at least twice (`kv_loads_per_row`), all q/k/v transforms move -- K/V ones to
    stop the per-tile recomputation, the query one to leave the attention CTA's critical path
    (docs/fa2.md, "Transform pre-pass"); otherwise none.

    Example:
        >>> from attncc.gym import rope
        >>> ir, _ = rope(64).trace()
        >>> choose_prepass(ir, option=None, q_len=4096, num_q_heads=8, num_kv_heads=8,
        ...                rows_per_cta=128, head_fusion=1)
        ('query_mod', 'key_mod')
        >>> choose_prepass(ir, option="kv", q_len=1, num_q_heads=8, num_kv_heads=8,
        ...                rows_per_cta=16, head_fusion=1)
        ('key_mod',)
    """
    if option in (None, "auto"):
        loads = kv_loads_per_row(q_len=q_len, num_q_heads=num_q_heads,
                                 num_kv_heads=num_kv_heads, rows_per_cta=rows_per_cta,
                                 head_fusion=head_fusion)
        option = "qkv" if loads >= 2 else "none"
    if option not in PREPASS_CHOICES:
        raise ValueError(f"kernel_options['PREPASS']={option!r}: use 'auto' (default), 'none', "
                         f"'kv' or 'qkv'")
    return transforms_in(ir, PREPASS_CHOICES[option])


def prepass_grid(*, warps: tuple[int, int, int]) -> tuple[int, int, int]:
    """The grid for (q, k, v) task counts: one warp per task, WARPS per CTA.

    Example:
        >>> prepass_grid(warps=(1, 0, 0))
        (1, 1, 1)
    """
    return (-(-sum(warps) // WARPS), 1, 1)


def prepass_source(pre: VariantIR, *, head_dim: int, dtype: str, fast_math: bool = True) -> Any:
    """Codegen's translation unit (a GeneratedKernel) for the hoisted hooks `pre` (simplified).

    Example:
        >>> from attncc.ir.nodes import var, vec
        >>> from attncc.ir.program import Hook
        >>> gk = prepass_source(VariantIR(hooks={"value_mod": Hook("value_mod",
        ...                     vec("v", var("d")) * 0.5)}, name="half_v"),
        ...                     head_dim=128, dtype="bfloat16")
        >>> gk.kernel_name, gk.block
        ('attncc_half_v_prepass_d128_bf16', (256, 1, 1))
    """
    from attncc.codegen.generate import generate_source

    return generate_source(pre, head_dim=head_dim, dtype=dtype, kernel="prepass",
                           fast_math=fast_math)


def prepass_kernel(pre: VariantIR, *, head_dim: int, dtype: str, fast_math: bool,
                   device: int) -> Any:
    """The loaded pre-pass kernel (a KernelLauncher) for `pre` (simplified), from the kernel
    cache (runtime/jit/kernels.py)."""
    from ..jit.kernels import KernelSpec, get_kernel

    return get_kernel(KernelSpec("prepass", pre, head_dim, dtype, fast_math=fast_math,
                                 device=device)).launcher


def _strides(prefix: str, t: torch.Tensor) -> dict[str, int]:
    return {f"{prefix}_stride_{d}": t.stride(i) for i, d in enumerate("bhs")}


def run_prepass(kernel: Any, pre: VariantIR, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                captured: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the pre-pass on the current stream: `(q', k', v')`, a transformed contiguous copy
    where `pre` has that tensor's hook and the input itself where it has not. `captured` is the
    VariantParams values of `pre` (jit.launch_args.captured)."""
    from attncc.codegen.generate import variant_param_values

    ins = {"q": q, "k": k, "v": v}
    hooks = {"q": "query_mod", "k": "key_mod", "v": "value_mod"}
    outs = {n: torch.empty(t.shape, dtype=t.dtype, device=t.device)
            if hooks[n] in pre.hooks and t.numel() else t for n, t in ins.items()}
    warps = tuple(-(-ins[n].shape[:3].numel() // ROWS_PER_WARP) if outs[n] is not ins[n] else 0
                  for n in "qkv")
    if sum(warps) == 0:
        return outs["q"], outs["k"], outs["v"]
    B, Hq, Sq, _ = q.shape
    ap: dict[str, Any] = {"batch": B, "num_q_heads": Hq, "num_kv_heads": k.shape[1],
                          "q_len": Sq, "kv_len": k.shape[2], "warps_q": warps[0],
                          "warps_k": warps[1], "warps_v": warps[2]}
    for n in "qkv":
        ap[n], ap[f"{n}_out"] = ins[n].data_ptr(), outs[n].data_ptr()
        ap.update(_strides(n, ins[n]), **_strides(f"{n}_out", outs[n]))
    vp = variant_param_values(kernel.vp.layout, captured["scalars"], captured["tensors"])
    kernel.launch(prepass_grid(warps=warps), (THREADS, 1, 1), 0, kernel.ap.flatten(ap),
                  kernel.vp.flatten(vp), stream=current_raw_stream(q.device.index))
    return outs["q"], outs["k"], outs["v"]
