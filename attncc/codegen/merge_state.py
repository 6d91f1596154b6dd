"""The translation units of the variant-free kernels: the attention-state merge kernel
(kernels/small/merge_state.cuh), the backward's row kernel (kernels/small/bwd_rows.cuh) and its
dQ conversion (kernels/small/bwd_dq.cuh).

Unlike the attention kernels it has no variant: one kernel per storage type, merging two states
``(o, lse)`` of the same rows (runtime/serving/merge_kernel.py launches it). The unit is the shipped
headers plus one entry and the static_asserts that pin `MERGE_STATE_PARAMS` to the C struct.

Example:
    >>> k = merge_state_source("bfloat16")
    >>> k.kernel_name, "ATTNCC_MERGE_STATE_ENTRY(attncc_merge_state_bf16, attncc::bf16)" in k.source
    ('attncc_merge_state_bf16', True)
"""
from __future__ import annotations

from typing import NamedTuple

from attncc.kernels import read_template

from .constants import static_asserts
from .errors import CodegenError
from .generate import DTYPES
from .layout import BWD_DQ_PARAMS, BWD_ROWS_PARAMS, MERGE_STATE_PARAMS, StructLayout

__all__ = ["MergeStateKernel", "merge_state_source", "bwd_rows_source", "bwd_dq_source",
           "small_unit"]


class MergeStateKernel(NamedTuple):
    """A variant-free kernel's source, its extern "C" name and its one argument's layout."""

    source: str
    kernel_name: str
    params_layout: StructLayout


def merge_state_source(dtype: str) -> MergeStateKernel:
    """The merge kernel for o arrays of `dtype` ("bfloat16", "float16" or "float32").

    Example:
        >>> merge_state_source("float32").kernel_name
        'attncc_merge_state_f32'
        >>> merge_state_source("int8")
        Traceback (most recent call last):
        ...
        attncc.errors.CodegenError: dtype='int8': the merge kernel takes o in one of bfloat16, float16, float32
    """
    if dtype not in DTYPES:
        raise CodegenError(f"dtype={dtype!r}: the merge kernel takes o in one of "
                           f"{', '.join(DTYPES)}")
    ctype, short = DTYPES[dtype]
    name = f"attncc_merge_state_{short}"
    source = small_unit(f"attention-state merge kernel for {dtype}", "small/merge_state.cuh",
                        MERGE_STATE_PARAMS, "merge", f"ATTNCC_MERGE_STATE_ENTRY({name}, {ctype})")
    return MergeStateKernel(source, name, MERGE_STATE_PARAMS)


def bwd_rows_source(dtype: str) -> MergeStateKernel:
    """The FA3-class backward's row kernel (kernels/small/bwd_rows.cuh: LSE base 2 and delta per
    query tile) for dO and O of `dtype` ("bfloat16" or "float16").

    Example:
        >>> bwd_rows_source("float16").kernel_name
        'attncc_bwd_rows_f16'
    """
    return _backward_unit(dtype, "bwd_rows", "the backward's row kernel", BWD_ROWS_PARAMS)


def bwd_dq_source(dtype: str) -> MergeStateKernel:
    """The FA3-class backward's dQ conversion (kernels/small/bwd_dq.cuh: fp32 dq_accum in the
    consumers' staging order to dQ rows) for dQ of `dtype` ("bfloat16" or "float16").

    Example:
        >>> bwd_dq_source("bfloat16").kernel_name
        'attncc_bwd_dq_bf16'
    """
    return _backward_unit(dtype, "bwd_dq", "the backward's dQ conversion", BWD_DQ_PARAMS)


def _backward_unit(dtype: str, kind: str, what: str, layout: StructLayout) -> MergeStateKernel:
    """The unit of a backward helper kernel `kind` (kernels/small/<kind>.cuh, entry macro
    ATTNCC_<KIND>_ENTRY) for 16-bit `dtype`."""
    if dtype not in ("bfloat16", "float16"):
        raise CodegenError(f"dtype={dtype!r}: {what} takes bfloat16 or float16 tensors")
    ctype, short = DTYPES[dtype]
    name = f"attncc_{kind}_{short}"
    source = small_unit(f"{what} for {dtype}", f"small/{kind}.cuh", layout, kind,
                        f"ATTNCC_{kind.upper()}_ENTRY({name}, {ctype})")
    return MergeStateKernel(source, name, layout)


def small_unit(what: str, template: str, layout: StructLayout, kernel: str, entry: str) -> str:
    """A variant-free kernel's translation unit: the shipped types and `template`, the
    static_asserts pinning `layout` and `kernel`'s mirrored constants, and one entry."""
    return "\n".join([
        f"// attncc: {what} (kernels/{template})",
        read_template("common/attncc_types.cuh"),
        read_template(template),
        "namespace attncc {",
        *layout.static_asserts(),
        *static_asserts(kernel),
        "}  // namespace attncc",
        entry,
        "",
    ])
