"""serve_bench's arithmetic and /proc reading (the load itself runs against a live agent)."""

from __future__ import annotations

import os
import time

from ops.bench.serve_bench import cpu_seconds, report


def test_report_keys_and_math() -> None:
    ok = {"ttft": 0.1, "e2e": 1.0, "out": 10, "in": 5, "tpot": 0.01}
    r = report([ok, dict(ok, ttft=0.3, tpot=None, out=1), {"error": "HTTP 503"}], 2.0, {"agent": 0.5, "worker": 1.0})
    for key in ("requests", "req_s", "output_tok_s", "total_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                "tpot_ms_p99", "cpu_cores"):
        assert key in r
    assert r["requests"] == 3 and r["errors"] == 1 and r["first_error"] == "HTTP 503"
    assert r["req_s"] == 1.0 and r["output_tok_s"] == 5.5 and r["total_tok_s"] == 10.5
    assert r["ttft_ms_p99"] == 300.0 and r["tpot_ms_p50"] == 10.0
    assert (r["cpu_cores_agent"], r["cpu_cores_worker"], r["cpu_cores"]) == (0.25, 0.5, 0.75)


def test_cpu_seconds_of_a_live_and_a_missing_process() -> None:
    before = cpu_seconds(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    assert cpu_seconds(os.getpid()) > before
    assert cpu_seconds(None) == 0.0 and cpu_seconds(2**22 + 12345) == 0.0
