"""Export a variant as a standalone `.cu` file for users who build with nvcc themselves.

The file is the same translation unit NVRTC compiles, plus a top-of-file comment documenting
the kernel, its arguments and their layout, and a host launcher
`extern "C" int <kernel_name>_launch(const attncc::AttentionParams*, const VariantParams_<name>*,
void* stream)` guarded by `#ifndef __CUDACC_RTC__`. Build it with
`nvcc -gencode=arch=compute_90a,code=sm_90a -c file.cu`.

Example:
    >>> import attncc
    >>> ir, _ = attncc.Variant(mask_mod=lambda b, h, q, kv: q >= kv, name="causal").trace()
    >>> text = export_source(ir, head_dim=128, dtype="bfloat16")
    >>> "attncc_causal_simple_d128_bf16_launch(" in text and "#ifndef __CUDACC_RTC__" in text
    True
"""
from __future__ import annotations

import shlex

from ..ir.program import VariantIR
from .generate import export_kernel

__all__ = ["export_source"]


def export_source(ir: VariantIR, *, head_dim: int, dtype: str, kernel: str = "simple",
                  filename: str | None = None) -> str:
    """The documented `.cu` text for `ir` (see the module docstring). `filename`: the name the
    text will be saved under, which its build line then names (default `<kernel_name>.cu`).

    Example:
        >>> from attncc.ir.program import VariantIR
        >>> text = export_source(VariantIR(name="plain"), head_dim=64, dtype="float32")
        >>> text.count("<<<grid, dim3(128), 0, (cudaStream_t)stream>>>")
        1
        >>> text = export_source(VariantIR(name="plain"), head_dim=64, dtype="float32",
        ...                      filename="softcap.cu")
        >>> "code=sm_90a -c softcap.cu" in text
        True
    """
    gk = export_kernel(ir, head_dim=head_dim, dtype=dtype, kernel=kernel)
    source = gk.source
    if kernel in _SM90A_ONLY:  # the template's note on other targets holds for FA2 only
        source = _replace_once(source, _ANY_SM80, "this kernel runs only on sm_90a")
    if filename is None:
        return source
    return _replace_once(source, f" -c {gk.kernel_name}.cu\n", f" -c {shlex.quote(filename)}\n")


_SM90A_ONLY = ("fa3", "fa3batch")
_ANY_SM80 = "any sm_80+ target works, e.g. -gencode=arch=compute_80,code=sm_80"


def _replace_once(text: str, old: str, new: str) -> str:
    """`old` replaced by `new`; an AssertionError if the template no longer has `old` (the
    header would otherwise go on saying something untrue)."""
    if old not in text:
        raise AssertionError(f"the export template no longer contains {old!r}")
    return text.replace(old, new, 1)
