#!/usr/bin/env bash
# One GPU run for the engine's serving figures: GPU tests, the engine at concurrency 200 (AB=1:
# also with synchronous steps) and offline, batch-1, then the daemon at concurrency 200; LOAD=1
# adds the load bench. Results under $OUT (at most 8 files).
#   . ops/gpu/env.sh; bash ops/gpu/mixed_check.sh
set -u
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}
status=0
timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu/test_engine_gpu.py -k "mixed or graph or capture"} \
  > "$OUT/tests_gpu.txt" 2>&1 || status=1
tail -n 3 "$OUT/tests_gpu.txt"
[ -f "$M/config.json" ] || python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" \
  make-model --arch llama --preset llama-3.1-8b --out "$M" --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
eb() {  # name, env, args...
  local name=$1 envs=$2; shift 2
  env $envs timeout ${BENCH_S:-120} python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --out "$OUT/$name.json" "$@" \
    >> "$OUT/bench_log.txt" 2>&1 || status=1
  python3 - "$OUT/$name.json" "$name" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1])); e = r.get("engine_result", r)
k = e.get("steps_by_kind", {})
print(sys.argv[2], "req/s %.1f tok/s %.0f ttft50 %.0f tpot50 %.1f cpu %.2f" % (e["req_s"], e["total_tok_s"], e["ttft_ms_p50"], e["tpot_ms_p50"], e["cpu_cores"]),
      {kk: (v["steps"], round(v["ms_mean"] or 0, 1)) for kk, v in k.items()}, "host", {kk: round(v, 2) for kk, v in e.get("host_ms_by_kind", {}).items()})
PY
}
eb c200_mixed "" --concurrency 200 --max-num-seqs 256 --max-num-batched-tokens 4096
[ -n "${AB:-}" ] && eb c200_sync "" --concurrency 200 --max-num-seqs 256 --max-num-batched-tokens 4096 --sync
eb off_16k_mixed "" --max-num-seqs 512 --max-num-batched-tokens 16384
eb off_4k_mixed "" --max-num-seqs 256 --max-num-batched-tokens 4096 --batch1
if [ -z "${NO_SERVE:-}" ]; then
  timeout ${SERVE_S:-150} python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
    --num-requests 1000 --max-model-len 4096 --max-num-seqs 256 --out "$OUT/serve_c200.json" >> "$OUT/bench_log.txt" 2>&1 || status=1
  python3 -c "import json;r=json.load(open('$OUT/serve_c200.json'));print('serve', {k: r[k] for k in ('req_s','total_tok_s','ttft_ms_p50','tpot_ms_p50','cpu_cores_agent','cpu_cores_worker')})" || true
fi
if [ -n "${LOAD:-}" ]; then
  timeout ${LOAD_S:-200} python3 ops/gpu/engine_load_bench.py "$M" "$OUT/engine_load.json" >> "$OUT/bench_log.txt" 2>&1 || status=1
  python3 - "$OUT/engine_load.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps(r, indent=None)[:3000])
PY
fi
exit $status
