#!/usr/bin/env bash
# Issue 36's same-run bench: the daemon at concurrency 200 (sharegpt-like, 1000 requests, the 8B)
# with no penalised request, then with 10 % carrying presence, frequency and repetition penalties,
# then plain again (these machines drift: the two plain runs bracket the penalised one).
#   . ops/gpu/env.sh; bash ops/gpu/penalised.sh        (results under $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}
[ -f "$M/config.json" ] || python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" \
  make-model --arch llama --preset llama-3.1-8b --out "$M" --device cuda > "$OUT/make_model.txt" 2>&1
run() {  # run NAME FRACTION
  timeout 200 python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
    --num-requests "${NREQ:-1000}" --max-model-len 4096 --max-num-seqs 256 --penalised-fraction "$2" \
    --out "$OUT/serve_$1.json" > "$OUT/serve_$1.txt" 2>&1
  echo "$1 rc=$?" >> "$OUT/penalised_runs.txt"
  pkill -f "agent.cli serve" 2>/dev/null; pkill -f engine.worker 2>/dev/null; sleep 3
}
run plain1 0; run penalised10 0.1; run plain2 0
