#!/usr/bin/env bash
# Create (or reuse) the virtualenv and install the project with its test extra.
# torch==2.13.0 first: on machines without a GPU that pin takes the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${INFIRE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.infire-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" || "$VENV/bin/python" -m pip install -q "torch>=2.11"
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
