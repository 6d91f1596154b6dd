"""Compile-check many variants' hooks at once: one translation unit, one small kernel each.

Property tests generate hundreds of variants; compiling each on a full attention kernel would
take seconds apiece. `hook_test_unit` puts only the shipped type helpers, each variant's structs
and a tiny `__global__` that calls every enabled hook (so templates are instantiated and every
hook body is type-checked and code-generated) into one source for a single NVRTC call.

Example:
    >>> from attncc.ir.nodes import var
    >>> from attncc.ir.program import Hook, VariantIR
    >>> ir = VariantIR(hooks={"mask_mod": Hook("mask_mod", var("q_idx") >= var("kv_idx"))})
    >>> src = hook_test_unit([ir, ir], prefix="t")
    >>> src.count("__global__"), "Variant_t_1" in src
    (2, True)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from ..ir.program import VariantIR
from .generate import generate_variant

__all__ = ["hook_test_unit"]

# A head vector for the calls: any index reads a (never executed) global row.
_PRELUDE = """
// Hook compile test: never launched; each kernel only makes every hook get instantiated.
struct AttnccHookTestVec {
    const float* row;
    __device__ __forceinline__ float operator[](int i) const { return row[i]; }
};
"""

_CALLS = {
    "has_query_transform": "out[0] = V::QueryTransform(vp, vec, 0, 1, 2, 3);",
    "has_key_transform": "out[1] = V::KeyTransform(vp, vec, 0, 1, 2, 3);",
    "has_value_transform": "out[2] = V::ValueTransform(vp, vec, 0, 1, 2, 3);",
    "has_logits_transform": "out[3] = V::LogitsTransform(vp, out[8], 0, 1, 2, 3);",
    "has_logits_mask": "out[4] = V::LogitsMask(vp, 0, 1, 2, 3) ? 1.0f : 0.0f;",
    "has_output_transform": "out[5] = V::OutputTransform(vp, vec, 0, 1, 2, 3);",
}

_BACKWARD_CALLS = {
    "has_logits_grad": "out[6] = V::LogitsGrad(vp, out[8], 0, 1, 2, 3);",
    "has_captured_grad": "V::CapturedGrad(vp, g, out[7], out[8], 0, 1, 2, 3);",
    "has_tile_grads": ("{ float acc[V::kTileGradSlots] = {}; "
                       "V::TileGradTerms(vp, acc, out[7], out[8], 0, 1, 2, 3); "
                       "V::TileGradFlush(vp, g, acc, 0, 1); }"),
    "has_diag_grads": ("{ float acc[V::kDiagGradSlots]; "
                       "V::DiagGradTerms(vp, acc, out[7], out[8], 0, 1, 2, 3); "
                       "V::DiagGradAdd(vp, g, acc, 0, 1, 2, 3); }"),
}


def hook_test_unit(variants: Sequence[VariantIR], prefix: str = "v", *, backward: bool = False,
                   grad_tensors: Mapping[str, Sequence[str]] | None = None,
                   fast_math: bool = False) -> str:
    """One CUDA source declaring every variant (renamed `<prefix>_<i>`) and calling its hooks.

    Kernels are `extern "C" __global__ void attncc_hooktest_<prefix>_<i>(...)`. `backward=True`
    generates backward variants (docs/backward.md): the kernels also take the VariantGrads
    struct and call LogitsGrad / CapturedGrad, whose layouts are static_asserted;
    `grad_tensors` maps a variant's original name to its captured tensors requiring grad.

    Example:
        >>> from attncc.ir.program import VariantIR
        >>> "attncc_hooktest_p_0" in hook_test_unit([VariantIR()], prefix="p")
        True
    """
    from ..kernels import read_template

    parts = [read_template("common/attncc_types.cuh").rstrip("\n") + "\n", _PRELUDE]
    for i, ir in enumerate(variants):
        grads = tuple((grad_tensors or {}).get(ir.name, ())) if backward else ()
        vc = generate_variant(replace(ir, name=f"{prefix}_{i}"), backward=backward,
                              grad_tensors=grads, fast_math=fast_math)
        calls = [c for flag, c in _CALLS.items() if getattr(vc, flag)]
        if backward:
            calls += [c for flag, c in _BACKWARD_CALLS.items() if getattr(vc, flag)]
        body = "\n".join(f"    {c}" for c in calls) or "    out[0] = 0.0f;"
        checks = ("\n".join(vc.params_layout.static_asserts() + vc.grads_layout.static_asserts())
                  + "\n") if vc.grads_layout is not None else ""
        extra = f", {vc.grads_name} g" if backward else ""
        parts.append(f"\n{vc.text}\n{checks}"
                     f'extern "C" __global__ void attncc_hooktest_{vc.name}('
                     f"{vc.params_name} vp{extra}, float* out) {{\n"
                     f"    using V = {vc.struct_name};\n"
                     f"    const AttnccHookTestVec vec{{out + 16}};\n"
                     f"    (void)vec;\n"
                     f"{body}\n}}\n")
    return "".join(parts)
