#!/usr/bin/env bash
# One GPU run for the per-model streams and the memory/reload work: GPU tests, the quiet model's
# TTFT next to floods with streams on and off, the load bench, the engine at concurrency 200.
# Results under $OUT.
#   . ops/gpu/env.sh; bash ops/gpu/streams_check.sh
set -u
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}; S=${MSMALL:-/tmp/msmall}
status=0
mk() { [ -f "$2/config.json" ] || python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" \
  make-model --arch "$1" --preset "$3" --out "$2" --device cuda >> "$OUT/make_model.txt" 2>&1 || status=1; }
mk llama "$M" llama-3.1-8b
mk qwen3 "$S" small
timeout ${TESTS_S:-170} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu tests/integration/test_load_cuda.py} \
  > "$OUT/tests_gpu.txt" 2>&1 || status=1
tail -n 4 "$OUT/tests_gpu.txt"
mm() {  # name, streams (1/0), shared step tokens
  INFIRE_MODEL_STREAMS=$2 timeout ${MM_S:-110} python3 -m ops.bench.multi_model_bench --device cuda --big "$M" "$M" \
    --small "$S" --kv-gib 36 --warm-tier-bytes 42949672960 --phases ttft ${SWAP:+swap} --flood 128 512 \
    --shared-step-tokens "$3" --out "$OUT/$1.json" > "$OUT/$1.txt" 2>&1 || status=1
  echo "== $1"; tail -n 20 "$OUT/$1.txt"
}
SWAP=1 mm mm_streams_512 1 512
mm mm_nostreams_512 0 512
timeout ${BENCH_S:-90} python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --concurrency 200 \
  --max-num-seqs 256 --max-num-batched-tokens 4096 --out "$OUT/c200.json" > "$OUT/c200.txt" 2>&1 || status=1
python3 -c "import json;r=json.load(open('$OUT/c200.json'));e=r.get('engine_result',r);print('c200', {k: e[k] for k in ('req_s','total_tok_s','ttft_ms_p50','tpot_ms_p50','cpu_cores')})" || tail -n 5 "$OUT/c200.txt"
timeout ${LOAD_S:-80} python3 ops/gpu/engine_load_bench.py "$M" "$OUT/engine_load.json" --skip-dropped --no-overlap \
  > "$OUT/load.txt" 2>&1 || status=1
python3 -c "import json;print(json.dumps(json.load(open('$OUT/engine_load.json')))[:2500])" || tail -n 5 "$OUT/load.txt"
[ -n "${NO_ZERO:-}" ] || mm mm_streams_0 1 0
exit $status
