#!/usr/bin/env bash
# One GPU run for the multi-model step rules and the memory/reload work: GPU
# tests, then the quiet model's TTFT next to floods under each setting in $MM, then (unless
# MM_ONLY=1) the engine at concurrency 200 and the load bench. JSON under $OUT, logs in $LOGS.
#   . ops/gpu/env.sh; MM="name:ENV=1,ENV2=0:shared_tokens ..." [PHASES="ttft saturated light"] bash ops/gpu/streams_check.sh
set -u
OUT=${OUT:-./gpu_out}; LOGS=${LOGS:-/tmp/logs}; mkdir -p "$OUT" "$LOGS"
M=${M8B:-/tmp/m8b}; S=${MSMALL:-/tmp/msmall}
status=0
mk() { [ -f "$2/config.json" ] || python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" \
  make-model --arch "$1" --preset "$3" --out "$2" --device cuda >> "$LOGS/make_model.txt" 2>&1 || status=1; }
mk llama "$M" llama-3.1-8b
mk qwen3 "$S" small
timeout ${TESTS_S:-170} python3 -m pytest -q -p no:cacheprovider --tb=short ${TESTS:-tests/gpu tests/integration/test_load_cuda.py} \
  > "$OUT/tests_gpu.txt" 2>&1 || status=1
grep -E "^(FAILED|ERROR|E  )" "$OUT/tests_gpu.txt" | head -n 20; tail -n 1 "$OUT/tests_gpu.txt"
mm() {  # name, comma-separated env, shared step tokens
  env ${2//,/ } timeout ${MM_S:-100} python3 -m ops.bench.multi_model_bench --device cuda --big "$M" "$M" \
    --small "$S" --kv-gib 36 --warm-tier-bytes 42949672960 --phases ${PHASES:-ttft} ${SWAP:+swap} --flood 128 512 \
    --trickle ${TRICKLE:-24} --shared-step-tokens "$3" --out "$OUT/mm_$1.json" > "$LOGS/mm_$1.txt" 2>&1 || status=1
  echo "== $1 ($2, shared $3)"; grep -E "TTFT|flooded|swap|in [0-9.]+ s from" "$LOGS/mm_$1.txt" || tail -n 5 "$LOGS/mm_$1.txt"
}
for spec in ${MM:-cap_512::512 nocap::0}; do
  IFS=: read -r name envs shared <<< "$spec"
  mm "$name" "$envs" "$shared"
done
[ -n "${MM_ONLY:-}" ] && exit $status
timeout ${BENCH_S:-90} python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --concurrency 200 \
  --max-num-seqs 256 --max-num-batched-tokens 4096 --out "$OUT/c200.json" > "$LOGS/c200.txt" 2>&1 || status=1
python3 -c "import json;r=json.load(open('$OUT/c200.json'));e=r.get('engine_result',r);print('c200', {k: e[k] for k in ('req_s','total_tok_s','ttft_ms_p50','tpot_ms_p50','cpu_cores')})" || tail -n 5 "$LOGS/c200.txt"
timeout ${LOAD_S:-80} python3 ops/gpu/engine_load_bench.py "$M" "$OUT/engine_load.json" --skip-dropped --no-overlap \
  > "$LOGS/load.txt" 2>&1 || status=1
python3 -c "import json;print(json.dumps(json.load(open('$OUT/engine_load.json')))[:2500])" || tail -n 5 "$LOGS/load.txt"
exit $status
