"""The ModelManager's vocabulary: states, legal transitions, errors, the per-model entry.

The manager (``agent.manager.manager``), its room planner (``agent.manager.room``) and the APIs
import these from here. An entry owns its state: :meth:`ModelEntry.move` is the only transition,
checked against ``NEXT_STATES``; it tells the entry's observer (the manager logs it and mirrors
it in the metrics) and wakes whoever waits on the entry (:meth:`ModelEntry.wait_change`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Protocol

from agent.config import ModelSettings
from engine.model_info import ModelInfo


class State(str, Enum):
    ABSENT = "absent"
    PULLING = "pulling"
    CACHED = "cached"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    UNLOADING = "unloading"
    FAILED = "failed"


NEXT_STATES: dict[State, frozenset[State]] = {
    State.ABSENT: frozenset({State.PULLING, State.CACHED, State.FAILED}),
    State.PULLING: frozenset({State.CACHED, State.FAILED}),
    State.CACHED: frozenset({State.PULLING, State.LOADING, State.ABSENT}),
    # to pulling: a reload after a worker restart whose files were asked to be pulled while it was
    # loaded (ModelManager.pull): it pulls first, as its next load does
    State.LOADING: frozenset({State.READY, State.FAILED, State.CACHED, State.PULLING}),
    State.READY: frozenset({State.DRAINING, State.LOADING, State.FAILED}),
    # back to ready: a drain for a load's room called off (ModelManager._recall_drains)
    State.DRAINING: frozenset({State.UNLOADING, State.READY, State.LOADING, State.FAILED}),
    State.UNLOADING: frozenset({State.CACHED, State.LOADING, State.FAILED}),
    State.FAILED: frozenset({State.PULLING, State.LOADING, State.CACHED, State.ABSENT}),
}


class ManagerError(Exception):
    """A model operation was refused. ``status`` is the HTTP status the APIs answer with."""

    status = 409
    code = "conflict"

    def __init__(self, message: str, *, retry_after: float | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.details = dict(details or {})


class UnknownModel(ManagerError):
    status, code = 404, "model_not_found"


class ModelNotReady(ManagerError):
    status, code = 503, "model_not_ready"


# Retry-After of a 503 because the agent is shutting down: it is gone for longer than a worker restart.
SHUTDOWN_RETRY_S = 5


class ShuttingDown(ManagerError):
    status, code = 503, "shutting_down"


class QueueFull(ManagerError):
    status, code = 503, "queue_full"


class SnapshotBroken(ManagerError):
    """The cached files do not match the model's manifest; the entry is marked for repair (the
    next pull or load verifies every sha256 and fetches what is wrong)."""

    status, code = 503, "snapshot_broken"


class CacheBusy(ManagerError):
    """Another process holds the model's cache lock past the deadline."""

    status, code = 503, "cache_busy"


class NoRoom(ManagerError):
    """A load that does not fit the memory budget even after evicting every idle model it may;
    ``details`` holds the engine's figures (needed, free, evictable, budget, short)."""

    status, code = 507, "no_room"


# A model whose load was in flight when the worker died this many times is not reloaded after a
# restart: one bad model must not keep taking the worker (and every other model) down.
CRASH_LOOP_LOADS = 2

# A load that failed on its own (bad weights or config, a canary that decodes nothing, a capture
# error) is not started again by a request before LOAD_RETRY_S, doubling with each failure in a
# row up to LOAD_RETRY_MAX_S (an operator's load goes at once): without it, every request for
# such a model ran a whole load, and took its room from a healthy model first (evicted, or
# drained with its streams cut) — a CPU churn pass saw one healthy model evicted and reloaded
# for each of ten requests. Room refusals and the worker's own failures are not the model's.
LOAD_RETRY_S = 5.0
LOAD_RETRY_MAX_S = 300.0
TRANSIENT_LOAD_CODES = frozenset({"worker_died", "worker_down", "no_engine", "busy"})

# Worker error codes of a load that mean its files may be wrong (the next load re-verifies every
# sha256); any other failure (no room, out of memory, a capture error) leaves the bytes trusted.
BYTES_SUSPECT_CODES = frozenset({"WeightsError", "ModelConfigError", "SafetensorError", "HeaderTooLarge"})


class ModelSource(Protocol):
    """What the manager needs of the disk cache (``agent.manager.model_source`` adapts DiskCache)."""

    def snapshot(self, name: str) -> Path | None: ...
    def cached_names(self) -> list[str]: ...
    def version(self, name: str) -> str | None: ...
    async def pull(self, name: str, verify: bool = False) -> Path: ...
    async def check(self, name: str, rehash: bool = False) -> list[str]: ...
    def pull_progress(self, name: str) -> dict[str, Any] | None: ...
    async def pin(self, name: str) -> None: ...
    def unpin(self, name: str) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def derived(self, name: str, scheme: str) -> Path | None: ...
    def want_derived(self, name: str, scheme: str) -> None: ...
    def drop_derived(self, name: str, scheme: str) -> None: ...


# Told of every transition an entry makes: (entry, its previous state).
StateObserver = Callable[["ModelEntry", "State"], None]


# How long a model's admitted requests keep counting toward its demand (the e-folding time):
# long enough to tell a model of 1 request a second from one of 0.1 (Zipf traffic over twelve
# 8Bs), short enough that a model no longer asked for falls behind within a minute or two.
DEMAND_TAU_S = 30.0


@dataclass
class ModelEntry:
    name: str
    settings: ModelSettings
    state: State = State.ABSENT
    reason: str = ""
    snapshot: Path | None = None
    info: ModelInfo | None = None  # the engine's, from its Loaded (None: never loaded, or unloaded)
    tokenizer: Any = None
    in_flight: int = 0
    preempted: int = 0  # of in_flight, engine requests waiting for it to come back (ModelManager.wait_back)
    load_waiters: int = 0  # engine requests (prompts x n) waiting for this model's (auto)load, not admitted yet
    load_requests: int = 0  # the HTTP requests among them (what demand counts: ``claim``)
    last_used: float | None = None  # wall clock, for humans
    last_used_mono: float = 0.0  # monotonic: LRU order and keep_alive
    # Requests admitted, decayed with DEMAND_TAU_S (at demand_at): how wanted it is, which orders
    # the models a load may evict or drain (the least wanted first)
    demand: float = 0.0
    demand_at: float = 0.0
    load_seconds: float | None = None
    task: asyncio.Task[None] | None = None
    op: str = ""  # what ``task`` does: pull, load, unload, evict, idle, broken, verify, reload
    want_loaded: bool = False  # reload after a worker restart
    pinned: bool = False  # pinned in the disk cache (loaded or loading), not the user's pin
    pin_override: bool | None = None  # set through the admin API; None: settings.pin
    refusal: dict[str, Any] = field(default_factory=dict)  # figures of the last load refused for room
    failure: ManagerError | None = None  # why it is failed, typed (the APIs answer its status)
    needs_repair: bool = False  # the next pull or load verifies every sha256 (a load failed on its bytes)
    # A pull was asked while it was loaded (the store may hold another version): its next load,
    # an operator's or an autoload, pulls first (the cache's manifest against the store's).
    needs_pull: bool = False
    # Workers that died while this model's load was in flight; at CRASH_LOOP_LOADS it is failed
    # and not reloaded automatically (an operator's load resets it).
    crashed_loads: int = 0
    # Loads in a row that failed on their own, and when a request may start the next one
    # (monotonic; LOAD_RETRY_S); a load that reaches ready clears both.
    failed_loads: int = 0
    retry_at: float = 0.0
    # Its drain for a load's room is called off (that load ended without needing it): the unload
    # stops waiting and the model serves again, never having left the engine. Cleared by any
    # move out of draining (a drain cut short by the worker's death leaves nothing behind).
    recalled: bool = False
    in_worker: bool = False  # its Load, or the canary's first decode, is in the worker now
    derived_load: bool = False  # its last load read a derived artifact (its FP8 checkpoint), not the snapshot
    been_ready: bool = False  # ready at least once since the agent started (preload is done)
    last_verify: dict[str, Any] | None = None  # the last verify action's findings
    # The last load's steps in order (pull, verify, load, tokenizer, canary): (start, end), monotonic.
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Held for the whole of a load or an unload: two operations on one model never interleave.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    observer: StateObserver | None = field(default=None, repr=False)
    # Set (and replaced) on every change a waiter may care about: a transition, an operation's end.
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def retry_in(self) -> float:
        """Seconds before a request may start its next load (LOAD_RETRY_S); 0 when it may now."""
        return max(0.0, self.retry_at - time.monotonic()) if self.state is State.FAILED else 0.0

    def move(self, state: State, reason: str = "", failure: ManagerError | None = None) -> None:
        """Go to ``state`` (ManagerError if ``NEXT_STATES`` has no such step), recording why and,
        when failed, the typed failure the APIs answer with. Staying in a state updates the reason."""
        if state != self.state and state not in NEXT_STATES[self.state]:
            raise ManagerError(f"{self.name}: cannot go from {self.state.value} to {state.value}")
        previous = self.state
        self.state, self.reason, self.failure = state, reason, failure if state is State.FAILED else None
        self.recalled &= state is State.DRAINING  # a recall is of the drain under way, never a later one
        self.been_ready |= state is State.READY
        if self.observer is not None:
            self.observer(self, previous)
        self.signal_change()

    @property
    def at_rest(self) -> State:
        """Where an unload leaves it: cached when its files are on disk, else absent."""
        return State.CACHED if self.snapshot is not None else State.ABSENT

    @property
    def busy(self) -> bool:
        """An operation (pull, load, unload, verify) is running on it."""
        return self.task is not None and not self.task.done()

    def effective(self, key: Literal["quantization", "kv_cache_dtype"]) -> str | None:
        """What its load runs with once ready (the engine decides for a pre-quantized checkpoint),
        its settings' until then."""
        if self.state is State.READY and self.info is not None:
            return getattr(self.info, key)
        return getattr(self.settings, key)

    def signal_change(self) -> None:
        """Wake every ``wait_change``: a transition, an operation that ended (its state may not
        have moved, e.g. a pull that leaves it cached), the last request in flight that ended."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def next_change(self) -> asyncio.Event:
        """The event the next ``signal_change`` sets (take it with no await after reading the
        state, and no change is missed)."""
        return self._changed

    async def wait_change(self, timeout: float) -> bool:
        """Until the next ``signal_change`` (True) or ``timeout`` seconds (False). Read the state
        before calling, with no await in between, and no change is missed."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    @property
    def queue_limit(self) -> int:
        # Running plus as many waiting: past that, a client is better served by a 503 and a
        # retry elsewhere than by a queue it cannot see the end of.
        q = self.settings.max_queue
        return q if q is not None else 2 * self.settings.max_num_seqs

    @property
    def pin(self) -> bool:
        """Never evicted for another model's load, never unloaded when idle."""
        return self.settings.pin if self.pin_override is None else self.pin_override

    def touch(self) -> None:
        self.last_used, self.last_used_mono = time.time(), time.monotonic()

    def wanted(self, now: float) -> float:
        """Its requests admitted, each weighing exp(-age / DEMAND_TAU_S): a rate of r requests a
        second reads about r * DEMAND_TAU_S."""
        return self.demand * math.exp(-(now - self.demand_at) / DEMAND_TAU_S) if self.demand else 0.0

    def claim(self, now: float) -> float:
        """What a load of this model asks room for: its demand so far and the requests waiting
        for the load (not admitted yet, so not in ``wanted``; counted as ``wanted`` counts them,
        one per HTTP request whatever its prompts x n), and those preempted from it, paused
        mid-answer (counted again: a comeback must not queue behind colder loads)."""
        return self.wanted(now) + self.load_requests + self.preempted

    def note_request(self, now: float) -> None:
        self.demand, self.demand_at = self.wanted(now) + 1.0, now

    def idle_for(self, now: float) -> float:
        return now - self.last_used_mono if self.in_flight == 0 else 0.0


class Admission:
    """One admitted request's slot; use as a context manager so the slot is always returned."""

    def __init__(self, entry: ModelEntry, choices: int = 1) -> None:
        self.entry = entry
        self.choices = choices  # engine requests it holds (prompts × n): what the queue limit counts

    def __enter__(self) -> ModelEntry:
        self.entry.in_flight += self.choices
        self.entry.touch()
        self.entry.note_request(self.entry.last_used_mono)
        return self.entry

    def __exit__(self, *exc: Any) -> None:
        self.entry.in_flight -= self.choices
        self.entry.touch()
        if self.entry.in_flight <= self.entry.preempted:
            self.entry.signal_change()  # a drain waits for the last one out (of those in the engine)
