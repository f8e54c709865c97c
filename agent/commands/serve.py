"""``infire-agent serve``: run the daemon in the foreground (systemd runs this)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    p.add_argument("--config", help="TOML config file (default: $INFIRE_CONFIG)")
    p.add_argument("--engine", choices=["core", "none"], default="core",
                   help="'none' runs the control plane with an engine-less worker (no models; for tests)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Settings, then the engine worker (its start is seconds: ``import torch``, the CUDA context),
    then everything else of the agent (logging, the event loop, aiohttp, the API, the manager)
    while the worker starts: they overlap instead of following each other."""
    from agent.admin_client import agent_listening
    from agent.config import ConfigError, load_settings
    from agent.worker.options import worker_env, worker_options
    from agent.worker.spawn import spawn_worker

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    sock = settings.server.admin_socket_path()
    if agent_listening(sock):  # before a worker is spawned (it would wait on the live one's worker)
        print(f"serve: another agent is listening on {sock}", file=sys.stderr)
        return 1
    options, env = worker_options(settings), worker_env(settings)
    try:
        first = spawn_worker(options, args.engine, env)
    except OSError as e:
        print(f"serve: cannot start the engine worker: {e}", file=sys.stderr)
        return 1
    from agent.log import configure_logging, get_logger
    from agent.worker.client import WorkerClient

    configure_logging(settings.log_format, settings.log_level)
    worker = WorkerClient(options, engine=args.engine, env=env, first=first,
                          hang_timeout_s=settings.server.worker_hang_timeout)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        import asyncio

        runner = asyncio.run
    try:
        runner(_serve(settings, args.engine, worker))
    except (OSError, RuntimeError) as e:  # port in use
        get_logger("serve").error("failed", error=str(e))
        return 1
    return 0


async def _serve(settings: Any, engine: str, worker: Any) -> None:
    """Supervise the worker already started, then import and run the app."""
    await worker.start(wait=False)
    try:
        from agent.app import serve

        await serve(settings, engine=engine, worker=worker)
    finally:
        await worker.stop()  # the app's lifecycle stopped it already, unless it never got that far
