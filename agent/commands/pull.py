"""``infire-agent pull NAME``: fetch a model into the disk cache.

With an agent running (its admin socket answers) the pull goes through the admin API; with none
it pulls straight into the cache (``pull_direct``). ``--store``/``--cache-dir`` always pull
directly. Exit codes: 0 done, 1 store/integrity/disk failure, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="pull a model from the store into the disk cache",
                       description='Fetch a model from the store into the disk cache, checked against its manifest (sizes always, every sha256 with --verify) and repaired where it differs. Goes through the running agent when one answers, else straight into the cache.')
    p.add_argument("name", help="model name")
    p.add_argument("--config", help="TOML config file (default: $INFIRE_CONFIG)")
    p.add_argument("--store", help="store URL (default: settings store.url)")
    p.add_argument("--cache-dir", help="cache folder (default: settings cache.dir)")
    p.add_argument("--part-size", help="download part size, e.g. 32MiB")
    p.add_argument("--concurrency", type=int, help="parts in flight at the start (default 16)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verify", action="store_true",
                   help="re-read every cached file's sha256 (sizes are always checked) and repair what differs")
    p.set_defaults(func=run)


def pull_direct(name: str, *, store_url: str, cache_dir: str | Path, max_bytes: int, endpoint_url: str | None = None,
                region: str = "auto", path_style: bool = False, part_size: int | None = None,
                concurrency: int | None = None, progress_stream: TextIO | None = None, verify: bool = False) -> Path:
    """Pull ``name`` into the cache at ``cache_dir`` without an agent; returns the snapshot folder.

    Blocking (runs its own event loop); raises the typed errors of ``cache``.
    """
    from cache.disk_cache import DiskCache
    from cache.downloader import DownloadConfig
    from cache.manifest import validate_name
    from cache.progress import BarPrinter, Progress
    from cache.store import open_store

    validate_name(name)  # before anything is created on disk
    fields = {}
    if part_size:
        fields["part_size"] = part_size
    if concurrency:
        fields.update(concurrency=concurrency, max_concurrency=max(concurrency, 32),
                      min_concurrency=min(2, concurrency))
    cfg = DownloadConfig(**fields)
    store = open_store(store_url, endpoint_url, region, path_style,
                       **({"max_connections": cfg.max_concurrency + 8} if store_url.startswith("s3://") else {}))
    import asyncio

    progress = Progress(name)
    try:
        cache = DiskCache(cache_dir, max_bytes, download=cfg)
        if progress_stream is None:
            return asyncio.run(cache.pull(store, name, progress, verify=verify))
        with BarPrinter(progress, progress_stream):
            return asyncio.run(cache.pull(store, name, progress, verify=verify))
    finally:
        store.close()


def _pull_via_agent(name: str, settings, verify: bool = False) -> int | None:
    """Pull through a running agent's admin API (so its cache state stays in one process);
    None when no agent answers."""
    from agent.admin_client import AdminClient, AgentDown

    try:
        status, body = AdminClient.from_settings(settings, timeout=5.0).operate(name, "pull", wait=True, verify=verify)
    except AgentDown:
        return None
    model = body.get("model") or {}
    if status >= 400:
        err = (body.get("error") or {}).get("message") or body
        print(f"pull {name}: {err}", file=sys.stderr)
        return 2 if status in (400, 404) else 1
    print(model.get("snapshot") or f"{name}: {model.get('state')}")
    return 0


def run(args: argparse.Namespace) -> int:
    from agent.config import ConfigError, load_settings
    from agent.log import configure_logging
    from agent.units import parse_size
    from cache.errors import CacheError, ManifestError

    try:
        settings = load_settings(args.config)
        part_size = parse_size(args.part_size) if args.part_size else None
    except (ConfigError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    configure_logging(settings.log_format, "warning" if not args.quiet else "error")
    if not (args.store or args.cache_dir):
        done = _pull_via_agent(args.name, settings, args.verify)
        if done is not None:
            return done
    try:
        path = pull_direct(
            args.name, store_url=args.store or settings.store.url, cache_dir=args.cache_dir or settings.cache.dir,
            max_bytes=settings.cache.max_bytes, endpoint_url=settings.store.endpoint_url or None,
            region=settings.store.region, path_style=settings.store.path_style, part_size=part_size,
            concurrency=args.concurrency, progress_stream=None if args.quiet else sys.stderr, verify=args.verify)
    except ManifestError as e:
        print(f"pull {args.name}: {e}", file=sys.stderr)
        return 2
    except (CacheError, ValueError) as e:
        print(f"pull {args.name}: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
