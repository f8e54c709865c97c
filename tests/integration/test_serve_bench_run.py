"""The daemon-level benchmark runs end to end on CPU (a tiny model, a few requests): it starts the
daemon the way `demo` does, so a change to those helpers that the bench was not updated for shows
here and not first on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.agent_harness import REPO


def test_serve_bench_runs_against_a_real_daemon(tmp_path) -> None:
    out = tmp_path / "serve.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "INFIRE_ENGINE__SANDBOX": "false"}
    r = subprocess.run([sys.executable, "-m", "ops.bench.serve_bench", "--arch", "llama", "--preset", "tiny",
                        "--device", "cpu", "--num-requests", "6", "--concurrency", "3",
                        "--max-num-seqs", "4", "--penalised-fraction", "0.5", "--scrape-gauges", "0.05",
                        "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["requests"] == 6 and report["req_s"] > 0 and report["mode"] == "concurrency-3"
    assert report["warmup_requests"] == 3  # the concurrency's worth, before the measured window
    # half of them (seeded) carry the penalties the engine applies on the device; both kinds served
    assert 0 < report["penalised_requests"] < 6 and report["errors"] == 0, report
    assert report["tpot_ms_p50_penalised"] > 0 and report["tpot_ms_p50_plain"] > 0
    # the gateway's gauges as its picker scrapes them: requests ran and held pages in the window
    # (never more running than the model's max_num_seqs), and nothing is left once it drained
    g = report["gateway_gauges"]
    assert g["samples"] > 5 and g["failures"] == 0, g
    assert 1 <= g["running"]["max"] <= 4 and 0 < g["kv_usage"]["max"] <= 1, g
    assert g["after"] == {"waiting": 0, "running": 0, "kv_usage": 0}, g
    assert g["cache_config"]["block_size"] == "16" and int(g["cache_config"]["num_gpu_blocks"]) > 0, g


def test_long_context_bench_runs_against_a_real_daemon(tmp_path) -> None:
    out = tmp_path / "long.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "INFIRE_ENGINE__SANDBOX": "false"}
    r = subprocess.run([sys.executable, "-m", "ops.bench.long_context_bench", "--preset", "tiny", "--device", "cpu",
                        "--lengths", "64,128", "--long-len", "96", "--long-n", "2", "--short-concurrency", "2",
                        "--short-len", "16", "--short-out", "8", "--out-tokens", "8", "--max-model-len", "256",
                        "--short-lead-s", "0.5", "--decode-step-tokens", "32", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    report = json.loads(out.read_text())
    assert [row["prompt"] for row in report["single"]] == [64, 128] and report["decode_step_tokens"] == 32
    assert all(row["prefill_tok_s"] > 0 and row["out"] == 8 for row in report["single"])
    mixed = report["mixed"]
    assert mixed["errors"] == 0 and mixed["long_ttft_ms_max"] > 0 and mixed["short_requests_in_window"] >= 1
    assert mixed["short_tpot_ms_p50"] > 0
    steps = mixed["engine_steps"]  # the engine's steps over the window, from the agent's status
    assert steps["steps"] > 0 and steps["step_ms"] > 0 and 0 <= steps["mixed_graph_share"] <= 1
