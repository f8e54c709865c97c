"""``infire-agent models [--json]``: every model the agent knows and its state."""

from __future__ import annotations

import argparse
import json
import sys

from agent.commands._admin import EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_common, client, model_table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the agent's models and their states",
                       description='List every model the running agent knows (configured, cached, in its store and asked for) with its state, memory, KV pages, prefix cache, requests in flight, last use, time left before an idle unload and the reason of its last unload or failure.')
    add_common(p)
    p.add_argument("--json", action="store_true", help="print the models as the admin API's JSON list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.admin_client import AdminError, AgentDown

    c = client(args)
    if c is None:
        return EXIT_USAGE
    try:
        st = c.status()  # the models, and the worker's device that names the memory column
    except AgentDown as e:
        print(f"infire-agent is not running: {e}", file=sys.stderr)
        return EXIT_FAIL
    except AdminError as e:
        print(f"models: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(json.dumps(st.get("models") or [], indent=2) if args.json else model_table(st))
    return EXIT_OK
