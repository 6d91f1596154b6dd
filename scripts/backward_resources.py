"""The FA2-class backward kernel's resource report: for every AttentionGym variant (transforms
stripped: the backward runs on the transformed q/k/v) at head dims 64/128/256, plus the
variants whose captured float tensor is made learnable (relative_bias's table, alibi's slopes),
the form the kernel cache picks (runtime/jit/kernels.py: the first of
`codegen.tiles.backward_fallbacks` with neither spills nor a stack frame), its registers,
spill bytes, stack frame and shared memory, from ptxas's `-v` report through NVRTC. Writes a
markdown table (and JSON with --out).

    python -m scripts.backward_resources --out bench/results/backward-resources-nvrtc12.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

LEARNABLE = ("relative_bias", "alibi", "alibi_causal")  # their captured float tensor gets .grad


def report(variant: str, head_dim: int, learnable: bool, arch: str) -> dict[str, Any]:
    from attncc.codegen.tiles import backward_fallbacks
    from attncc.gym import GYM
    from attncc.ir.simplified import simplify_variant
    from attncc.runtime.flex.autograd import attention_ir
    from attncc.runtime.jit.kernels import KernelSpec, compile_spec
    from attncc.runtime.jit.policy import stack_frame

    ir, _ = GYM[variant](1, 16, 1024, head_dim).trace()
    ir = simplify_variant(attention_ir(ir))
    grads = tuple(t.name for t in ir.tensors if learnable and t.dtype.name == "F32")
    forms = backward_fallbacks(head_dim)
    form = compile_spec(KernelSpec("fa2_backward", ir=ir, head_dim=head_dim, dtype="bfloat16",
                                   tiles=forms[0], fallbacks=forms[1:], grad_tensors=grads),
                        arch)
    log = form.result.log
    regs = re.search(r"Used (\d+) registers", log)
    t = form.spec.tiles
    return {"variant": variant, "head_dim": head_dim, "grad_tensors": list(grads),
            "kernel": form.gen.kernel_name, "form": [t.tq, t.tkv, t.dsplit],
            "registers": int(regs.group(1)) if regs else None, "spill_bytes": form.spill_bytes,
            "stack_frame": stack_frame(log), "smem_bytes": form.gen.smem_bytes,
            "threads": form.gen.threads, "first_form": form.spec.tiles == forms[0]}


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"FA2-class backward kernels, {meta['arch']}, NVRTC {meta['nvrtc']}, bf16 "
             f"(scripts/backward_resources.py)", "",
             "| variant | D | grads | form (q, kv, split) | regs | spill B | stack B | smem B "
             "| threads |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['head_dim']} | {', '.join(r['grad_tensors']) or '-'}"
                     f" | {tuple(r['form'])}{'' if r['first_form'] else ' (fallback)'} | "
                     f"{r['registers']} | {r['spill_bytes']} | {r['stack_frame']} | "
                     f"{r['smem_bytes']} | {r['threads']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from attncc.gym import GYM
    from attncc.runtime.jit.nvrtc import nvrtc_version

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    a = ap.parse_args()
    cases = [(v, d, False) for v in sorted(GYM) for d in a.head_dims]
    cases += [(v, d, True) for v in LEARNABLE for d in a.head_dims]
    rows = []
    for v, d, learn in cases:
        rows.append(report(v, d, learn, a.arch))
        print(json.dumps(rows[-1]), flush=True)
    meta = {"arch": a.arch, "nvrtc": ".".join(map(str, nvrtc_version()))}
    text = table(rows, meta)
    print(text)
    if a.out:
        a.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
