"""The room policy simulator (ops/bench/room_sim.py) runs the manager's own code against its
simulated engine: requests are served, no more models are resident than fit, and a node of more
models than slots swaps (loads in the window, drains of busy models)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_room_simulator_serves_and_swaps_within_its_slots(tmp_path) -> None:
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "-m", "ops.bench.room_sim", "--models", "5", "--slots", "2", "--rate", "6",
                        "--zipf", "0.5", "--duration", "4", "--gen-len", "64", "--step-ms", "5", "--load-s", "0.05",
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    o = res["overall"]
    assert o["requests"] > 10 and o["errors"] == 0 and o["max_resident"] <= 2
    assert o["loads"] > 0 and o["swap_requests"] > 0 and o["swap_ttft_ms_p50"] >= 50  # a load at least
    assert o["drains"] > 0  # busy models drained for loads (one at a time holds the two slots)
