"""``infire-agent models [--json]``: every model the agent knows and its state."""

from __future__ import annotations

import argparse
import json
import sys

from agent.commands._admin import EXIT_FAIL, EXIT_OK, EXIT_USAGE, MODEL_HEADERS, add_common, client, model_rows, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the agent's models and their states")
    add_common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.admin_client import AdminError, AgentDown

    c = client(args)
    if c is None:
        return EXIT_USAGE
    try:
        models = c.models()
    except (AgentDown, AdminError) as e:
        print(f"models: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(json.dumps(models, indent=2) if args.json else (table(MODEL_HEADERS, model_rows(models)) if models else "no models"))
    return EXIT_OK
