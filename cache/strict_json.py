"""JSON objects that may not repeat a key (``json`` keeps the last one silently; a reader that keeps
the first would see another document)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PairsHook = Callable[[list[tuple[str, Any]]], dict[str, Any]]


def no_duplicate_keys(what: str, error: Callable[[str], Exception]) -> PairsHook:
    """An ``object_pairs_hook`` raising ``error("<what> repeats the key 'k'")`` on a repeated key."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise error(f"{what} repeats the key {k!r}")
            out[k] = v
        return out

    return hook
