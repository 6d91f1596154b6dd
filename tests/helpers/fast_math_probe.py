"""The fast-math probe kernel (tests/gpu/test_fast_math.py runs it, tests/kernels/
test_probes_compile.py compiles it): its source and argument structs."""
from __future__ import annotations

from attncc.codegen.layout import struct_layout


SRC = r"""
struct FnArgs {
  const float* x;
  float* y;
  int n;
  int fn;
};
struct Unused { int x; };

extern "C" __global__ void fast_fns(FnArgs a, Unused) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.n) return;
  const float x = a.x[i];
  a.y[i] = a.fn == 0 ? attncc::fast_sin(x) : attncc::fast_cos(x);
}
"""


ARGS = struct_layout("FnArgs", [("x", "const float*"), ("y", "float*"), ("n", "int"),
                                ("fn", "int")])
UNUSED = struct_layout("Unused", [("x", "int")])


def source() -> str:
    """The probe translation unit: the shipped types header and the kernel."""
    from attncc.kernels import read_template

    return read_template("common/attncc_types.cuh") + SRC
