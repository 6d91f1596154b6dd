"""Debug helper (not a test): run the P.V wgmma probe once per (LBO, SBO) in a child process, so a
faulting encoding does not poison the others.
Usage: python -m scripts.experiments.probe_wgmma_rs [lbo sbo]."""
import subprocess
import sys

import torch

if len(sys.argv) == 3:
    from attncc.runtime.jit.launcher import load_kernel
    from attncc.runtime.jit.nvrtc import compile_cuda
    from tests.helpers.wgmma_probe import ARGS, UNUSED, probe_source, run_probe
    kl = load_kernel(compile_cuda(probe_source(), arch="sm_90a").cubin, "wg_rs_v", ARGS, UNUSED)
    g = torch.Generator(device="cuda").manual_seed(5)
    p = torch.randn(64, 64, generator=g, device="cuda").bfloat16()
    v = torch.randn(64, 64, generator=g, device="cuda").bfloat16()
    got = run_probe(kl, p, v, 64, int(sys.argv[1]), int(sys.argv[2]))
    ref = p.float() @ v.float()
    print("err", float((got - ref).norm() / ref.norm()), "rows-ok",
          [(i, bool(((got[i] - ref[i]).norm() / ref[i].norm()) < 1e-2)) for i in (0, 8, 16, 63)],
          "cols", [(j, float((got[:, j] - ref[:, j]).norm() / ref[:, j].norm())) for j in (0, 8, 63)])
else:
    for lbo in (16, 128, 1024, 8192):
        for sbo in (16, 128, 1024, 2048):
            r = subprocess.run([sys.executable, "-m", "scripts.experiments.probe_wgmma_rs",
                                str(lbo), str(sbo)], capture_output=True, text=True)
            tail = (r.stdout.strip().splitlines() or ["?"])[-1]
            err = [l for l in r.stderr.splitlines() if "Error" in l][-1:]
            print(lbo, sbo, "rc", r.returncode, tail[:200], err, flush=True)
