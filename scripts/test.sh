#!/usr/bin/env bash
# The test command: sets itself up on a fresh machine, then runs the suite (CPU; tests/gpu skip
# without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "${INFIRE_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@"
