"""Every subcommand and every option of the ``infire-agent`` CLI says what it does in ``--help``."""

from __future__ import annotations

import argparse

from agent.cli import build_parser


def _walk(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", None, helps.get(name)
                yield from _walk(sub, f"{path} {name}")
        else:
            yield path, action, action.help


def test_every_subcommand_and_option_has_help() -> None:
    missing = []
    for path, action, text in _walk(build_parser(), "infire-agent"):
        what = path if action is None else f"{path} {'/'.join(action.option_strings) or action.dest}"
        if not (text and text.strip() and text != argparse.SUPPRESS):
            missing.append(what)
    assert missing == [], f"no help text: {missing}"


def test_the_walk_sees_every_subcommand() -> None:
    names = {p.split()[1] for p, a, _ in _walk(build_parser(), "infire-agent") if a is None}
    assert {"demo", "models", "status", "load", "unload", "pull", "publish", "serve", "make-model", "stop"} <= names
