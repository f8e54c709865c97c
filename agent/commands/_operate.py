"""``load`` / ``unload`` (and ``pull`` through a running agent): one admin operation, waited for."""

from __future__ import annotations

import argparse
import sys

from agent.commands._admin import EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_common, client


def add_parser(sub: argparse._SubParsersAction, op: str, help: str) -> None:
    p = sub.add_parser(op, help=help)
    p.add_argument("name", help="model name")
    add_common(p)
    p.add_argument("--no-wait", action="store_true", help="return at once (202) instead of waiting")
    p.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds to wait for the operation")
    if op == "load":
        p.add_argument("--quantization", choices=["fp8", "none"], default=None,
                       help="load with FP8 weights (fp8) or the checkpoint's dtype (none); default: the model's settings")
        p.add_argument("--kv-cache-dtype", choices=["fp8", "none"], default=None,
                       help="an e4m3 KV cache (fp8) or one in the model's dtype (none); default: the model's settings")
    p.set_defaults(func=lambda args: run(args, op))


def run(args: argparse.Namespace, op: str) -> int:
    from agent.admin_client import AgentDown
    from agent.config import MODEL_NAME_RE

    if not MODEL_NAME_RE.fullmatch(args.name):
        print(f"{op}: {args.name!r} is not a model name (^[a-z0-9][a-z0-9._-]{{0,127}}$)", file=sys.stderr)
        return EXIT_USAGE
    c = client(args)
    if c is None:
        return EXIT_USAGE
    try:
        status, body = c.operate(args.name, op, wait=not args.no_wait, timeout=args.wait_timeout,
                                 quantization=getattr(args, "quantization", None),
                                 kv_cache_dtype=getattr(args, "kv_cache_dtype", None))
    except AgentDown as e:
        print(f"{op} {args.name}: infire-agent is not running: {e}", file=sys.stderr)
        return EXIT_FAIL
    m = body.get("model") or {}
    if status >= 400:
        err = (body.get("error") or {}).get("message") or body
        print(f"{op} {args.name}: {err}", file=sys.stderr)
        return EXIT_USAGE if status in (400, 404) else EXIT_FAIL
    print(f"{m.get('name', args.name)}: {m.get('state', '?')}" + (" (in progress)" if status == 202 else ""))
    return EXIT_OK
