#!/usr/bin/env bash
# One GPU run: the engine's graph/launcher GPU tests, the launch-cost micro bench, the step-shape
# sweep of the offline bench (+ batch-1, + the transformers peer) and the load bench.
# Usage (repo root, GPU machine):  . ops/gpu/env.sh; bash ops/gpu/engine_sweep.sh   — results under $OUT.
set -u
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}
PEER=${PEER:-100}
status=0
t0=$(date +%s)
python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)" > "$OUT/state.txt" 2>&1
( python3 -c "import sys; from agent.cli import main; sys.exit(main(['make-model','--arch','llama','--preset','llama-3.1-8b','--out','$M','--device','cuda']))" > "$OUT/make_model.txt" 2>&1 ) &
mk=$!
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k "graph or capture or deferred or (transformers and llama)" > "$OUT/gpu_tests.txt" 2>&1 || status=1
wait $mk || status=1
echo "make-model+tests $(( $(date +%s) - t0 )) s" >> "$OUT/state.txt"
timeout ${SWEEP_S:-300} python3 ops/gpu/engine_sweep.py "$M" "$OUT/sweep.json" --peer "$PEER" > "$OUT/sweep.txt" 2>&1 || status=1
echo "sweep done $(( $(date +%s) - t0 )) s" >> "$OUT/state.txt"
timeout ${LOAD_S:-100} python3 ops/gpu/engine_load_bench.py "$M" "$OUT/engine_load.json" > "$OUT/engine_load.txt" 2>&1 || status=1
echo "== state"; cat "$OUT/state.txt"
echo "== GPU engine tests"; grep -E "passed|failed|Error|assert|FAILED|ERROR" "$OUT/gpu_tests.txt" | tail -n 15
echo "== load bench"; tail -n 6 "$OUT/engine_load.txt"
echo "== sweep"; grep -v "^run \|^launch\|^peer" "$OUT/sweep.txt" | tail -n 14
exit $status
