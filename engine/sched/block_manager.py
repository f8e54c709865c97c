"""Pages of the KV cache → sequences (no torch import).

A *page* (block) holds the K/V of ``block_size`` consecutive tokens of one sequence, for all
layers. A sequence's *block table* lists its page ids in token order; it only grows while the
sequence lives and is returned whole when the sequence finishes, is aborted or is preempted.

Pages come from an injectable :class:`PageSource`: a :class:`PageAllocator` (a free list over
``num_pages`` ids of one model's cache), or the shared PagePool's allocator for one model
(engine/kv/page_pool.py), which hands out *global* page ids through the same calls —
nothing here assumes ids are dense or start at 0.
"""

from __future__ import annotations

from typing import Protocol


class OutOfPages(Exception):
    """No free page is left (callers check ``can_allocate`` first; this is the backstop)."""


class PageError(Exception):
    """A page id was freed twice or never belonged to this source."""


class PageSource(Protocol):
    """Where pages come from: one model's free list today, the shared PagePool later."""

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...

    def allocate(self) -> int: ...

    def free(self, page_id: int) -> None: ...


class PageAllocator:
    """O(1) free list over page ids ``first_id .. first_id + num_pages - 1``."""

    def __init__(self, num_pages: int, first_id: int = 0) -> None:
        if num_pages < 0 or first_id < 0:
            raise ValueError("num_pages and first_id must be >= 0")
        self._first = first_id
        self._total = num_pages
        # Pop from the end: low ids are handed out first, which keeps small runs compact.
        self._free = list(range(first_id + num_pages - 1, first_id - 1, -1))
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._total

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPages("no free KV page")
        pid = self._free.pop()
        self._in_use[pid - self._first] = 1
        return pid

    def free(self, page_id: int) -> None:
        i = page_id - self._first
        if not 0 <= i < self._total or not self._in_use[i]:
            raise PageError(f"page {page_id} is not allocated here")
        self._in_use[i] = 0
        self._free.append(page_id)


class BlockManager:
    """Block tables of the live sequences of one model, over an injected page source."""

    def __init__(self, block_size: int, pages: PageSource) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.pages = pages
        self._tables: dict[int, list[int]] = {}
        self._used = 0

    # -- sizes -----------------------------------------------------------------------------
    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_pages(self, seq_id: int, num_tokens: int) -> int:
        """Pages to add so the sequence's table covers ``num_tokens`` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.pages_for_tokens(num_tokens) - have)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.pages.num_free

    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    @property
    def num_total_pages(self) -> int:
        return self.pages.num_total

    @property
    def num_used_pages(self) -> int:
        return self._used

    # -- tables ----------------------------------------------------------------------------
    def ensure_capacity(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the table to cover ``num_tokens`` tokens; all or nothing (False: not enough)."""
        need = self.num_new_pages(seq_id, num_tokens)
        if need > self.pages.num_free:
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self.pages.allocate())
        self._used += need
        return True

    def block_table(self, seq_id: int) -> list[int]:
        """The live table (read it, do not keep or change it)."""
        return self._tables.get(seq_id, [])

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: int) -> int:
        """Return every page of the sequence; unknown ids are a no-op. Returns pages freed."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        # Reverse: the tail pages are the least likely to be worth reusing soon.
        for pid in reversed(table):
            self.pages.free(pid)
        self._used -= len(table)
        return len(table)

    def live_sequences(self) -> list[int]:
        return list(self._tables)
