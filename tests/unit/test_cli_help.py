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


def test_every_subcommand_describes_itself_in_users_words() -> None:
    """``infire-agent CMD --help`` opens with what CMD does; no help text speaks HTTP status codes."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = [name for name, p in sub.choices.items() if not (p.description and len(p.description) > 20)]
    assert bare == [], f"no description: {bare}"
    jargon = [f"{path} {'/'.join(a.option_strings)}" for path, a, text in _walk(parser, "infire-agent")
              if a is not None and text and any(code in text for code in ("202", "(200)", "404"))]
    assert jargon == [], jargon
