"""Pages of the KV cache → sequences (no torch import).

A *page* (block) holds the K/V of ``block_size`` consecutive tokens of one sequence, for all
layers. A sequence's *block table* lists its page ids in token order; it only grows while the
sequence lives and is returned whole when the sequence finishes, is aborted or is preempted.

Pages come from an injectable :class:`PageSource`: a :class:`PageAllocator` (a free list over
``num_pages`` ids of one model's cache), or the shared PagePool's allocator for one model
(engine/kv/page_pool.py), which hands out *global* page ids through the same calls —
nothing here assumes ids are dense or start at 0.

Prefix caching (with a :class:`~engine.sched.prefix_index.PrefixIndex`): a *full* page whose
tokens are known and whose K/V is written (or queued to be, in the order of the model's steps, ahead
of any step that could read it) is indexed by its key chain. A new sequence whose leading blocks'
keys are indexed starts with those pages in its table (``take_prefix``) and computes only the
rest; such pages are shared, counted by reference, and never written again (a sequence only
writes past its shared prefix, into pages of its own). When the last table holding an indexed
page lets go of it, the page goes back to the source *cached-free*: free for anyone, still
indexed, handed out least recently freed first, and dropped from the index (``on_evict``) at that
moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.sched.prefix_index import PrefixIndex


class OutOfPages(Exception):
    """No free page is left (callers check ``can_allocate`` first; this is the backstop)."""


class PageError(Exception):
    """A page id was freed twice or never belonged to this source."""


class PageSource(Protocol):
    """Where pages come from: one model's free list, or its view of the shared PagePool.

    ``num_free`` counts cached-free pages (free, still holding K/V a prefix index points at);
    ``allocate`` hands out plain free pages first, then the least recently freed cached-free one,
    calling ``on_evict(page_id)`` for it first; ``free_cached`` frees a page but keeps its K/V for
    ``take_cached``, which takes it back (False when the page is not cached-free for this source's
    model or may not be taken now: a cap, another model's minimum); ``drop_cached`` makes every
    cached-free page of this model a plain free one."""

    on_evict: Callable[[int], None] | None

    @property
    def num_free(self) -> int: ...

    @property
    def num_total(self) -> int: ...

    def allocate(self) -> int: ...

    def free(self, page_id: int) -> None: ...

    def free_cached(self, page_id: int) -> None: ...

    def take_cached(self, page_id: int) -> bool: ...

    def drop_cached(self) -> None: ...


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
        self._cached_free: dict[int, None] = {}  # insertion order: least recently freed first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def cached_free_pages(self) -> list[int]:
        """Cached-free pages, least recently freed first."""
        return list(self._cached_free)

    def allocate(self) -> int:
        if self._free:
            pid = self._free.pop()
        elif self._cached_free:
            pid = next(iter(self._cached_free))
            del self._cached_free[pid]
            if self.on_evict is not None:
                self.on_evict(pid)
        else:
            raise OutOfPages("no free KV page")
        self._in_use[pid - self._first] = 1
        return pid

    def free(self, page_id: int) -> None:
        self._release(page_id)
        self._free.append(page_id)

    def free_cached(self, page_id: int) -> None:
        self._release(page_id)
        self._cached_free[page_id] = None

    def take_cached(self, page_id: int) -> bool:
        if page_id not in self._cached_free:
            return False
        del self._cached_free[page_id]
        self._in_use[page_id - self._first] = 1
        return True

    def drop_cached(self) -> None:
        """Turn every cached-free page into a plain free one (the index that kept them is gone)."""
        self._free.extend(self._cached_free)
        self._cached_free.clear()

    def _release(self, page_id: int) -> None:
        i = page_id - self._first
        if not 0 <= i < self._total or not self._in_use[i]:
            raise PageError(f"page {page_id} is not allocated here")
        self._in_use[i] = 0


class BlockManager:
    """Block tables of the live sequences of one model, over an injected page source; with
    ``prefix`` (this model's index), full pages are shared through it (the module's docstring)."""

    def __init__(self, block_size: int, pages: PageSource, prefix: PrefixIndex | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.pages = pages
        self.prefix = prefix
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}  # page -> tables holding it (every page of every table)
        if prefix is not None:
            pages.on_evict = prefix.drop_page

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
        """Pages held by live tables, each once however many tables share it."""
        return len(self._refs)

    # -- tables ----------------------------------------------------------------------------
    def ensure_capacity(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the table to cover ``num_tokens`` tokens; all or nothing (False: not enough)."""
        need = self.num_new_pages(seq_id, num_tokens)
        # most calls need nothing (a decode needs a page every block_size tokens): no pool count then
        if need and need > self.pages.num_free:
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(need):
            pid = self.pages.allocate()
            table.append(pid)
            self._refs[pid] = 1
        return True

    def block_table(self, seq_id: int) -> list[int]:
        """The live table (read it, do not keep or change it)."""
        return self._tables.get(seq_id, [])

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: int) -> int:
        """Let go of every page of the sequence (indexed ones no other table holds go back
        cached-free);
        unknown ids are a no-op. Returns how many pages were in its table."""
        table = self._tables.pop(seq_id, None)
        if not table:
            return 0
        refs, prefix = self._refs, self.prefix
        # Reverse: a sequence's tail is freed before its head, so under pressure its last
        # blocks are handed out first and the shared head (the likelier hit) stays longest.
        for pid in reversed(table):
            n = refs[pid] - 1
            if n:
                refs[pid] = n
                continue
            del refs[pid]
            if prefix is not None and prefix.key(pid) is not None:
                self.pages.free_cached(pid)
            else:
                self.pages.free(pid)
        return len(table)

    def live_sequences(self) -> list[int]:
        return list(self._tables)

    def refs(self, page_id: int) -> int:
        return self._refs.get(page_id, 0)

    # -- prefix caching --------------------------------------------------------------------
    def cached_prefix(self, keys: list[bytes]) -> tuple[list[int], int]:
        """The pages of the longest run of ``keys`` that is indexed, and how many of them are
        cached-free (taking those uses free pages). Nothing changes."""
        prefix = self.prefix
        if prefix is None:
            return [], 0
        pages: list[int] = []
        cached_free = 0
        for key in keys:
            pid = prefix.page(key)
            if pid is None:
                break
            pages.append(pid)
            cached_free += pid not in self._refs
        return pages, cached_free

    def take_prefix(self, seq_id: int, pages: list[int]) -> int:
        """Start ``seq_id``'s (empty) table with ``pages`` (from :meth:`cached_prefix`, this
        step); stops at the first cached-free page the source will not give back. Returns how many
        it took."""
        if self._tables.get(seq_id):
            raise ValueError(f"sequence {seq_id} already has pages")
        table: list[int] = []
        refs = self._refs
        for pid in pages:
            if pid in refs:
                refs[pid] += 1
            elif self.pages.take_cached(pid):
                refs[pid] = 1
            else:
                break
            table.append(pid)
        if table:
            self._tables[seq_id] = table
        return len(table)

    def index_blocks(self, seq_id: int, keys: list[bytes], start: int, stop: int) -> int:
        """Index the sequence's pages of blocks ``start .. stop - 1`` (each full, its tokens
        known, its K/V written or queued in the order of the model's steps) under ``keys``; returns
        ``stop``, the next block to index."""
        prefix = self.prefix
        table = self._tables.get(seq_id)
        if prefix is None or table is None:
            return start
        for i in range(start, stop):
            prefix.add(keys[i], table[i])
        return stop

    def drop_prefix_cache(self) -> int:
        """Forget the index: cached-free pages become plain free; pages in live tables stay where
        they are (freed normally when their sequences end). Returns the entries dropped."""
        if self.prefix is None:
            return 0
        self.pages.drop_cached()
        return self.prefix.clear()
