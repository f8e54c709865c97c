"""PoolKeeper: the memory ledger, the shared KV pool, its resizes, and the runners over its memory.

It owns the :class:`~engine.core.ledger.MemoryLedger` (every byte booked) and the
:class:`~engine.kv.page_pool.PagePool` (every model's KV pages), and builds each model's KV views
and :class:`~engine.runner.model_runner.ModelRunner` over the pool (rebuilt when the pool is
re-created). It reads the core's :class:`~engine.core.model_table.ModelTable`, and changes only
its slots' ``kv``/``runner``. The loader books and releases a load through its verbs (``plan``,
``book``, ``pages_for``, ``record_workspace``, ``release``, ``trim``), never through the ledger
or the pool directly.

Policy (docs/multi-model.md, "Resizing"): on a GPU the pool grows and shrinks in place (its
memory is a virtual range: views, runners and graphs stay valid); a load that must shrink it (its
weights need the room) preempts only the running sequences holding its cut-off tail (they
recompute, token-identical), and a trim waits while the tail is in use. Off a GPU the pool is
re-created, only when no sequence holds a page (a load that must resize it while sequences are
live preempts them all first), and the runners are rebuilt on the new memory.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.core import heap
from engine.core.ledger import LedgerError, LoadPlan, LoadRefused, MemoryLedger
from engine.core.memory_plan import LoadNeeds, Workspace, pool_target
from engine.core.model_table import ModelTable
from engine.config import ModelConfig
from engine.core.slot import ModelSlot
from engine.core.vacancy import VACANCIES_MAX, VACANT_PREFIX, Vacancy
from engine.errors import EngineError
from engine.kv.kv_cache import KVCache, KVSpec
from engine.kv.layout import ModelPageSource, PoolBusyError
from engine.kv.page_pool import PagePool
from engine.options import EngineOptions
from engine.runner.cuda_graphs import DEFAULT_BUCKETS
from engine.runner.model_runner import ModelRunner
from engine.runner.streams import StreamPool
from engine.stats import MemoryStats, ModelMemory
from engine.sampling import SamplingParams
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


def device_held_bytes(device: torch.device) -> int:
    """Bytes in use on the whole device now, as the driver counts them (what an out-of-memory
    is decided against)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def reclaimable_bytes(device: torch.device) -> int:
    """Cached segments of the caching allocator's default pool that hold no live block: the
    allocator frees them itself before an allocation fails, so they are not the engine's. Graph
    pools' segments are not counted (a captured graph keeps them whatever they hold now)."""
    return free_default_segments(torch.cuda.memory_snapshot(), device.index or 0)


def free_default_segments(segments: list[dict[str, Any]], device_index: int) -> int:
    """The bytes of ``torch.cuda.memory_snapshot()`` segments on ``device_index`` that lie in
    the default pool (pool id (0, 0)) with no allocated byte."""
    return sum(int(seg["total_size"]) for seg in segments
               if seg.get("device", device_index) == device_index and int(seg.get("allocated_size", 0)) == 0
               and tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0))


class PoolKeeper:
    """The ledger and the pool of one engine, and the runners over the pool.

    ``slots``: the core's :class:`~engine.core.model_table.ModelTable` (read; runners attached to
    its slots).
    ``options``: the engine's; every runner is built with its ``max_num_batched_tokens``,
    ``cuda_graphs``, ``mixed_buckets`` and the decode buckets (``decode_buckets``: the options',
    or where they say None the graph buckets on CUDA with graphs, else none). ``streams``: the
    core's stream pool its runners borrow from (None off CUDA).
    """

    def __init__(self, ledger: MemoryLedger, device: torch.device, slots: ModelTable,
                 options: EngineOptions, streams: StreamPool | None) -> None:
        self.ledger = ledger
        self.pool: PagePool | None = None  # created by the first load (it knows the page size)
        self.device = device
        self._slots = slots
        self.max_num_batched_tokens = options.max_num_batched_tokens
        buckets = options.decode_buckets
        if buckets is None:  # the graph buckets where graphs are captured; none on CPU
            buckets = DEFAULT_BUCKETS if device.type == "cuda" and options.cuda_graphs else ()
        self.decode_buckets: tuple[int, ...] = tuple(buckets)
        self.mixed_buckets = options.mixed_buckets
        self.cuda_graphs = options.cuda_graphs
        self.streams = streams
        self.resizes = 0  # pool re-creations (each rebuilds every loaded model's runner) and their seconds
        self._changed_at = time.monotonic()  # the last load booked or model released: a grow waits for quiet
        self.resize_seconds = 0.0
        # Unloaded models' memory and runners kept for the next load of their kind (engine/core/vacancy.py)
        self.vacancies: list[Vacancy] = []
        self._claimed: Vacancy | None = None  # the one a load is booking with (book)
        self.vacancies_claimed = 0  # loads that took one (stats)
        # What the device held before this engine put anything on it (the CUDA context, other
        # processes): the fixed slack beside the budget; reconcile() counts only what comes after.
        self._device_baseline = device_held_bytes(device) if device.type == "cuda" else 0

    def reconcile(self) -> int:
        """Before a load is decided: the ledger takes the device's own figure of what this engine
        holds (everything on the device since it started, less cached free segments the allocator
        hands back on demand) and charges what no booking explains as ``untracked`` (library
        scratch, graph pools captured after the load's measurement, fragmentation). Returns the
        untracked bytes; 0 off CUDA, where the books are the truth."""
        if self.device.type != "cuda":
            return 0
        held = device_held_bytes(self.device) - self._device_baseline - reclaimable_bytes(self.device)
        return self.ledger.reconcile(max(0, held))

    # -- a load's books: what the loader asks for -------------------------------------------------
    def shared_page_bytes(self) -> int | None:
        """The pool's page size while a model is on it (a load takes its pages as they are), else None."""
        return self.pool.page_bytes if self.pool is not None and self.pool.models() else None

    def plan(self, name: str, needs: LoadNeeds, evictable: tuple[str, ...] | list[str] = ()) -> LoadPlan:
        """The ledger's plan of a load (which of ``evictable`` to unload first), against the
        device's figure (:meth:`reconcile`); raises :class:`LoadRefused` when even that is not
        enough. Books nothing."""
        self.reconcile()
        return self.ledger.check_load(name, needs.weight_bytes, needs.workspace.held, needs.min_kv_bytes,
                                      evictable=list(evictable), step_bytes=needs.workspace.step)

    def book(self, name: str, cfg: ModelConfig, needs: LoadNeeds, evictable: tuple[str, ...] | list[str] = (),
             vacancy: Vacancy | None = None) -> float:
        """Book a load, all or nothing: the ledger's verdict (a refusal says what evicting the
        offered ``evictable`` models would do), the pool fitted to it, the weights booked, the
        model's pages registered (its minimum held back from then on). Returns the seconds the
        pool's fit took. ``vacancy``: the one the load claimed (:meth:`claim`); its books are given
        up once the device's figure is taken (before, the figure would charge its tensors, still
        on the device, as untracked) and the load books the same bytes in their place. The
        caller drops the vacancy (:meth:`discard`) when this raises."""
        self._claimed = vacancy  # a resize or trim in here finds its KV views (_stale_vacancies)
        try:
            return self._book(name, cfg, needs, evictable, vacancy)
        finally:
            self._claimed = None

    def _book(self, name: str, cfg: ModelConfig, needs: LoadNeeds, evictable: tuple[str, ...] | list[str],
              vacancy: Vacancy | None) -> float:
        self.reconcile()
        if vacancy is not None:
            self.ledger.release(vacancy.book)
        # The other vacancies stay while this load fits beside them as the pool is (two loads
        # draining for room each take their own victim's); else they all go, their room this
        # load's: kept, they would make it shrink the pool (every running sequence preempted,
        # every runner rebuilt, theirs staled).
        kept = sum(self.ledger.model_bytes(v.book) for v in self.vacancies)
        beside = self.beside_pool(needs)
        if kept and (self.ledger.room() - kept < beside + needs.min_kv_bytes or self.ledger.snapshot().free < beside):
            self.drop_vacancies()
        try:
            plan = self.ledger.check_load(name, needs.weight_bytes, needs.workspace.held, needs.min_kv_bytes,
                                          step_bytes=needs.workspace.step)
        except LoadRefused as e:
            if vacancy is not None:  # its memory back before the refusal's figures take the device's
                self.discard(vacancy)
            raise self._refusal(name, needs, e, evictable) from None
        t = time.perf_counter()
        self._changed_at = time.monotonic()
        self.fit(needs, plan.kv_pool_bytes_after)
        t = time.perf_counter() - t
        try:
            self.ledger.reserve_weights(name, needs.weight_bytes, workspace_estimate=needs.workspace.held,
                                        min_kv_bytes=needs.min_kv_bytes, step_bytes=needs.workspace.step)
        except EngineError:
            self.trim()
            raise
        try:
            self.pool.register(name, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, dtype=needs.kv_dtype, min_pages=needs.min_pages,
                               max_pages=needs.want_pages, tokens_per_page=needs.tokens_per_page)
        except BaseException:
            self.ledger.release(name)
            self.trim()
            raise
        return t

    def _refusal(self, name: str, needs: LoadNeeds, e: LoadRefused, evictable) -> LoadRefused:
        """The refusal with what evicting the offered models (those booked here) would do."""
        offered = tuple(m for m in dict.fromkeys(evictable) if m in self.ledger)  # an offer may be stale
        if not offered:
            return e
        try:
            plan = self.plan(name, needs, offered)
        except LoadRefused as full:
            return full
        total = self.ledger.net_frees(offered, needs.workspace.step)
        return LoadRefused(name, needed=e.needed, free=e.free, evictable=total, budget=e.budget,
                           evictable_models=offered, parts=e.parts, evict=plan.evict)

    def beside_pool(self, needs: LoadNeeds) -> int:
        """What a load books beside the KV pool: its weights, its held workspace, and what its
        step adds to the step booking (engine/core/ledger.py)."""
        return needs.weight_bytes + needs.workspace.held + self.ledger.step_more(needs.workspace.step)

    def pages_for(self, name: str) -> ModelPageSource:
        """The page source of a model booked here (its block manager allocates through it)."""
        return self.pool.allocator_for(name)

    @property
    def generation(self) -> int:
        """The pool memory's generation (a resize makes a new one): a runner built on an older
        one is stale."""
        return self.pool.generation

    def record_workspace(self, name: str, workspace: Workspace) -> None:
        """The workspace measured (or carried over) for a loaded model, booked in place of its estimate."""
        self.ledger.record_workspace(name, workspace.held, workspace.step)

    def release(self, name: str, *, trim: bool = True) -> None:
        """Everything booked for ``name``: its pages and pool registration, its ledger entry,
        then its device memory; the pool is trimmed when ``trim`` (a load in flight leaves that
        to its end: that model is in the pool but not yet among the slots whose wants size it)."""
        self._changed_at = time.monotonic()
        if self.pool is not None and name in self.pool.models():
            self.pool.free_all(name)  # the backstop: an unload's aborts freed them already
            self.pool.unregister(name)
        if name in self.ledger:
            self.ledger.release(name)
        self.return_device_memory()  # the models' memory back before the pool is fitted
        if trim:
            self.trim()

    def vacate(self, slot: ModelSlot, compute_key: str, shape: str, landing: Any = None) -> bool:
        """At an unload (the slot out of the model table, its requests aborted and settled): keep
        its weights and runner for the next load of ``compute_key`` at ``shape`` (engine/core/vacancy.py)
        and give back its pages; the slot's tensors move to the vacancy. False (nothing done) for
        a model that has nothing to keep (no runner, or not on the pool: the caller releases it).
        ``landing``: the event of the warm tier's copies from its weights still in flight (a load
        into the vacancy waits for it)."""
        if slot.runner is None or slot.pages is None or slot.model is None or slot.name not in self.ledger:
            return False
        self._changed_at = time.monotonic()
        model, kv, runner = slot.model, slot.kv, slot.runner
        slot.model = slot.kv = slot.runner = None  # the vacancy's alone: a resize must find no other view
        if self.cuda_graphs and self.decode_buckets and runner.graphs is None:
            kv = runner = None  # an eager stand-in after a failed capture: the next model gets real graphs
        else:
            runner.vacate()
        book = VACANT_PREFIX + slot.name
        if book in self.ledger:  # a vacancy of this name left by an earlier unload: the newer one stays
            self.discard(next(v for v in self.vacancies if v.book == book), books=True)
        while len(self.vacancies) >= VACANCIES_MAX:  # the oldest goes: its room is the pool's
            self.discard(self.vacancies[0], books=True)
        self.pool.free_all(slot.name)
        self.pool.unregister(slot.name)
        self.ledger.vacate(slot.name, book)
        self.vacancies.append(Vacancy(book, compute_key, shape, model, kv, runner, self.pool.generation,
                                      slot.workspace, landing))
        if runner is None:
            self.ledger.record_workspace(book, 0)
        # No trim: the room stays booked for the next load, which claims the vacancy (its pool
        # as it is) or drops it and fits the pool to itself; quiet, the pool grows into it.
        return True

    def claim(self, compute_key: str, shape: str) -> Vacancy | None:
        """A load's first step: the vacancy of its key and shape, if any, out of the list and
        still booked (its books go in :meth:`book`, which also drops the others if the load
        needs their room)."""
        found = next((v for v in self.vacancies if v.compute_key == compute_key and v.shape == shape), None)
        if found is not None:
            self.vacancies.remove(found)
            self.vacancies_claimed += 1
        return found

    def discard(self, v: Vacancy, *, books: bool = False, give_back: bool = True) -> None:
        """Let go of a vacancy's tensors (and, ``books``, its ledger entry), its memory back to the
        driver unless ``give_back`` is False (the caller returns it once for several)."""
        if v in self.vacancies:
            self.vacancies.remove(v)
        held = v.model is not None or v.runner is not None
        v.model = v.kv = v.runner = None
        if books and v.book in self.ledger:
            self.ledger.release(v.book)
        if give_back and held:
            self.return_device_memory()

    def _stale_vacancies(self) -> None:
        """The pool's memory is going: the runners kept over it (and the one a load is booking
        with) go first; their weights stay."""
        for v in [*self.vacancies, *([self._claimed] if self._claimed is not None else [])]:
            v.runner = v.kv = None
            if v.book in self.ledger:  # its graph pools and step buffers went with the runner
                self.ledger.record_workspace(v.book, 0)

    def drop_vacancies(self) -> None:
        """Every vacancy gone, memory and books (the pool grows into the room)."""
        if not self.vacancies:
            return
        for v in list(self.vacancies):
            self.discard(v, books=True, give_back=False)
        self.return_device_memory()

    def trim(self) -> None:
        """Shrink the pool to the loaded models' wants when that is cheap (:meth:`fit` with no new
        load); never grow it. An unload's room is the next load's in a swap: grown into at the
        unload, the pool had to shrink again at that load, every running sequence preempted and
        every runner rebuilt twice a swap. :meth:`grow_when_quiet` grows it once loads settle."""
        self.fit(None, None, grow=False)

    def grow_when_quiet(self, quiet_s: float) -> bool:
        """Fit the pool to its target, growing it into the room unloads left, once no load was
        booked and no model released for ``quiet_s`` seconds (off a GPU also only while no page is
        live); True when it was resized."""
        if self.pool is None or time.monotonic() - self._changed_at < quiet_s:
            return False
        self.drop_vacancies()  # nobody loaded into them while it was quiet: the room is the pool's
        before = self.resizes
        self.fit(None, None)
        return self.resizes != before

    def _pooled(self) -> list[ModelSlot]:
        """The loaded models on the pool (a tensor-parallel one owns its cache)."""
        return [s for s in self._slots.values() if s.pages is not None]

    def grow_under_pressure(self, quiet_s: float) -> bool:
        """:meth:`grow_when_quiet` for a busy engine whose models wait for pages: only a pool that
        grows in place (a GPU's: no live page moves, no runner is rebuilt) and is below what its
        models could use together (else the vacancies would go for nothing)."""
        pool = self.pool
        if pool is None or pool.memory_moves:
            return False
        if pool.num_pages >= sum(s.needs.want_pages for s in self._pooled()):
            return False
        return self.grow_when_quiet(quiet_s)

    def fit(self, new: LoadNeeds | None, kv_after: int | None, grow: bool = True) -> None:
        """Resize the pool to its target when that is cheap or required by a load (``new``): the
        weights need room the pool holds, or its minimum needs pages the pool lacks. Cheap: on a
        GPU any grow, and a shrink whose cut-off tail is free; off it, any resize with no live page.
        A required resize preempts the running sequences in its way first (on a GPU those holding
        the tail, off it all). ``grow`` False: only a smaller target is taken. A load then gets
        its minimum whatever the size: models above their own minimums give pages back (a busy
        model takes the pages of one that left, its cap being what the others' minimums leave,
        so a pool already the right size may lack them)."""
        self._fit_size(new, kv_after, grow)
        pool = self.pool
        if new is not None and pool.num_free - pool.num_reserved < new.min_pages:
            self._make_room(self._pooled(), pool.num_pages, new.min_pages)

    def _fit_size(self, new: LoadNeeds | None, kv_after: int | None, grow: bool) -> None:
        """:meth:`fit`'s resize."""
        # No model on the pool: it goes now (a load makes one of its own page size), unless a
        # vacancy's runner is built on it and no load of another page size asks.
        kept_for = any(v.runner is not None for v in self.vacancies)
        if self.pool is not None and not self.pool.models() and (
                new.page_bytes != self.pool.page_bytes if new is not None else not kept_for):
            self._stale_vacancies()  # their runners' KV views are of this memory
            self.pool = None
            self.ledger.set_kv_pool(0)
        if self.pool is None:
            if new is None:
                return
            # Addresses for as many pages as the whole budget holds (a GPU's pool grows and
            # shrinks inside them: engine/kv/page_memory.py, ElasticMemory)
            self.pool = PagePool(0, new.page_bytes, self.device, capacity=self.ledger.budget // new.page_bytes)
        pool = self.pool
        pb = pool.page_bytes
        pooled = self._pooled()
        wants = [s.needs.want_pages for s in pooled] + ([new.want_pages] if new else [])
        if kv_after is None:
            snap = self.ledger.snapshot()
            kv_after = snap.free + snap.kv_pool_bytes  # the budget beside weights and workspace
        target = pool_target(kv_after, pb, wants)
        cur = pool.num_pages
        if target == cur or (target > cur and not grow):
            return
        must_shrink = new is not None and cur * pb > kv_after
        must_grow = new is not None and pool.num_free - pool.num_reserved < new.min_pages
        if new is not None and target < cur and not (must_shrink or must_grow):
            # A load shrinks the pool only when its weights need the room: a resize rebuilds
            # every runner, and leaves the vacancies' stale (the next load of their kind would
            # capture again); the trim after unloads and the quiet growth fit it otherwise.
            return
        if not pool.memory_moves:
            # The pool's memory stays where it is (a GPU's): growing touches no live page, and a
            # shrink needs only its cut-off tail free and, for a load, its minimum's pages below.
            # A load preempts the sequences in the way (lowest pages are handed out first: few
            # hold the tail); a trim leaves a tail in use alone.
            need = new.min_pages if new is not None else 0
            if target < cur and (pool.holders_at_or_above(target) or pool.room_below(target) < need):
                if not (must_shrink or must_grow):
                    return
                self._make_room(pooled, target, need)
        elif any(pool.num_used(n) for n in pool.models()):
            if not (must_shrink or must_grow):
                return  # a grow (or a trim after unload) waits until the pool is idle
            self._make_room(pooled, 0, 0)
        try:
            self._resize(target)
        except EngineError as e:
            if new is not None:
                raise  # a load needs this resize: it fails, contained (the runners are rebuilt)
            # A trim only gives room back early: when the old memory cannot be let go of yet (a
            # view of it still referenced), the pool keeps its size and every model serves on.
            log.warning("KV pool trim %d -> %d pages skipped: %s", cur, target, e)

    def _make_room(self, pooled: list[ModelSlot], limit: int, need: int) -> None:
        """Preempt running sequences (they recompute, token-identical) until no page ``>= limit``
        is held and the pages below it leave ``need`` beyond what the models hold and are
        guaranteed: first those holding a page of the cut-off tail, then, newest first, those of
        models above their minimum (other models' pages beyond their minimums sit low, where
        the room is). Raises when that is not reached."""
        pool = self.pool
        holders = pool.holders_at_or_above(limit)
        for s in pooled:
            if s.name in holders:
                for seq in list(s.scheduler.running):
                    if any(p >= limit for p in s.scheduler.blocks.block_table(seq.seq_id)):
                        s.scheduler.preempt(seq.req_id)
        for s in pooled if need else ():
            for seq in reversed(list(s.scheduler.running)):
                if pool.room_below(limit) >= need:
                    break
                if pool.num_used(s.name) > s.needs.min_pages:
                    s.scheduler.preempt(seq.req_id)
        if pool.holders_at_or_above(limit) or (need and pool.room_below(limit) < need):
            raise EngineError(f"the KV pool cannot be cut to {limit} pages with {need} free: pages are "
                              "still held after preempting the sequences in the way")

    def _resize(self, target: int) -> None:
        """Resize the pool to ``target`` pages (its pages from ``target`` up free). Where the
        resize moves the memory (off a GPU) the runners are rebuilt on the new memory. Ledger
        order: a larger pool is booked before it is allocated, a smaller one after."""
        pool = self.pool
        old = pool.num_pages
        t0 = time.perf_counter()
        moves = pool.memory_moves
        pooled = self._pooled() if moves else []
        for s in pooled:  # views (and captured graphs) of the old memory must go first
            s.runner = s.kv = None
        if moves:
            self._stale_vacancies()  # theirs too: a claim then builds a runner on the kept weights
        try:
            if target > old:
                self.ledger.set_kv_pool(target * pool.page_bytes)
            try:
                try:
                    pool.resize(target)
                except PoolBusyError:
                    heap.collect()  # a reference cycle may still hold the old views; then retry once
                    pool.resize(target)
                self.resizes += 1
            except Exception:
                if target > old:
                    self.ledger.set_kv_pool(old * pool.page_bytes)
                raise
            if target < old:
                self.ledger.set_kv_pool(target * pool.page_bytes)
        except (LedgerError, EngineError) as e:
            raise EngineError(f"KV pool resize {old} -> {target} pages failed: {e}") from e
        finally:
            for s in pooled:
                self.reattach_runner(s)
            self.resize_seconds += time.perf_counter() - t0

    def attach_runner(self, slot: ModelSlot) -> None:
        """KV views over the pool and a runner on them (on CUDA: its decode graphs captured)."""
        slot.kv, slot.runner = self.new_runner(slot.name, slot.config, slot.model, slot.max_num_seqs,
                                                slot.scheduler.config.max_model_len)

    def reattach_runner(self, slot: ModelSlot) -> None:
        """A loaded model's runner rebuilt over the pool's new memory, whatever else failed: a
        model that served before a resize must serve after it. When its graphs cannot be captured
        (out of memory: another load's failure left the device tight), it runs eagerly instead
        (no graph pool); only when even that fails is it left without a runner, which the core
        never steps (its requests are aborted; ``slot.broken`` says why) until the next resize
        rebuilds it. Never raises: one model's runner must not leave the others' unbuilt."""
        slot.broken = ""
        try:
            self.attach_runner(slot)
            return
        except Exception as e:  # noqa: BLE001 - any failure here is one model's, kept to it
            first = f"{type(e).__name__}: {e}"
        slot.runner = slot.kv = None
        self.return_device_memory()  # what the failed capture took
        try:
            slot.kv, slot.runner = self.new_runner(slot.name, slot.config, slot.model, slot.max_num_seqs,
                                                    slot.scheduler.config.max_model_len, cuda_graphs=False)
            slot.broken = ""
            log.warning("model %s: runner rebuilt without CUDA graphs after: %s", slot.name, first)
        except Exception as e:  # noqa: BLE001
            slot.runner = slot.kv = None
            slot.broken = f"its runner could not be rebuilt after a KV pool resize: {first}; eagerly: {type(e).__name__}: {e}"
            log.error("model %s: %s", slot.name, slot.broken)

    def new_runner(self, name: str, cfg, model, max_num_seqs: int, max_model_len: int,
                   cuda_graphs: bool | None = None) -> tuple[KVCache, ModelRunner]:
        """The KV cache over model ``name``'s pages of the pool and a runner on it; touches no slot
        (the load thread's :class:`engine.runner.prebuild.RunnerBuild` calls it too).
        ``cuda_graphs``: False builds an eager runner (None: the engine's setting)."""
        lay = self.pool.layout(name)
        spec = KVSpec(cfg.num_layers, lay.tokens_per_page, cfg.num_kv_heads, cfg.head_dim, getattr(torch, lay.dtype))
        if lay.tokens_per_page * lay.bytes_per_token == self.pool.page_bytes:
            kv = KVCache.from_buffer(spec, self.pool.flat_buffer(name))
        else:  # padded pages: per-layer views whose page stride is the whole page
            kv = KVCache.from_views(spec, self.pool.kv_views(name))
        graphs = self.cuda_graphs if cuda_graphs is None else cuda_graphs
        return kv, ModelRunner(model, kv, self.max_num_batched_tokens, max_num_seqs, max_model_len,
                               decode_buckets=self.decode_buckets if graphs else (), cuda_graphs=graphs,
                               mixed_buckets=self.mixed_buckets, stream_pool=self.streams)

    def warm_up(self, slot: ModelSlot) -> None:
        """One step at the largest batch, eagerly (every row sampled, with temperature: the
        sampler's kernel and its candidate buffers are part of the peak, and its compile or cache
        load happens here, not in the first sampled request's step) so its peak can be measured:
        eagerly, because a step of that size may run so whatever graph its bucket has (prompt
        logprobs run every step eagerly), and a replay's activations are the graph pool's, not
        the step's — at 512 tokens with a mixed graph the step was booked 0.25 MB against a
        2.9 MB eager step (tests/gpu, test_memory_gpu); and
        before it one short prompt run eagerly on each of the runner's two step streams: its
        attention takes the prefill kernel's small-step launch shape
        (engine/kernels/attention_triton.py, prefill_shape), compiled here, and its forward makes
        the library workspaces cuBLAS (and cuBLASLt, for biased and FP8 layers) keep for good on
        a stream they first run on — 32 MiB each on Hopper — inside the load's measurement. A
        warm-up whose largest step replays a graph runs no matmul on the step streams, and the
        first eager step on one (prompt logprobs, a bucket without a graph) made them unbooked,
        at serving time (tests/gpu, test_memory_gpu). The sequences share one block table of the
        model's own guaranteed pages: their K/V writes land only there, and the pages are freed
        after."""
        cfg = slot.scheduler.config
        per_seq = min(cfg.max_model_len - 1, self.max_num_batched_tokens)
        table = [slot.pages.allocate() for _ in range(-(-per_seq // slot.pages.block_size))]
        out = SchedulerOutput()
        left = self.max_num_batched_tokens
        params = SamplingParams(temperature=1.0, seed=0)
        while left > 0 and len(out.seqs) < slot.max_num_seqs:
            n = min(per_seq, left)
            i = len(out.seqs)
            out.seqs.append(ScheduledSeq(-1 - i, f"warmup{i}", [0] * n, 0, table, True, 0, params))
            out.num_batched_tokens += n
            left -= n
        short = SchedulerOutput()
        short.seqs.append(ScheduledSeq(-1, "warmup-short", [0] * min(per_seq, 16), 0, table, True, 0, params))
        short.num_batched_tokens = len(short.seqs[0].token_ids)
        try:
            # The short steps first: the workspaces they make stay, and made after the largest
            # step's peak they were taken off its figure (device_peak - device_allocated: the
            # step booked 87 KiB for a 24 MiB eager step on an H100).
            for urgent in (False, True):
                slot.runner.execute(short, urgent=urgent, eager=True)
            slot.runner.execute(out, eager=True)
        finally:
            for page in table:
                slot.pages.free(page)

    def start_peak(self) -> None:
        """The device's peak allocation (:meth:`device_peak`) counts from now, the device's queued
        work done first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def device_allocated(self) -> int:
        """Bytes of the live tensors (after :meth:`device_peak`, which synchronizes)."""
        return torch.cuda.memory_allocated(self.device)

    def device_reserved(self) -> int:
        """The allocator's segments once its cache is handed back: what live tensors and graph
        pools hold, whole segments. Synchronizes the device (a load that measures, on the
        stepping thread: no capture is in flight)."""
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def device_peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def return_device_memory(self) -> None:
        """After a model's tensors are dropped: hand their device memory back to the driver (the
        KV pool's is not the allocator's: it shrinks in place on a GPU).

        The weights and the graphs' private pools are released (a reload of 16 GB of weights
        waits little, and stale graph pools would otherwise pile up until an allocation fails).
        The cycle collector runs first: a reference cycle may still hold the model's tensors (a
        full collection costs ~70 ms on a loaded worker; an unload is rare). It runs on CPU too: the model's objects were frozen at its
        load (engine/core/heap.py), and only this collection can free a frozen cycle.
        """
        heap.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def room(self) -> int:
        """Bytes a load may take without evicting anyone (the ledger's ``room``)."""
        return self.ledger.room()

    def release_cached(self) -> None:
        """After a load: hand the allocator's cached free memory back to the driver. A load's
        temporaries (quantization at load, staging, the warm-up's activations) are freed into the
        allocator's cache, which keeps them outside the books: on the H200, twelve FP8 8Bs held
        8.6 GiB beyond the ledger (NVML above the budget) until an eviction emptied the cache.
        It synchronizes the device: called on the stepping thread once the load thread is done,
        so no capture is in flight anywhere."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory(self) -> MemoryStats:
        """The budget and who holds it, in bytes (engine/stats.py): ``used`` is weights +
        workspace + vacancies + the whole KV pool, ``kv_used`` its pages held; per model on the pool its
        weights, workspace, KV minimum, KV bytes and pages held, and the pages it could hold."""
        snap = self.ledger.snapshot()
        pool = self.pool
        pb = pool.page_bytes if pool is not None else 0
        models = {}
        for name, s in self._slots.items():
            if s.pages is None:
                continue
            models[name] = ModelMemory(weights=snap.weights.get(name, 0), workspace=snap.workspace.get(name, 0),
                                       kv_min=snap.kv_min.get(name, 0), kv_used=s.pages.num_used * pb,
                                       kv_pages_used=s.pages.num_used, kv_pages_total=s.pages.num_total)
        vacant = snap.vacant
        return MemoryStats(budget=snap.budget, used=snap.used, free=snap.free,
                           weights=sum(b for n, b in snap.weights.items() if n not in vacant),
                           workspace=sum(b for n, b in snap.workspace.items() if n not in vacant),
                           vacant=sum(snap.weights[n] + snap.workspace[n] for n in vacant), step=snap.step,
                           kv=snap.kv_pool_bytes, kv_used=sum(m.kv_used for m in models.values()),
                           page_bytes=pb, kv_pages=pool.num_pages if pool is not None else 0,
                           kv_pages_free=pool.num_free if pool is not None else 0, untracked=snap.untracked,
                           device=(max(0, device_held_bytes(self.device) - self._device_baseline)
                                   if self.device.type == "cuda" else 0),
                           models=models, models_omitted=0, pool_resizes=self.resizes,
                           pool_resize_s=round(self.resize_seconds, 6))
