"""The FA3 kernel's resource report: registers, spills, shared memory, and what its SASS holds.

Compiles the FA3 translation unit for each AttentionGym variant x head dim at the default tiles
(flex/tile_choice.py) as attncc does (the kernel cache, runtime/jit/kernels.py: again in the
low-pressure form if the first compile spills; both spill figures are reported), reads ptxas's `-v` report from NVRTC,
and -- where `cuobjdump` is on PATH (the H200 image has it under /usr/local/cuda/bin) -- counts
HGMMA (wgmma), USETMAXREG (setmaxnreg) and UTMALDG (TMA load) instructions in the SASS. Writes a
markdown table (and JSON with --out).

    python -m scripts.fa3_resources --out $OUT/fa3-resources.json
    python -m scripts.fa3_resources --all      # every AttentionGym variant
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any


VARIANTS = ("noop", "causal", "softcap_causal", "alibi_causal", "sliding_window")


def _cuobjdump() -> str | None:
    return shutil.which("cuobjdump") or next(
        (p for p in ("/usr/local/cuda/bin/cuobjdump",) if os.path.exists(p)), None)


def report(variant: str, head_dim: int) -> dict[str, Any]:
    from attncc.ir.simplify import simplify_variant
    from attncc.runtime.flex.gpu_flex import kernel_spec
    from attncc.runtime.flex.tile_choice import choose_tiles
    from attncc.gym import GYM
    from attncc.runtime.jit.kernels import compile_spec
    from attncc.runtime.jit.policy import wgmma_notes

    plan = choose_tiles(head_dim, q_len=4096, kv_len=4096, group=1, heads=16, batch=1,
                        kernel_options={"KERNEL": "fa3"})
    ir = simplify_variant(GYM[variant](1, 16, 4096, head_dim).trace()[0])
    # what attncc runs (the kernel cache): the kernel as it is, or its low-pressure form if
    # that one spilled; trail[0] is the first compile
    trail: list[Any] = []
    form = compile_spec(kernel_spec(ir, head_dim, "bfloat16", plan), "sm_90a", trail)
    res = form.result
    rec: dict[str, Any] = {
        "variant": variant, "head_dim": head_dim, "tkv": plan.tkv, "stages": plan.stages,
        "first_spill_bytes": trail[0].spill_bytes, "low_pressure": form.spec.low_pressure,
        "registers": int(re.findall(r"Used (\d+) registers", res.log)[0]),
        "spill_bytes": form.spill_bytes, "retries": sum(f.retries for f in trail),
        "smem_bytes": form.gen.smem_bytes,
        # warnings, and ptxas's notes that it waited for or serialized wgmmas
        "ptxas_warnings": [ln for ln in res.log.splitlines() if "warning" in ln.lower()]
                          + wgmma_notes(res.log)}
    tool = _cuobjdump()
    if tool:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(res.cubin)
            f.flush()
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                                  check=True).stdout
        for op in ("HGMMA", "USETMAXREG", "UTMALDG", "SYNCS", "BAR"):
            rec[op] = len(re.findall(rf"\b{op}\b", sass))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--all", action="store_true",
                    help="every AttentionGym variant, not only the benchmarked five")
    args = ap.parse_args()
    if args.all:
        from attncc.gym import GYM
    variants = tuple(GYM) if args.all else VARIANTS
    recs = [report(v, d) for v in variants for d in (64, 128, 256)]
    cols = ["variant", "head_dim", "tkv", "stages", "first_spill_bytes", "low_pressure",
            "registers", "spill_bytes", "smem_bytes", "HGMMA", "USETMAXREG", "UTMALDG"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in recs:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    if any(r["ptxas_warnings"] for r in recs):
        print("ptxas warnings:", {f"{r['variant']}-d{r['head_dim']}": r["ptxas_warnings"]
                                  for r in recs if r["ptxas_warnings"]})
    if args.out:
        Path(args.out).write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
