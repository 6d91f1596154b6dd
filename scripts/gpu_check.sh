#!/usr/bin/env bash
# The one script to run on the H200 test machine: installs attncc, runs the GPU tests and the
# FA2 benchmark sample, and writes logs/results under $OUT (the device tool's output folder;
# a temp dir elsewhere).
#
#   scripts/gpu_check.sh                 # tests + benchmark
#   scripts/gpu_check.sh tests [ARGS]    # GPU tests only: pytest -m gpu tests, in SHARDS processes
#                                        # (TESTS="tests/gpu/a.py tests/gpu/b.py": only those files)
#   scripts/gpu_check.sh bench [ARGS]    # bench/prefill.py only (ARGS go to it)
#   scripts/gpu_check.sh decode [ARGS]   # bench/decode.py only (ARGS go to it)
#   scripts/gpu_check.sh shared_prefix   # bench/shared_prefix.py (cascade vs single format)
#   scripts/gpu_check.sh backward [ARGS] # bench/backward.py (forward+backward vs Flex and SDPA)
#   scripts/gpu_check.sh train [ARGS]    # examples/train_relbias.py (attncc vs Flex training)
# Set ATTNCC_COMMIT to the commit being measured (the device copy has no .git).
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
# a kernel loaded with spills or local memory its form is expected to run without is an error
# (runtime/jit/kernels.py check_resources), in the tests and the benchmarks alike
export ATTNCC_STRICT_RESOURCES=1

# lark, and transformers when carried, by name: their dependencies come from the image where it
# has them, else from .whl (DEVELOPERS.md: transformers' are not all on the image)
for pkg in lark transformers; do
    if ls .whl/"$pkg"-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --find-links .whl "$pkg" || exit 1
    fi
done
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    cat "$OUT/install.log"; exit 1; }

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    python3 -c "import torch, cuda.bindings as cb; print('torch', torch.__version__, 'cuda-bindings', cb.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.log"

status=0
if [[ "$MODE" == "all" || "$MODE" == "tests" ]]; then
    # the whole correctness product (~4,500 cases). Mostly NVRTC compile time, so SHARDS pytest
    # processes (default 4) share the GPU and the CPU cores; one log per shard, then a summary.
    SHARDS="${SHARDS:-4}"
    pids=()
    for ((i = 0; i < SHARDS; i++)); do
        ATTNCC_TEST_SHARD="$i/$SHARDS" ATTNCC_FULL_MATRIX=1 python3 -m pytest -m gpu ${TESTS:-tests} -q -rfEs \
            -p no:cacheprovider --tb=short --durations=5 "${@:2}" >"$OUT/pytest-shard$i.log" 2>&1 &
        pids+=($!)
    done
    for ((i = 0; i < SHARDS; i++)); do
        wait "${pids[$i]}" || status=1
        echo "shard $i/$SHARDS: $(tail -1 "$OUT/pytest-shard$i.log")" | tee -a "$OUT/pytest.log"
    done
    grep -h "^FAILED\|^ERROR" "$OUT"/pytest-shard*.log | tee -a "$OUT/pytest.log"
    # the NVRTC-only checks of the kernels (spills, ptxas notes, probes) with this machine's
    # NVRTC (no GPU needed; also run in CI)
    python3 -m pytest -m "nvrtc and not gpu" tests/kernels tests/codegen/test_discrete_kernel.py \
        tests/runtime/flex/test_kernel_spills.py tests/runtime/serving/test_kernel_spills.py \
        -q -p no:cacheprovider --tb=short \
        2>&1 | tail -3 | tee -a "$OUT/pytest.log"
fi

if [[ "$MODE" == "all" || "$MODE" == "bench" ]]; then
    # attncc vs FlexAttention vs SDPA flash/cuDNN; extra arguments go to bench/prefill.py
    # (e.g. `scripts/gpu_check.sh bench --S 2048 --variants causal`)
    ATTNCC_COMMIT="${ATTNCC_COMMIT:-unknown}" python3 -m bench.prefill --out "$OUT/prefill-h200.json" \
        "${@:2}" 2>&1 | tee "$OUT/bench.log"
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
fi
if [[ "$MODE" == "decode" ]]; then
    # BatchAttention decode vs FlexAttention vs SDPA; extra arguments go to bench/decode.py
    ATTNCC_COMMIT="${ATTNCC_COMMIT:-unknown}" python3 -m bench.decode --out "$OUT/decode-h200.json" \
        "${@:2}" 2>&1 | tee "$OUT/decode.log"
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
fi
if [[ "$MODE" == "shared_prefix" ]]; then
    ATTNCC_COMMIT="${ATTNCC_COMMIT:-unknown}" python3 -m bench.shared_prefix \
        --out "$OUT/shared-prefix-h200.json" "${@:2}" 2>&1 | tee "$OUT/shared-prefix.log"
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
fi
if [[ "$MODE" == "backward" ]]; then
    # forward+backward of attncc vs FlexAttention vs SDPA flash/cuDNN (bench/backward.py)
    ATTNCC_COMMIT="${ATTNCC_COMMIT:-unknown}" python3 -m bench.backward \
        --out "$OUT/backward-h200.json" "${@:2}" 2>&1 | tee "$OUT/backward.log"
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
fi
if [[ "$MODE" == "train" ]]; then
    # the learnable relative-bias training example, attncc vs FlexAttention, curves to $OUT
    python3 examples/train_relbias.py --out "$OUT/train-relbias-h200.json" "${@:2}" 2>&1 \
        | tee "$OUT/train.log"
    [[ ${PIPESTATUS[0]} -ne 0 ]] && status=1
fi
echo "gpu_check: exit $status (logs in $OUT)"
exit $status
