#!/usr/bin/env bash
# One GPU run for the daemon-level figures: the sharegpt-like load through the agent's HTTP API at
# concurrency 200 (issue 6), then the multi-model bench (issue 7: two 8B-shaped models and a small
# one under a budget that holds two). Usage (repo root, on the GPU machine):
#   . ops/gpu/env.sh; bash ops/gpu/serve_multi.sh      — results under $OUT, summary last.
set -u
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}; S=${MSMALL:-/tmp/msmall}
NREQ=${NREQ:-1000}
status=0
mk() { python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" make-model "$@"; }
[ -f "$M/config.json" ] || mk --arch llama --preset llama-3.1-8b --out "$M" --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
[ -f "$S/config.json" ] || mk --arch qwen3 --preset small --out "$S" --device cuda >> "$OUT/make_model.txt" 2>&1 || status=1
work=$(mktemp -d /tmp/serve.XXXX)
timeout ${SERVE_TIMEOUT:-260} python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
  --num-requests "$NREQ" --max-model-len 4096 --max-num-seqs 256 --out "$OUT/serve_c200.json" > "$OUT/serve.txt" 2>&1 || status=1
pkill -f "agent.cli serve" 2>/dev/null; pkill -f "infire-agent serve" 2>/dev/null; pkill -f engine.worker 2>/dev/null
rm -rf "$work" /tmp/serve-bench-* 2>/dev/null
# Multi-model (issue 7): engine_bench's offline shape (16384-token steps, 512 seqs, max_model_len 2048) for
# both 8B-shaped models, each with MM_KV_GIB of KV reserved; the budget holds A and B but not C beside them.
# About 2-3 minutes: loads ~15 s (first one compiles), warm-up ~5 s, saturated 3 x 12 s, light 3 x 12 s,
# TTFT ~12 s, swaps ~10 s. Summary on stdout (multi_model.txt), every figure in multi_model.json.
for _ in $(seq 30); do  # the serving run's worker must have let go of the GPU before the budget is set
  [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break; sleep 1
done
INFIRE_COMMIT=${INFIRE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} \
timeout ${MM_TIMEOUT:-240} python3 -m ops.bench.multi_model_bench --device cuda --big "$M" "$M" --small "$S" \
  --kv-gib ${MM_KV_GIB:-36} --warm-tier-bytes $((40 * 1024 * 1024 * 1024)) ${MM_ARGS:-} \
  --out "$OUT/multi_model.json" > "$OUT/multi_model.txt" 2>&1 || status=1
echo "== serve c200"; tail -n 12 "$OUT/serve.txt"
echo "== multi-model"; tail -n 30 "$OUT/multi_model.txt"
exit $status
