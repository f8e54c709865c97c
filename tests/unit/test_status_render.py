"""The CLI's human output: byte counts, durations, tables and ``infire-agent status``."""

from __future__ import annotations

from agent.commands._admin import human_duration, table
from agent.commands.status import render
from cache.sizes import human_bytes


def test_status_rendering() -> None:
    assert human_bytes(None) == "-" and human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.0 GiB"
    assert human_duration(59) == "59s" and human_duration(3700) == "1h01m"
    assert table(["A", "BB"], [["x", "y"]]).splitlines() == ["A  BB", "x  y"]
    st = {"version": "0.1.0", "uptime_s": 65, "ready": False, "draining": False,
          "worker": {"pid": 7, "alive": True, "device": "cpu", "restarts": 2},
          "budget": {"total_bytes": 1 << 30, "used_bytes": 1 << 20}, "cache": {"max_bytes": 1 << 30, "used_bytes": 0},
          "models": [{"name": "m", "state": "failed", "reason": "load failed: boom", "device_bytes": 0,
                      "kv_pages": {"used": 0, "total": 0}, "in_flight": 0, "last_used": None}]}
    st["models"].append({"name": "p", "state": "pulling", "pull": {"done_bytes": 1 << 29, "total_bytes": 1 << 30},
                         "device_bytes": 0, "kv_pages": {}, "in_flight": 0, "last_used": None})
    out = render(st)
    assert "pulling 50% of 1.0 GiB" in out
    assert "NOT READY" in out and "worker restarts: 2" in out and "load failed: boom" in out and "never" in out
    assert "engine:" not in out  # no memory report from the worker yet
    st["engine"] = {"memory": {"budget": 4 << 30, "used": 3 << 30, "weights": 2 << 30, "workspace": 0,
                               "kv": 1 << 30, "kv_used": 1 << 29, "kv_pages": 64, "kv_pages_free": 32}}
    line = next(ln for ln in render(st).splitlines() if ln.startswith("engine:"))
    assert line == ("engine: 3.0 GiB of 4.0 GiB = weights 2.0 GiB + workspace 0 B + KV pool 1.0 GiB "
                    "(512.0 MiB in use, 32 of 64 pages free)"), line
