#!/usr/bin/env bash
# Issue 38's same-run measurements on the GPU machine (results under $OUT):
#   . ops/gpu/env.sh; bash ops/gpu/long_context.sh kernels daemon c200 [old-daemon] [tests]
# kernels: ops/gpu/prefill_bench.py (4k-32k, launch-shape sweep; torch's flash backend beside it);
# daemon: ops/bench/long_context_bench.py on the 8B (TTFT at 8k-120k; eight 32k prompts beside a
# c64 short stream); c200: the sharegpt-like daemon bench at concurrency 200 in this tree, with 10 %
# penalised requests, and in the tree at $OLD (the "not below" check); c200ab: the same without the
# penalised run; gauges: c200 with the gateway protocol's gauges scraped every $GAUGE_S (0.05 s,
# the picker's default; issue 39); c200old: the c200 run in $OLD alone;
# old-daemon: the long-context
# bench in $OLD; steps: the mixed phase alone at each of $STEPS (decode_step_tokens; default
# "512 768 1024"): the decodes' TPOT against the long prompts' TTFT; tests: tests/gpu (the kernel
# files first).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}
model() { [ -f "$M/config.json" ] || python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" \
  make-model --arch llama --preset llama-3.1-8b --out "$M" --device cuda > "$OUT/make_model.txt" 2>&1; }
stop() { pkill -f "[a]gent.cli serve" 2>/dev/null; pkill -f "[e]ngine.worker" 2>/dev/null; sleep 2; }
in_tree() {  # in_tree DIR CMD...: a command in another checkout (its engine, its bench)
  local tree; tree=$(cd "$1" && pwd); shift
  (cd "$tree" && PYTHONPATH="${PYTHONPATH%%:*}:$tree" INFIRE_COMMIT=$(cat "$tree/COMMIT" 2>/dev/null || echo "") "$@")
}
serve() {  # serve NAME FRACTION [TREE [BENCH ARGS...]]
  model
  local name=$1 frac=$2 tree=${3:-.}; shift; shift; shift || true
  in_tree "$tree" timeout 240 python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
    --num-requests 1000 --max-model-len 4096 --max-num-seqs 256 --penalised-fraction "$frac" "$@" \
    --out "$OUT/serve_$name.json" > "$OUT/serve_$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/runs.txt"; stop
}
for phase in "$@"; do
  case $phase in
    kernels) timeout 200 python3 ops/gpu/prefill_bench.py --sweep --max-len "${MAX_LEN:-32768}" > "$OUT/prefill.txt" 2>&1
             echo "kernels rc=$?" >> "$OUT/runs.txt" ;;
    daemon) model; timeout 240 python3 -m ops.bench.long_context_bench --model-dir "$M" --device cuda \
              --max-model-len 131072 --out "$OUT/lc.json" > "$OUT/lc.txt" 2>&1; echo "daemon rc=$?" >> "$OUT/runs.txt"; stop ;;
    old-daemon) model; in_tree "${OLD:?set OLD}" timeout 240 python3 -m ops.bench.long_context_bench --model-dir "$M" \
                  --device cuda --max-model-len 131072 --out "$OUT/lc_old.json" > "$OUT/lc_old.txt" 2>&1
                echo "old-daemon rc=$?" >> "$OUT/runs.txt"; stop ;;
    steps) model; for b in ${STEPS:-512 768 1024}; do
             timeout 200 python3 -m ops.bench.long_context_bench --model-dir "$M" --device cuda --max-model-len 131072 \
               --phases mixed --decode-step-tokens "$b" --out "$OUT/lc_mixed_$b.json" > "$OUT/lc_mixed_$b.txt" 2>&1
             echo "steps $b rc=$?" >> "$OUT/runs.txt"; stop
           done ;;
    c200) serve plain 0; serve penalised10 0.1; serve plain_old 0 "${OLD:?set OLD}" ;;
    c200ab) serve plain 0; serve plain_old 0 "${OLD:?set OLD}" ;;
    gauges) serve gauges 0 . --scrape-gauges "${GAUGE_S:-0.05}" ;;
    c200old) serve plain_old 0 "${OLD:?set OLD}" ;;
    tests) timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu \
             > "$OUT/tests_gpu.txt" 2>&1; echo "tests rc=$?" >> "$OUT/runs.txt" ;;
  esac
done
