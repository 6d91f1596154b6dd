"""Issue 30, op coverage on CUDA: every op case (tests/helpers/op_cases.py) as the hooks emit it
(tests/helpers/op_kernel.py) against torch running the same Python on CUDA float32 / int32
tensors. Integer and boolean results agree exactly in every spelling; float results agree to
float rounding (NaN and infinities in the same places) with fast_math off and in a discrete
value's exact spelling, and to bf16 tolerance with fast_math on at moderate inputs (the
one-instruction approximations are documented in attncc_types.cuh)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.op_cases import NK, NQ, grid, make_mod, tables
from tests.helpers.op_kernel import ARGS, SPELLINGS, TABLES, case_nodes, kernel_source, \
    tables_layout

pytestmark = pytest.mark.gpu


def _run_kernel(n_cases: int) -> torch.Tensor:
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda, device_arch

    res = compile_cuda(kernel_source(), arch=device_arch())
    kl = load_kernel(res.cubin, "op_cases", ARGS, tables_layout())
    tabs = {k: v.cuda().contiguous() for k, v in tables().items()}
    values = {}
    for t in TABLES:
        values[t] = tabs[t].data_ptr()
        values[f"{t}_stride"] = [1]
    out = torch.full((len(SPELLINGS) * n_cases, NQ, NK), -1, dtype=torch.int32, device="cuda")
    kl.launch((-(-NQ * NK // 256), len(SPELLINGS) * n_cases, 1), (256, 1, 1), 0,
              kl.ap.flatten({"out": out.data_ptr(), "q_len": NQ, "kv_len": NK}),
              kl.vp.flatten(values), stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out


def _moderate(t: torch.Tensor) -> torch.Tensor:
    a = t.abs()
    return torch.isfinite(t) & ((a == 0) | ((a >= 1e-30) & (a <= 1e4)))


def _check(spelling: str, want: torch.Tensor, raw: torch.Tensor, ok_inputs: torch.Tensor) -> str:
    """'' when the kernel's raw 32-bit results match torch's values, else a description."""
    want = want.expand(NQ, NK)
    if want.dtype == torch.bool or not want.is_floating_point():
        bad = raw.long() != want.long()
    else:
        got = raw.view(torch.float32)
        if spelling == "fast":
            keep = ok_inputs & torch.isfinite(want)
            close = torch.isclose(got, want, rtol=4e-3, atol=1e-5)
            bad = keep & ~close
        else:
            same_special = (got.isnan() == want.isnan()) & \
                (torch.isinf(got) == torch.isinf(want))
            close = torch.isclose(got, want, rtol=2e-6, atol=1e-37, equal_nan=True)
            bad = ~(same_special & close)
    if not bool(bad.any()):
        return ""
    i, j = (int(t) for t in bad.nonzero()[0])
    shown = raw[i, j].view(torch.float32) if want.is_floating_point() else raw[i, j]
    return (f"{int(bad.sum())} differ, e.g. q_idx={i} kv_idx={j}: torch {want[i, j].item()!r} "
            f"attncc {shown.item()!r}")


def test_op_cases_match_torch_on_cuda() -> None:
    nodes = case_nodes()
    out = _run_kernel(len(nodes))
    tabs = {k: v.cuda() for k, v in tables().items()}
    # indices at the full [NQ, NK] shape: torch's CUDA isclose refuses to broadcast its
    # operands ([NQ, 1] with [1, NK]) where the CPU's does; the values are the same
    g = {k: (v.expand(NQ, NK).contiguous() if v.dim() == 2 else v).cuda()
         for k, v in grid().items()}
    ok_inputs = _moderate(tabs["x"])[:, None] & _moderate(tabs["y"])[None, :]
    bad = []
    for c, (name, src, _) in enumerate(nodes):
        want = torch.as_tensor(make_mod(src, tabs)(**g), device="cuda")
        for s, spelling in enumerate(SPELLINGS):
            msg = _check(spelling, want, out[s * len(nodes) + c], ok_inputs)
            if msg:
                bad.append(f"{spelling} {name}: {src}: {msg}")
    assert not bad, f"{len(bad)} of {len(SPELLINGS) * len(nodes)} differ:\n" + "\n".join(bad[:20])
