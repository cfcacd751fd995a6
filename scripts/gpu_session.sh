#!/usr/bin/env bash
# One device run (the `run` tool gives a bare machine each start): install, every CUDA test,
# then the whole-model benchmark, logs under $OUT. Extra arguments go to scripts/bench.py, e.g.
#   bash scripts/gpu_session.sh --variants v41graph,eager,v41graph-noP6 --batches 1,64
# Set SKIP_TESTS=1 to go straight to the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
if [ "${SKIP_TESTS:-0}" = "0" ]; then
    # -p no:logging: torch's trace logger otherwise floods failure reports
    # the compiler's capture/race checks first (they matter most and take ~1.5 min each), then
    # the kernel tests (~140, several minutes)
    python3 -m pytest -m cuda -v -p no:cacheprovider -p no:logging --tb=short \
        tests/test_compiler_cuda.py tests/test_fake_quant.py tests/test_mhc_sinkhorn.py \
        tests/test_moe_grouped.py tests/test_decode_metadata.py tests/test_ratio2_kernel.py tests/test_kernels_cuda.py \
        tests/test_quant_gemm_cuda.py tests/test_pdl.py \
        > "$OUT/cuda_tests.log" 2>&1
    tail -25 "$OUT/cuda_tests.log"
fi
python3 scripts/bench.py --out "$OUT" "$@" 2> "$OUT/bench.log" | tee "$OUT/bench_table.txt"
