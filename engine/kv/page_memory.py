"""The device memory behind a PagePool and the per-model K/V views over it.

Two kinds, one interface (``views``, ``flat``, ``forget``, ``resize``, ``num_pages``, ``moves``):

- :class:`ElasticMemory`, on CUDA: the pages live in a :class:`~engine.kv.vmm.VirtualRange` of
  ``capacity`` pages' addresses, of which the first ``num_pages`` are backed. A resize maps or
  unmaps the tail; nothing moves, so views, runners and their captured graphs stay valid, and a
  load takes the pool's free tail while every model serves (``moves`` False).
- :class:`PoolMemory`, elsewhere: one ``uint8`` tensor ``[num_pages, page_bytes]``, re-created by
  a resize that copies the live pages through host memory (``moves`` True: views must be dropped
  and fetched again).

Kept apart from the page accounting in ``engine/kv/page_pool.py`` so that module stays importable
without torch; the pool creates its memory only when it is given a device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from engine.kv.layout import KVLayout, PagePoolError, PoolBusyError

KVViews = list[tuple[torch.Tensor, torch.Tensor]]


def pool_memory(num_pages: int, page_bytes: int, device: Any, capacity: int | None) -> PoolMemory | ElasticMemory:
    """The memory of a pool of ``num_pages`` on ``device``: elastic on CUDA (``capacity``: the
    most pages it may ever back, required there), a plain tensor elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        if capacity is None:
            raise PagePoolError("a pool on a GPU needs its capacity (the most pages the budget holds)")
        return ElasticMemory(num_pages, page_bytes, device, capacity)
    return PoolMemory(num_pages, page_bytes, device)


def _layer_views(flat: torch.Tensor, num_pages: int, page_bytes: int, lay: KVLayout) -> KVViews:
    """Per layer ``(k, v)`` of shape ``[num_pages, tokens_per_page, kv_heads, head_dim]`` over
    ``flat`` (``[num_pages, page_elems]`` of the model's dtype).

    Inside a page the model's data is ``[layers, 2, tokens_per_page, kv_heads, head_dim]`` from
    byte 0; the page stride is the whole page (``page_bytes // itemsize`` elements), whatever
    part of the page the model fills.
    """
    block = lay.tokens_per_page * lay.num_kv_heads * lay.head_dim
    size = (num_pages, lay.tokens_per_page, lay.num_kv_heads, lay.head_dim)
    stride = (page_bytes // lay.itemsize, lay.num_kv_heads * lay.head_dim, lay.head_dim, 1)
    base = flat.storage_offset()
    return [(torch.as_strided(flat, size, stride, base + 2 * layer * block),
             torch.as_strided(flat, size, stride, base + (2 * layer + 1) * block))
            for layer in range(lay.num_layers)]


class ModelViews:
    """Each model's K/V views over the memory's ``[pages, page_bytes]`` byte tensor
    (``_require``), cached until ``forget`` (or, where the memory moves, its resize)."""

    page_bytes: int
    _views: dict[str, KVViews]

    def _require(self) -> torch.Tensor:
        raise NotImplementedError

    def views(self, model: str, lay: KVLayout) -> KVViews:
        cached = self._views.get(model)
        if cached is None:
            raw = self._require()
            cached = self._views[model] = _layer_views(raw.view(getattr(torch, lay.dtype)), raw.shape[0],
                                                       self.page_bytes, lay)
        return cached

    def flat(self, lay: KVLayout) -> torch.Tensor:
        return self._require().view(getattr(torch, lay.dtype)).view(-1)

    def forget(self, model: str) -> None:
        self._views.pop(model, None)


class ElasticMemory(ModelViews):
    """The pool's pages in a virtual range of ``capacity`` pages, the first ``num_pages`` backed.

    Views span all ``capacity`` pages (their addresses never change); the pool hands out only
    pages below ``num_pages``, so nothing touches the unbacked rest. Newly mapped chunks are
    zeroed (a kernel reading a masked, never-written slot must see no NaN bit patterns; a page
    handed out again keeps its old bytes, as any reused page does); shrinking waits for the
    device (a queued step may still read a page being cut) and gives the memory back to the
    driver at once."""

    moves = False

    def __init__(self, num_pages: int, page_bytes: int, device: torch.device, capacity: int) -> None:
        from engine.kv.vmm import VirtualRange

        if capacity < num_pages:
            raise PagePoolError(f"a pool of {num_pages} pages does not fit its capacity of {capacity}")
        self.page_bytes = page_bytes
        self.device = device
        self.capacity = capacity
        self._range = VirtualRange(device, capacity * page_bytes)
        self._pages = 0
        self._tensor: torch.Tensor | None = None  # [capacity, page_bytes], made at the first backing
        self._views: dict[str, KVViews] = {}
        self.resize(num_pages, [])

    @property
    def num_pages(self) -> int:
        return self._pages

    def resize(self, num_pages: int, live: list[int]) -> None:
        """Back exactly the first ``num_pages`` pages (the chunks they touch). ``live`` pages are
        all below it (the pool's precondition) and stay where they are."""
        from engine.kv.vmm import VmmError

        if num_pages > self.capacity:
            raise PagePoolError(f"{num_pages} pages is past the pool's capacity of {self.capacity}")
        try:
            try:
                self._range.map_to(num_pages * self.page_bytes)
            except VmmError as e:
                if not e.out_of_memory:
                    raise
                # The caching allocator's free blocks are room the books count as free (the
                # reconcile calls them reclaimable), but only torch hands them back: once, then
                # the mapping again.
                torch.cuda.empty_cache()
                self._range.map_to(num_pages * self.page_bytes)
        except VmmError as e:
            raise PagePoolError(f"could not back {num_pages} pages ({e}); the pool keeps its "
                                f"{self._pages} pages") from e
        self._pages = num_pages
        if self._tensor is None and self._range.mapped:
            self._tensor = self._range.tensor()[:self.capacity * self.page_bytes].view(self.capacity, self.page_bytes)

    def _require(self) -> torch.Tensor:
        if self._tensor is None:
            raise PoolBusyError("the pool has no backed page yet")
        return self._tensor


class PoolMemory(ModelViews):
    """The pool's bytes on ``device``; views are cached per model until the next resize."""

    moves = True

    def __init__(self, num_pages: int, page_bytes: int, device: Any) -> None:
        self.page_bytes = page_bytes
        self.device = torch.device(device)
        self.tensor: torch.Tensor | None = self._zeros(num_pages)
        self._views: dict[str, KVViews] = {}

    def _zeros(self, num_pages: int) -> torch.Tensor:
        # Zeroed, so a kernel that reads a masked, never-written slot sees no NaN bit patterns.
        return torch.zeros((num_pages, self.page_bytes), dtype=torch.uint8, device=self.device)

    @property
    def num_pages(self) -> int:
        return 0 if self.tensor is None else self.tensor.shape[0]

    def resize(self, num_pages: int, live: list[int]) -> None:
        """Re-create the memory with ``num_pages`` pages; pages in ``live`` (all below
        ``num_pages``) keep their bytes, through host memory, so the device never holds the old
        and the new tensor at once. Raises ``PoolBusyError``, changing nothing, when views
        handed out earlier are still referenced (the old memory could not be released)."""
        old = self._require()
        old_pages = old.shape[0]
        index = torch.tensor(sorted(live), dtype=torch.long, device=old.device) if live else None
        saved = old.index_select(0, index).to("cpu") if live else None
        self._views.clear()
        # Dtype-changing views are not autograd views of the byte tensor: watch the storage.
        ref = StorageWeakRef(old.untyped_storage())
        self.tensor = None
        del old
        if not ref.expired():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            self.tensor = torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(
                storage, 0, (storage.nbytes() // self.page_bytes, self.page_bytes))
            raise PoolBusyError("views of the pool are still referenced outside it; drop them "
                                "(fetch kv_views again after the resize) before resizing")
        # No empty_cache here: it synchronizes the device and unmaps every cached block (after an
        # unload, the old weights' ~300 blocks), which a reload then maps again; a request the
        # cached blocks cannot serve makes torch's allocator release them and retry by itself.
        try:
            new = self._zeros(num_pages)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            # Put the old pages back where they were, so the pool and its books stay as before.
            new = self._zeros(old_pages)
            if saved is not None:
                new.index_copy_(0, index, saved.to(self.device))
            self.tensor = new
            raise PagePoolError(f"could not allocate {num_pages} pages ({e}); the pool keeps "
                                f"its {old_pages} pages") from e
        if saved is not None:
            new.index_copy_(0, index, saved.to(self.device))
        self.tensor = new

    def _require(self) -> torch.Tensor:
        if self.tensor is None:  # only between the release and the allocation of a resize
            raise PoolBusyError("the pool's memory is being re-created")
        return self.tensor
