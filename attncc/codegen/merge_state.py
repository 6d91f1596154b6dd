"""The translation unit of the attention-state merge kernel (kernels/small/merge_state.cuh).

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
from .layout import MERGE_STATE_PARAMS, StructLayout

__all__ = ["MergeStateKernel", "merge_state_source"]


class MergeStateKernel(NamedTuple):
    """A merge kernel's source, its extern "C" name and its one argument's layout."""

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
    source = "\n".join([
        f"// attncc: attention-state merge kernel for {dtype} (kernels/small/merge_state.cuh)",
        read_template("common/attncc_types.cuh"),
        read_template("small/merge_state.cuh"),
        "namespace attncc {",
        *MERGE_STATE_PARAMS.static_asserts(),
        *static_asserts("merge"),
        "}  // namespace attncc",
        f"ATTNCC_MERGE_STATE_ENTRY({name}, {ctype})",
        "",
    ])
    return MergeStateKernel(source, name, MERGE_STATE_PARAMS)
