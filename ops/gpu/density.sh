#!/usr/bin/env bash
# Issue 35's density runs on the GPU machine, each phase given what is left of the call's time.
#   . ops/gpu/env.sh; bash ops/gpu/density.sh fp8 bf16        (phases in order; results under $OUT;
#   FP8_N / FP8_S: models and seconds of the fp8 phase, 12 and 120 by default; BF16_S / WARM_S:
#   seconds of the bf16 and warm phases, 120 by default)
# Phases: fp8 (12 x 8B, FP8 weights + KV, 0.5 req/s each), bf16 (12 x 8B, Zipf 1.0, 4 req/s, page
# cache), warm (the same with a 64 GiB warm tier), drills (four FP8 models serving: 20 load/unload
# cycles of an FP8 and a plain model, a load that fails in the engine, a load under a neighbour's
# device-memory grab, a SIGSTOPped worker), gputests (tests/gpu); bf16preempt / warmpreempt: the
# bf16 / warm phase with server.preempt_for_room on (busy models preempted for room when their
# requests can resume, not drained: the A/B of preemption in one device run); warmdistinct: the warm
# phase with each name a model of its own files (density_bench --distinct: the tier keeps a copy per
# name, as for twelve different 8Bs, where one set of bytes shares one copy); bf16old / warmold: the bf16 / warm phase in the
# tree at $OLD (made here with `git archive C | tar -x -C .old/C && echo C > .old/C/COMMIT`,
# carried): an A/B in one device run.
# One kept folder (/tmp/dens) so later phases reuse the store and cache (the disk: 64 GB free
# holds the source, the store, the cache and its FP8 artifact, ~55 GB). Each phase's agent log
# comes back gzipped.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}; K=/tmp/dens
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
left() { echo $(( END - $(date +%s) )); }
df -h /tmp > "$OUT/disk.txt" 2>&1
[ -f "$M/config.json" ] || python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" \
  make-model --arch llama --preset llama-3.1-8b --out "$M" --device cuda > "$OUT/make_model.txt" 2>&1
bench() {  # bench NAME ARGS... (TREE=dir: that tree's daemon and bench, e.g. an older commit's)
  local name=$1; shift
  local t; t=$(left); [ "$t" -gt 60 ] || { echo "$name: skipped, ${t}s left" >> "$OUT/skipped.txt"; return; }
  local tree; tree=$(cd "${TREE:-.}" && pwd)
  (cd "$tree" && PYTHONPATH="${PYTHONPATH%%:*}:$tree" INFIRE_COMMIT=$(cat "$tree/COMMIT" 2>/dev/null || echo "${INFIRE_COMMIT:-}") \
    timeout "$t" python3 -m ops.bench.density_bench --model-dir "$M" --device cuda --keep-dir "$K" \
    --out "$OUT/density_$name.json" --drain-timeout 60 "$@") > "$OUT/density_$name.txt" 2>&1
  echo "$name rc=$? at $(date +%T)" >> "$OUT/density_$name.txt"
  pkill -f "agent.cli serve" 2>/dev/null; pkill -f engine.worker 2>/dev/null; sleep 2
  [ -f "$K/agent.log" ] && gzip -c "$K/agent.log" > "$OUT/log_$name.gz" && : > "$K/agent.log"
  df -h /tmp >> "$OUT/disk.txt" 2>&1
}
# the bf16 workload (twelve 8Bs, Zipf 1.0, 4 req/s in all) and the same with a 64 GiB warm tier
BF16="--models 12 --rate 4 --zipf 1.0 --duration ${BF16_S:-120} --prompt-len 256 --gen-len 128"
WARM="--models 12 --rate 4 --zipf 1.0 --duration ${WARM_S:-120} --prompt-len 256 --gen-len 128 --warm-tier-bytes 64GiB"
for phase in "$@"; do
  case $phase in
    fp8) bench fp8 --models ${FP8_N:-12} --quantization fp8 --kv-cache-dtype fp8 --rate-per-model 0.5 --duration ${FP8_S:-120} \
           --prompt-len 256 --gen-len 128 ;;
    bf16) bench bf16 $BF16 ;;
    bf16old) TREE=${OLD:?set OLD to the older tree} bench bf16old $BF16 ;;
    warmold) TREE=${OLD:?set OLD to the older tree} bench warmold $WARM ;;
    bf16preempt) bench bf16preempt $BF16 --preempt ;;
    warm) bench warm $WARM ;;
    warmpreempt) bench warmpreempt $WARM --preempt ;;
    warmdistinct) bench warmdistinct $WARM --distinct ;;
    drills) bench drills --models 4 --quantization fp8 --kv-cache-dtype fp8 --rate-per-model 1 --duration 130 \
              --prompt-len 256 --gen-len 128 --worker-hang-timeout 10 --drill-cycles 20 --drill-cycles-at 2 \
              --drill-load-fail-at 70 --drill-oom-at 80 --drill-sigstop-at 100 ;;
    gputests) timeout "$(left)" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1 ;;
  esac
done
ls "$K/store" > /dev/null 2>&1 && du -sh "$K"/* >> "$OUT/disk.txt" 2>&1
