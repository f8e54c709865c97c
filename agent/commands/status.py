"""``infire-agent status [--json]``: what the agent is doing; exit 1 when it is down."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from agent.commands._admin import (
    EXIT_FAIL, EXIT_OK, EXIT_USAGE, MODEL_HEADERS, add_common, client, human_duration, model_rows, table,
)
from cache.sizes import human_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="models, budget, cache and worker of the running agent")
    add_common(p)
    p.add_argument("--json", action="store_true", help="print the admin API's status JSON")
    p.set_defaults(func=run)


def render(st: dict[str, Any]) -> str:
    w, b, c = st["worker"], st["budget"], st["cache"]
    worker = f"worker pid {w['pid']} ({w.get('device') or '?'})" if w.get("alive") else "worker DOWN"
    if w.get("engine_error"):
        worker += f" engine error: {w['engine_error']}"
    head = [
        f"infire-agent {st['version']}  up {human_duration(st['uptime_s'])}  {worker}  "
        f"{'ready' if st.get('ready') else 'NOT READY'}" + ("  draining" if st.get("draining") else ""),
        f"budget: {human_bytes(b.get('used_bytes'))} used of {human_bytes(b.get('total_bytes'))}"
        f"   cache: {human_bytes(c.get('used_bytes'))} used of {human_bytes(c.get('max_bytes'))}"
        f"   worker restarts: {w.get('restarts', 0)}",
    ]
    mem = (st.get("engine") or {}).get("memory")
    if mem:  # the engine's own books, as the worker last reported them
        head.append(f"engine: {human_bytes(mem.get('used'))} of {human_bytes(mem.get('budget'))}"
                    f" = weights {human_bytes(mem.get('weights'))} + workspace {human_bytes(mem.get('workspace'))}"
                    f" + KV pool {human_bytes(mem.get('kv'))} ({human_bytes(mem.get('kv_used'))} in use,"
                    f" {mem.get('kv_pages_free', 0)} of {mem.get('kv_pages', 0)} pages free)")
    head.append("")
    models = st.get("models") or []
    body = table(MODEL_HEADERS, model_rows(models)) if models else "no models known (try: infire-agent pull NAME)"
    return "\n".join(head) + body


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
