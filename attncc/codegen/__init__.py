"""Codegen: VariantIR -> CUDA functor structs -> one self-contained translation unit.

Example:
    >>> from attncc.ir.program import VariantIR
    >>> gk = generate_source(VariantIR(name="plain"), head_dim=128, dtype="bfloat16")
    >>> gk.kernel_name
    'attncc_plain_simple_d128_bf16'
"""
from .errors import CodegenError
from .export import export_source
from .generate import (DTYPES, KERNELS, GeneratedKernel, KernelSpec, VariantCode, export_kernel,
                       generate_source, generate_variant, kernel_name, variant_param_values)
from .layout import ATTENTION_PARAMS, Field, StructLayout

__all__ = ["ATTENTION_PARAMS", "CodegenError", "DTYPES", "Field", "GeneratedKernel", "KERNELS",
           "KernelSpec", "StructLayout", "VariantCode", "export_kernel", "export_source",
           "generate_source", "generate_variant", "kernel_name", "variant_param_values"]
