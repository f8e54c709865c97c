#!/usr/bin/env bash
# Compare this tree with an older commit's in ONE device run (these machines drift between runs):
# the same benches, alternating old and new, results under $OUT with the tree's name in each file.
# Usage (repo root, on the GPU machine; the old tree made here with
#   mkdir -p .old/C && git archive C | tar -x -C .old/C && echo C > .old/C/COMMIT
# and carried):
#   . ops/gpu/env.sh; OLD=.old/C bash ops/gpu/compare_trees.sh engine   # offline bench + load, x2
#   . ops/gpu/env.sh; OLD=.old/C [LOAD=1] bash ops/gpu/compare_trees.sh serve    # tests/gpu, daemon c200 [, load]
#   . ops/gpu/env.sh; OLD=.old/C [ROUNDS=n] bash ops/gpu/compare_trees.sh load    # the load bench, n rounds
set -u
phase=${1:-engine}
OUT=${OUT:-./gpu_out}; mkdir -p "$OUT"
M=${M8B:-/tmp/m8b}
NEW=$PWD
OLD=$(cd "${OLD:?set OLD to the old tree}" && pwd)
old_name=$(cat "$OLD/COMMIT" 2>/dev/null || echo old)
new_name=$(cat "$NEW/COMMIT" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo new)
status=0
site=${PYTHONPATH%%:*}
in_tree() {  # in_tree DIR SECONDS CMD...: run CMD in DIR, that tree (and the wheels) on the path
  local dir=$1 secs=$2; shift 2
  (cd "$dir" && PYTHONPATH="$site:$dir" INFIRE_COMMIT=$(cat "$dir/COMMIT" 2>/dev/null || echo "$new_name") \
    timeout "$secs" "$@")
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu_state.csv" 2>&1
[ -f "$M/config.json" ] || in_tree "$NEW" 120 python3 -c "import sys; from agent.cli import main; sys.exit(main(sys.argv[1:]))" \
  make-model --arch llama --preset llama-3.1-8b --out "$M" --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
engine_bench() {  # engine_bench DIR NAME ROUND
  in_tree "$1" 150 python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda \
    --out "$OUT/engine_$2_$3.json" > "$OUT/engine_$2_$3.txt" 2>&1 || status=1
}
load_bench() {  # load_bench DIR NAME [ROUND]
  local f=load_$2${3:+_$3}
  in_tree "$1" 120 python3 ops/gpu/engine_load_bench.py "$M" "$OUT/$f.json" --device cuda --skip-dropped \
    --no-overlap > "$OUT/$f.txt" 2>&1 || status=1
}
serve_bench() {  # serve_bench DIR NAME
  in_tree "$1" 200 python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
    --num-requests "${NREQ:-1000}" --max-model-len 4096 --max-num-seqs 256 \
    --out "$OUT/serve_$2.json" > "$OUT/serve_$2.txt" 2>&1 || status=1
  pkill -f "agent.cli serve" 2>/dev/null; pkill -f engine.worker 2>/dev/null
  for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break; sleep 1; done
}
if [ "$phase" = engine ]; then
  engine_bench "$OLD" old 1; engine_bench "$NEW" new 1
  load_bench "$OLD" old; load_bench "$NEW" new
  if [ "${ROUNDS:-2}" -gt 1 ]; then engine_bench "$NEW" new 2; engine_bench "$OLD" old 2; fi
elif [ "$phase" = load ]; then  # the load bench alone, alternating old and new, ROUNDS times
  for r in $(seq "${ROUNDS:-2}"); do load_bench "$OLD" old "$r"; load_bench "$NEW" new "$r"; done
else
  in_tree "$NEW" "${TESTS_TIMEOUT:-260}" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1 || status=1
  serve_bench "$OLD" old; serve_bench "$NEW" new
  if [ -n "${LOAD:-}" ]; then load_bench "$NEW" new; load_bench "$OLD" old; fi
fi
python3 - "$OUT" "$old_name" "$new_name" <<'PY'
import glob, json, os, sys
out, old, new = sys.argv[1:]
def get(path, *keys):
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        return None
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d
print(f"old = {old}, new = {new}")
for kind, keys in (("engine", ("total_tok_s",)), ("serve", ("req_s",)), ("serve", ("total_tok_s",)), ("serve", ("cpu_cores",))):
    for p in sorted(glob.glob(os.path.join(out, f"{kind}_*.json"))):
        print(f"{os.path.basename(p):<24} {'.'.join(keys):<14} {get(p, *keys)}")
for p in sorted(glob.glob(os.path.join(out, "load_*.json"))):
    for case in ("first_load", "page_cache_warm", "warm_tier", "warm_tier_new_shape"):
        print(f"{os.path.basename(p):<24} {case:<20} load_s {get(p, case, 'load_s')} "
              f"first_token_s {get(p, case, 'to_first_token_s')}")
PY
[ -f "$OUT/gpu_tests.txt" ] && tail -n 15 "$OUT/gpu_tests.txt"
exit $status
