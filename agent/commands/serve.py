"""``infire-agent serve``: run the daemon in the foreground (systemd runs this)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    p.add_argument("--config", help="TOML config file (default: $INFIRE_CONFIG)")
    p.add_argument("--engine", choices=["core", "none"], default="core",
                   help="'none' runs the control plane with an engine-less worker (no models; for tests)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.config import ConfigError, load_settings
    from agent.log import configure_logging, get_logger

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    try:
        runner(_serve(settings, args.engine))
    except (OSError, RuntimeError) as e:  # port in use, live agent on the socket
        get_logger("serve").error("failed", error=str(e))
        return 1
    return 0


async def _serve(settings: Any, engine: str) -> None:
    """Start the engine worker first, then import and run the app: the worker's start (its torch
    import: seconds) overlaps the agent's own imports (aiohttp, the API, the manager) instead of
    following them."""
    from agent.admin_client import agent_listening
    from agent.worker.client import WorkerClient
    from agent.worker.options import worker_env, worker_options

    sock = settings.server.admin_socket_path()
    if agent_listening(sock):  # before a worker is spawned (it would wait on the live one's worker)
        raise RuntimeError(f"another agent is listening on {sock}")
    worker = WorkerClient(worker_options(settings), engine=engine, env=worker_env(settings))
    await worker.start(wait=False)
    try:
        await worker.spawned()
        from agent.app import serve

        await serve(settings, engine=engine, worker=worker)
    finally:
        await worker.stop()  # the app's lifecycle stopped it already, unless it never got that far
