"""Tokenizer: encode, decode, chat templates, incremental detokenization and stop strings."""

from __future__ import annotations


def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each byte value to the printable character standing for it.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, a few others)
    are shifted to code points from 256 up, in byte order, so no symbol is whitespace.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    kept = set(keep)
    table: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table
