#!/usr/bin/env bash
# One GPU run for the kernels: compile report, GPU tests, kernel bench, load bench.
# Usage (repository root): bash ops/gpu/kernels_all.sh   — results under $OUT (default ./gpu_out).
# Everything is checked as well as timed; the tables are printed last. About 4-6 minutes on an H200.
set -u
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/infire_triton_cache}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu_state.csv" 2>&1
python ops/gpu/aot_check.py --json "$OUT/aot_check.json" > "$OUT/aot_check.txt" 2>&1 || status=1
timeout 300 python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_weight_stream.py \
  > "$OUT/gpu_tests.txt" 2>&1 || status=1
timeout 240 python ops/gpu/load_bench.py 4 "$OUT/load_bench.json" > "$OUT/load_bench.txt" 2>&1 || status=1
timeout 300 python ops/gpu/kernel_bench.py "$OUT/kernel_bench.json" > "$OUT/kernel_bench.txt" 2>&1 || status=1
echo "== aot_check (sm_90 resources)"; tail -n 26 "$OUT/aot_check.txt"
echo "== GPU tests"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/gpu_tests.txt" | tail -n 25
echo "== load bench"; tail -n 14 "$OUT/load_bench.txt"
echo "== kernel bench"; tail -n 52 "$OUT/kernel_bench.txt"
exit $status
