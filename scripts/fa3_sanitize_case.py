"""One small FA3 launch for compute-sanitizer (memcheck, racecheck): checked against the fp64
reference, so a clean sanitizer log comes from a launch that also computed the right thing.

    compute-sanitizer --tool memcheck python scripts/fa3_sanitize_case.py
    compute-sanitizer --tool racecheck python scripts/fa3_sanitize_case.py

The case has odd lengths (a partial last query block and a partial last KV tile), GQA 2, a
causal block mask (partial and full blocks) and a softcap score_mod, at head dims 64 and 128.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attncc  # noqa: E402
from attncc.runtime import gpu_flex  # noqa: E402
from attncc.runtime.reference import attention_reference  # noqa: E402
from examples.gym import GYM, causal  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    for d in (64, 128):
        S, Hq, Hkv = 300, 4, 2
        q = torch.randn(1, Hq, S, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, Hkv, S, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        bm = attncc.create_block_mask(causal, None, None, S, S, device="cuda")
        ir, bind = attncc.Variant(score_mod=GYM["softcap"](1, Hq, S, d).score_mod).trace()
        out = torch.full_like(q, float("nan"))
        gpu_flex.gpu_flex_attention(q, k, v, ir, bind, block_mask=bm, enable_gqa=True,
                                    kernel_options={"KERNEL": "fa3"}, out=out)
        torch.cuda.synchronize()
        ref, _ = attention_reference(q, k, v, ir, bind, block_mask=bm, enable_gqa=True)
        err = float((out.double() - ref).norm() / ref.norm())
        assert not torch.isnan(out).any() and err < 2e-2, (d, err)
        print(f"d={d}: FA3 rel err {err:.1e}")


if __name__ == "__main__":
    main()
