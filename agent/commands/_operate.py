"""``load`` / ``unload`` (and ``pull`` through a running agent): one admin operation, waited for."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from agent.commands._admin import EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_common, client
from agent.commands._local_model import NAME_HELP, looks_like_folder

if TYPE_CHECKING:
    from agent.admin_client import AdminClient

DESCRIPTIONS = {
    "load": "Load a model on the running agent and wait until it is ready: pulled from the store into the "
            "disk cache first when needed, then loaded on the GPU (or the CPU). A local model folder (DIR) is "
            "published to the agent's store first, under --name or the folder's name.",
    "unload": "Unload a model on the running agent: new requests are refused, the ones in flight finish "
              "(up to server.drain_timeout), then its memory is given back. Its files stay in the disk cache.",
}


def add_parser(sub: argparse._SubParsersAction, op: str, help: str) -> None:
    p = sub.add_parser(op, help=help, description=DESCRIPTIONS[op])
    if op == "load":
        p.add_argument("name", metavar="NAME|DIR", help="model name, or a local model folder to publish to the "
                       "running agent's store and load")
        p.add_argument("--name", dest="as_name", metavar="NAME", help=NAME_HELP + "; with DIR")
    else:
        p.add_argument("name", help="model name")
    add_common(p)
    p.add_argument("--no-wait", action="store_true",
                   help=f"start the {op} and return without waiting for it to finish "
                        f"(see how it goes with `infire-agent status`)")
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

    version = None
    if op == "load" and looks_like_folder(args.name):
        code, version = _publish_folder(args)
        if code is not None:
            return code
    if not MODEL_NAME_RE.fullmatch(args.name):
        print(f"{op}: {args.name!r} is not a model name (^[a-z0-9][a-z0-9._-]{{0,127}}$)", file=sys.stderr)
        return EXIT_USAGE
    c = client(args)
    if c is None:
        return EXIT_USAGE
    try:
        if version is not None:
            code = _take_version(c, args.name, version, args.wait_timeout)
            if code is not None:
                return code
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


def _take_version(c: AdminClient, name: str, version: str, timeout: float) -> int | None:
    """The agent's cache holds another version of ``name`` than the ``version`` just published (a
    load of a cached model reads its cache: "ready" once came over the old weights, and a model
    mended in the store failed again on its old files). A pull takes the new version now, or,
    while the model is in use, makes its next load pull first (any load: an autoload between
    these steps too); a model in use is then unloaded (a load under way finished first), so the
    load that follows serves the folder. None: go on loading; else an exit code."""
    from agent.admin_client import AdminError

    try:
        m = next((m for m in c.models() if m.get("name") == name), None)
    except AdminError as e:
        print(f"load {name}: the agent did not list its models: {e}", file=sys.stderr)
        return EXIT_FAIL
    if m is None or m.get("version") in (None, version):
        return None  # none cached (the load pulls), or this version already
    state = m.get("state")
    steps = ["pull"]
    if state in ("loading", "ready", "draining", "unloading"):
        print(f"load: {name} is {state} with another version: unloading it first", file=sys.stderr, flush=True)
        steps += ["load", "unload"] if state == "loading" else ["unload"]
    for step in steps:
        status, body = c.operate(name, step, wait=True, timeout=timeout)
        after = (body.get("model") or {}).get("state")
        if status != 200 or (step == "unload" and after not in ("cached", "absent")):
            err = (body.get("error") or {}).get("message") or f"it is {after}"
            print(f"load {name}: {step} before taking the new version failed ({err}); its next load takes "
                  "the new version", file=sys.stderr)
            return EXIT_FAIL
    return None


def _publish_folder(args: argparse.Namespace) -> tuple[int | None, str | None]:
    """``load DIR``: publish the folder into the running agent's store and set ``args.name`` to
    its name ((None, the published version): go on loading it); with no agent, say how to serve
    a folder ((an exit code, None))."""
    from pydantic import ValidationError

    from agent.admin_client import AdminError, AgentDown
    from agent.commands._local_model import LocalModelError, check_folder, model_name, publish_folder
    from agent.config import StoreSettings

    try:
        folder = check_folder(args.name)
        name = model_name(folder, args.as_name)
    except LocalModelError as e:
        print(f"load: {e}", file=sys.stderr)
        return EXIT_USAGE, None
    c = client(args)
    if c is None:
        return EXIT_USAGE, None
    named = "" if args.as_name is None else f" --name {name}"
    try:
        store = StoreSettings.model_validate(c.status().get("store")).model_dump()
    except (AgentDown, AdminError, ValidationError) as e:
        print(f"load: {folder} is a model folder and no agent answers to load it into ({e}).\n"
              f"Serve it in one command (publishes it, loads it, serves it as {name!r}):\n"
              f"  infire-agent serve {folder}{named}", file=sys.stderr)
        return EXIT_FAIL, None
    print(f"load: publishing {folder} as {name} to {store['url']}", file=sys.stderr, flush=True)
    try:
        version = publish_folder(folder, name, store)
    except LocalModelError as e:
        print(f"load: {e}", file=sys.stderr)
        return EXIT_FAIL, None
    args.name = name
    return None, version
