"""attncc in one minute: write a variant in Python, run it, check it, compile it.

Run: `python examples/quickstart.py` (CPU is enough; the compile step needs only NVRTC, which the
cuda-bindings wheel provides, not a GPU).
"""
from __future__ import annotations

import time
import warnings

import torch

import attncc


# 1. An attention variant is plain Python: FlexAttention's score_mod and mask_mod.
#    Captured values (CAP) become kernel arguments: changing CAP never recompiles.
CAP = 30.0


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)     # Gemma-2 style logit soft-capping


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


variant = attncc.Variant(score_mod=softcap, mask_mod=causal, name="softcap_causal")


def main() -> None:
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 256, 64
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))

    # 2. Run it. On CPU tensors attncc computes the exact result (float64 inside).
    t0 = time.perf_counter()
    out, lse = attncc.flex_attention(q, k, v, score_mod=variant, return_lse=True)
    print(f"attncc.flex_attention: out {tuple(out.shape)} {out.dtype}, "
          f"lse {tuple(lse.shape)}  ({time.perf_counter() - t0:.2f} s)")

    # 3. Check it against torch's own FlexAttention (eager mode on CPU; it warns about that).
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block_mask = create_block_mask(causal, None, None, S, S, device="cpu")
        ref, ref_lse = flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask,
                                      return_lse=True)
    err = ((out - ref).norm() / ref.norm()).item()
    lse_err = ((lse - ref_lse).norm() / ref_lse.norm()).item()
    print(f"vs torch FlexAttention: relative error out {err:.2e}, lse {lse_err:.2e}")

    # 4. What attncc traced: one typed IR expression per hook.
    ir, _ = variant.trace()
    print("\ntraced IR:\n" + "\n".join("  " + line for line in ir.format().splitlines()))

    # 5. Compile it to CUDA with NVRTC (no GPU needed to compile).
    try:
        from attncc.runtime.jit.nvrtc import available
    except ImportError as e:
        print(f"\ncompile step skipped: {e}")
        return
    if not available():
        print("\ncompile step skipped: NVRTC could not be loaded (pip install cuda-bindings)")
        return
    t0 = time.perf_counter()
    try:
        kernel = attncc.compile(variant, head_dim=D, dtype="bfloat16", arch="sm_90a")
    except (ImportError, AttributeError) as e:
        print(f"\ncompile step skipped: attncc.compile is not available ({e})")
        return
    print(f"\nattncc.compile: {kernel.kernel_name} for {kernel.arch}, {len(kernel.cubin)} byte "
          f"cubin ({time.perf_counter() - t0:.2f} s, cache hit: {kernel.cache_hit})")
    print("generated CUDA (captured values and the hooks you wrote):")
    for line in variant_cuda(kernel.source):
        print("  " + line)


def variant_cuda(source: str, max_lines: int = 40) -> list[str]:
    """The variant's part of the generated source, without the identity hooks it compiles out."""
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("struct VariantParams_")),
                 None)
    if start is None:  # unexpected layout: show the beginning of the file
        return lines[:max_lines]
    shown: list[str] = []
    skipping = False
    for line in lines[start:]:
        if "identity (not given" in line:
            skipping = True  # an identity hook's block runs until the next blank line
        elif skipping and not line.strip():
            skipping = False
            continue
        elif skipping and line == "};":  # the struct's end closes the last skipped block
            skipping = False
        if not skipping:
            shown.append(line)
        if line == "};" and any(x.startswith("struct Variant_") for x in shown):
            break
    return shown[:max_lines]

if __name__ == "__main__":
    main()
