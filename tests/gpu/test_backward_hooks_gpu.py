"""The generated backward hooks (LogitsGrad, CapturedGrad) on the GPU, one thread per position,
against the fp64 derivatives the backward oracle evaluates (docs/backward.md, sections 2-3)."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc.gym import GYM
from attncc.ir.autodiff import score_mod_grad
from attncc.ir.evaluator import evaluate
from tests.helpers.backward_probe import KERNEL, probe
from tests.helpers.learnable import LEARNABLE

pytestmark = pytest.mark.gpu

B, H, SQ, SKV = 2, 4, 37, 53


def _variants():
    out = []
    for n, f in sorted(LEARNABLE.items()):
        mod, tensors = f(H, SQ, SKV)
        out.append((n, attncc.Variant(score_mod=mod, name=n), True))
    for n in ("softcap", "softcap_causal", "alibi", "relative_bias"):
        out.append((n, GYM[n](B, H, max(SQ, SKV), 64), False))
    return out


@pytest.mark.parametrize("fast_math", [True, False])
@pytest.mark.parametrize("name,variant,learnable", _variants(), ids=[v[0] for v in _variants()])
def test_backward_hooks_match_fp64_derivatives(name, variant, learnable, fast_math) -> None:
    from attncc.codegen.generate import variant_param_values
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda, device_arch

    ir, bind = variant.trace()
    grads = [t.name for t in ir.tensors] if learnable else []
    pr = probe(ir, grads, fast_math=fast_math)
    kl = load_kernel(compile_cuda(pr.source, arch=device_arch()).cubin, KERNEL, pr.args,
                     pr.variant.params_layout)
    g = torch.Generator().manual_seed(7)
    score = (torch.randn(B, H, SQ, SKV, generator=g) * 3).cuda()
    dlogit = torch.randn(B, H, SQ, SKV, generator=g).cuda()
    lg = torch.full_like(score, float("nan"))
    tensors = {n: t.detach().cuda().contiguous() for n, t in bind.tensors.items()}
    bufs = {n: torch.zeros(tensors[n].shape, dtype=torch.float32, device="cuda") for n in grads}
    values = {"score": score.data_ptr(), "dlogit": dlogit.data_ptr(), "lg": lg.data_ptr(),
              "B": B, "H": H, "Sq": SQ, "Skv": SKV}
    for f in pr.args.fields:
        if f.name.endswith("_grad"):
            t = next(n for n, base in pr.variant.grad_fields.items() if base == f.name)
            values[f.name] = bufs[t].data_ptr()
        elif f.name.endswith("_grad_stride"):
            t = next(n for n, base in pr.variant.grad_fields.items() if base + "_stride" == f.name)
            values[f.name] = list(bufs[t].stride())
    vp = variant_param_values(pr.variant.params_layout, dict(bind.scalars),
                              {n: (t.data_ptr(), list(t.stride()), list(t.shape))
                               for n, t in tensors.items()})
    n = B * H * SQ * SKV
    kl.launch((-(-n // 256), 1, 1), (256, 1, 1), 0, kl.ap.flatten(values), kl.vp.flatten(vp),
              stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()

    # fp64 on the CPU: the derived expressions, evaluated as the oracle does
    sg = score_mod_grad(ir, grads)
    env = {"score": score.cpu().double(), "b": torch.arange(B).view(B, 1, 1, 1),
           "h": torch.arange(H).view(1, H, 1, 1), "q_idx": torch.arange(SQ).view(1, 1, SQ, 1),
           "kv_idx": torch.arange(SKV).view(1, 1, 1, SKV)}
    cpu_tensors = {k: t.detach().cpu() for k, t in bind.tensors.items()}
    want = torch.broadcast_to(evaluate(sg.logits, env, cpu_tensors, dict(bind.scalars),
                                       torch.float64), score.shape)
    assert not lg.isnan().any()
    torch.testing.assert_close(lg.cpu().double(), want, rtol=2e-3, atol=2e-3)
    d = dlogit.cpu().double()
    for t in grads:
        acc = torch.zeros(cpu_tensors[t].shape, dtype=torch.float64)
        for r in (r for r in sg.reads if r.tensor == t):
            val = torch.broadcast_to(evaluate(r.grad, env, cpu_tensors, dict(bind.scalars),
                                              torch.float64), score.shape) * d
            idx = tuple(torch.broadcast_to(evaluate(i, env, cpu_tensors, dict(bind.scalars)),
                                           score.shape).long() for i in r.indices)
            acc.index_put_(idx, val, accumulate=True)
        scale = acc.abs().max().clamp(min=1.0)
        err = (bufs[t].cpu().double() - acc).abs().max() / scale
        assert err < 1e-4, f"{name} d{t}: relative error {float(err):.3g}"
