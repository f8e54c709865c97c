#!/usr/bin/env bash
# Cascade attention (engine/runner/cascade.py) on the H200, in ONE device run: the shared-system
# workload with prefix caching off then on (this tree), the same caching-on run on an OLD tree
# before cascade attention (same machine, same run), and the plain and multi-turn workloads
# (off then on). Results are archived to $OUT/all.tgz after each part.
# Usage (repo root, on the GPU machine):  . ops/gpu/env.sh; [OLD=.old/C] bash ops/gpu/cascade.sh [parts...]
#   parts: tests probe shared old plain oldplain multiturn multiturn8   (default: shared old plain oldplain multiturn)
set -u
FINAL=${OUT:-./gpu_out}; mkdir -p "$FINAL"
OUT=$(mktemp -d /tmp/cascade.XXXX)
M=${M8B:-/tmp/m8b}
status=0
[ -f "$M/config.json" ] || timeout 120 python3 -m agent.cli make-model --arch llama --preset llama-3.1-8b --out "$M" \
  --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
SERVE=(--concurrency 200 --max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len 4096)
bench() {  # bench NAME SECONDS CACHING ARGS...
  local name=$1 secs=$2 caching=$3; shift 3
  timeout "$secs" python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda --prefix-caching "$caching" \
    --out "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1 || status=1
}
for part in ${*:-shared old plain oldplain multiturn}; do
  case $part in
    tests) timeout 200 python3 -m pytest -q tests/gpu > "$OUT/tests_gpu.txt" 2>&1 || status=1 ;;
    shared) bench shared_c200 240 both --workload shared-system --num-requests 1000 "${SERVE[@]}" ;;
    old)  # the caching-on run of the tree before cascade attention
      [ -n "${OLD:-}" ] && (cd "$OLD" && timeout 150 python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda \
        --prefix-caching on --out "$OUT/shared_c200_old.json" --workload shared-system --num-requests 1000 \
        "${SERVE[@]}" > "$OUT/shared_c200_old.txt" 2>&1) || status=1 ;;
    oldplain)  # what an empty plan costs: the plain workload on the old tree (caching on)
      [ -n "${OLD:-}" ] && (cd "$OLD" && timeout 120 python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda \
        --prefix-caching on --out "$OUT/plain_c200_old.json" --num-requests 1000 \
        "${SERVE[@]}" > "$OUT/plain_c200_old.txt" 2>&1) || status=1 ;;
    plain) bench plain_c200 200 both --num-requests 1000 "${SERVE[@]}" ;;
    multiturn) bench multiturn 200 both --workload multi-turn --num-requests 200 --turns 5 "${SERVE[@]}" ;;
    multiturn8) bench multiturn8 240 both --workload multi-turn --num-requests 200 --turns 8 "${SERVE[@]}" ;;
    probe) timeout 120 python3 ops/gpu/cascade_probe.py "$OUT/cascade_probe.json" > "$OUT/cascade_probe.txt" 2>&1 || status=1 ;;
  esac
  tar -czf "$FINAL/all.tgz" -C "$OUT" .
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import glob, json, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        d = json.load(open(p))
    except (OSError, ValueError):
        continue
    off = d.get("caching_off") or {}
    print(os.path.basename(p), {k: d.get(k) for k in ("req_s", "total_tok_s", "ttft_ms_p50", "wall_s", "cached_fraction",
                                                      "on_vs_off_total_tok_s", "on_vs_off_ttft_p50", "cascade",
                                                      "steps_by_kind")},
          "off:", {k: off.get(k) for k in ("req_s", "total_tok_s", "ttft_ms_p50", "wall_s")})
PY
tar -czf "$FINAL/all.tgz" -C "$OUT" .
exit $status
