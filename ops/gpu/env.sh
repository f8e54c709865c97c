# Source at the top of every command on the GPU machine (no registry there):
#   . ops/gpu/env.sh
# Installs the carried wheels (.whl/, made here by ../shared/gpu/fetch-wheels.sh) into
# /tmp/site, puts the repo on PYTHONPATH, and keeps Triton's compile cache in the run's folder.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" >&2
export PYTHONPATH=/tmp/site:$PWD
# The registry's newest llguidance for this machine's Python may be older than the project needs
# (1.6 takes one end-of-text id: every grammar test fails on it); say so before anything runs.
python3 - <<'PY' >&2
import importlib.metadata as m
try:
    v = m.version("llguidance")
except m.PackageNotFoundError:
    v = None
if v is None or tuple(int(x) for x in v.split(".")[:2]) < (1, 7):
    print(f"warning: llguidance {v or 'missing'} here; pyproject asks >= 1.7 (carry a newer wheel in .whl/)")
PY
# Bytecode for the wheels and the repo, as an installation has it (pip compiles what it installs;
# the machine's Python does not write bytecode itself): without it every start compiles the
# agent's imports again (~0.5 s of a restart there). torch's is the worker's own concern
# (agent/worker/options.py: worker_env).
python3 -m compileall -q -j 0 /tmp/site agent cache engine sandbox text modelgen ops >/dev/null 2>&1 || true
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# The commit the copied tree came from (benches record it; the copy has no .git of its own):
#   git archive HEAD | tar -x -C T && git rev-parse --short HEAD > T/COMMIT
[ -f COMMIT ] && export INFIRE_COMMIT=$(cat COMMIT)
