"""One CUDA kernel holding every op case (`tests/helpers/op_cases.py`) as the hooks emit it:
with fast_math off, on, and as a discrete value's exact spelling. `tests/codegen/
test_ops_compile.py` compiles it with NVRTC, `tests/gpu/test_ops_gpu.py` runs it.

Each case writes its value's 32 bits (a float's bits, an int, a bool as 0 / 1) at every
(q_idx, kv_idx) of the NQ x NK grid, reading the captured tables from `OpTables`.
"""
from __future__ import annotations

import functools

import torch

from attncc.codegen.cuda_expr import ExprNames, emit
from attncc.codegen.layout import struct_layout
from attncc.ir.nodes import F32, Node, binary, where
from attncc.ir.simplify import simplify
from tests.helpers.op_cases import NK, NQ, all_cases, grid, make_mod, tables, traced

SPELLINGS = ("plain", "fast", "exact")
TABLES = ("x", "y", "i", "j", "k", "z")
ARGS = struct_layout("OpArgs", [("out", "int*"), ("q_len", "int"), ("kv_len", "int")])


def _ctype(t: torch.Tensor) -> str:
    return "const float*" if t.dtype == torch.float32 else "const int*"


def tables_layout():
    tabs = tables()
    members = []
    for name in TABLES:
        members += [(name, _ctype(tabs[name])), (f"{name}_stride", "attncc::i64", 1)]
    return struct_layout("OpTables", members)


_KERNEL = r"""
struct OpArgs { int* out; int q_len; int kv_len; };
struct OpTables {
%(members)s
};
__device__ __forceinline__ int bits(float x) { return __float_as_int(x); }
__device__ __forceinline__ int bits(int x) { return x; }
__device__ __forceinline__ int bits(bool x) { return x ? 1 : 0; }

%(functions)s

extern "C" __global__ void op_cases(OpArgs a, OpTables p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int c = blockIdx.y;
  if (i >= a.q_len * a.kv_len) return;
  const int q_idx = i / a.kv_len, kv_idx = i %% a.kv_len;
  int r = 0;
  switch (c) {
%(switch)s
  }
  a.out[(long long)c * a.q_len * a.kv_len + i] = r;
}
"""


@functools.lru_cache(maxsize=1)
def case_nodes() -> list[tuple[str, str, Node]]:
    """(name, source, simplified value node) of every case, in kernel order."""
    out = []
    tabs = tables()
    # indices at the full [NQ, NK] shape: torch 2.11's isclose does not broadcast its operands
    # ([NQ, 1] with [1, NK]; 2.13's does); only the value's dtype is used here
    g = {k: (v.expand(NQ, NK).contiguous() if v.dim() == 2 else v) for k, v in grid().items()}
    for name, src in all_cases():
        fn = make_mod(src, tabs)
        node, _ = traced(fn, torch.as_tensor(fn(**g)))
        out.append((name, src, simplify(node)))
    return out


def _function(fname: str, node: Node, spelling: str) -> str:
    if spelling == "exact" and node.dtype is F32:
        # a comparison puts the value in the discrete cone: spelled as torch computes it
        node = where(binary("ne", node, node), node, node)
    names = ExprNames(tensors={t: t for t in TABLES}, params="p")
    code = emit(node, names, fast_math=spelling == "fast")
    body = "\n".join("  " + line for line in code.temps)
    return (f"__device__ __noinline__ {code.ctype} {fname}(int b, int h, int q_idx, int kv_idx, "
            f"float score, const OpTables& p) {{\n{body}\n  return {code.value};\n}}")


@functools.lru_cache(maxsize=1)
def kernel_source() -> str:
    from attncc.kernels import read_template

    nodes = case_nodes()
    functions, switch = [], []
    for s, spelling in enumerate(SPELLINGS):
        for j, (_, _, node) in enumerate(nodes):
            c = s * len(nodes) + j
            functions.append(_function(f"case_{c}", node, spelling))
            switch.append(f"    case {c}: r = bits(case_{c}(0, 0, q_idx, kv_idx, 0.0f, p)); "
                          "break;")
    tabs = tables()
    members = "\n".join(f"  {_ctype(tabs[t])} {t};\n  attncc::i64 {t}_stride[1];" for t in TABLES)
    return read_template("common/attncc_types.cuh") + _KERNEL % {
        "members": members, "functions": "\n\n".join(functions), "switch": "\n".join(switch)}
