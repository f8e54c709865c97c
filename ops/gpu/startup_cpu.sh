#!/usr/bin/env bash
# Issue 18's figures in ONE device run: restart to ready (defaults, and a 40 GiB warm tier), the
# daemon at c200 (req/s, the process tree's CPU; a py-spy profile of agent and worker), c1 TPOT.
# Usage (repo root, on the GPU machine):
#   . ops/gpu/env.sh; [OLD=.old/C] bash ops/gpu/startup_cpu.sh [startup] [serve] [profile] [load] [diag] [c1]
# With OLD, the startup and serve parts run for the old tree too (alternating), for a same-run A/B.
set -u
# Results gather in a work folder; after each part they are archived to $OUT/all.tgz, the one file
# that comes back (a device call returns at most 8 files, and what a killed call left).
FINAL=${OUT:-./gpu_out}; mkdir -p "$FINAL"
OUT=$(mktemp -d /tmp/issue18.XXXX)
M=${M8B:-/tmp/m8b}
NEW=$PWD
parts=${*:-startup serve profile c1}
status=0
site=${PYTHONPATH%%:*}
in_tree() {  # in_tree DIR SECONDS CMD...
  local dir=$1 secs=$2; shift 2
  (cd "$dir" && PYTHONPATH="$site:$dir" INFIRE_COMMIT=$(cat "$dir/COMMIT" 2>/dev/null || echo new) \
    timeout "$secs" "$@")
}
settle() {
  pkill -f "agent.cli serve" 2>/dev/null; pkill -f engine.worker 2>/dev/null
  for _ in $(seq 30); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break; sleep 1; done
}
trees="new:$NEW"
[ -n "${OLD:-}" ] && trees="old:$(cd "$OLD" && pwd) $trees"
[ -n "${OLD:-}" ] && { python3 -m compileall -q -j 0 "$OLD" >/dev/null 2>&1 || true; }  # as env.sh does for the new tree
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu_state.csv" 2>&1
[ -f "$M/config.json" ] || in_tree "$NEW" 120 python3 -m agent.cli make-model --arch llama --preset llama-3.1-8b \
  --out "$M" --device cuda > "$OUT/make_model.txt" 2>&1 || status=1
for part in $parts; do
  for t in $trees; do
    name=${t%%:*}; dir=${t#*:}
    case $part in
      startup)
        in_tree "$dir" 240 python3 -m ops.bench.startup_bench --model-dir "$M" --device cuda --restarts "${RESTARTS:-3}" \
          --out "$OUT/startup_default_$name.json" > "$OUT/startup_default_$name.txt" 2>&1 || status=1; settle
        in_tree "$dir" 240 python3 -m ops.bench.startup_bench --model-dir "$M" --device cuda --restarts "${RESTARTS:-3}" \
          --warm-tier-bytes 40GiB --out "$OUT/startup_warm_$name.json" > "$OUT/startup_warm_$name.txt" 2>&1 || status=1; settle ;;
      serve)
        in_tree "$dir" 200 python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
          --num-requests 1000 --max-model-len 4096 --max-num-seqs 256 \
          --out "$OUT/serve_$name.json" > "$OUT/serve_$name.txt" 2>&1 || status=1; settle ;;
      profile)
        [ "$name" = new ] || continue
        command -v py-spy >/dev/null || export PATH=$site/bin:$PATH
        in_tree "$dir" 200 python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 200 \
          --num-requests 1000 --max-model-len 4096 --max-num-seqs 256 --profile "$OUT/profile" \
          --out "$OUT/serve_profiled_$name.json" > "$OUT/serve_profiled_$name.txt" 2>&1 || status=1; settle ;;
      load)
        [ "$name" = new ] || continue
        in_tree "$dir" 240 python3 ops/gpu/load_bench.py "${LOAD_GIB:-2}" "$OUT/load_bench.json" > "$OUT/load_bench.txt" 2>&1 || status=1 ;;
      diag)
        [ "$name" = new ] || continue
        { echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
          python3 -c "import torch, os; d = os.path.dirname(torch.__file__); print('torch', torch.__version__, d, 'writable', os.access(d, os.W_OK), 'pycache', os.path.isdir(os.path.join(d, '__pycache__')))"
          timed() { local label=$1; shift; TIMEFORMAT="$label: %R s"; time "$@"; }  # (the machine has no bc)
          for i in 1 2; do timed "import torch" python3 -c "import torch"; done
          for i in 1 2; do timed "import torch, pycache prefix" env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "import torch"; done
          timed "import torch + context" python3 -c "import torch; torch.zeros(1, device='cuda')"
          python3 -c "
import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); torch.cuda.init(); t2 = time.perf_counter()
torch.zeros(1, device='cuda'); torch.cuda.synchronize(); t3 = time.perf_counter()
print(f'in one process: import torch {t1 - t0:.3f} s, torch.cuda.init {t2 - t1:.3f} s, first tensor {t3 - t2:.3f} s')"
          LD_DEBUG=statistics python3 -c "import torch" 2>&1 | tail -12; } > "$OUT/torch_import.txt" 2>&1
        python3 -X importtime -c "import torch" 2> "$OUT/torch_importtime.txt" ;;
      c1)
        in_tree "$dir" 150 python3 -m ops.bench.serve_bench --model-dir "$M" --device cuda --concurrency 1 \
          --num-requests "${C1_REQUESTS:-24}" --max-model-len 4096 --max-num-seqs 256 \
          --out "$OUT/serve_c1_$name.json" > "$OUT/serve_c1_$name.txt" 2>&1 || status=1; settle ;;
      *) echo "unknown part: $part" >&2; status=1 ;;
    esac
    tar -czf "$FINAL/all.tgz" -C "$OUT" .
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import glob, json, os, sys
out = sys.argv[1]
for p in sorted(glob.glob(os.path.join(out, "*.json"))):
    try:
        d = json.load(open(p))
    except (OSError, ValueError):
        continue
    keys = ("restart_to_ready_s", "first_start_to_ready_s", "first_token_after_restart_s_worst", "req_s",
            "total_tok_s", "cpu_cores", "cpu_cores_agent", "cpu_cores_worker", "tpot_ms_p50", "ttft_ms_p99", "errors")
    print(os.path.basename(p), {k: d[k] for k in keys if k in d})
PY
tar -czf "$FINAL/all.tgz" -C "$OUT" .
exit $status
