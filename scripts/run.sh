#!/usr/bin/env bash
# The run command: sets itself up, then starts the embedded default (`infire-agent demo`):
# a local file store seeded with a small generated model, the daemon on loopback, one streamed
# chat answer. Extra arguments go to `demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${INFIRE_VENV:-.venv}/bin/infire-agent" demo "$@"
