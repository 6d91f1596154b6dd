"""One kernel holding every case of `discrete_exprs` twice, as the hooks emit it with and without
fast math (tests/gpu/test_discrete_gpu.py runs it, tests/codegen/test_discrete_kernel.py
compiles it)."""
from __future__ import annotations

import functools

from attncc.codegen.cuda_expr import ExprNames, emit
from attncc.codegen.layout import struct_layout
from attncc.frontend import Variant
from attncc.ir.simplify import simplify_variant
from tests.helpers.discrete_exprs import Case, cases


N_CASES = 520
N_PARAMS = 4  # captured floats a case may read: c0 .. c3

ARGS = struct_layout("DiscreteArgs", [("out", "float*"), ("params", "const float*"),
                                      ("q_len", "int"), ("kv_len", "int")])
UNUSED = struct_layout("Unused", [("x", "int")])

_KERNEL = r"""
struct DiscreteArgs {
  float* out;
  const float* params;
  int q_len;
  int kv_len;
};
struct Unused { int x; };
struct CaseParams { float c0, c1, c2, c3; };

%(functions)s

extern "C" __global__ void discrete_cases(DiscreteArgs a, Unused) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int c = blockIdx.y;
  if (i >= a.q_len * a.kv_len) return;
  const int q_idx = i / a.kv_len, kv_idx = i %% a.kv_len;
  const float* pv = a.params + %(n_params)d * (c %% %(n_cases)d);
  const CaseParams p = {pv[0], pv[1], pv[2], pv[3]};
  float r = 0.0f;
  switch (c) {
%(switch)s
  }
  a.out[(long long)c * a.q_len * a.kv_len + i] = r;
}
"""


def _traced(case: Case):
    ir, bind = Variant(score_mod=case.function()).trace()
    return simplify_variant(ir).expr("score_mod"), bind


def _function(name: str, case: Case, fast_math: bool) -> str:
    """The case's score_mod as the hooks emit it (its int part when it returns f32(int))."""
    expr, _ = _traced(case)
    if expr.op == "to_f32":
        expr = expr.args[0]
    names = ExprNames(scalars={f"c{j}": f"c{j}" for j in range(N_PARAMS)}, params="p")
    code = emit(expr, names, fast_math=fast_math)
    body = "\n".join("  " + line for line in code.temps)
    return (f"__device__ __noinline__ float {name}(int b, int h, int q_idx, int kv_idx, "
            f"float score, const CaseParams& p) {{\n{body}\n"
            f"  return (float)({code.value});\n}}")


@functools.lru_cache(maxsize=1)
def kernel_source() -> str:
    from attncc.kernels import read_template

    all_cases = cases(N_CASES, seed=2027)
    functions, switch = [], []
    for fast in (False, True):
        for j, case in enumerate(all_cases):
            c = j + (N_CASES if fast else 0)
            functions.append(_function(f"case_{c}", case, fast))
            switch.append(f"    case {c}: r = case_{c}(0, 0, q_idx, kv_idx, 0.0f, p); break;")
    return read_template("common/attncc_types.cuh") + _KERNEL % {
        "functions": "\n\n".join(functions), "switch": "\n".join(switch),
        "n_params": N_PARAMS, "n_cases": N_CASES}
