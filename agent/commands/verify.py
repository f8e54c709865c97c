"""``infire-agent verify NAME``: check every sha256 of a cached model and repair what is wrong.

With an agent running (its admin socket answers) the check goes through the admin API, so the
agent's view of the model stays right (a loaded model is checked, and repaired by its next
load); with none it checks the cache folder directly and repairs from the store. Exit codes:
0 intact or repaired, 1 broken and not repaired (or the repair failed), 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from agent.commands._admin import EXIT_FAIL, EXIT_OK, EXIT_USAGE, add_common, client


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a cached model's files against its manifest (sha256) and repair them",
                       description='Read every file of a cached model, compare it with the sha256 its manifest lists, and fetch again what differs (a loaded model is repaired by its next load). Exit 0 when the files are whole or were repaired.')
    p.add_argument("name", help="model name")
    add_common(p)
    p.add_argument("--wait-timeout", type=float, default=3600.0, help="seconds to wait for the check and repair")
    p.set_defaults(func=run)


def _report(name: str, v: dict) -> int:
    problems = v.get("problems") or []
    for line in problems:
        print(f"{name}: {line}")
    if not problems:
        print(f"{name}: ok")
        return EXIT_OK
    if v.get("repaired"):
        print(f"{name}: repaired")
        return EXIT_OK
    print(f"{name}: broken, not repaired" + (" (loaded: its next load repairs it)" if v.get("loaded") else ""),
          file=sys.stderr)
    return EXIT_FAIL


def _via_agent(args: argparse.Namespace) -> int | None:
    from agent.admin_client import AgentDown

    c = client(args)
    if c is None:
        return EXIT_USAGE
    try:
        status, body = c.request("POST", f"/admin/v1/models/{args.name}/verify?timeout={args.wait_timeout:g}",
                                 timeout=args.wait_timeout + 30)
    except AgentDown:
        return None
    v = body.get("verify")
    if v is None:
        err = (body.get("error") or {}).get("message") or body
        print(f"verify {args.name}: {err}", file=sys.stderr)
        return EXIT_USAGE if status in (400, 404) else EXIT_FAIL
    return _report(args.name, {**v, "loaded": (body.get("model") or {}).get("state") == "ready"})


def _direct(args: argparse.Namespace) -> int:
    from agent.config import ConfigError, load_settings
    from cache.disk_cache import DiskCache
    from cache.errors import CacheError
    from cache.store import open_store

    try:
        s = load_settings(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE

    async def main() -> dict:
        cache = DiskCache(s.cache.dir, s.cache.max_bytes)
        if cache.snapshot_path(args.name) is None:
            raise CacheError(f"{args.name} is not cached")
        report = await cache.check(args.name, rehash=True, blobs=True)
        if report.ok:
            return {"problems": []}
        store = open_store(s.store.url, s.store.endpoint_url or None, s.store.region, s.store.path_style)
        try:
            await cache.pull(store, args.name, verify=True)
        finally:
            store.close()
        return {"problems": report.problems(), "repaired": True}

    import asyncio

    try:
        return _report(args.name, asyncio.run(main()))
    except CacheError as e:
        print(f"verify {args.name}: {e}", file=sys.stderr)
        return EXIT_FAIL


def run(args: argparse.Namespace) -> int:
    from agent.config import MODEL_NAME_RE

    if not MODEL_NAME_RE.fullmatch(args.name):
        print(f"verify: {args.name!r} is not a model name (^[a-z0-9][a-z0-9._-]{{0,127}}$)", file=sys.stderr)
        return EXIT_USAGE
    done = _via_agent(args)
    return _direct(args) if done is None else done
