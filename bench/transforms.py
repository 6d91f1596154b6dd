"""Transform-variant benchmark: RoPE inside attention (query_mod + key_mod, causal) on FA3 and FA2,
against what a FlexAttention or SDPA user does instead -- rotate q and k with PyTorch ops, then
call the attention -- all in one process on the same inputs (bf16, H=16, D=128, B*S=16384).

attncc runs the hooks three ways: both in the pre-pass (the default here: once per row,
runtime/flex/prepass.py), only key_mod there (`*_kv_prepass`, kernel_options PREPASS="kv"), and both
inside the attention kernel (`*_in_kernel`, PREPASS="none"); `attncc_fa3_causal` (no RoPE at
all) is the ceiling.

TFLOP/s count 4*D FLOPs per unmasked (query, key) pair (causal: half of S^2), as
bench/prefill.py does; the rotate-then-attend cells include the rotation's time, because that is
the work the in-kernel transform replaces. Every cell is checked against the FA2 output.

    python -m bench.transforms --out bench/results/transforms-h200.json
    python -m bench.transforms --report bench/results/transforms-h200.json   # table + PNG

Example:
    >>> rotate_half_tables(8, 4)[0].shape
    torch.Size([4, 8])
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable


from bench.prefill import (HEAD_DIM, HEADS, TOKENS, _compiled_flex, _prefill_meta,  # noqa: E402
                           _rel_err)

IMPLS = ("attncc_fa3", "attncc_fa3_kv_prepass", "attncc_fa3_in_kernel", "attncc_fa2",
         "attncc_fa2_in_kernel", "flex_rotated", "sdpa_cudnn_rotated", "attncc_fa3_causal")
_OPTIONS = {"attncc_fa3": {"KERNEL": "fa3"},
            "attncc_fa3_kv_prepass": {"KERNEL": "fa3", "PREPASS": "kv"},
            "attncc_fa3_in_kernel": {"KERNEL": "fa3", "PREPASS": "none"},
            "attncc_fa2": {"KERNEL": "fa2"},
            "attncc_fa2_in_kernel": {"KERNEL": "fa2", "PREPASS": "none"}}
SEQ_LENS = (2048, 8192)


def rotate_half_tables(D: int, S: int, base: float = 10000.0) -> tuple[Any, Any]:
    """cos and sin [S, D] of attncc.gym.rope's half-rotated layout (pair i, i + D/2)."""
    import torch

    i = torch.arange(D) % (D // 2)
    theta = torch.arange(S)[:, None].double() * torch.exp(-math.log(base) * (2 * i) / D)
    return theta.cos().float(), theta.sin().float()


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    """x * cos + rotate_half(x) * sin in fp32, back to x's dtype (what attncc's hook computes)."""
    import torch

    half = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


def cells(S: int) -> dict[str, Callable[[], Any]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import attncc
    from attncc.gym import causal, rope

    B = TOKENS // S
    g = torch.Generator(device="cuda").manual_seed(S)
    q, k, v = (torch.randn(B, HEADS, S, HEAD_DIM, generator=g, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    variant = attncc.Variant(query_mod=rope(HEAD_DIM).query_mod, key_mod=rope(HEAD_DIM).key_mod,
                             name="rope")
    bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
    tbm = create_block_mask(causal, None, None, S, S, device="cuda")
    cos, sin = (t.cuda() for t in rotate_half_tables(HEAD_DIM, S))
    flex = _compiled_flex(flex_attention)

    def sdpa() -> Any:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v,
                                                  is_causal=True)

    def attncc_cell(opts: dict[str, Any]) -> Callable[[], Any]:
        return lambda: attncc.flex_attention(q, k, v, score_mod=variant, block_mask=bm,
                                             kernel_options=opts)
    return {
        **{impl: attncc_cell(opts) for impl, opts in _OPTIONS.items()},
        "attncc_fa3_causal": lambda: attncc.flex_attention(q, k, v, block_mask=bm,
                                                           kernel_options={"KERNEL": "fa3"}),
        "flex_rotated": lambda: flex(_rotate(q, cos, sin), _rotate(k, cos, sin), v,
                                     block_mask=tbm),
        "sdpa_cudnn_rotated": sdpa,
    }


def kernel_times(fn: Callable[[], Any], label: str, reps: int = 20) -> None:
    """Print the GPU time per call of each kernel `fn` launches (torch.profiler)."""
    import torch

    from bench.timing import profiled_kernels

    for ev in profiled_kernels(fn, reps):
        if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "device_time", 0):
            us = getattr(ev, "device_time_total", 0.0) / reps
            if us > 0:
                print(f"  {label}: {ev.key[:60]:60s} {us:8.1f} us/call")


def run(seq_lens: tuple[int, ...], profile: bool = False) -> list[dict[str, Any]]:
    import torch
    from triton.testing import do_bench

    results = []
    for S in seq_lens:
        fns = cells(S)
        ref = fns["attncc_fa2"]()
        for impl in IMPLS:
            try:
                out = fns[impl]()
                torch.cuda.synchronize()
                ms = do_bench(fns[impl], warmup=25, rep=100, return_mode="median")
            except Exception as e:  # reported, not fatal
                results.append({"S": S, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"S={S} {impl}: {results[-1]['error']}")
                continue
            flops = 4 * HEAD_DIM * (S * S / 2.0) * HEADS * (TOKENS // S)
            ceiling = impl == "attncc_fa3_causal"  # no RoPE: not comparable to the others
            rec = {"S": S, "variant": "causal" if ceiling else "rope_causal", "impl": impl,
                   "ms": ms, "tflops": flops / ms / 1e9,
                   "rel_err_vs_fa2": None if ceiling else _rel_err(out, ref)}
            results.append(rec)
            err = "" if ceiling else f" err {rec['rel_err_vs_fa2']:.1e}"
            print(f"S={S} {impl:20s} {ms:7.3f} ms {rec['tflops']:6.1f} TFLOP/s{err}")
        if profile:
            for impl in ("attncc_fa3", "attncc_fa3_kv_prepass"):
                kernel_times(fns[impl], f"S={S} {impl}")
    return results


def report(data: dict[str, Any]) -> str:
    """Markdown table: TFLOP/s per implementation and S, and attncc FA3's ratio to each."""
    rows = [r for r in data["results"] if "tflops" in r]
    seqs = sorted({r["S"] for r in rows})
    get = {(r["impl"], r["S"]): r["tflops"] for r in rows}
    m = data.get("meta", {})
    lines = [f"{m.get('gpu', '?')}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}, "
             f"attncc {str(m.get('attncc_commit', '?'))[:10]}, {str(m.get('date', '?'))[:10]}; "
             f"RoPE (query_mod + key_mod) + causal, bf16, H=16, D=128, B*S=16384; TFLOP/s "
             f"(causal counts half); ratios are attncc_fa3 / that row.", "",
             "| impl | " + " | ".join(f"S={s}" for s in seqs) + " |",
             "|---|" + "---|" * len(seqs)]
    for impl in IMPLS:
        cells_ = []
        for s in seqs:
            t, mine = get.get((impl, s)), get.get(("attncc_fa3", s))
            cells_.append("-" if t is None else f"{t:.0f}" + (
                f" (FA3 {mine / t:.2f}x)" if mine and impl != "attncc_fa3" else ""))
        lines.append(f"| {impl} | " + " | ".join(cells_) + " |")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    """TFLOP/s per implementation, one group of bars per S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if "tflops" in r]
    seqs = sorted({r["S"] for r in rows})
    get = {(r["impl"], r["S"]): r["tflops"] for r in rows}
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(IMPLS)
    for i, impl in enumerate(IMPLS):
        xs = [j + i * width for j in range(len(seqs))]
        ax.bar(xs, [get.get((impl, s), 0.0) for s in seqs], width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(seqs))], [f"S={s}" for s in seqs])
    ax.set_ylabel("TFLOP/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"RoPE + causal, {data['meta'].get('gpu', '?')}, bf16, H=16, D=128", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="+", default=list(SEQ_LENS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None, help="print the table of a JSON")
    ap.add_argument("--profile", action="store_true",
                    help="also print the kernel times of attncc_fa3 (pre-pass vs attention)")
    args = ap.parse_args()
    if args.report:
        data = json.loads(args.report.read_text())
        plot(data, args.report.with_suffix(".png"))
        print(report(data))
        return
    data = {"meta": _prefill_meta(), "results": run(tuple(args.S), args.profile)}
    print(report(data))
    if args.out:
        args.out.write_text(json.dumps(data, indent=1))
        args.out.with_suffix(".md").write_text(report(data) + "\n")
        plot(data, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
