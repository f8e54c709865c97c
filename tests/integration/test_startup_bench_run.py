"""The startup benchmark runs end to end on CPU (a tiny model, one restart): it starts the daemon the
way serve_bench does, so a change to those helpers that it was not updated for shows here and not
first on the GPU machine. Figures are not checked for speed, only for consistency."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.agent_harness import REPO


def test_startup_bench_measures_a_start_and_a_restart(tmp_path) -> None:
    out = tmp_path / "startup.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "INFIRE_ENGINE__SANDBOX": "false"}
    r = subprocess.run([sys.executable, "-m", "ops.bench.startup_bench", "--arch", "llama", "--preset", "tiny",
                        "--device", "cpu", "--restarts", "1", "--max-model-len", "256", "--max-num-seqs", "4",
                        "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    report = json.loads(out.read_text())
    for key in ("date", "gpu", "commit", "command", "model", "first_start_to_ready_s", "first_token_after_start_s",
                "restart_to_ready_s", "restart_to_ready_s_worst", "first_token_after_restart_s", "starts"):
        assert key in report, key
    assert report["mode"] == "startup" and report["gpu"] == "none (cpu)"
    assert len(report["restart_to_ready_s"]) == 1 and report["restart_to_ready_s_worst"] == report["restart_to_ready_s"][0]
    first, restart = report["starts"]
    assert (first["start"], restart["start"]) == ("first", "restart")
    for s in (first, restart):
        assert s["exit_code"] == 0 and 0 < s["livez_s"] <= s["readyz_s"] <= s["first_token_s"]
        names = {p["name"] for p in s["phases"]}
        assert {"agent_start", "worker_hello", "model_load", "model_canary"} <= names
    # The first start pulls the model; the restart finds it in the cache.
    assert "model_pull" in {p["name"] for p in first["phases"]}
    assert "model_pull" not in {p["name"] for p in restart["phases"]}
