"""Warm tier: recently unloaded models' weights kept in (pinned) host RAM under a byte budget.

``put(name, tensors)`` packs a model's tensors into one host buffer (page-locked with
``cudaHostRegister`` when CUDA is there, so the way back runs at pinned PCIe speed; torch's
pinned allocator is avoided because it rounds to powers of two and keeps freed blocks), evicting least-recently-used models until it fits;
``restore(name, dst)`` copies the packed bytes straight into the new device tensors on a few
CUDA streams and returns when they have landed. A model bigger than the whole budget is refused
(``put`` returns False) without evicting anything. ``put_async`` returns before a device
source's copies have landed (an unload's stash on the stepping thread), with their event: the
entry is held until then. Thread-safe (one lock); the copies run outside the lock, for entries
held against eviction.

``prepin()`` page-locks the whole budget once (a thread at start: ``prepin_async``); puts then take
a range of that arena, from its first pinned piece on (a range lies inside the pinned prefix).
Nothing else is ever page-locked, and with pinning on nothing pageable is stored: a put finding no
pinned range stores nothing (False) rather than pin a buffer on the unload's path (~0.3 s per GB
on the H200: the first eviction of an 8B took 19.9 s to answer after when it pinned) or copy into
pageable memory (15 s for an 8B there). It
pins in ``PIN_CHUNK_BYTES`` pieces, one ``cudaHostRegister`` each, and asks ``wait_turn`` before
each: the worker passes "wait until the engine is idle, or a pace under traffic", because a
registration holds the driver up (on the H200, 40 GiB pinned beside the first load after a
restart held its KV pool's allocation up for 6-11 s, and a 1-token request behind it took 8.9 s).
Copies in and out of the arena are split where one registration ends and the next begins, so each
DMA stays inside one page-locked range.

``note(name, tag, value)`` / ``noted(name, tag)`` keep small figures with a stored entry and go
with it (EngineCore keeps the workspace it measured for those weights at one load shape there,
so a reload at that shape books the figure instead of measuring it again).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.errors import EngineError
from engine.stats import WarmTierStats

_ALIGN = 256  # each tensor starts on a 256-byte boundary of the packed buffer
PIN_CHUNK_BYTES = 64 << 20  # one registration, ~30 ms on the H200: the longest a step or load waits for pinning
log = logging.getLogger(__name__)


class WarmTierError(EngineError):
    """A restore does not match what was stored (names, shapes, dtypes), or a bad budget."""


@dataclass(frozen=True)
class _Slot:
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Entry:
    buffer: torch.Tensor  # uint8, host
    slots: dict[str, _Slot]
    nbytes: int
    users: int = 0  # restores in progress: not evictable meanwhile
    notes: dict[str, object] = field(default_factory=dict)
    arena_off: int | None = None  # where its buffer lies in the arena (None: a buffer of its own)
    dropped: bool = False  # out of the store while a restore still reads it: freed after that
    landing: torch.cuda.Event | None = None  # a put's device-to-host copies still in flight (one user)


class _Arena:
    """One page-locked host allocation of the whole budget, carved into entry buffers (first fit,
    frees coalesced), so a put after the start-up pinning pays only its copy."""

    def __init__(self, buf: torch.Tensor, cuts: list[int] | None = None, limit: int | None = None) -> None:
        self.buf = buf
        self.free: list[tuple[int, int]] = [(0, buf.numel())]  # (offset, size), by offset
        self.cuts = cuts or []  # offsets where one page-locked registration ends and the next begins
        # Ranges end at or below this offset: the page-locked prefix while the pinning goes on
        # (the tier serves puts from the first pinned piece on, not from the last).
        self.limit = buf.numel() if limit is None else limit

    def pieces(self, off: int, n: int) -> list[tuple[int, int]]:
        """``[off, off + n)`` as (start, end) ranges relative to ``off``, none crossing a cut."""
        inside = [c - off for c in self.cuts if off < c < off + n]
        bounds = [0, *inside, n]
        return list(zip(bounds, bounds[1:]))

    def take(self, n: int) -> int | None:
        for i, (off, size) in enumerate(self.free):
            if off + n > self.limit:
                return None  # by offset: every later range lies further out
            if size >= n:
                if size == n:
                    del self.free[i]
                else:
                    self.free[i] = (off + n, size - n)
                return off
        return None

    def give(self, off: int, n: int) -> None:
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < off:
            i += 1
        free.insert(i, (off, n))
        if i + 1 < len(free) and off + n == free[i + 1][0]:  # merge with the next range
            free[i] = (off, n + free.pop(i + 1)[1])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # and with the previous one
            prev_off, prev_n = free[i - 1]
            free[i - 1] = (prev_off, prev_n + free.pop(i)[1])


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, _Slot], int]:
    slots, off = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        slots[name] = _Slot(off, n, tuple(t.shape), t.dtype)
        off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    return slots, off


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _unregister_all(ptrs: list[int]) -> None:
    for ptr in ptrs:
        _unregister(ptr)


def _cuts(base: int, n: int, chunk: int) -> list[int]:
    """Offsets into a buffer at ``base`` of ``n`` bytes where a new ``chunk``-sized registration
    begins: at addresses that are multiples of ``chunk``, so no page is in two registrations."""
    return [a - base for a in range((base // chunk + 1) * chunk, base + n, chunk)]


def _pin_pieces(buf: torch.Tensor, cuts: list[int], pin: bool, wait_turn: Callable[[], None],
                pinned: Callable[[int], None]) -> bool:
    """Page-lock ``buf`` piece by piece between ``cuts`` (with ``pin``), calling ``wait_turn``
    before each piece and ``pinned(end)`` after it. False when a registration failed (then none
    is left: it stays pageable)."""
    base, bounds = buf.data_ptr(), [0, *cuts, buf.numel()]
    done: list[int] = []
    # registered from the first piece on: the finalizer unregisters whatever was done
    weakref.finalize(buf, _unregister_all, done)
    for start, end in zip(bounds, bounds[1:]):
        wait_turn()
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(base + start, end - start, 0)
            if int(err) != 0:
                log.warning("warm tier: cudaHostRegister of %d bytes failed (%s); keeping it pageable", end - start, err)
                _unregister_all(done)
                done.clear()
                return False
            done.append(base + start)
        pinned(end)
    return True


class WarmTier:
    """LRU store of host copies of model weights, bounded by ``budget_bytes``."""

    def __init__(self, budget_bytes: int, pin: bool | None = None, pin_chunk_bytes: int = PIN_CHUNK_BYTES):
        if budget_bytes < 0:
            raise WarmTierError(f"warm tier budget must be >= 0, got {budget_bytes}")
        if pin_chunk_bytes < 4096 or pin_chunk_bytes % 4096:
            raise WarmTierError(f"pin_chunk_bytes must be a positive multiple of 4096, got {pin_chunk_bytes}")
        self.budget_bytes = budget_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.pin_chunk_bytes = pin_chunk_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self.last_put_seconds: dict[str, float] = {}
        self._arena: _Arena | None = None
        self._landing: list[_Entry] = []  # entries whose put's copies are in flight (see put_async)
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}

    def prepin(self, wait_turn: Callable[[], None] = lambda: None) -> bool:
        """Allocate and page-lock the whole budget now, ``pin_chunk_bytes`` at a time, calling
        ``wait_turn`` before each piece (seconds for tens of GB: call it from a thread at start,
        see :meth:`prepin_async`); later puts carve their buffers from it instead of pinning a
        fresh one each (~0.3 s per GB). False when there is nothing to do."""
        if not self.budget_bytes or self._arena is not None:
            return False
        buf = torch.empty(self.budget_bytes, dtype=torch.uint8)
        arena = _Arena(buf, _cuts(buf.data_ptr(), buf.numel(), self.pin_chunk_bytes), limit=0)
        with self._lock:
            if self._arena is not None:
                return False
            self._arena = arena

        def pinned(end: int) -> None:
            with self._lock:
                arena.limit = end

        if not _pin_pieces(buf, arena.cuts, self.pin, wait_turn, pinned):
            with self._lock:
                arena.limit = 0  # nothing page-locked is left: no put takes a range (see put)
        return True

    def prepin_async(self, wait_turn: Callable[[], None] = lambda: None) -> threading.Thread:
        """:meth:`prepin` in a daemon thread (puts take ranges of what it has pinned so far)."""
        def run() -> None:
            try:
                self.prepin(wait_turn)
            except Exception as e:  # host RAM refused: with pinning on, the tier stores nothing
                log.warning("warm tier: pinning %d bytes at start failed: %s", self.budget_bytes, e)

        t = threading.Thread(target=run, name="warm-tier-pin", daemon=True)
        t.start()
        return t

    def _pieces(self, arena_off: int | None, s: _Slot) -> list[tuple[int, int]]:
        """The copies one tensor of an entry takes: one per page-locked registration it spans in
        the arena (a DMA crossing two would fall back to a staged, pageable copy); one otherwise."""
        if arena_off is None or self._arena is None:
            return [(0, s.nbytes)]
        return self._arena.pieces(arena_off + s.offset, s.nbytes)

    def _release(self, e: _Entry) -> None:
        """An entry left the store (lock held): its arena range is free once no restore reads it."""
        if e.users:
            e.dropped = True
        elif e.arena_off is not None and self._arena is not None:
            self._arena.give(e.arena_off, e.nbytes)
            e.arena_off = None

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def _used(self) -> int:
        """(Lock held.) The stored models' bytes."""
        return sum(e.nbytes for e in self._entries.values())

    def stats(self) -> WarmTierStats:
        """Its budget, what a put may take now (the pinned prefix while pinning goes on) and
        what the stored models hold."""
        with self._lock:
            if not self.pin:
                ready = self.budget_bytes
            else:
                ready = self._arena.limit if self._arena is not None else 0
            return WarmTierStats(budget=self.budget_bytes, ready=ready,
                                 used=self._used(), models=len(self._entries))

    def models(self) -> list[str]:
        """Stored keys (the engine's: one per set of device bytes), least recently used first."""
        with self._lock:
            return list(self._entries)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def _landed(self) -> None:
        """(Lock held.) Entries whose put's copies have landed lose the put's hold: evictable,
        readable, their arena range free once dropped."""
        for e in [e for e in self._landing if e.landing is not None and e.landing.query()]:
            self._landing.remove(e)
            e.landing = None
            e.users -= 1
            if e.dropped and not e.users:
                self._release(e)

    def _evict_for(self, need: int) -> bool:
        """Drop least recently used idle entries until ``need`` more bytes fit; False if impossible
        (then nothing is dropped)."""
        used = sum(e.nbytes for e in self._entries.values())
        busy = sum(e.nbytes for e in self._entries.values() if e.users)
        if busy + need > self.budget_bytes:
            return False
        for name in list(self._entries):
            if used + need <= self.budget_bytes:
                break
            e = self._entries[name]
            if not e.users:
                used -= e.nbytes
                del self._entries[name]
                self._release(e)
                # the key names every weight file's identity (hundreds of characters): its digest
                log.info("warm tier: evicted %s (%d bytes)", hashlib.sha256(name.encode()).hexdigest()[:12], e.nbytes)
        return True

    def _carve(self, need: int) -> int | None:
        """An arena range of ``need`` bytes (lock held), evicting least recently used idle entries
        until one is contiguous; None without an arena or when busy entries fragment it."""
        if self._arena is None:
            return None
        off = self._arena.take(need)
        for name in list(self._entries):
            if off is not None:
                break
            e = self._entries[name]
            if not e.users:
                del self._entries[name]
                self._release(e)
                off = self._arena.take(need)
        return off

    def keep(self, name: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Mark ``name`` most recently used when it is stored with exactly these names, shapes
        and dtypes, without copying a byte (True); the caller vouches that the bytes are equal."""
        slots, _ = _layout(tensors)
        with self._lock:
            # A restore reading it meanwhile changes nothing of its bytes: refused here, the
            # unload would copy the same 16 GB again on the stepping thread.
            e = self._entries.get(name)
            if e is None or e.slots != slots:
                return False
            self._entries.move_to_end(name)
            return True

    def put(self, name: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Store host copies of ``tensors`` (any device) under ``name``, replacing an older copy,
        and return once they have landed.

        Returns False, storing nothing and evicting nothing, when it cannot fit the budget or,
        with ``pin``, the part of the arena page-locked so far (:meth:`prepin`).
        """
        stored, landing = self.put_async(name, tensors)
        if landing is not None:
            landing.synchronize()
            with self._lock:
                self._landed()
        return stored

    def put_async(self, name: str, tensors: dict[str, torch.Tensor]) -> tuple[bool, torch.cuda.Event | None]:
        """:meth:`put` without waiting for device tensors' copies: (stored, the event of their
        landing, None when nothing is in flight).

        Why: an unload stashes on the stepping thread, and waiting there for an 8B's 16 GB to
        cross PCIe held every model's steps ~0.3 s an unload (H100, docs/perf.md, the warm tier
        at 9dac9ac). The copies run on the tier's own stream after the work queued before them;
        each source tensor is marked used by that stream (``record_stream``), so memory freed
        meanwhile is not handed out again before they have read it. Whoever writes into the
        source tensors themselves (a load into the unloaded model's vacancy) waits for the
        event first. Until it has landed the entry is held: not evicted, restores copy after it
        (their streams wait for the event), :meth:`get` answers None. A put that finds no room
        while earlier puts' copies are in flight (two unloads in a row) waits for them and tries
        again: an entry in flight can neither be evicted nor give back its range, and the second
        stash refused would send its model's reload to the files.
        """
        slots, total = _layout(tensors)
        for attempt in (0, 1):
            with self._lock:
                self._landed()
                if total > self.budget_bytes or (self.pin and (self._arena is None or total > self._arena.limit)):
                    return False, None  # over the budget, or over what is page-locked yet (see below)
                old = self._entries.pop(name, None)  # the new copy replaces it
                if not self._evict_for(total):
                    if old is not None:
                        self._entries[name] = old
                    off, fits = None, False
                else:
                    if old is not None:
                        self._release(old)
                    off = self._carve(total)
                    # Without a range: busy entries fragment the arena, or its pinning has not
                    # reached this much yet: store nothing. A pageable copy on an unload's path
                    # took 15 s for an 8B on the H200 (the stepping thread waiting on it, every
                    # model's step with it); the model's next load reads its files instead
                    # (docs/perf.md, density warm at 187541c).
                    fits = off is not None or (self._arena is None and not self.pin)
                if fits:
                    # reserve the bytes now so a concurrent put cannot overshoot the budget
                    entry = _Entry(torch.empty(0, dtype=torch.uint8), slots, total, users=1, arena_off=off)
                    self._entries[name] = entry
                    break
                in_flight = [e.landing for e in self._landing]
                if attempt or not in_flight:
                    return False, None
            for ev in in_flight:
                ev.synchronize()
        landing, stream = None, None
        try:
            t0 = time.perf_counter()
            # without an arena range (no pinning: a CPU engine) a pageable buffer of its own
            buf = self._arena.buf[off:off + total] if off is not None else torch.empty(total, dtype=torch.uint8)
            t1 = time.perf_counter()
            srcs = {n: _bytes_of(t) for n, t in tensors.items()}
            cuda = next((t.device for t in srcs.values() if t.is_cuda), None)
            if cuda is not None:
                stream = self._copy_streams.get(cuda)
                if stream is None:
                    stream = self._copy_streams[cuda] = torch.cuda.Stream(device=cuda)
                stream.wait_stream(torch.cuda.current_stream(cuda))  # after what wrote them
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for n, src in srcs.items():
                    s = slots[n]
                    for a, b in self._pieces(off, s):
                        buf[s.offset + a:s.offset + b].copy_(src[a:b], non_blocking=src.is_cuda)
            if stream is not None:
                for src in srcs.values():
                    if src.is_cuda:
                        src.record_stream(stream)
                landing = torch.cuda.Event()
                landing.record(stream)
            # Where an unload's stash goes: the host buffer (allocation + page-locking) vs issuing
            # the copies (their landing is the event's).
            self.last_put_seconds = {"buffer_s": t1 - t0, "copy_s": time.perf_counter() - t1}
        except BaseException:
            if stream is not None:
                stream.synchronize()  # copies already issued still write into its range
            with self._lock:
                entry.users = 0
                if self._entries.get(name) is entry:
                    del self._entries[name]
                self._release(entry)
            raise
        with self._lock:
            entry.buffer = buf
            if landing is None:
                entry.users = 0
            else:  # the put's hold stays until the copies land (_landed)
                entry.landing = landing
                self._landing.append(entry)
        return True, landing

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        """Host tensors (views of the stored buffer) of ``name``, marking it most recently used.
        Valid while ``name`` stays stored: with a pinned arena its range is reused once dropped."""
        with self._lock:
            self._landed()
            e = self._entries.get(name)
            if e is None or e.users:
                return None
            self._entries.move_to_end(name)
            return {n: e.buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for n, s in e.slots.items()}

    def note(self, name: str, tag: str, value: object) -> bool:
        """Keep ``value`` (a small immutable figure: the tier does not read it) under ``tag`` with
        the stored ``name`` (False: ``name`` is not stored)."""
        with self._lock:
            e = self._entries.get(name)
            if e is None:
                return False
            e.notes[tag] = value
            return True

    def noted(self, name: str, tag: str) -> object | None:
        """The value kept under ``tag`` with ``name``; None once the entry is gone or replaced."""
        with self._lock:
            e = self._entries.get(name)
            return None if e is None else e.notes.get(tag)

    def discard(self, name: str) -> bool:
        with self._lock:
            e = self._entries.pop(name, None)
            if e is not None:
                self._release(e)
            return e is not None

    def restore(self, name: str, dst: dict[str, torch.Tensor], streams: int = 2) -> bool:
        """Copy ``name``'s stored bytes into ``dst`` (same names, shapes, dtypes; contiguous).

        Returns False when ``name`` is not stored; raises WarmTierError on a mismatch. The entry
        stays stored (and becomes most recently used): the caller discards it if it wants the RAM.
        """
        with self._lock:
            self._landed()
            e = self._entries.get(name)
            if e is None or e.buffer.numel() < e.nbytes:  # (a put on another thread still issuing its copies)
                return False
            if set(dst) != set(e.slots):
                missing = sorted(set(e.slots) ^ set(dst))[:3]
                raise WarmTierError(f"restore of {name!r}: tensor names differ from the stored copy ({missing})")
            for n, t in dst.items():
                s = e.slots[n]
                if tuple(t.shape) != s.shape or t.dtype != s.dtype or not t.is_contiguous():
                    raise WarmTierError(f"restore of {name!r}: {n} is {tuple(t.shape)} {t.dtype}, stored "
                                        f"{s.shape} {s.dtype} (destination must be contiguous)")
            e.users += 1
            landing = e.landing
            self._entries.move_to_end(name)
        try:
            cuda = [t for t in dst.values() if t.is_cuda]
            ss = [torch.cuda.Stream(device=cuda[0].device) for _ in range(max(1, streams))] if cuda else []
            if landing is not None and not cuda:
                landing.synchronize()  # a host destination reads the buffer now
            for st in ss:
                # The destinations were allocated on the current stream and may reuse memory its
                # queued kernels (another model's step) still read: copy only after those, and
                # after the stored copy has landed.
                st.wait_stream(torch.cuda.current_stream(cuda[0].device))
                if landing is not None:
                    st.wait_event(landing)
            for i, (n, t) in enumerate(dst.items()):
                s = e.slots[n]
                src, out = e.buffer[s.offset:s.offset + s.nbytes], _bytes_of(t)
                with torch.cuda.stream(ss[i % len(ss)]) if t.is_cuda else contextlib.nullcontext():
                    for a, b in self._pieces(e.arena_off, s):
                        out[a:b].copy_(src[a:b], non_blocking=t.is_cuda)
            for st in ss:
                st.synchronize()
        finally:
            with self._lock:
                e.users -= 1
                if e.dropped and not e.users:
                    self._release(e)
        return True
