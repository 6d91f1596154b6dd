#!/usr/bin/env bash
# The one script to run on the H200 test machine: installs attncc, runs the GPU tests and the
# FA2 benchmark sample, and writes logs/results under $OUT (the device tool's output folder;
# a temp dir elsewhere).
#
#   scripts/gpu_check.sh            # tests + benchmark
#   scripts/gpu_check.sh tests      # GPU tests only:  pytest -m gpu tests/gpu
#   scripts/gpu_check.sh bench      # benchmark only
#
# lark is not installed on the H200 image: carry it as a wheel in .whl/ (see DEVELOPERS.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl lark
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# a fresh kernel cache per run, inside the machine (cubins of another NVRTC are never reused)
export ATTNCC_CACHE_DIR="${ATTNCC_CACHE_DIR:-/tmp/attncc-cache}"

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    cat "$OUT/install.log"; exit 1; }

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    python3 -c "import torch, cuda.bindings as cb; print('torch', torch.__version__, 'cuda-bindings', cb.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.log"

status=0
if [[ "$MODE" == "all" || "$MODE" == "tests" ]]; then
    python3 -m pytest -m gpu tests/gpu -q -rs -rP -p no:cacheprovider --tb=short --durations=10 \
        2>&1 | tee "$OUT/pytest.log"
    status=${PIPESTATUS[0]}
    # the NVRTC checks of tests/gpu (no GPU needed; also run in CI)
    python3 -m pytest -m "nvrtc and not gpu" tests/gpu -q -p no:cacheprovider --tb=short \
        2>&1 | tail -3 | tee -a "$OUT/pytest.log"
fi

if [[ "$MODE" == "all" || "$MODE" == "bench" ]]; then
    python3 - 2>&1 <<'EOF' | tee "$OUT/bench.log"
# FA2 sample: bf16, H=16, D=128, B*S=16384, S=4096 (full and causal) vs SDPA's flash backend,
# plus a tile sweep for D=128 and a FlexAttention softcap+causal comparison.
import json, math, os, time
import torch
import attncc
from attncc.runtime import gpu_flex
from examples.gym import causal, softcap
from triton.testing import do_bench

dev = "cuda"
B, H, S, D = 4, 16, 4096, 128
g = torch.Generator(device=dev).manual_seed(0)
q, k, v = (torch.randn(B, H, S, D, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
bm_causal = attncc.create_block_mask(causal, None, None, S, S, device=dev)
plain_ir, plain_b = attncc.Variant(name="full").trace()
sc_ir, sc_b = attncc.Variant(score_mod=softcap(30.0), name="softcap").trace()
flops_full = 4 * B * H * S * S * D

def tflops(ms, causal_):
    return flops_full * (0.5 if causal_ else 1.0) / (ms * 1e-3) / 1e12

def bench(fn):
    fn(); torch.cuda.synchronize()
    return do_bench(fn, warmup=50, rep=300, return_mode="median")

rows = []
def record(impl, variant, ms, causal_, extra=""):
    t = tflops(ms, causal_)
    rows.append({"impl": impl, "variant": variant, "S": S, "ms": ms, "tflops": t, "note": extra})
    print(f"{impl:28s} {variant:16s} {ms:8.3f} ms {t:7.1f} TFLOP/s {extra}", flush=True)

from torch.nn.attention import sdpa_kernel, SDPBackend
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    record("sdpa_flash", "full", bench(f), False)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    record("sdpa_flash", "causal", bench(f), True)

SWEEP = (None, {"BLOCK_M": 128, "BLOCK_N": 64})
CASES = (("full", None, False), ("causal", bm_causal, True))
t0 = time.time()
plans = [gpu_flex.plan_launch(q, k, v, plain_ir, plain_b, block_mask=bm, kernel_options=o)
         for o in SWEEP for _, bm, _ in CASES]
plans.append(gpu_flex.plan_launch(q, k, v, sc_ir, sc_b, block_mask=bm_causal))
print(f"precompiled {gpu_flex.precompile(plans)} kernels in {time.time() - t0:.1f} s", flush=True)
for opts in SWEEP:
    for name, bm, causal_ in CASES:
        info = gpu_flex.compiled_kernel_info(q, k, v, plain_ir, plain_b, block_mask=bm,
                                             kernel_options=opts)
        f = lambda: gpu_flex.gpu_flex_attention(q, k, v, plain_ir, plain_b, block_mask=bm,
                                                kernel_options=opts)
        tag = f"tq={info['tq']} tkv={info['tkv']} st={info['stages']} regs={info['registers']} spill={info['spill_bytes']} smem={info['smem_bytes']}"
        record("attncc" + ("" if opts is None else "*"), name, bench(f), causal_, tag)
# other head dims (B*S = 16384, H = 16): default tiles and one alternative
for D2, alt in ((64, {"BLOCK_M": 64, "BLOCK_N": 128}), (256, {"BLOCK_M": 32, "BLOCK_N": 32})):
    q2, k2, v2 = (torch.randn(B, H, S, D2, generator=g, device=dev, dtype=torch.bfloat16)
                  for _ in range(3))
    scale2 = 4 * B * H * S * S * D2 / (4 * B * H * S * S * D)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
        ms = bench(f); print(f"sdpa_flash D={D2} causal {ms:.3f} ms {tflops(ms, True) * scale2:.1f} TFLOP/s")
    for opts in (None, alt):
        info = gpu_flex.compiled_kernel_info(q2, k2, v2, plain_ir, plain_b, block_mask=bm_causal,
                                             kernel_options=opts)
        f = lambda: gpu_flex.gpu_flex_attention(q2, k2, v2, plain_ir, plain_b,
                                                block_mask=bm_causal, kernel_options=opts)
        ms = bench(f)
        print(f"attncc D={D2} causal {ms:.3f} ms {tflops(ms, True) * scale2:.1f} TFLOP/s "
              f"tq={info['tq']} tkv={info['tkv']} regs={info['registers']} spill={info['spill_bytes']}")
# correctness of the benchmarked configuration against SDPA
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float()
got = gpu_flex.gpu_flex_attention(q, k, v, plain_ir, plain_b, block_mask=bm_causal)[0].float()
print("causal rel err vs sdpa:", float((got - ref).norm() / ref.norm()))

f = lambda: gpu_flex.gpu_flex_attention(q, k, v, sc_ir, sc_b, block_mask=bm_causal)
record("attncc", "softcap_causal", bench(f), True)
try:
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    tbm = create_block_mask(causal, None, None, S, S, device=dev)
    cflex = torch.compile(flex_attention)
    sc = softcap(30.0)
    f = lambda: cflex(q, k, v, score_mod=sc, block_mask=tbm)
    record("flex", "softcap_causal", bench(f), True)
    f = lambda: cflex(q, k, v, block_mask=tbm)
    record("flex", "causal", bench(f), True)
    from examples.gym import alibi, sliding_window
    al = alibi(H)
    al_ir, al_b = attncc.Variant(score_mod=al).trace()
    f = lambda: gpu_flex.gpu_flex_attention(q, k, v, al_ir, al_b, block_mask=bm_causal)
    record("attncc", "alibi_causal", bench(f), True)
    al_dev = lambda s, b, h, qi, ki: s + al_slopes[h] * (ki - qi)
    al_slopes = al.__closure__[0].cell_contents.to(dev) if al.__closure__ else None
    f = lambda: cflex(q, k, v, score_mod=al_dev, block_mask=tbm)
    record("flex", "alibi_causal", bench(f), True)
    sw = sliding_window(1024)
    bm_sw = attncc.create_block_mask(sw, None, None, S, S, device=dev)
    tbm_sw = create_block_mask(sw, None, None, S, S, device=dev)
    pairs = sum(min(i, 1024) + 1 for i in range(S)) / (S * S)
    f = lambda: gpu_flex.gpu_flex_attention(q, k, v, plain_ir, plain_b, block_mask=bm_sw)
    ms = bench(f); print(f"attncc sliding1024 {ms:.3f} ms {flops_full * pairs / (ms * 1e-3) / 1e12:.1f} TFLOP/s")
    f = lambda: cflex(q, k, v, block_mask=tbm_sw)
    ms = bench(f); print(f"flex   sliding1024 {ms:.3f} ms {flops_full * pairs / (ms * 1e-3) / 1e12:.1f} TFLOP/s")
except Exception as e:  # FlexAttention is a comparison only
    print("flex comparison failed:", type(e).__name__, e)

qs, ks, vs = (torch.randn(1, 8, 128, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
gpu_flex.gpu_flex_attention(qs, ks, vs, plain_ir, plain_b); torch.cuda.synchronize()
ts = []
for _ in range(300):
    t1 = time.perf_counter(); gpu_flex.gpu_flex_attention(qs, ks, vs, plain_ir, plain_b)
    ts.append((time.perf_counter() - t1) * 1e6)
torch.cuda.synchronize(); ts.sort()
print(f"host cost of a cached gpu_flex_attention call (no mask): median {ts[len(ts) // 2]:.1f} us")
out = os.environ.get("OUT", ".")
with open(os.path.join(out, "fa2_bench.json"), "w") as fh:
    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh,
              indent=1)
EOF
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
fi
echo "gpu_check: exit $status (logs in $OUT)"
exit $status
