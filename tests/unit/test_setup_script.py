"""scripts/setup.sh keeps pip's noise back (``WARNING: Location ... is ignored``, the
editable-install notice) and shows a real failure: run against a stand-in ``python`` that
talks like pip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE = """#!/usr/bin/env bash
for i in 1 2 3; do echo "WARNING: Location 'https://mirror/simple/x$i/' is ignored: it is either a non-existing path or lacks a specific scheme." >&2; done
echo "  !!" >&2
echo "  Editable install will be performed using a meta path finder." >&2
if [ -n "${FAIL_ON:-}" ] && [[ "$*" == *"$FAIL_ON"* ]]; then echo "ERROR: No matching distribution found for $FAIL_ON" >&2; exit 1; fi
exit 0
"""


def _venv(tmp: Path) -> Path:
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(FAKE)
    py.chmod(0o755)
    return venv


def test_setup_is_quiet_when_pip_succeeds(tmp_path: Path) -> None:
    env = {**os.environ, "INFIRE_VENV": str(_venv(tmp_path))}
    r = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "WARNING: Location" not in out and "Editable" not in out and "!!" not in out, out


def test_setup_shows_a_real_failure_without_the_noise(tmp_path: Path) -> None:
    env = {**os.environ, "INFIRE_VENV": str(_venv(tmp_path)), "FAIL_ON": "-e"}
    r = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "ERROR: No matching distribution found" in r.stderr and "failed" in r.stderr, r.stderr
    assert "WARNING: Location" not in r.stderr and "Editable" not in r.stderr, r.stderr
    assert not (tmp_path / "venv" / ".infire-installed").exists()
