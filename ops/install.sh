#!/usr/bin/env bash
# Install infire-agent as a systemd service: venv, unit, user, dirs, environment file with a
# fresh admin token. Idempotent: re-running upgrades the code and unit, keeps agent.env.
#
#   sudo ops/install.sh [--prefix /opt/infire-agent] [--source DIR] [--python python3]
#                       [--root DIR] [--skip-venv] [--no-start]
#
# --root installs into another root (image builds, tests): no systemctl, no start.
# --skip-venv leaves $PREFIX/venv alone (already provisioned, or a test).
set -euo pipefail

PREFIX=/opt/infire-agent
SOURCE=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=python3
ROOT=
SKIP_VENV=0
START=1

die() { echo "install.sh: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=${2:?}; shift 2 ;;
    --source) SOURCE=${2:?}; shift 2 ;;
    --python) PYTHON=${2:?}; shift 2 ;;
    --root) ROOT=${2:?}; START=0; shift 2 ;;
    --skip-venv) SKIP_VENV=1; shift ;;
    --no-start) START=0; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done
case "$PREFIX" in /*) ;; *) die "--prefix must be absolute: $PREFIX" ;; esac
[ -f "$SOURCE/systemd/infire-agent.service" ] || die "$SOURCE is not an infire-agent checkout"
if [ -z "$ROOT" ] && [ "$(id -u)" -ne 0 ]; then die "run as root (or use --root DIR)"; fi

R=${ROOT%/}
SYSTEMD_DIR=$R/etc/systemd/system
install -d -m 0755 "$R$PREFIX" "$R$PREFIX/docs" "$SYSTEMD_DIR" "$R/usr/lib/sysusers.d" "$R/usr/lib/tmpfiles.d"
install -d -m 0750 "$R/etc/infire"

# 1. Code: a private virtualenv. torch picks the CUDA or CPU build for this machine.
if [ "$SKIP_VENV" -eq 0 ]; then
  "$PYTHON" -m venv "$R$PREFIX/venv"
  "$R$PREFIX/venv/bin/python" -m pip install -q --upgrade pip
  "$R$PREFIX/venv/bin/python" -m pip install -q "$SOURCE"
fi

# 2. User and directories (sysusers.d, tmpfiles.d), then the unit with our prefix.
install -m 0644 "$SOURCE/systemd/sysusers.d/infire-agent.conf" "$R/usr/lib/sysusers.d/infire-agent.conf"
install -m 0644 "$SOURCE/systemd/tmpfiles.d/infire-agent.conf" "$R/usr/lib/tmpfiles.d/infire-agent.conf"
sed "s#/opt/infire-agent#$PREFIX#g" "$SOURCE/systemd/infire-agent.service" > "$SYSTEMD_DIR/infire-agent.service.tmp"
chmod 0644 "$SYSTEMD_DIR/infire-agent.service.tmp"
mv -f "$SYSTEMD_DIR/infire-agent.service.tmp" "$SYSTEMD_DIR/infire-agent.service"
install -m 0644 "$SOURCE/docs/operations.md" "$R$PREFIX/docs/operations.md"
install -m 0644 "$SOURCE/systemd/infire-agent.env.example" "$R$PREFIX/docs/infire-agent.env.example"

# Growing restart delays need systemd >= 254; older versions would warn about unknown keys.
SD_VERSION=$(systemctl --version 2>/dev/null | awk 'NR==1 {print $2}')
if [ -n "$SD_VERSION" ] && [ "$SD_VERSION" -ge 254 ] 2>/dev/null; then
  install -d -m 0755 "$SYSTEMD_DIR/infire-agent.service.d"
  install -m 0644 "$SOURCE/systemd/restart-backoff.conf" "$SYSTEMD_DIR/infire-agent.service.d/restart-backoff.conf"
fi

# 3. Environment file: created once from the example with a random admin token; never
#    overwritten, since it holds the operator's settings and secrets.
ENV_FILE=$R/etc/infire/agent.env
if [ ! -s "$ENV_FILE" ]; then
  umask 077
  TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  { sed "s/^#INFIRE_ADMIN_TOKEN=$/INFIRE_ADMIN_TOKEN=$TOKEN/" "$SOURCE/systemd/infire-agent.env.example"; } > "$ENV_FILE.tmp"
  chmod 0600 "$ENV_FILE.tmp"
  mv -f "$ENV_FILE.tmp" "$ENV_FILE"
  echo "install.sh: wrote $ENV_FILE with a new admin token (INFIRE_ADMIN_TOKEN)"
fi
chmod 0600 "$ENV_FILE"

# 4. Apply: create the user and dirs now, reload systemd, enable and start.
if [ -n "$ROOT" ]; then
  if command -v systemd-sysusers >/dev/null; then systemd-sysusers --root="$R"; fi
  if command -v systemd-tmpfiles >/dev/null; then systemd-tmpfiles --root="$R" --create; fi
  echo "install.sh: installed into $R (not started)"
  exit 0
fi
systemd-sysusers
systemd-tmpfiles --create /usr/lib/tmpfiles.d/infire-agent.conf
systemctl daemon-reload
if [ "$START" -eq 1 ]; then
  systemctl enable --now infire-agent.service
  echo "install.sh: started; check with: systemctl status infire-agent; $PREFIX/venv/bin/infire-agent status"
else
  systemctl enable infire-agent.service
  echo "install.sh: enabled, not started: systemctl start infire-agent"
fi
