#!/usr/bin/env bash
# One GPU run for the engine: GPU engine tests, the 8B offline bench (+ batch-1 decode, + the
# transformers peer), and the engine load bench. Usage (repo root, on the GPU machine):
#   . ops/gpu/env.sh; bash ops/gpu/engine_all.sh        — results under $OUT, summary last.
set -u
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}
PEER=${PEER:-150}
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu_state.csv" 2>&1
python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)" >> "$OUT/gpu_state.csv" 2>&1
t0=$(date +%s)
( python3 -c "import sys; from agent.cli import main; sys.exit(main(['make-model','--arch','llama','--preset','llama-3.1-8b','--out','$M','--device','cuda']))" > "$OUT/make_model.txt" 2>&1 ) &
mk=$!
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu_tests.txt" 2>&1 || status=1
wait $mk || status=1
echo "make-model+tests $(( $(date +%s) - t0 )) s" >> "$OUT/gpu_state.csv"
timeout 290 python3 -m ops.bench.engine_bench --model-dir "$M" --batch1 --peer "$PEER" --peer-timeout 110 --device cuda \
  --profile-steps 40 --out "$OUT/engine_bench.json" > "$OUT/engine_bench.txt" 2>&1 || status=1
# the same workload at the latency shape (256 sequences, 4096-token steps; the bench's default is 512 / 16384)
timeout 150 python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --max-num-seqs 256 \
  --max-num-batched-tokens 4096 --out "$OUT/engine_bench_512.json" > "$OUT/engine_bench_512.txt" 2>&1 || status=1
timeout 110 python3 ops/gpu/engine_load_bench.py "$M" "$OUT/engine_load.json" > "$OUT/engine_load.txt" 2>&1 || status=1
echo "== state"; cat "$OUT/gpu_state.csv"
echo "== GPU engine tests"; grep -E "passed|failed|Error|assert|FAILED|ERROR" "$OUT/gpu_tests.txt" | tail -n 20
echo "== engine bench"; tail -n 5 "$OUT/engine_bench.txt"
python3 - "$OUT/engine_bench.json" "$OUT/engine_bench_512.json" <<'PY' || true
import json, sys
e = json.load(open(sys.argv[2])) if __import__("os").path.exists(sys.argv[2]) else {}
print("256/4096 (latency) variant:", {k: e.get(k) for k in ("total_tok_s", "req_s", "tpot_ms_p50", "host_ms_by_kind", "steps_by_kind")})
d = json.load(open(sys.argv[1]))
for r in (d.get("profile") or {}).get("top_tottime", [])[:14]: print("prof", r)
keys = ("host_ms_by_kind", "req_s", "output_tok_s", "total_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
        "cpu_cores", "host_ms_per_step", "wait_ms_per_step", "steps", "graph_steps", "load_s", "graph_capture_s",
        "vs_peer_total_tok_s")
for k in keys: print(f"{k:<22} {d.get(k)}")
print("steps_by_kind", d.get("steps_by_kind")); print("batch1", d.get("batch1")); print("peer", d.get("peer"))
PY
echo "== load bench"; tail -n 6 "$OUT/engine_load.txt"
exit $status
