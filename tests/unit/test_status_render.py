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
    assert "used =" not in out  # no memory report from the worker yet
    budget = [ln for ln in out.splitlines() if ln.startswith("budget")]
    assert budget == ["budget: 1.0 MiB used / 1023.0 MiB free / 0 B evictable of 1.0 GiB CPU memory"], budget
    st["engine"] = {"memory": {"budget": 4 << 30, "used": 3 << 30, "weights": 2 << 30, "workspace": 0,
                               "kv": 1 << 30, "kv_used": 1 << 29, "kv_pages": 64, "kv_pages_free": 32}}
    lines = render(st).splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("budget"))
    assert lines[i] == "budget: 3.0 GiB used / 1.0 GiB free / 0 B evictable of 4.0 GiB CPU memory", lines[i]
    assert lines[i + 1] == ("  used = weights 2.0 GiB + workspace 0 B + KV pool 1.0 GiB "
                            "(512.0 MiB in use, 32 of 64 pages free)"), lines[i + 1]
    st["engine"]["memory"].update(vacant=1 << 29, weights=(2 << 30) - (1 << 29))  # an unloaded model's, kept
    line = next(ln for ln in render(st).splitlines() if ln.startswith("  used = "))
    assert line == ("  used = weights 1.5 GiB + workspace 0 B + vacant 512.0 MiB (kept for the next load of its "
                    "kind) + KV pool 1.0 GiB (512.0 MiB in use, 32 of 64 pages free)"), line
    st["engine"]["memory"].update(step=1 << 29, weights=(2 << 30) - (1 << 30))  # a GPU's step booking
    line = next(ln for ln in render(st).splitlines() if ln.startswith("  used = "))
    assert line == ("  used = weights 1.0 GiB + workspace 0 B + step 512.0 MiB (two of the largest, for all models)"
                    " + vacant 512.0 MiB (kept for the next load of its kind) + KV pool 1.0 GiB (512.0 MiB in use,"
                    " 32 of 64 pages free)"), line


def _model(name: str, state: str, device_bytes: int, **kw) -> dict:
    return {"name": name, "state": state, "reason": None, "device_bytes": device_bytes, "kv_pages": {},
            "in_flight": 0, "last_used": None, "pinned": False, **kw}


def test_budget_line_counts_what_a_load_may_evict() -> None:
    """Evictable: ready, unpinned models with nothing in flight (the manager's rule)."""
    st = {"version": "0.1.0", "uptime_s": 1, "ready": True,
          "worker": {"pid": 7, "alive": True, "device": "cuda:0", "restarts": 0},
          "budget": {"total_bytes": 80 << 30, "used_bytes": 30 << 30}, "cache": {"max_bytes": 1 << 40, "used_bytes": 0},
          "models": [_model("idle", "ready", 8 << 30), _model("pinned", "ready", 10 << 30, pinned=True),
                     _model("busy", "ready", 12 << 30, in_flight=3), _model("cold", "cached", 0)]}
    out = render(st)
    budget = [ln for ln in out.splitlines() if ln.startswith("budget")]
    assert budget == ["budget: 30.0 GiB used / 50.0 GiB free / 8.0 GiB evictable of 80.0 GiB GPU memory"], budget
    header = next(ln for ln in out.splitlines() if ln.startswith("MODEL"))
    assert header.split()[:4] == ["MODEL", "STATE", "GPU", "MEM"]


def test_memory_is_named_by_the_device() -> None:
    st = {"version": "0.1.0", "uptime_s": 1, "ready": True,
          "worker": {"pid": 7, "alive": True, "device": "cpu", "restarts": 0},
          "budget": {"total_bytes": None, "used_bytes": 0, "fraction": 0.9}, "cache": {"max_bytes": 1, "used_bytes": 0},
          "models": [_model("m", "cached", 0)]}
    out = render(st)
    header = next(ln for ln in out.splitlines() if ln.startswith("MODEL"))
    assert "CPU MEM" in header and "GPU" not in out
    assert "budget: not known yet (the engine worker sizes it when it starts)" in out


def test_the_fp8_column_says_what_of_a_model_is_e4m3() -> None:
    st = {"version": "0.1.0", "uptime_s": 1, "ready": True,
          "worker": {"pid": 7, "alive": True, "device": "cuda:0", "restarts": 0},
          "budget": {"total_bytes": 80 << 30, "used_bytes": 30 << 30}, "cache": {"max_bytes": 1 << 40, "used_bytes": 0},
          "models": [_model("a", "ready", 8 << 30, quantization="fp8", kv_cache_dtype="fp8"),
                     _model("b", "ready", 8 << 30, quantization="fp8", kv_cache_dtype=None),
                     _model("c", "ready", 15 << 30, quantization=None, kv_cache_dtype=None)]}
    lines = render(st).splitlines()
    header = next(ln for ln in lines if ln.startswith("MODEL"))
    col = header.index("FP8")
    cells = {ln.split()[0]: ln[col:].split()[0] for ln in lines[lines.index(header) + 1:]}
    assert cells == {"a": "weights+kv", "b": "weights", "c": "-"}


def test_status_shows_the_url_the_idle_unload_and_a_capped_reason() -> None:
    """The listen URL; each model's time to an idle unload; its last unload's or failure's reason
    in a capped column, so a long one never widens the table."""
    long = "load failed: " + "x" * 700
    st = {"version": "0.1.0", "uptime_s": 1, "ready": True, "listen": "http://127.0.0.1:8080",
          "worker": {"pid": 7, "alive": True, "device": "cpu", "restarts": 0},
          "budget": {"total_bytes": 1 << 30, "used_bytes": 0}, "cache": {"max_bytes": 1 << 30, "used_bytes": 0},
          "models": [_model("a", "ready", 1 << 20, keep_alive_s=300, unload_in_s=125.0),
                     _model("b", "failed", 0, reason=long),
                     _model("c", "cached", 0, reason="idle past keep_alive"),
                     _model("d", "ready", 1 << 20, keep_alive_s=-1, unload_in_s=None),
                     _model("e", "ready", 1 << 20, keep_alive_s=300, pinned=True)]}
    out = render(st)
    assert "http://127.0.0.1:8080/v1" in out
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("MODEL"))
    assert "UNLOAD IN" in header and "REASON" in header
    rows = {ln.split()[0]: ln for ln in lines[lines.index(header) + 1:]}
    assert "2m05s" in rows["a"] and "never" in rows["d"] and "pinned" in rows["e"]
    assert "idle past keep_alive" in rows["c"]
    assert "load failed: xxx" in rows["b"] and "…" in rows["b"]
    assert max(len(ln) for ln in lines) < 200, max(len(ln) for ln in lines)
