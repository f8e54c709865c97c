"""``infire-agent load NAME``: load a model (pulling it first when needed) and wait until ready."""

from __future__ import annotations

import argparse

from agent.commands._operate import add_parser


def register(sub: argparse._SubParsersAction) -> None:
    add_parser(sub, "load", "load a model on the running agent (pulls it first if needed)")
