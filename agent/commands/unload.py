"""``infire-agent unload NAME``: drain a model's requests and unload it."""

from __future__ import annotations

import argparse

from agent.commands._operate import add_parser


def register(sub: argparse._SubParsersAction) -> None:
    add_parser(sub, "unload", "drain and unload a model on the running agent")
