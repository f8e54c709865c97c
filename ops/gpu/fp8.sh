#!/usr/bin/env bash
# Issue 19's figures in ONE device run, bf16 beside FP8 in each part: the FP8 GPU tests; offline
# sharegpt-like 1000 requests with batch-1 decode (engine_bench --quantization both); the few-rows
# GEMM sweep. Results are archived to $OUT/all.tgz after each part.
# Usage (repo root, on the GPU machine):  . ops/gpu/env.sh; bash ops/gpu/fp8.sh [parts...]
#   parts: tests offline offline_kv c200 kernels accuracy   (default: all but accuracy)
set -u
FINAL=${OUT:-./gpu_out}; mkdir -p "$FINAL"
OUT=$(mktemp -d /tmp/issue19.XXXX)
M=${M8B:-/tmp/m8b}
status=0
[ -f "$M/config.json" ] || timeout 120 python3 -m agent.cli make-model --arch llama --preset llama-3.1-8b --out "$M" \
  --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
for part in ${*:-tests offline offline_kv c200 kernels}; do
  case $part in
    tests) timeout 200 python3 -m pytest -q tests/gpu/test_fp8_gpu.py > "$OUT/tests_fp8.txt" 2>&1 || status=1 ;;
    offline) timeout 400 python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --quantization both \
        --num-requests 1000 --batch1 --out "$OUT/offline.json" > "$OUT/offline.txt" 2>&1 || status=1 ;;
    offline_kv)  # the FP8 run with an FP8 KV cache too
      timeout 400 python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --quantization both \
        --kv-cache-dtype fp8 --num-requests 1000 --batch1 --out "$OUT/offline_kv.json" > "$OUT/offline_kv.txt" 2>&1 || status=1 ;;
    c200)  # the daemon, bf16 then FP8 weights + FP8 KV, same workload
      for q in none fp8; do
        kv=auto; [ $q = fp8 ] && kv=fp8
        timeout 300 python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
          --num-requests 1000 --quantization $q --kv-cache-dtype $kv --out "$OUT/c200_$q.json" > "$OUT/c200_$q.txt" 2>&1 || status=1
      done ;;
    accuracy) timeout 300 python3 -m ops.bench.fp8_accuracy --engine --device cuda --out "$OUT/accuracy.json" \
        > "$OUT/accuracy.txt" 2>&1 || status=1 ;;
    kernels) timeout 300 python3 ops/gpu/fp8_bench.py "$OUT/fp8_bench.json" > "$OUT/fp8_bench.txt" 2>&1 || status=1 ;;
    *) echo "unknown part: $part" >&2; status=1 ;;
  esac
  tar -czf "$FINAL/all.tgz" -C "$OUT" .
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
d = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(d, n)))
    except (OSError, ValueError):
        return None
for f in ("tests_fp8.txt",):
    p = os.path.join(d, f)
    if os.path.exists(p):
        print(f, open(p).read().strip().splitlines()[-1])
o = load("offline.json")
if o:
    b = o["bf16"]
    print(f"offline total tok/s bf16 {b['total_tok_s']:.0f} fp8 {o['total_tok_s']:.0f} x{o['vs_bf16_total_tok_s']:.3f}")
    print("batch1 bf16", b.get("batch1"), "fp8", o.get("batch1"))
o = load("offline_kv.json")
if o:
    b = o["bf16"]
    print(f"offline (FP8 KV) total tok/s bf16 {b['total_tok_s']:.0f} fp8 {o['total_tok_s']:.0f} x{o['vs_bf16_total_tok_s']:.3f}"
          f" kv pages {b.get('kv_pages')} -> {o.get('kv_pages')}")
    print("batch1 bf16", b.get("batch1"), "fp8", o.get("batch1"))
c0, c1 = load("c200_none.json"), load("c200_fp8.json")
if c0 and c1:
    print(f"c200 req/s bf16 {c0['req_s']} fp8 {c1['req_s']} x{c1['req_s'] / c0['req_s']:.3f}, cores {c0['cpu_cores']} / {c1['cpu_cores']}")
k = load("fp8_bench.json")
if k:
    print("decode-step linears", k["decode_step_linears"])
PY
tar -czf "$FINAL/all.tgz" -C "$OUT" .
exit $status
