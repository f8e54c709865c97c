"""serve_bench's arithmetic and /proc reading (the load itself runs against a live agent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from ops.bench.serve_bench import cpu_seconds, report, tree_cpu_delta, tree_cpu_seconds, tree_pids


def test_report_keys_and_math() -> None:
    ok = {"ttft": 0.1, "e2e": 1.0, "out": 10, "in": 5, "tpot": 0.01}
    r = report([ok, dict(ok, ttft=0.3, tpot=None, out=1), {"error": "HTTP 503"}], 2.0,
               {"agent": 0.5, "worker": 1.0, "children": 0.25})
    for key in ("requests", "req_s", "output_tok_s", "total_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                "tpot_ms_p99", "cpu_cores", "cpu_cores_children"):
        assert key in r
    assert r["requests"] == 3 and r["errors"] == 1 and r["first_error"] == "HTTP 503"
    assert r["req_s"] == 1.0 and r["output_tok_s"] == 5.5 and r["total_tok_s"] == 10.5
    assert r["ttft_ms_p99"] == 300.0 and r["tpot_ms_p50"] == 10.0
    # cpu_cores is the whole process tree: agent + worker + the other descendants.
    assert (r["cpu_cores_agent"], r["cpu_cores_worker"], r["cpu_cores_children"], r["cpu_cores"]) == (
        0.25, 0.5, 0.125, 0.875)


def test_cpu_seconds_of_a_live_and_a_missing_process() -> None:
    before = cpu_seconds(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    assert cpu_seconds(os.getpid()) > before
    assert cpu_seconds(None) == 0.0 and cpu_seconds(2**22 + 12345) == 0.0


def test_the_process_tree_counts_every_descendant_once() -> None:
    # This process as the "agent", one child as the "worker", and a grandchild under it that burns
    # CPU: the grandchild is a child of the tree, not the worker's figure.
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(30)"
    spawn = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {burn!r}]); time.sleep(30)"
    worker = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            grand = {c.pid for c in psutil.Process(worker.pid).children()}
            if grand:
                break
            time.sleep(0.05)
        parts = tree_pids(os.getpid(), worker.pid)
        # (Other children of this test process, left by earlier tests, may be among the children too.)
        assert parts["agent"] == {os.getpid()} and parts["worker"] == {worker.pid} and len(grand) == 1
        assert grand <= parts["children"] and not parts["children"] & {os.getpid(), worker.pid}
        before = tree_cpu_seconds(parts)
        while time.monotonic() < deadline:  # the grandchild burns what is left of its 0.6 s of CPU
            cpu = tree_cpu_delta(before, tree_cpu_seconds(tree_pids(os.getpid(), worker.pid)))
            if cpu["children"] >= 0.2:
                break
            time.sleep(0.05)
        assert set(cpu) == {"agent", "worker", "children"}
        assert cpu["children"] >= 0.2 and cpu["worker"] < 0.2  # the worker itself only sleeps
        # A process that appears between two readings counts whole.
        assert tree_cpu_delta({"children": {}}, {"children": {1: 0.5, 2: 0.25}}) == {"children": 0.75}
        assert tree_cpu_delta({"worker": {7: 1.0}}, {"worker": {7: 1.5}}) == {"worker": 0.5}
    finally:
        for c in psutil.Process(worker.pid).children(recursive=True):
            c.kill()
        worker.kill()
        worker.wait()


def test_results_name_the_host_cpu(tmp_path) -> None:
    from ops.bench.engine_bench import save_result

    path = save_result({"x": 1}, str(tmp_path / "r.json"), "unused")
    host = json.loads(path.read_text())["host"]
    assert host["cpu"] and host["cores"] >= 1
