"""A probe kernel for the backward hooks: one thread per (b, h, q_idx, kv_idx) calls a variant's
LogitsGrad, CapturedGrad and the tile / diagonal gradient hooks (over one element) on given
scores and dlogits (tests/gpu/test_backward_hooks_gpu.py
runs it; tests/codegen/test_backward_hooks.py compiles it).

The launcher passes two structs, so the probe's first argument (`ProbeArgs`) carries the score,
dlogit and output pointers, the sizes and the members of `VariantGrads_<name>`, which the
kernel copies into a `Grads` before calling the hook.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from attncc.codegen.generate import VariantCode, generate_variant
from attncc.codegen.layout import StructLayout, struct_layout
from attncc.ir.program import VariantIR

KERNEL = "attncc_backward_probe"


@dataclass(frozen=True)
class Probe:
    source: str
    args: StructLayout  # ProbeArgs
    variant: VariantCode


def probe(ir: VariantIR, grad_tensors: Sequence[str], fast_math: bool = True) -> Probe:
    from attncc.kernels import read_template

    vc = generate_variant(ir, backward=True, grad_tensors=grad_tensors, fast_math=fast_math)
    gfields = [f for f in vc.grads_layout.fields if f.role != "unused"]
    members = [("score", "const float*"), ("dlogit", "const float*"), ("lg", "float*"),
               ("B", "int"), ("H", "int"), ("Sq", "int"), ("Skv", "int"),
               *((f.name, f.ctype, f.count if f.is_array else None) for f in gfields)]
    args = struct_layout("ProbeArgs", members)
    decl = "\n".join(f"  {f.declaration}" for f in args.fields)
    copy = "\n".join(
        (f"  for (int k = 0; k < {f.count}; ++k) g.{f.name}[k] = a.{f.name}[k];"
         if f.is_array else f"  g.{f.name} = a.{f.name};") for f in gfields) or "  g._unused = 0;"
    src = (read_template("common/attncc_types.cuh") + "\n" + vc.text + "\n"
           + "\n".join(vc.params_layout.static_asserts() + vc.grads_layout.static_asserts())
           + f"\nstruct ProbeArgs {{\n{decl}\n}};\n"
           + "\n".join(args.static_asserts()) + "\n"
           + f'extern "C" __global__ void {KERNEL}(ProbeArgs a, {vc.params_name} vp) {{\n'
           f"  using V = {vc.struct_name};\n"
           "  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
           "  const long long n = (long long)a.B * a.H * a.Sq * a.Skv;\n"
           "  if (i >= n) return;\n"
           "  const int kv_idx = (int)(i % a.Skv), q_idx = (int)(i / a.Skv % a.Sq);\n"
           "  const int h = (int)(i / ((long long)a.Skv * a.Sq) % a.H);\n"
           "  const int b = (int)(i / ((long long)a.Skv * a.Sq * a.H));\n"
           f"  V::Grads g;\n{copy}\n"
           "  a.lg[i] = V::LogitsGrad(vp, a.score[i], b, h, q_idx, kv_idx);\n"
           "  V::CapturedGrad(vp, g, a.dlogit[i], a.score[i], b, h, q_idx, kv_idx);\n"
           # the kernels' sums taken over one element: the same total per gradient entry
           "  if constexpr (V::has_tile_grads) {\n"
           "    float acc[V::kTileGradSlots] = {};\n"
           "    V::TileGradTerms(vp, acc, a.dlogit[i], a.score[i], b, h, q_idx, kv_idx);\n"
           "    V::TileGradFlush(vp, g, acc, b, h);\n"
           "  }\n"
           "  if constexpr (V::has_diag_grads) {\n"
           "    float acc[V::kDiagGradSlots];\n"
           "    V::DiagGradTerms(vp, acc, a.dlogit[i], a.score[i], b, h, q_idx, kv_idx);\n"
           "    V::DiagGradAdd(vp, g, acc, b, h, q_idx, kv_idx);\n"
           "  }\n"
           "}\n")
    return Probe(src, args, vc)
