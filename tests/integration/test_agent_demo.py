"""``infire-agent demo`` (the README's run command) end to end, in a temporary folder."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from tests.integration.agent_harness import REPO, free_port


def test_demo_end_to_end_then_reuse(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "INFIRE_ENGINE__SANDBOX": "false",
           "INFIRE_SERVER__RUNTIME_DIR": str(tmp_path / "run")}  # the admin socket, away from a real agent's
    cmd = [sys.executable, "-m", "agent.cli", "demo", "--dir", str(tmp_path / "demo"), "--port", str(free_port()),
           "--preset", "tiny", "--max-tokens", "8"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    pid_match = re.search(r"\(pid (\d+),", r.stdout)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "publishing demo-llama" in r.stdout and "demo-llama is ready" in r.stdout
        assert re.search(r"==> \d+ tokens in", r.stdout)
        assert "status" in r.stdout and "/v1/chat/completions" in r.stdout
        assert pid_match is not None
        again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
        assert "already has demo-llama" in again.stdout and "already running" in again.stdout
    finally:
        if pid_match is not None:
            pid = int(pid_match.group(1))
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
