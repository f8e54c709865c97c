"""The ``infire-agent`` command line.

Each subcommand lives in its own module under ``agent/commands`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import agent
import agent.commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infire-agent", description="Serve LLMs from one GPU.")
    parser.add_argument("--version", action="version", version=f"infire-agent {agent.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(agent.commands.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"agent.commands.{mod.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
    except KeyboardInterrupt:
        code = 130
    if argv is None and "triton" in sys.modules:
        # The program itself (not a caller in this process), after a command that imported
        # Triton (make-model, quantize): end without interpreter teardown, where nanobind would
        # print its "leaked instances" report after our last line.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
