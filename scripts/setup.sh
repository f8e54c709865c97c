#!/usr/bin/env bash
# Create (or reuse) the virtualenv and install the project with its test extra.
# torch==2.13.0 first: on machines without a GPU that pin takes the CPU build.
# pip's chatter is kept back (its "WARNING: Location ... is ignored" lines, the editable-install
# notice): a step that succeeds prints nothing; one that fails prints pip's output, less that noise.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${INFIRE_VENV:-.venv}
NOISE='^WARNING: Location .* is ignored|[Ee]ditable (install|mode)|^DEPRECATION: .*editable|^[[:space:]]*!!+[[:space:]]*$|^\[notice\]'

pip_install() {
  local out rc=0
  out=$(mktemp)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$out" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "setup: pip install $* failed (exit $rc):" >&2
    grep -v -E "$NOISE" "$out" >&2 || true
  fi
  rm -f "$out"
  return "$rc"
}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.infire-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing torch and the project into $VENV (minutes the first time)" >&2
  pip_install --upgrade pip
  pip_install "torch==2.13.0" 2>/dev/null || pip_install "torch>=2.11"
  pip_install -e '.[dev]'
  touch "$stamp"
fi
