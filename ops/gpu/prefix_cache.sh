#!/usr/bin/env bash
# Issue 20's figures in ONE device run, each workload with prefix caching off then on in one
# process (engine_bench --prefix-caching both): shared system prompt at c200 (with a control: caching
# off at c150) and offline, multi-turn chat replay at 5 and 8 turns, the plain sharegpt-like workload
# (caching must cost it < 2%); with OLD=<tree>, the caching-on runs of shared and plain on that
# tree too, in the same call (an A/B of a change); the scheduler's host cost with and without the
# index. Results are archived to $OUT/all.tgz after each part.
# Usage (repo root, on the GPU machine):  . ops/gpu/env.sh; [OLD=.old/C] [CONTROL=] bash ops/gpu/prefix_cache.sh [parts...]
#   parts: tests shared old offline multiturn multiturn8 plain oldplain sched
#   (default: tests shared offline multiturn plain sched)
set -u
FINAL=${OUT:-./gpu_out}; mkdir -p "$FINAL"
OUT=$(mktemp -d /tmp/issue20.XXXX)
M=${M8B:-/tmp/m8b}
status=0
[ -f "$M/config.json" ] || timeout 120 python3 -m agent.cli make-model --arch llama --preset llama-3.1-8b --out "$M" \
  --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
SERVE=(--concurrency 200 --max-num-seqs 256 --max-num-batched-tokens 4096 --max-model-len 4096)
bench() {  # bench NAME SECONDS TREE MODE ARGS...: engine_bench in TREE with --prefix-caching MODE
  local name=$1 secs=$2 tree=$3 mode=$4; shift 4
  [ -n "$tree" ] || { echo "part $name needs OLD=<tree>" >&2; status=1; return; }
  # the commit a result records: the tree's own (the OLD tree carries its COMMIT file)
  (cd "$tree" && export INFIRE_COMMIT=$(cat COMMIT 2>/dev/null || echo "${INFIRE_COMMIT:-}") &&
    timeout "$secs" python3 -m ops.bench.engine_bench --model-dir "$M" --device cuda \
    --prefix-caching "$mode" --out "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1) || status=1
}
# the shared part's control (caching off at this concurrency; CONTROL= leaves it out)
CONTROL=${CONTROL-150}
for part in ${*:-tests shared offline multiturn plain sched}; do
  case $part in
    tests) timeout 200 python3 -m pytest -q tests/gpu > "$OUT/tests_gpu.txt" 2>&1 || status=1 ;;
    shared)  # with a control: caching off at c150, how much batch composition alone moves greedy tokens
      bench shared_c200 300 . both --workload shared-system --num-requests 1000 "${SERVE[@]}" \
        ${CONTROL:+--control-concurrency $CONTROL} ;;
    old) bench shared_c200_old 150 "${OLD:-}" on --workload shared-system --num-requests 1000 "${SERVE[@]}" ;;
    offline)
      bench shared_offline 240 . both --workload shared-system --num-requests 1000 --max-num-seqs 512 \
        --max-num-batched-tokens 16384 --max-model-len 4096 ;;
    multiturn) bench multiturn 300 . both --workload multi-turn --num-requests 200 --turns 5 "${SERVE[@]}" ;;
    multiturn8) bench multiturn8 300 . both --workload multi-turn --num-requests 200 --turns 8 "${SERVE[@]}" ;;
    plain) bench plain_c200 240 . both --num-requests 1000 "${SERVE[@]}" ;;
    oldplain) bench plain_c200_old 120 "${OLD:-}" on --num-requests 1000 "${SERVE[@]}" ;;  # what the change costs with nothing shared
    sched) python3 -m ops.bench.sched_bench --running 512 --steps 200 > "$OUT/sched_bench.txt" 2>&1 || status=1 ;;
    *) echo "unknown part: $part" >&2; status=1 ;;
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
    print(os.path.basename(p), {k: d.get(k) for k in ("req_s", "total_tok_s", "ttft_ms_p50", "cached_fraction",
                                                      "on_vs_off_total_tok_s", "on_vs_off_ttft_p50", "same_outputs",
                                                      "on_vs_off_outputs", "control", "cascade", "steps_by_kind")},
          "off:", {k: off.get(k) for k in ("req_s", "total_tok_s", "ttft_ms_p50")})
PY
tar -czf "$FINAL/all.tgz" -C "$OUT" .
exit $status
