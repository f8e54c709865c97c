"""PagePool: one pool of fixed-size byte pages holding the KV cache of every loaded model.

Memory is ``[pages, page_bytes]`` bytes (engine/kv/page_memory.py: on a GPU a virtual range of
``capacity`` pages, the first ``num_pages`` backed; elsewhere one tensor of ``num_pages``). A model
registers with its KV shape and gets ``tokens_per_page = page_bytes // bytes_per_token``
(bytes_per_token = layers × 2 × kv_heads × head_dim × dtype size) and, per layer, K and V views
``[pages, tokens_per_page, kv_heads, head_dim]`` whose page stride is the whole page: inside a page the model's data is laid
out ``[layers, 2, tokens_per_page, kv_heads, head_dim]``. Page ids are global, so the same page
serves a big model or a small one as load shifts.

Sharing rules, all O(1) per call:
- each model has a guaranteed minimum of pages, held back from everyone else while it is below
  it, so a burst on one model cannot lock another out (invariant: free pages ≥ the sum over
  models of ``max(0, min - counted)``);
- an optional cap per model;
- above their minimums, models take free pages first come first served.

Prefix caching: a model's block manager frees a page it no longer holds but whose K/V its
prefix index still points at as *cached-free* (``free_cached``). A cached-free page is free (it
counts as free for every model, for admission and for a loading model's room), sits in one
pool-wide least-recently-freed order, and is handed out only after the plain free pages; the
model that freed it is told (``on_evict`` of its allocator) just before. ``take_cached`` takes
one back for its model (a cache hit), under the same minimums and caps as an allocation. A fence
or a resize evicts the cached-free pages it cuts off; a resize keeps the others' contents;
unregistering a model makes its cached-free pages plain free ones.

Free pages are handed out lowest id first, so live pages gather at the bottom and a shrink
finds its tail free.

A page a model frees while a step of that model is on the device (``step_launched`` ..
``step_done``, told by the engine) may still be written by that step: a sequence that ended at the
collect of step N has a row in step N+1, launched behind it, which writes its next token's K/V
into the sequence's last page; an abort or a preemption frees the pages of a step in flight. The
model's own later steps run after that step (one model's steps are ordered on the device), but
another model's step runs beside it on that model's own streams (engine/runner/streams.py) and
would take the page and write it at the same time. So while other models share the pool, such a free
is *held*: the page stays the model's (owned, counted, in its cap) until the steps of that model
launched before the free are done, and only the model itself takes it back meanwhile (a prefix
hit on a held cached page, or an allocation when no plain free page is left: its next steps run
after the one that may still write it). A model's steps finish in the order they were launched, so a held
page carries the count of the model's steps launched at its free, and goes when that many are
done (not when none is on the device: a model that launches each step behind the last always has
one there).

Resizing (see docs/multi-model.md): ``fence(limit)`` stops handing out pages ``>= limit`` so they
drain as sequences finish; ``resize(n)`` then changes the memory with page ids and contents kept.
On a GPU (``ElasticMemory``) the tail is mapped or unmapped in place: views stay valid and
``generation`` stays. Elsewhere the memory is re-created, the live pages copied through host
memory (device peak max(old, new), never old + new); ``generation`` changes and cached views are
invalidated.

The module imports no torch at import time, so torch-free code (block manager, scheduler tests)
may use it; a pool built with ``device=None`` does the accounting only.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from engine.sched.block_manager import OutOfPages
from engine.kv.layout import (
    PAGE_ALIGN,
    KVLayout,
    ModelPageSource,
    PageOwnershipError,
    PagePoolError,
    PoolBusyError,
    PoolExhausted,
    _positive_int,
    kv_layout,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from engine.kv.page_memory import ElasticMemory, PoolMemory

__all__ = ["PagePool"]


class _Slot:
    """One registration of a model; allocators bound to an unregistered slot stop working."""

    __slots__ = ("name", "layout", "min_pages", "max_pages", "used", "counted", "pages", "active", "on_evict",
                 "launched", "done", "held", "reusable")

    def __init__(self, name: str, layout: KVLayout, min_pages: int, max_pages: int | None) -> None:
        self.name = name
        self.layout = layout
        self.min_pages = min_pages
        self.max_pages = max_pages
        self.used = 0  # pages held
        self.counted = 0  # pages held below the fence: only these count toward the minimum
        self.pages: set[int] = set()
        self.active = True
        self.on_evict: Any = None  # called with a cached-free page id of this model as it is handed out
        self.launched = 0  # its steps launched (on the device at some time)
        self.done = 0  # of those, the ones done, in launch order
        self.held: dict[int, tuple[bool, int]] = {}  # page freed behind a step -> (freed cached, launched then)
        self.reusable = 0  # of those, below the fence: it may take them back

    def reserve(self) -> int:
        return max(0, self.min_pages - self.counted)


class _ModelAllocator:
    """``ModelPageSource`` for one model registration."""

    def __init__(self, pool: PagePool, slot: _Slot) -> None:
        self._pool = pool
        self._slot = slot

    @property
    def block_size(self) -> int:
        return self._slot.layout.tokens_per_page

    @property
    def num_free(self) -> int:
        return self._pool._available(self._live())

    @property
    def num_total(self) -> int:
        slot = self._live()
        return slot.used + self._pool._takeable(slot)  # its held pages are in ``used`` already

    @property
    def num_used(self) -> int:
        return self._live().used

    def allocate(self) -> int:
        page_id = self._pool._allocate(self._live())
        if page_id is None:
            raise OutOfPages(f"no KV page free for {self._slot.name!r}")
        return page_id

    def try_allocate(self) -> int | None:
        return self._pool._allocate(self._live())

    def free(self, page_id: int) -> None:
        self._pool._free_after_steps(self._live(), page_id, False)

    def free_cached(self, page_id: int) -> None:
        self._pool._free_after_steps(self._live(), page_id, True)

    def take_cached(self, page_id: int) -> bool:
        slot = self._live()
        if slot.held.get(page_id, (False, 0))[0]:  # freed cached behind a step on the device: never left
            self._pool._unhold(slot, page_id)
            return True
        return self._pool._take_cached(slot, page_id)

    def step_launched(self) -> None:
        """A step of this model is on the device from now (frees are held until it is done)."""
        self._live().launched += 1

    def step_done(self) -> None:
        """The oldest step of this model on the device is done: the pages held behind it go."""
        slot = self._live()
        if slot.done >= slot.launched:
            raise PagePoolError(f"model {slot.name!r} has no step on the device to be done")
        slot.done += 1
        self._pool._release_held(slot)

    @property
    def num_held(self) -> int:
        """Pages freed but held until this model's steps on the device are done."""
        return len(self._slot.held)

    def drop_cached(self) -> None:
        self._pool._drop_cached(self._live())

    @property
    def on_evict(self) -> Any:
        return self._slot.on_evict

    @on_evict.setter
    def on_evict(self, hook: Any) -> None:
        self._slot.on_evict = hook

    def can_allocate(self, n: int) -> bool:
        return self._pool._available(self._live()) >= n

    def _live(self) -> _Slot:
        if not self._slot.active:
            raise PagePoolError(f"model {self._slot.name!r} is no longer registered in the pool")
        return self._slot


class PagePool:
    """The shared KV page pool. ``device=None``: accounting only, no memory, no views.
    ``capacity``: the most pages it may ever have (required on a GPU, where its addresses are
    reserved for that many at once)."""

    def __init__(self, num_pages: int, page_bytes: int, device: Any = None, capacity: int | None = None) -> None:
        self.page_bytes = _positive_int("page_bytes", page_bytes)
        if page_bytes % PAGE_ALIGN:
            raise PagePoolError(f"page_bytes must be a multiple of {PAGE_ALIGN}, got {page_bytes}")
        self.num_pages = _positive_int("num_pages", num_pages, 0)
        self.device = device
        self.generation = 0
        self._limit = num_pages  # pages >= limit are fenced: never handed out
        self._free_ids: list[int] = list(range(num_pages))  # a heap: the lowest id first
        self._cached_free: dict[int, _Slot] = {}  # free pages still indexed, least recently freed first
        self._owner: list[_Slot | None] = [None] * num_pages
        self._slots: dict[str, _Slot] = {}
        self._reserve = 0  # sum of slot.reserve(): free pages held back for minimums
        self._memory: PoolMemory | ElasticMemory | None = None
        if device is not None:
            from engine.kv.page_memory import pool_memory

            self._memory = pool_memory(num_pages, page_bytes, device, capacity)

    # -- models -----------------------------------------------------------------------------------
    def register(self, model: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: Any, min_pages: int = 0, max_pages: int | None = None,
                 tokens_per_page: int | None = None) -> KVLayout:
        """Add a model; ``tokens_per_page`` may ask for fewer tokens than fit (kernel tiling).

        Raises ``PoolExhausted`` when ``min_pages`` cannot be guaranteed from the free pages that
        are not already held back for other models' minimums.
        """
        if model in self._slots:
            raise PagePoolError(f"model {model!r} is already registered in the pool")
        layout = kv_layout(self.page_bytes, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=dtype, tokens_per_page=tokens_per_page)
        _positive_int("min_pages", min_pages, 0)
        if max_pages is not None and _positive_int("max_pages", max_pages, 0) < min_pages:
            raise PagePoolError(f"max_pages {max_pages} < min_pages {min_pages} for {model!r}")
        spare = self.num_free - self._reserve
        if min_pages > spare:
            raise PoolExhausted(f"cannot guarantee {min_pages} pages to {model!r}: {spare} free "
                                f"pages are not held for other models ({self.num_free} free, of which "
                                f"{len(self._cached_free)} cached; {self._reserve} held back)")
        self._slots[model] = _Slot(model, layout, min_pages, max_pages)
        self._reserve += min_pages
        return layout

    def unregister(self, model: str) -> None:
        """Remove a model that holds no pages (``free_all`` first); its allocators go dead."""
        slot = self._slot(model)
        if slot.used:
            raise PoolBusyError(f"model {model!r} still holds {slot.used} pages")
        self._drop_cached(slot)  # its index goes with it: plain free pages now
        self._reserve -= slot.reserve()
        slot.active = False
        del self._slots[model]
        if self._memory is not None:
            self._memory.forget(model)

    def allocator_for(self, model: str) -> ModelPageSource:
        return _ModelAllocator(self, self._slot(model))

    def layout(self, model: str) -> KVLayout:
        return self._slot(model).layout

    def free_all(self, model: str) -> int:
        """Give back every page ``model`` holds (unload, abort of everything), held ones too: the
        caller has no step of it on the device. Returns how many."""
        slot = self._slot(model)
        slot.held.clear()
        slot.reusable = 0
        slot.done = slot.launched
        pages = list(slot.pages)
        for page_id in pages:
            self._free(slot, page_id)
        return len(pages)

    # -- the O(1) core ----------------------------------------------------------------------------
    def _available(self, slot: _Slot) -> int:
        # and it may take back its own held pages (below the fence), which it still counts
        return self._takeable(slot) + slot.reusable

    def _takeable(self, slot: _Slot) -> int:
        """Free pages ``slot`` may take: below its minimum, the pages held back for it too."""
        n = len(self._free_ids) + len(self._cached_free) - self._reserve + slot.reserve()
        if slot.max_pages is not None:
            n = min(n, slot.max_pages - slot.used)
        return max(0, n)

    def _allocate(self, slot: _Slot) -> int | None:
        takeable = self._takeable(slot)
        if takeable and self._free_ids:
            page_id = heapq.heappop(self._free_ids)
        elif slot.reusable:
            # Its own page freed behind its step on the device: its next steps run after that one.
            page_id = next(p for p in slot.held if p < self._limit)
            cached = self._unhold(slot, page_id)
            if cached and slot.on_evict is not None:
                slot.on_evict(page_id)  # handed out again: it leaves the model's index
            return page_id
        elif takeable:
            page_id = next(iter(self._cached_free))
            self._evict(page_id)
        else:
            return None
        self._take(slot, page_id)
        return page_id

    def _take_cached(self, slot: _Slot, page_id: int) -> bool:
        if self._cached_free.get(page_id) is not slot or not self._takeable(slot):
            return False
        del self._cached_free[page_id]
        self._take(slot, page_id)
        return True

    def _drop_cached(self, slot: _Slot) -> None:
        """Make ``slot``'s cached-free pages plain free ones (its index is gone); no hook is called."""
        for page_id in [p for p, owner in self._cached_free.items() if owner is slot]:
            del self._cached_free[page_id]
            heapq.heappush(self._free_ids, page_id)

    def _evict(self, page_id: int) -> None:
        owner = self._cached_free.pop(page_id)
        if owner.active and owner.on_evict is not None:
            owner.on_evict(page_id)

    def _take(self, slot: _Slot, page_id: int) -> None:
        if slot.counted < slot.min_pages:
            self._reserve -= 1
        slot.counted += 1
        slot.used += 1
        slot.pages.add(page_id)
        self._owner[page_id] = slot

    def _free_after_steps(self, slot: _Slot, page_id: int, cached: bool) -> None:
        """Free now, or hold the page while ``slot`` has a step on the device and the pool is
        shared (the module docstring says why)."""
        if page_id in slot.held:
            raise PageOwnershipError(f"{slot.name!r} frees page {page_id} twice (held behind its step on the device)")
        if slot.launched > slot.done and len(self._slots) > 1:
            self._check_owner(slot, page_id)
            if page_id >= self._limit and cached:
                cached = False  # fenced: it is not kept (as _free does), so it leaves the index now
                if slot.on_evict is not None:
                    slot.on_evict(page_id)
            slot.held[page_id] = (cached, slot.launched)
            slot.reusable += page_id < self._limit
            return
        self._free(slot, page_id, cached)

    def _unhold(self, slot: _Slot, page_id: int) -> bool:
        """Take ``page_id`` off ``slot``'s held pages (it stays the slot's); whether it was freed cached."""
        cached, _ = slot.held.pop(page_id)
        slot.reusable -= page_id < self._limit
        return cached

    def _release_held(self, slot: _Slot) -> None:
        # tags rise in insertion order (the launched count only grows): the due pages lead
        due = []
        for page_id, (_, tag) in slot.held.items():
            if tag > slot.done:
                break
            due.append(page_id)
        for page_id in due:
            self._free(slot, page_id, self._unhold(slot, page_id))

    def _check_owner(self, slot: _Slot, page_id: int) -> None:
        if isinstance(page_id, bool) or not isinstance(page_id, int) or not 0 <= page_id < self.num_pages:
            raise PagePoolError(f"{page_id!r} is not a page id of this pool (0..{self.num_pages - 1})")
        if self._owner[page_id] is not slot:
            owner = self._owner[page_id]
            who = "nobody (double free)" if owner is None else repr(owner.name)
            raise PageOwnershipError(f"{slot.name!r} frees page {page_id}, held by {who}")

    def _free(self, slot: _Slot, page_id: int, cached: bool = False) -> None:
        self._check_owner(slot, page_id)
        self._owner[page_id] = None
        slot.pages.discard(page_id)
        slot.used -= 1
        if page_id < self._limit:
            slot.counted -= 1
            if slot.counted < slot.min_pages:
                self._reserve += 1
            if cached:
                self._cached_free[page_id] = slot
            else:
                heapq.heappush(self._free_ids, page_id)
        elif cached and slot.on_evict is not None:
            slot.on_evict(page_id)  # fenced: it drains and is not kept, so it leaves the index now
        # A fenced page just drains: it is not handed out again before the resize.

    # -- shrinking and growing ----------------------------------------------------------------------
    def fence(self, limit: int) -> int:
        """Stop handing out pages ``>= limit`` (ahead of ``resize(limit)``); returns how many of
        them are still held. Pages above the fence no longer count toward a model's minimum, so
        the minimums must be honourable from the pages below it, else ``PoolExhausted``."""
        _positive_int("limit", limit, 0)
        if limit > self.num_pages:
            raise PagePoolError(f"fence {limit} is past the pool's {self.num_pages} pages")
        counted = {s.name: sum(1 for p in s.pages if p < limit) for s in self._slots.values()}
        reserve = sum(max(0, s.min_pages - counted[s.name]) for s in self._slots.values())
        free_below = limit - sum(counted.values())
        if free_below < reserve:
            raise PoolExhausted(f"a fence at {limit} pages leaves {free_below} free pages below it "
                                f"but {reserve} are guaranteed to models")
        self._limit = limit
        for s in self._slots.values():
            s.counted = counted[s.name]
            for p, (cached, tag) in list(s.held.items()):
                if p >= limit and cached:  # held cached above the fence: out of the index, as a free would
                    s.held[p] = (False, tag)
                    if s.on_evict is not None:
                        s.on_evict(p)
            s.reusable = sum(1 for p in s.held if p < limit)
        self._reserve = reserve
        for page_id in [p for p in self._cached_free if p >= limit]:
            self._evict(page_id)
        self._free_ids = [p for p in range(limit) if self._owner[p] is None and p not in self._cached_free]
        return self.num_fenced_in_use()

    def num_fenced_in_use(self) -> int:
        return sum(1 for p in range(self._limit, self.num_pages) if self._owner[p] is not None)

    def resize(self, num_pages: int) -> None:
        """Give the pool ``num_pages`` pages, keeping page ids and live contents.

        Pages ``>= num_pages`` must be free (``fence`` first and let them drain). On a GPU the
        tail is mapped or unmapped in place (views stay valid). Elsewhere live pages are copied
        through host memory and the old memory is released before the new is allocated, so the
        device never holds both; views from before must have been dropped: if any is still
        referenced, nothing changes and ``PoolBusyError`` is raised (the old memory could not be
        released). Book a larger size in the ledger before growing; shrink the ledger after.
        """
        _positive_int("num_pages", num_pages, 0)
        held_above = sum(1 for p in range(num_pages, self.num_pages) if self._owner[p] is not None)
        if held_above:
            raise PoolBusyError(f"cannot resize to {num_pages} pages: {held_above} pages above "
                                "are still held (fence and let them drain first)")
        used = sum(s.used for s in self._slots.values())
        reserve = sum(max(0, s.min_pages - s.used) for s in self._slots.values())
        if num_pages - used < reserve:
            raise PoolExhausted(f"{num_pages} pages cannot hold {used} live pages plus "
                                f"{reserve} guaranteed to models")
        for page_id in [p for p in self._cached_free if p >= num_pages]:
            self._evict(page_id)
        if self._memory is not None:  # cached-free pages keep their K/V too
            live = [p for s in self._slots.values() for p in s.pages]
            self._memory.resize(num_pages, live + list(self._cached_free))
        self._owner = self._owner[:num_pages] + [None] * max(0, num_pages - self.num_pages)
        self.num_pages = self._limit = num_pages
        for s in self._slots.values():
            s.counted = s.used
            s.reusable = len(s.held)  # none is above the new size: the resize checked
        self._reserve = reserve
        self._free_ids = [p for p in range(num_pages) if self._owner[p] is None and p not in self._cached_free]
        if self.memory_moves:
            self.generation += 1

    # -- memory and views -----------------------------------------------------------------------
    @property
    def memory_moves(self) -> bool:
        """Whether a resize moves the memory (views, and runners built on them, must be rebuilt):
        not on a GPU, where the tail is mapped and unmapped in place."""
        return self._memory is None or self._memory.moves

    def room_below(self, limit: int) -> int:
        """Free pages below ``limit`` beyond every model's guaranteed minimum, once no page at or
        above it is held: what a shrink to ``limit`` leaves a new model's minimum."""
        slots = self._slots.values()
        return limit - sum(s.used for s in slots) - sum(max(0, s.min_pages - s.used) for s in slots)

    def holders_at_or_above(self, limit: int) -> set[str]:
        """Models holding a page ``>= limit`` (a shrink to ``limit`` waits for or preempts them)."""
        return {owner.name for owner in self._owner[limit:] if owner is not None}

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def kv_views(self, model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(k_cache, v_cache)``, each ``[pages, tokens_per_page, kv_heads, head_dim]``
        over the shared memory (on a GPU ``capacity`` pages, of which only those below
        ``num_pages`` may be touched); page stride = ``page_bytes // itemsize`` elements. Valid
        until ``generation`` changes (a resize off a GPU): do not keep them across one."""
        slot = self._slot(model)
        return self._require_memory().views(model, slot.layout)

    def flat_buffer(self, model: str) -> torch.Tensor:
        """The whole pool as one 1-D tensor of the model's dtype: the buffer
        ``engine.kv.kv_cache.KVCache.from_buffer`` takes. Only for a layout that fills its page
        exactly (``tokens_per_page * bytes_per_token == page_bytes``), because ``KVCache``
        assumes a page stride of exactly one page of its own data."""
        lay = self._slot(model).layout
        if lay.tokens_per_page * lay.bytes_per_token != self.page_bytes:
            raise PagePoolError(f"{model!r} fills {lay.tokens_per_page * lay.bytes_per_token} of "
                                f"{self.page_bytes} page bytes; use kv_views for padded pages")
        return self._require_memory().flat(lay)

    def _require_memory(self) -> PoolMemory:
        if self._memory is None:
            raise PagePoolError("this pool has no memory (built with device=None)")
        return self._memory

    # -- reading ------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Free pages that may be handed out (below the fence), including held-back and cached-free ones."""
        return len(self._free_ids) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def cached_free_pages(self, model: str | None = None) -> list[int]:
        """Cached-free pages (of ``model``'s, or all), least recently freed first."""
        slot = self._slot(model) if model is not None else None
        return [p for p, owner in self._cached_free.items() if slot is None or owner is slot]

    @property
    def num_reserved(self) -> int:
        """Free pages held back for models below their minimum."""
        return self._reserve

    def num_used(self, model: str) -> int:
        return self._slot(model).used

    def models(self) -> list[str]:
        return list(self._slots)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per model: ``used``, ``min``, ``max`` (-1: no cap), ``available`` (what it could take)."""
        return {n: {"used": s.used, "min": s.min_pages,
                    "max": -1 if s.max_pages is None else s.max_pages,
                    "available": self._available(s)} for n, s in self._slots.items()}

    def audit(self) -> None:
        """Recount everything from the owner table; ``PagePoolError`` on any disagreement.
        O(pages): for tests and debug checks after unload, not for every step."""
        owned = [0] * len(self._slots)
        index = {id(s): i for i, s in enumerate(self._slots.values())}
        for page_id, owner in enumerate(self._owner):
            if owner is not None:
                if id(owner) not in index or page_id not in owner.pages:
                    raise PagePoolError(f"page {page_id} has a stale owner {owner.name!r}")
                owned[index[id(owner)]] += 1
        for s, n in zip(self._slots.values(), owned):
            below = sum(1 for p in s.pages if p < self._limit)
            if n != s.used or len(s.pages) != s.used or below != s.counted:
                raise PagePoolError(f"{s.name!r}: owns {n} pages, books {s.used} / {s.counted}")
        free = sorted(self._free_ids + list(self._cached_free))
        expect = [p for p in range(self._limit) if self._owner[p] is None]
        if free != expect or len(set(self._free_ids) & set(self._cached_free)):
            raise PagePoolError("the free list disagrees with the owner table (leak or double free)")
        if any(owner not in self._slots.values() for owner in self._cached_free.values()):
            raise PagePoolError("a cached-free page belongs to a model no longer registered")
        if self._reserve != sum(s.reserve() for s in self._slots.values()) or self._reserve > len(free):
            raise PagePoolError(f"held-back pages {self._reserve} are wrong or exceed {len(free)} free")
        for s in self._slots.values():
            if not set(s.held) <= s.pages or not 0 <= s.done <= s.launched \
                    or any(tag > s.launched for _, tag in s.held.values()) \
                    or s.reusable != sum(1 for p in s.held if p < self._limit):
                raise PagePoolError(f"{s.name!r}: pages held behind its steps disagree with its books")

    def _slot(self, model: str) -> _Slot:
        try:
            return self._slots[model]
        except KeyError:
            raise PagePoolError(f"model {model!r} is not registered in the pool") from None
