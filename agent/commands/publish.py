"""``infire-agent publish DIR --name NAME``: upload a model folder to the store.

Blobs first (skipped when the store already has them), the manifest last. The store is
``--store``, else ``store.url`` when the config file or ``INFIRE_STORE__URL`` sets it, else the
store of the agent answering on the admin socket (so a model published next to a running
``demo`` or ``serve`` is one it can load); with none of these it refuses rather than guess.
Exit codes: 0 done, 1 store failure, 2 bad input (refused before anything was uploaded).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="upload a model folder to the store",
                       description="Upload a Hugging Face model folder (config.json, *.safetensors, tokenizer files) to the model store under NAME: files the store already has are skipped, the manifest goes last, so a publish cut short leaves nothing a pull would use. The store is --store, else the configured store.url, else the running agent's store.")
    p.add_argument("dir", help="model folder (config.json, *.safetensors, tokenizer files)")
    p.add_argument("--name", required=True, help="model name (^[a-z0-9][a-z0-9._-]{0,127}$)")
    p.add_argument("--config", help="TOML config file (default: $INFIRE_CONFIG)")
    p.add_argument("--store", help="store URL, file:///dir or s3://bucket/prefix (default: settings store.url "
                                   "when set, else the running agent's store)")
    p.add_argument("--part-size", help="multipart upload part size (default 64MiB, at least 5MiB)")
    p.add_argument("--reupload", action="store_true",
                   help="send every file again, even those the store has at their size (replaces a store copy "
                        "corrupted in place, which pulls refuse for its hash)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _store(args: argparse.Namespace, settings: Any) -> dict[str, Any] | None:
    """The store to publish to (url, endpoint_url, region, path_style), or None when neither
    the command line, the settings nor a running agent names one."""
    from pydantic import ValidationError

    from agent.admin_client import AdminClient, AdminError, AgentDown
    from agent.config import StoreSettings

    s = settings.store.model_dump()
    if args.store:
        return {**s, "url": args.store}
    if "url" in settings.store.model_fields_set:
        return s
    try:
        running = AdminClient.from_settings(settings, timeout=5.0).status().get("store")
    except (AgentDown, AdminError):
        return None
    try:
        return StoreSettings.model_validate(running).model_dump()  # the agent's answer, checked
    except ValidationError:
        return None


def run(args: argparse.Namespace) -> int:
    from agent.config import ConfigError, load_settings
    from agent.log import configure_logging
    from agent.units import parse_size
    from cache.errors import CacheError, ManifestError, SafetensorsError
    from cache.progress import BarPrinter, Progress
    from cache.store import open_store
    from cache.publish import publish_model

    try:
        settings = load_settings(args.config)
        opts = {"multipart_part_size": parse_size(args.part_size)} if args.part_size else {}
    except (ConfigError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    configure_logging(settings.log_format, "warning" if not args.quiet else "error")
    where = _store(args, settings)
    if where is None:
        print(f"publish {args.name}: no store configured and no agent running to publish for: pass --store URL, "
              "or set store.url in the config file (--config FILE or INFIRE_CONFIG) or INFIRE_STORE__URL",
              file=sys.stderr)
        return 2
    url = where["url"]
    progress = Progress(args.name)
    try:
        store = open_store(url, where["endpoint_url"] or None, where["region"], where["path_style"],
                           **(opts if url.startswith("s3://") else {}))
        try:
            if args.quiet:
                m = publish_model(store, args.dir, args.name, progress, reupload=args.reupload)
            else:
                with BarPrinter(progress, sys.stderr):
                    m = publish_model(store, args.dir, args.name, progress, reupload=args.reupload)
        finally:
            store.close()
    except (ManifestError, SafetensorsError) as e:
        print(f"publish {args.name}: {e}", file=sys.stderr)
        return 2
    except CacheError as e:
        print(f"publish {args.name}: {e}", file=sys.stderr)
        return 1
    print(f"published {m.name}: {len(m.files)} files, {m.total_size} bytes to {url}")
    return 0
