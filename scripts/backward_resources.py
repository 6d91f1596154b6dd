"""The backward kernels' resource report: for every AttentionGym variant (transforms stripped:
the backward runs on the transformed q/k/v) at head dims 64/128/256, plus the variants whose
captured float tensor is made learnable (relative_bias's table, alibi's slopes), the form the
kernel cache picks for each backward template asked for (`--kernels`; runtime/jit/kernels.py:
FA2-class, the first of `codegen.tiles.backward_fallbacks` with neither spills nor a stack frame;
FA3-class, its forms with 64-, 32- and 16-column query sub-tiles, or the FA2-class ones, the
first that neither spills nor keeps a stack frame: docs/backward.md), its registers, spill
bytes, stack frame and shared memory, from ptxas's `-v` report through NVRTC. The FA3-class
kernel's register count is the launch's (168 a thread for 384 threads); its consumers run with
the number in parentheses (setmaxnreg, `FA3_BWD_CONSUMER_REGS`), which ptxas's spill report
covers. Writes a markdown table (and JSON with --out).

    python -m scripts.backward_resources --out bench/results/backward-resources-nvrtc12.json
    python -m scripts.backward_resources --kernels fa3 --head-dims 64 128
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from attncc.codegen.constants import FA3_BWD_CONSUMER_REGS

LEARNABLE = ("relative_bias", "alibi", "alibi_causal")  # their captured float tensor gets .grad


def report(variant: str, head_dim: int, learnable: bool, arch: str,
           kernel: str = "fa2") -> dict[str, Any]:
    from attncc.gym import GYM
    from attncc.ir.simplified import simplify_variant
    from attncc.runtime.flex.autograd import attention_ir
    from attncc.runtime.flex.backward import backward_spec
    from attncc.runtime.jit.kernels import compile_spec
    from attncc.runtime.jit.policy import stack_frame, wgmma_notes

    ir, _ = GYM[variant](1, 16, 1024, head_dim).trace()
    ir = simplify_variant(attention_ir(ir))
    grads = tuple(t.name for t in ir.tensors if learnable and t.dtype.name == "F32")
    spec = backward_spec(kernel, ir, head_dim, "bfloat16", None, fast_math=True, device=None,
                         grad_tensors=grads)
    form = compile_spec(spec, arch)
    log = form.result.log
    regs = re.search(r"Used (\d+) registers", log)
    t = form.spec.tiles
    return {"variant": variant, "head_dim": head_dim, "grad_tensors": list(grads),
            "asked": kernel, "kind": form.spec.kind,
            "kernel": form.gen.kernel_name, "form": [t.tq, t.tkv, t.dsplit],
            "registers": int(regs.group(1)) if regs else None,
            "consumer_registers": (FA3_BWD_CONSUMER_REGS if form.spec.kind == "fa3_backward"
                                   else None),
            "spill_bytes": form.spill_bytes,
            "stack_frame": stack_frame(log), "wgmma_serialized": bool(wgmma_notes(log)),
            "smem_bytes": form.gen.smem_bytes, "threads": form.gen.threads,
            "low_pressure": form.spec.low_pressure,
            "first_form": (form.spec.kind == spec.kind and form.spec.tiles == spec.tiles
                           and not form.spec.low_pressure)}


def _regs(r: dict[str, Any]) -> str:
    """ptxas's registers, and the consumers' under setmaxnreg in parentheses."""
    cons = r.get("consumer_registers")
    return f"{r['registers']}" + (f" ({cons})" if cons else "")


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Backward kernels, {meta['arch']}, NVRTC {meta['nvrtc']}, bf16 "
             f"(scripts/backward_resources.py)", "",
             "| asked | variant | D | grads | kernel, form (q, kv, split) | regs (consumers) "
             "| spill B "
             "| stack B | smem B | threads |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kind = r.get("kind", "fa2_backward").split("_")[0]
        lp = int(r.get("low_pressure") or 0)
        form = (f" ({64 >> lp}-column sub-tiles)" if kind == "fa3" else
                " (low-pressure)" if lp else "")
        lines.append(f"| {r.get('asked', 'fa2')} | {r['variant']} | {r['head_dim']} | "
                     f"{', '.join(r['grad_tensors']) or '-'} | {kind} {tuple(r['form'])}{form}"
                     f"{'' if r['first_form'] or r.get('low_pressure') else ' (fallback)'}"
                     f"{' (wgmma serialized)' if r.get('wgmma_serialized') else ''} | "
                     f"{_regs(r)} | {r['spill_bytes']} | {r['stack_frame']} | "
                     f"{r['smem_bytes']} | {r['threads']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from attncc.gym import GYM
    from attncc.runtime.jit.nvrtc import nvrtc_version

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--kernels", nargs="+", default=["fa2", "fa3"], choices=["fa2", "fa3"],
                    help="backward templates to report (fa3: head dims 64 and 128 only)")
    a = ap.parse_args()
    cases = [(v, d, False) for v in sorted(GYM) for d in a.head_dims]
    cases += [(v, d, True) for v in LEARNABLE for d in a.head_dims]
    rows = []
    for kernel in a.kernels:
        for v, d, learn in cases:
            if kernel == "fa3" and d not in (64, 128):
                continue
            rows.append(report(v, d, learn, a.arch, kernel))
            print(json.dumps(rows[-1]), flush=True)
    meta = {"arch": a.arch, "nvrtc": ".".join(map(str, nvrtc_version()))}
    text = table(rows, meta)
    print(text)
    if a.out:
        a.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
