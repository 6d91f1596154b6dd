"""Small backward launches for compute-sanitizer (memcheck, racecheck): each checked against
torch's autograd through the fp64 reference, so a clean sanitizer log comes from launches that
also computed the right gradients. `--kernel fa2|fa3` forces the template
(kernel_options["BACKWARD_KERNEL"]); without it each head dim runs what a call picks (on sm_90
the FA3-class kernel at 64/128, the FA2-class one at 256).

    compute-sanitizer --tool memcheck --report-api-errors no python -m scripts.fa2_backward_sanitize_case
    compute-sanitizer --tool racecheck python -m scripts.fa2_backward_sanitize_case --kernel fa3 dense64

Arguments pick parts (default: all): dense64, dense128, dense256 (odd lengths: a partial last
query tile and KV tile; GQA 2; a causal block mask with partial and full blocks; a softcap
score_mod), plain128 (the same without the score_mod: the widest sub-tile form), bias (a
learnable relative-bias table, CapturedGrad's atomics, plus learnable ALiBi slopes, summed
per warp: TileGradTerms / TileGradFlush), sigmoid (normalize none), deterministic (one
launch per KV tile, and the learnable table again in exact sums:
kernels/common/exact_grad.cuh). Racecheck instruments every
shared-memory access: run one part under it. The kernel: kernels/fa2/fa2_backward.cuh;
docs/backward.md, "Kernels".
"""
from __future__ import annotations

import sys
from typing import Any

import torch

import attncc
from attncc.gym import causal
from attncc.runtime.reference import attention_reference


def _softcap(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return 20.0 * torch.tanh(s / 20.0)


def _case(name: str, variant: attncc.Variant, d: int, *, hq: int = 4, hkv: int = 2,
          sq: int = 197, skv: int = 263, block_mask: Any = None,
          extra: dict[str, torch.Tensor] | None = None, options: dict | None = None) -> None:
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(1, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    extra = extra or {}
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    options = {**(options or {}), **_KERNEL} or None
    out = attncc.flex_attention(q, k, v, score_mod=variant, block_mask=block_mask,
                                enable_gqa=hq != hkv, kernel_options=options)
    do = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * do).sum(), [*leaves, *extra.values()])
    ref64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ir, bind = variant.trace()
    ref, _ = attention_reference(*ref64, ir, bind, block_mask=block_mask, enable_gqa=hq != hkv)
    want = torch.autograd.grad((ref * do).sum(), [*ref64, *extra.values()])
    torch.cuda.synchronize()
    for n, a, b in zip(["dq", "dk", "dv", *extra], got, want):
        err = float((a.double() - b).norm() / b.norm())
        ok = err < 2e-2 and not torch.isnan(a).any()
        print(f"{name}: {n} rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            raise SystemExit(1)


_KERNEL: dict[str, str] = {}  # kernel_options["BACKWARD_KERNEL"] of every case (--kernel)


def main(parts: list[str]) -> None:
    S = 263
    bm = attncc.create_block_mask(causal, None, None, 197, S, device="cuda")
    for d in (64, 128, 256):
        if f"dense{d}" in parts:
            _case(f"dense{d}", attncc.Variant(score_mod=_softcap), d, block_mask=bm)
    if "plain128" in parts:  # no score_mod: the FA3-class kernel's 64-column form at 128
        _case("plain128", attncc.Variant(), 128, block_mask=bm)
    bias = torch.randn(4, 197 + S - 1, device="cuda").mul_(0.5).requires_grad_(True)
    slopes = torch.linspace(0.02, 0.2, 4, device="cuda").requires_grad_(True)

    def rel(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return s + bias[h, q - kv + S - 1] + slopes[h] * (kv - q)

    learned = {"bias": bias, "slopes": slopes}
    if "bias" in parts:
        _case("bias", attncc.Variant(score_mod=rel, mask_mod=causal), 64, extra=learned)
    if "sigmoid" in parts:
        _case("sigmoid", attncc.Variant(score_mod=lambda s, b, h, q, kv: torch.sigmoid(s - 2),
                                        normalize="none"), 128)
    if "deterministic" in parts:
        _case("deterministic", attncc.Variant(mask_mod=causal), 128,
              options={"DETERMINISTIC": True})
        _case("deterministic bias", attncc.Variant(score_mod=rel, mask_mod=causal), 64,
              extra=learned, options={"DETERMINISTIC": True})


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--kernel"]:
        _KERNEL["BACKWARD_KERNEL"] = args[1]
        args = args[2:]
        if _KERNEL["BACKWARD_KERNEL"] == "fa3":  # the FA3-class kernel runs head dims 64 and 128
            args = args or ["dense64", "dense128", "plain128", "bias", "sigmoid",
                            "deterministic"]
    main(args or ["dense64", "dense128", "plain128", "dense256", "bias", "sigmoid",
                  "deterministic"])
