"""``infire-agent status [--json]``: what the agent is doing; exit 1 when it is down."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agent.commands._admin import (
    EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_common, client, human_duration, memory_name, model_table,
)
from cache.sizes import human_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="models, budget, cache and worker of the running agent",
                       description="What the running agent is doing: where it listens, its engine worker, the "
                       "memory budget, the disk cache, and each model's state, memory, time left before an idle "
                       "unload (keep_alive) and the reason of its last unload or failure (cut to fit the table; "
                       "--json has it whole). Exit 1 when no agent answers.")
    add_common(p)
    p.add_argument("--json", action="store_true", help="print the admin API's status JSON")
    p.set_defaults(func=run)


def budget_line(st: dict[str, Any]) -> list[str]:
    """The memory budget at a glance: used / free / evictable of the total, named by device;
    then what the used part is made of, when the engine has reported its books."""
    b, w = st.get("budget") or {}, st.get("worker") or {}
    mem = (st.get("engine") or {}).get("memory") or {}
    what = f"{memory_name(w.get('device'))} memory"
    total = mem.get("budget") or b.get("total_bytes")
    if not total:
        return ["budget: not known yet (the engine worker sizes it when it starts)"]
    used = int(mem.get("used", b.get("used_bytes")) or 0)
    # What a load may evict now (the manager's rule): ready, unpinned, nothing in flight.
    evictable = sum(int(m.get("device_bytes") or 0) for m in st.get("models") or []
                    if m.get("state") == "ready" and not m.get("pinned") and not m.get("in_flight"))
    lines = [f"budget: {human_bytes(used)} used / {human_bytes(max(0, total - used))} free / "
             f"{human_bytes(evictable)} evictable of {human_bytes(total)} {what}"]
    if mem:  # the engine's own books, as the worker last reported them
        vacant = f" + vacant {human_bytes(mem.get('vacant'))} (kept for the next load of its kind)" if mem.get("vacant") else ""
        step = f" + step {human_bytes(mem.get('step'))} (two of the largest, for all models)" if mem.get("step") else ""
        lines.append(f"  used = weights {human_bytes(mem.get('weights'))} + workspace {human_bytes(mem.get('workspace'))}"
                     f"{step}{vacant} + KV pool {human_bytes(mem.get('kv'))} ({human_bytes(mem.get('kv_used'))} in use,"
                     f" {mem.get('kv_pages_free', 0)} of {mem.get('kv_pages', 0)} pages free)")
    return lines


def render(st: dict[str, Any]) -> str:
    w, c = st["worker"], st["cache"]
    worker = f"worker pid {w['pid']} ({w.get('device') or '?'})" if w.get("alive") else "worker DOWN"
    if w.get("engine_error"):
        worker += f" engine error: {w['engine_error']}"
    head = [
        f"infire-agent {st['version']}  up {human_duration(st['uptime_s'])}  {worker}  "
        f"{'ready' if st.get('ready') else 'NOT READY'}" + ("  draining" if st.get("draining") else ""),
        *([f"listening on {st['listen']}  (OpenAI API: {st['listen']}/v1)"] if st.get("listen") else []),
        *budget_line(st),
        f"cache: {human_bytes(c.get('used_bytes'))} used of {human_bytes(c.get('max_bytes'))}"
        f"   worker restarts: {w.get('restarts', 0)}",
        "",
    ]
    return "\n".join(head) + model_table(st)


def run(args: argparse.Namespace) -> int:
    from agent.admin_client import AdminError, AgentDown

    c = client(args)
    if c is None:
        return EXIT_USAGE
    try:
        st = c.status()
    except AgentDown as e:
        if args.json:
            print(json.dumps({"up": False, "error": str(e)}))
        else:
            print(f"infire-agent is not running: {e}", file=sys.stderr)
        return EXIT_FAIL
    except AdminError as e:
        print(f"status: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(json.dumps(st, indent=2) if args.json else render(st))
    return EXIT_OK
