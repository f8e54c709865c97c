"""One model's index of full KV pages by what they hold (no torch import).

A full page's key is a hash chain: ``key(block i) = H(key(block i-1) ‖ token ids of block i)``,
rooted at a salt that names everything else that decides the K/V (the model's identity: its
weights' key and KV dtype). Two sequences whose first ``i`` blocks have equal keys have equal
tokens at every position of those blocks, so the K/V of those positions is the same: a page
computed for one serves the other. The hash is BLAKE2b (16 bytes): a prefix match must not be
forgeable, or one client could read another's cached K/V by crafting colliding token ids.

The index holds pages that are in a live sequence's table and pages that are *cached-free*: free
in the page source (taken first-come by anyone who needs a page, least recently freed first) but
still holding their K/V. The block manager keeps the index and the source in step: a page leaves
the index when the source hands it out again (``on_evict``), when its model is unloaded, or when
the cache is dropped.
"""

from __future__ import annotations

import hashlib
from array import array

KEY_BYTES = 16


def root_key(salt: str) -> bytes:
    return hashlib.blake2b(salt.encode(), digest_size=KEY_BYTES, person=b"infire-prefix").digest()


def _chain(parent: bytes, packed: bytes) -> bytes:
    """The key of a block: its parent's key and its token ids packed as int64."""
    return hashlib.blake2b(parent + packed, digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return _chain(parent, array("q", tokens).tobytes())


def extend_keys(keys: list[bytes], root: bytes, tokens: list[int], block_size: int, upto: int) -> None:
    """Append to ``keys`` (a sequence's chain so far) the keys of its full blocks below token
    ``upto`` (each equal to :func:`block_key` of its parent and tokens; the tokens are packed
    once for all the new blocks: admissions key whole prompts)."""
    start, stop = len(keys), upto // block_size
    if stop <= start:
        return
    raw = array("q", tokens[start * block_size:stop * block_size]).tobytes()
    width = 8 * block_size
    parent = keys[-1] if keys else root
    for j in range(0, len(raw), width):
        parent = _chain(parent, raw[j:j + width])
        keys.append(parent)


class PrefixIndex:
    """key ↔ page for one model; counters of what was asked and found."""

    def __init__(self, salt: str) -> None:
        self.root = root_key(salt)
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._page_of)

    def page(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def key(self, page_id: int) -> bytes | None:
        return self._key_of.get(page_id)

    def add(self, key: bytes, page_id: int) -> bool:
        """Index ``page_id`` under ``key``; False (nothing changed) when the key already has a
        page (the same blocks computed twice: the first stays) or the page already has a key."""
        if key in self._page_of or page_id in self._key_of:
            return False
        self._page_of[key] = page_id
        self._key_of[page_id] = key
        return True

    def drop_page(self, page_id: int) -> None:
        key = self._key_of.pop(page_id, None)
        if key is not None:
            del self._page_of[key]

    def pages(self) -> list[int]:
        return list(self._key_of)

    def clear(self) -> int:
        """Forget every entry; returns how many there were."""
        n = len(self._page_of)
        self._page_of.clear()
        self._key_of.clear()
        return n
