#!/usr/bin/env bash
# Issue 37's measurements on the GPU machine (results under $OUT), each phase given the time left:
#   . ops/gpu/env.sh; bash ops/gpu/moe.sh tune kernels qwen mixtral dense
# tune: ops/gpu/moe_tune.py at both shapes (tables into engine/kernels/moe_configs/, returned as
# $OUT/moe_configs.tgz: unpack into engine/kernels and commit them); kernels: ops/gpu/moe_bench.py at both full-size layer shapes (bf16 and FP8 experts by token
# count: GB/s at decode sizes, TFLOP/s at prefill sizes); align: the one-program alignment against
# the torch one by decode bucket (moe_bench --align); qwen: Qwen3-30B-A3B's shape offline,
# sharegpt-like 1,000 requests, bf16 then FP8 in one process, with batch-1 decode; mixtral:
# Mixtral-8x7B's shape FP8 offline; dense: the 8B offline in the same run (the reference the
# issue compares with); scout: Llama 4 Scout's text model in FP8 offline (an H200 only: ~109 GB of
# weights; the report's memory figures say how much KV the budget left). The full-size checkpoints do not fit the disk: their weights are random,
# made on the device (engine_bench --weights-on-device; ops/bench/device_weights.py).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
left() { echo $(( END - $(date +%s) )); }
offline() {  # offline NAME ARGS...
  local name=$1; shift
  local t; t=$(left); [ "$t" -gt 60 ] || { echo "$name: skipped, ${t}s left" >> "$OUT/runs.txt"; return; }
  timeout "$t" python3 -m ops.bench.engine_bench --device cuda --num-requests "${N:-1000}" \
    --out "$OUT/engine_$name.json" "$@" > "$OUT/engine_$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/runs.txt"
}
for phase in "$@"; do
  case $phase in
    tune) n=2; for s in qwen3-30b-a3b mixtral-8x7b; do  # the time left shared by the shapes to go
            t=$(left); timeout "$t" python3 ops/gpu/moe_tune.py --shape "$s" --budget-s $(( t / n - 15 )) \
              > "$OUT/tune_$s.txt" 2>&1; n=$(( n - 1 ))
            echo "tune $s rc=$?" >> "$OUT/runs.txt"
          done
          tar -czf "$OUT/moe_configs.tgz" -C engine/kernels moe_configs ;;  # one file: a call returns ~8
    kernels) for s in qwen3-30b-a3b mixtral-8x7b; do
               timeout 120 python3 ops/gpu/moe_bench.py --shape "$s" --out "$OUT/moe_$s.json" > "$OUT/moe_$s.txt" 2>&1
               echo "kernels $s rc=$?" >> "$OUT/runs.txt"
             done ;;
    align) timeout 120 python3 ops/gpu/moe_bench.py --align --out "$OUT/moe_align.json" > "$OUT/moe_align.txt" 2>&1
           echo "align rc=$?" >> "$OUT/runs.txt" ;;
    qwen) offline qwen --arch qwen3_moe --preset qwen3-30b-a3b --weights-on-device --quantization both --batch1 ;;
    mixtral) offline mixtral --arch mixtral --preset mixtral-8x7b --weights-on-device --quantization fp8 ;;
    dense) offline dense --arch llama --preset llama-3.1-8b --weights-on-device --quantization both --batch1 ;;
    scout) offline scout --arch llama4 --preset llama4-scout --weights-on-device --quantization fp8 --batch1 ;;
  esac
done
