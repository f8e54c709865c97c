"""``infire-agent serve [DIR]``: run the daemon in the foreground (systemd runs this).

With a model folder (``serve DIR [--name NAME]``, as ``vllm serve DIR``) the folder is published
into the configured store (the default local one when none is set), configured as a model that
loads at start and on request, and served under its name."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agent.commands._local_model import NAME_HELP


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="run the daemon in the foreground (optionally serving a local model folder)",
        description="Run the daemon in the foreground: the OpenAI API on server.host:server.port, the admin "
        "API and socket, the engine worker. With DIR, a Hugging Face model folder: publish it into the store "
        "(the default local store when none is configured), load it at start and serve it under --name "
        "(default: the folder's name), as `vllm serve DIR` does.",
    )
    p.add_argument("dir", nargs="?", metavar="DIR", help="a Hugging Face model folder to serve (config.json, "
                   "*.safetensors, tokenizer files)")
    p.add_argument("--name", help=NAME_HELP + "; with DIR")
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
    if args.name is not None and args.dir is None:
        print("serve: --name names a model folder: serve DIR --name NAME", file=sys.stderr)
        return 2
    sock = settings.server.admin_socket_path()
    if agent_listening(sock):  # before a worker is spawned (it would wait on the live one's worker)
        print(f"serve: another agent is listening on {sock}", file=sys.stderr)
        return 1
    folder = None
    if args.dir is not None:  # refused before a worker starts; published while it starts
        folder = _folder(args.dir, args.name)
        if folder is None:
            return 2
    options, env = worker_options(settings), worker_env(settings)
    try:
        first = spawn_worker(options, args.engine, env)
    except OSError as e:
        print(f"serve: cannot start the engine worker: {e}", file=sys.stderr)
        return 1
    if folder is not None:
        settings = _publish(settings, *folder)
        if settings is None:
            first.proc.kill()
            first.proc.wait()
            first.sock.close()
            return 2
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



def _folder(arg: str, name: str | None) -> tuple[Any, str] | None:
    """The model folder and its name, or None (message printed)."""
    from agent.commands._local_model import LocalModelError, check_folder, model_name

    try:
        folder = check_folder(arg)
        return folder, model_name(folder, name)
    except LocalModelError as e:
        print(f"serve: {e}", file=sys.stderr)
        return None


def _forget_cached(settings: Any, name: str, version: str) -> None:
    """A copy of ``name`` in the disk cache other than the ``version`` just published is dropped,
    so the start pulls the folder (a cached model loads from its cache: it would serve the old
    weights). Raises LocalModelError when the cache refuses (another agent has the model loaded);
    a later ``serve`` compares again, whatever the store held before it."""
    import asyncio

    from agent.commands._local_model import LocalModelError
    from cache.disk_cache import DiskCache
    from cache.errors import CacheError

    cache = DiskCache(settings.cache.dir, settings.cache.max_bytes)
    cached = cache.manifest(name)
    if cached is None or cached.digest() == version:
        return
    print(f"serve: dropping the cached previous version of {name}", file=sys.stderr, flush=True)
    try:
        asyncio.run(cache.remove(name))
    except CacheError as e:
        raise LocalModelError(f"the cache keeps the previous {name}: {e}") from None


def _publish(settings: Any, folder: Any, name: str) -> Any:
    """The settings serving ``folder`` as ``name``, published first; None (message printed)."""
    from agent.commands._local_model import LocalModelError, publish_folder, serve_settings
    from agent.log import configure_logging

    configure_logging(settings.log_format, "warning")  # the publish's own log lines: problems only
    print(f"serve: publishing {folder} as {name} to {settings.store.url}", file=sys.stderr, flush=True)
    try:
        _forget_cached(settings, name, publish_folder(folder, name, settings.store.model_dump()))
    except LocalModelError as e:
        print(f"serve: {e}", file=sys.stderr)
        return None
    print(f"serve: {name} loads at start; OpenAI API on http://{settings.server.host}:{settings.server.port}/v1 "
          f"(model \"{name}\")", file=sys.stderr, flush=True)
    return serve_settings(settings, folder, name)
