"""``infire-agent serve``: run the daemon in the foreground (systemd runs this)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    p.add_argument("--config", help="TOML config file (default: $INFIRE_CONFIG)")
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
    log = get_logger("serve")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("started", host=settings.server.host, port=settings.server.port)
        await stop.wait()
        log.info("stopped")

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    return 0
