"""Shared bits of the admin CLI commands: settings → client, human formatting, exit codes."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from cache.sizes import human_bytes

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: $INFIRE_CONFIG)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the agent")


def client(args: argparse.Namespace) -> Any:
    """An AdminClient from the settings, or None (message printed) when the config is bad."""
    from agent.admin_client import AdminClient
    from agent.config import ConfigError, load_settings

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return None
    return AdminClient.from_settings(settings, timeout=args.timeout)


def human_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def ago(wall: float | None) -> str:
    return "never" if wall is None else human_duration(max(0.0, time.time() - wall)) + " ago"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), *(line(r) for r in rows)])


def model_rows(models: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for m in models:
        kv = m.get("kv_pages") or {}
        state = m["state"]
        pull = m.get("pull") or {}
        if m["state"] == "pulling" and pull.get("total_bytes"):
            state += f" {100 * pull['done_bytes'] / pull['total_bytes']:.0f}% of {human_bytes(pull['total_bytes'])}"
        rows.append([m["name"], state, human_bytes(m.get("device_bytes")), _format_cell(m),
                     f"{kv.get('used', 0)}/{kv.get('total', 0)}", _prefix_cell(m), str(m.get("in_flight", 0)),
                     ago(m.get("last_used")), _unload_cell(m), clip(m.get("reason") or "", REASON_WIDTH)])
    return rows


REASON_WIDTH = 48  # the REASON column's cap: a long failure never widens the table (--json has it whole)


def clip(text: str, width: int) -> str:
    """``text`` on one line, at most ``width`` characters (an ellipsis says it was cut)."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _unload_cell(m: dict[str, Any]) -> str:
    """The UNLOAD IN column: time left before an idle unload (keep_alive), or why there is none."""
    if m.get("state") != "ready":
        return "-"
    if m.get("pinned"):
        return "pinned"
    if (m.get("keep_alive_s") or 0) < 0:
        return "never"
    left = m.get("unload_in_s")
    return "busy" if left is None else human_duration(left)


def _format_cell(m: dict[str, Any]) -> str:
    """The FP8 column: what of the model is e4m3 (its weights, its KV cache), or "-"."""
    parts = [p for p, on in (("weights", m.get("quantization") == "fp8"), ("kv", m.get("kv_cache_dtype") == "fp8"))
             if on]
    return "+".join(parts) if parts else "-"


def _prefix_cell(m: dict[str, Any]) -> str:
    """The PREFIX CACHE column: the pages the cache holds and its hit rate, or "off"."""
    prefix = m.get("prefix_cache") or {}
    if not prefix.get("enabled"):
        return "off"
    pages = (m.get("kv_pages") or {}).get("prefix_cached", 0)
    if not prefix.get("queried_tokens"):
        return str(pages)
    return f"{pages} ({100 * prefix['hit_tokens'] / prefix['queried_tokens']:.0f}% hit)"


def memory_name(device: str | None) -> str:
    """What the budget is of, by the worker's device: "GPU" on CUDA, "CPU" on the CPU."""
    d = (device or "").split(":")[0].lower()
    return {"cuda": "GPU", "cpu": "CPU"}.get(d, "DEVICE")


def model_headers(device: str | None) -> list[str]:
    """The model table's columns; the memory column is named by the worker's device."""
    return ["MODEL", "STATE", f"{memory_name(device)} MEM", "FP8", "KV PAGES", "PREFIX CACHE", "IN-FLIGHT",
            "LAST USE", "UNLOAD IN", "REASON"]


def model_table(st: dict[str, Any]) -> str:
    """The models of a status answer as a table, or a line saying there are none."""
    models = st.get("models") or []
    if not models:
        return "no models known (try: infire-agent load NAME)"
    return table(model_headers((st.get("worker") or {}).get("device")), model_rows(models))
