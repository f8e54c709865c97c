"""ModelManager: the life of every model the agent knows about.

Each model has one state::

    absent → pulling → cached → loading → ready → draining → unloading → cached
                  ↘         ↘          ↘                         ↘
                   failed (with a reason; a later pull or load starts over)

An entry makes its own transitions (``ModelEntry.move``); the manager logs each one
(``model_state``) and mirrors it in ``infire_model_state``. Pulls go through the disk cache
(:class:`ModelSource`), loads and unloads through the engine worker. Every operation on a model
(pull, load, unload, eviction, keep-alive unload, verify, reload after a restart) is started by
one helper, ``_run``: a background task owned by the manager, one per model at a time and under
the model's lock, so a slow load never blocks another model's traffic; a second operation is
refused (retry_after) while one runs. Callers await the task, or wait on the entry's change
signal (``admit_wait``, a drain). When the worker dies, models that were ready go back to
loading and are loaded again, one at a time, once a new worker says hello.

Room for a load: one global ``asyncio.Lock`` (the room lock) covers "plan → evict → load" so two
loads never plan on the same free bytes; pulls, tokenizer loads and the post-load check stay
outside it, so different models still load in parallel up to the engine step. A ``Load`` offers
the models :class:`~agent.manager.room.RoomPlanner` finds evictable; a refusal for room names
the shortest prefix of that offer that makes room. Those are drained and unloaded, and the load
is tried again, as often as a refusal names idle models to evict. A refusal no idle model can
cure waits for a model that may make room (busy with requests: never evicted while busy; or on
its way out) to change and tries again, until ``server.autoload_timeout`` has passed; then, or
when no model could ever make room, the load fails with the engine's numbers. Idle models are unloaded once their keep_alive has passed; with autoload on,
a request for a cached model that is not loaded loads it first.

The states, errors and the per-model entry are in ``agent.manager.entries``; what the admin API
shows of a model is built from the entry in ``agent.http.admin_view`` (the manager keeps no view).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import EllipsisType
from typing import Any

from agent.config import MODEL_NAME_RE, ModelSettings, Settings
from agent.log import get_logger
from agent.manager.entries import (
    BYTES_SUSPECT_CODES,
    CRASH_LOOP_LOADS,
    LOAD_RETRY_MAX_S,
    LOAD_RETRY_S,
    SHUTDOWN_RETRY_S,
    TRANSIENT_LOAD_CODES,
    Admission,
    CacheBusy,
    ManagerError,
    ModelEntry,
    ModelNotReady,
    ModelSource,
    NoRoom,
    QueueFull,
    ShuttingDown,
    SnapshotBroken,
    State,
    UnknownModel,
)
from agent.manager.room import Eviction, RoomPlanner
from agent.metrics import Metrics
from agent.worker.client import WorkerClient, WorkerError
from cache.errors import CacheError, ModelNotInStore

WORKER_WAIT_S = 180.0
KEEP_ALIVE_TICK_S = 0.25


TokenizerLoader = Callable[[Path], Any]
Verifier = Callable[[ModelEntry], Awaitable[bool]]


FP8 = "fp8"
FP8_DERIVED = "fp8-channel"  # the scheme a load quantizes to (engine/weights/fp8_writer.py "channel")
_CONFIG_MAX_BYTES = 4 << 20


def _prequantized(snapshot: Path | None) -> bool:
    """Whether a model folder is already a quantized checkpoint (its config says how)."""
    try:
        cfg = snapshot / "config.json" if snapshot is not None else None
        if cfg is None or cfg.stat().st_size > _CONFIG_MAX_BYTES:
            return False
        return "quantization_config" in json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the engine's load reports what is wrong with it


# Loads that may have drains of their own under way at once: the one whose room is nearly made
# and the next (pipelined: its drain runs beside the first's engine load). Unbounded, a queue of
# loads on the H100 drained every resident model at once, the most wanted among them (the most
# asked-for of twelve 8Bs drained 10 times in 120 s, e015e9c: docs/perf.md).
DRAINING_LOADS_MAX = 2
# How long a load waits for the room of models no more wanted than itself before it takes a more
# wanted one's (RoomPlanner.colder_coming): about one colder model's turn, its engine load (~0.6 s
# for an 8B into a vacancy, H100) and its requests' last tokens (~1-2 s at 128 out).
ROOM_PATIENCE_S = 3.0
# A busy model this near idle (the most tokens one of its requests may still produce) is drained
# for a load's room, not preempted: its last tokens take about as long as its requests' pause
# and recomputation would (~0.5 s at 30 ms a step).
PREEMPT_MIN_TOKENS = 16


# Operations that end loaded or on the way out: asking for the same again joins them
_LOADS = frozenset({"load", "reload"})
_UNLOADS = frozenset({"unload", "evict", "idle", "broken"})


class ModelManager:
    """The models' registry and their operations: start them (``pull``, ``load``, ``unload``,
    ``verify_files``: each returns the operation's task), admit requests (``admit``,
    ``admit_wait``), react to the worker (``on_worker_down``, ``on_worker_up``)."""

    def __init__(self, settings: Settings, worker: WorkerClient, source: ModelSource | None,
                 metrics: Metrics, load_tokenizer: TokenizerLoader, verify: Verifier | None = None) -> None:
        self.settings = settings
        self.worker = worker
        self.source = source
        self.metrics = metrics
        self.load_tokenizer = load_tokenizer
        self.verify = verify  # a one-token decode after a load: "ready" means it can generate
        self.models: dict[str, ModelEntry] = {}
        self._log = get_logger("manager")
        self._room = asyncio.Lock()  # plan → evict → load, one load at a time (not held over room waits)
        self._drains: dict[str, str] = {}  # a model drained for a load's room → that load's model
        # loads waiting for their model's operation under way to end (_load_after), by model
        self._queued_loads: dict[str, asyncio.Task[None]] = {}
        self._closing = False
        self._no_comebacks = False  # shutting down: preempted requests end instead of waiting (end_comebacks)
        self._planner = RoomPlanner(self.models)
        self._keep_alive: asyncio.Task[None] | None = None
        for m in settings.models:
            self._entry(m.name)
        if source is not None:
            for name in source.cached_names():
                self._entry(name)

    # --- registry ---------------------------------------------------------------------------

    def _entry(self, name: str, create: bool = True) -> ModelEntry:
        e = self.models.get(name)
        if e is not None:
            return e
        if not create or not isinstance(name, str) or not MODEL_NAME_RE.fullmatch(name):
            raise UnknownModel(f"the model {name!r} does not exist")
        snap = self.source.snapshot(name) if self.source is not None else None
        e = ModelEntry(name=name, settings=self.settings.model(name) or ModelSettings(name=name),
                       state=State.ABSENT if snap is None else State.CACHED, snapshot=snap, observer=self._observe)
        self.models[name] = e
        self.metrics.set_model_state(name, e.state.value)
        return e

    def get(self, name: str) -> ModelEntry:
        """A known model (configured, cached or touched by the admin API), else UnknownModel."""
        e = self.models.get(name)
        if e is None:
            raise UnknownModel(f"the model {name!r} does not exist")
        return e

    def _observe(self, e: ModelEntry, previous: State) -> None:
        """Every entry's transitions: logged, and mirrored in ``infire_model_state``."""
        if e.state is not previous:
            self._log.info("model_state", model=e.name, state=e.state.value, previous=previous.value,
                           reason=e.reason or None)
        if self.models.get(e.name) is e:  # a dropped entry leaves no series behind
            self.metrics.set_model_state(e.name, e.state.value)

    def _forget_load(self, e: ModelEntry) -> None:
        """What a load gave a model, given back once it is out of the engine (unloaded, failed, or
        gone with the worker): its tokenizer and engine info, its cache pin, its engine series."""
        e.tokenizer, e.info = None, None
        self._unpin(e)
        self.metrics.forget_model(e.name)

    def _drop(self, e: ModelEntry) -> None:
        """Forget a name the store does not know (and nothing configures or caches): no entry,
        no metrics series, nothing on disk; the next request for it is a plain 404."""
        if self.models.get(e.name) is e:
            del self.models[e.name]
            self.metrics.drop_model(e.name)

    def ready_models(self) -> list[ModelEntry]:
        return [e for e in self.models.values() if e.state is State.READY]

    def reachable_models(self) -> list[ModelEntry]:
        """What a request may name: every ready model, and every configured one a request would
        load (autoload), whatever its state now; configured order first."""
        configured = [self.models[m.name] for m in self.settings.models if m.name in self.models]
        out = [e for e in configured if e.state is State.READY or self.autoload_enabled(e)]
        return out + [e for e in self.ready_models() if e not in out]

    def busy(self) -> bool:
        """Some model is being pulled or loaded (systemd wants EXTEND_TIMEOUT_USEC then)."""
        return any(e.state in (State.PULLING, State.LOADING) for e in self.models.values())

    # --- background operations --------------------------------------------------------------

    def _run(self, e: ModelEntry, kind: str, op: Callable[..., Awaitable[None]], *args: Any,
             state: State | None = None, reason: str = "") -> asyncio.Task[None]:
        """Start ``op(*args)`` as ``e``'s one operation (``e.task``), run under ``e.lock``.

        Refused with ManagerError (retry_after) while another operation runs on ``e``. ``state``
        is entered now, before the task first runs: what callers and requests see at once (a
        draining model admits nothing more). The entry signals a change when the task ends."""
        if e.busy:
            raise ManagerError(f"{e.name} is {e.state.value}; try again when that finishes", retry_after=1.0)
        if state is not None:
            e.move(state, reason)

        async def locked() -> None:
            async with e.lock:
                await op(*args)

        e.op = kind
        e.task = asyncio.create_task(locked(), name=f"{kind}-{e.name}")
        e.task.add_done_callback(lambda _: e.signal_change())
        return e.task

    def pull(self, name: str, verify: bool = False) -> asyncio.Task[None] | None:
        """Start a pull; None when the model is loaded or on its way (its files are cached)."""
        if self.source is None:
            raise ManagerError("no model store is configured")
        e = self._entry(name)
        if e.state in (State.LOADING, State.READY, State.DRAINING, State.UNLOADING):
            e.needs_pull = True  # its files are in use: its next load pulls first
            return None
        if e.state is State.PULLING:
            raise ManagerError(f"{name} is being pulled", retry_after=1.0)
        return self._run(e, "pull", self._pull, e, verify, state=State.PULLING)

    async def _pull(self, e: ModelEntry, verify: bool = False) -> None:
        """Pull (verifying every sha256 with ``verify`` or after a failed load) and repair."""
        if self.source is None:
            e.move(State.FAILED, "no model store is configured")
            return
        e.move(State.PULLING)
        t0 = time.monotonic()
        try:
            e.snapshot = await self.source.pull(e.name, verify=verify or e.needs_repair)
        except ModelNotInStore as ex:
            e.move(State.FAILED, f"pull failed: {ex}", UnknownModel(str(ex)))
            if self.settings.model(e.name) is None and (e.snapshot is None or not e.snapshot.exists()):
                self._drop(e)
            return
        except Exception as ex:
            self.metrics.pull_failures.labels(model=e.name).inc()
            e.move(State.FAILED, f"pull failed: {type(ex).__name__}: {ex}")
            return
        finally:
            self._forget_evicted(e)
        e.needs_repair = e.needs_pull = False
        self.metrics.pull_seconds.labels(model=e.name).observe(time.monotonic() - t0)
        e.move(State.CACHED)

    def _forget_evicted(self, puller: ModelEntry) -> None:
        """After a pull of this manager (``_pull``, a load's repair), which makes its room by
        evicting models the cache holds unpinned (the least recently used first): those models
        are at rest with no files now. An idle cached one is absent (the next request pulls it
        again); a failed one keeps its state and reason without the snapshot. Status,
        /v1/models and the metrics said ``cached`` for a folder the eviction had removed."""
        for e in self.models.values():
            if e is puller or e.busy or e.snapshot is None or self.source.snapshot(e.name) is not None:
                continue
            e.snapshot = None
            if e.state is State.CACHED:
                e.move(State.ABSENT)

    def load(self, name: str, *, quantization: str | None | EllipsisType = ...,
             kv_cache_dtype: str | None | EllipsisType = ...) -> asyncio.Task[None] | None:
        """Start loading (pulling first when needed); None when it is already ready.

        ``quantization`` and ``kv_cache_dtype`` (None or "fp8"; ``...``: as the model's settings
        have them) replace the settings' for this and later loads; asking a loaded model for
        others is a conflict."""
        e = self._entry(name, create=self.source is not None)
        if e.state is State.READY:
            # against what the load runs with (a pre-quantized checkpoint is FP8 whatever was asked)
            differ = [f"{k} {e.effective(k) or 'none'}" for k, v in
                      (("quantization", quantization), ("kv_cache_dtype", kv_cache_dtype))
                      if v is not ... and v != e.effective(k)]
            if differ:
                raise ManagerError(f"{name} is loaded with {', '.join(differ)}; unload it first")
            return None
        asked = {k: v for k, v in (("quantization", quantization), ("kv_cache_dtype", kv_cache_dtype))
                 if v is not ... and v != getattr(e.settings, k)}
        if e.busy and e.op in _LOADS:
            # A load on its way (an operator's, a request's autoload, a reload): asking again joins it
            if asked:
                now = ", ".join(f"{k} {getattr(e.settings, k) or 'none'}" for k in asked)
                raise ManagerError(f"{name} is loading with {now}; ask for others after an unload", retry_after=1.0)
            assert e.task is not None
            return e.task
        if e.busy:  # an unload, a pull or a verify first: the load follows it (one queued load a model)
            queued = self._queued_loads.get(name)
            if queued is not None:
                return queued
            return self._load_after(e, lambda: self.load(name, quantization=quantization, kv_cache_dtype=kv_cache_dtype))
        if asked and e.state in (State.ABSENT, State.CACHED, State.FAILED):
            e.settings = e.settings.model_copy(update=asked)
        if e.state not in (State.ABSENT, State.CACHED, State.FAILED):
            raise ManagerError(f"{name} is {e.state.value}", retry_after=1.0)
        files_ok = e.snapshot is not None and e.snapshot.exists() and not e.needs_repair and not e.needs_pull
        task = self._run(e, "load", self._load, e, state=State.LOADING if files_ok else State.PULLING)
        e.crashed_loads = 0  # asked for again (an operator, a preload, a request): a fresh count
        return task

    async def _load(self, e: ModelEntry) -> None:
        try:
            await self._load_steps(e)
        except asyncio.CancelledError:
            raise
        except Exception as ex:  # unforeseen: the model still ends in a state with its reason
            self._log.exception("load_error", model=e.name)
            if e.state is not State.FAILED:
                e.want_loaded = False
                self._forget_load(e)
                e.move(State.FAILED, f"load failed: {type(ex).__name__}: {ex}")

    async def _load_steps(self, e: ModelEntry) -> None:
        e.phases = {}
        repairing = e.needs_repair  # this load verifies every sha256 and fetches what is wrong
        if e.snapshot is None or not e.snapshot.exists() or e.needs_repair or e.needs_pull:
            t = time.monotonic()
            # (a reload pulling first is a load anew: a pull that fails leaves it failed as any
            # load's does, cleared by an unload, not reloaded after the next restart)
            e.want_loaded = False
            await self._pull(e)
            e.phases["pull"] = (t, time.monotonic())
            if e.state is not State.CACHED:
                return
        e.move(State.LOADING)
        e.want_loaded, e.refusal = True, {}
        in_engine = False
        try:
            t = time.monotonic()
            await self._pin(e)
            try:
                await self._check_files(e)
            except SnapshotBroken as broken:  # the load that finds it repairs it and goes on
                await self._repair_for_load(e, broken)
            e.phases["verify"] = (t, time.monotonic())
            await self._wait_worker()
            t0 = time.monotonic()
            # The tokenizer loads in a thread while the worker loads weights.
            tok_task = asyncio.ensure_future(asyncio.to_thread(self._tokenizer, e))
            try:
                loaded = await self._engine_load(e)
            except BaseException:
                tok_task.cancel()
                raise
            e.phases["load"] = (t0, time.monotonic())
            in_engine = True
            e.info = loaded.info  # in the engine from here: its room is held (RoomPlanner.may_free)
            e.tokenizer = await tok_task
            e.load_seconds = time.monotonic() - t0
            engine_timings = loaded.timings
            t = time.monotonic()
            if self.verify is not None and not await self.verify(e):
                raise WorkerError("the model loaded but could not decode a token", "decode_failed")
            e.phases["canary"] = (t, time.monotonic())
        except asyncio.CancelledError:
            raise
        except Exception as ex:
            e.in_worker = False
            e.want_loaded = False
            if isinstance(ex, NoRoom):
                e.refusal = dict(ex.details)
            if isinstance(ex, WorkerError) and ex.code in BYTES_SUSPECT_CODES and e.derived_load:
                self.source.drop_derived(e.name, FP8_DERIVED)  # its FP8 checkpoint is what was unreadable
            elif isinstance(ex, SnapshotBroken) or (isinstance(ex, WorkerError) and ex.code in BYTES_SUSPECT_CODES):
                e.needs_repair = True  # the engine could not read its files: verify every sha256 next time
            if in_engine and self.worker.alive:
                try:
                    await self.worker.unload(e.name)  # do not leave a half-good model holding memory
                except WorkerError:
                    pass
            self._forget_load(e)
            if self._own_failure(e, ex):
                if e.needs_repair and not repairing:
                    e.retry_at = 0.0  # its bytes are suspect: the next load repairs them, at once
                else:
                    e.failed_loads += 1
                    e.retry_at = time.monotonic() + min(LOAD_RETRY_MAX_S,
                                                        LOAD_RETRY_S * 2.0 ** min(e.failed_loads - 1, 16))
            failure = ex if isinstance(ex, ManagerError) else None
            e.move(State.FAILED, str(ex) if failure is not None else f"load failed: {ex}", failure)
            return
        e.in_worker = False
        self.metrics.load_seconds.labels(model=e.name).observe(e.load_seconds)
        # Where a load's seconds went (the agent's phases, the engine's own): how a slow swap is read.
        self._log.info("model_loaded", model=e.name, seconds=round(e.load_seconds, 3),
                       phases={k: round(b - a, 3) for k, (a, b) in e.phases.items()},
                       engine={k: round(v, 3) for k, v in engine_timings.items()})
        e.touch()  # keep_alive and LRU count from the load, not from an older use
        e.crashed_loads = e.failed_loads = 0
        e.retry_at = 0.0
        e.move(State.READY)

    def _own_failure(self, e: ModelEntry, ex: Exception) -> bool:
        """Whether a failed load failed on its own (LOAD_RETRY_S: a request does not start the
        next one at once): not a room refusal that traffic may cure, not the worker's or the
        cache lock's doing; a load larger than the budget can ever hold is its own."""
        if isinstance(ex, NoRoom):
            return self._planner.never_fits(ex.details, exclude=e.name)
        if isinstance(ex, CacheBusy):
            return False
        return not (isinstance(ex, WorkerError) and ex.code in TRANSIENT_LOAD_CODES)

    def _tokenizer(self, e: ModelEntry) -> Any:
        t = time.monotonic()
        tokenizer = self.load_tokenizer(e.snapshot)
        e.phases["tokenizer"] = (t, time.monotonic())
        return tokenizer

    async def _engine_load(self, e: ModelEntry) -> Any:
        """Load ``e`` in the worker under the room lock, evicting what the engine names and
        draining busy models for the rest (the lock is let go while the drains run).

        An FP8 load of an unquantized model reads its FP8 checkpoint when the cache holds one
        (cache/derived.py: computed once, half the bytes, nothing quantized at load); the first
        such load quantizes as it loads and asks for that checkpoint to be built behind it."""
        model_dir, derive = e.snapshot, False
        if e.settings.quantization == FP8 and not _prequantized(e.snapshot):
            found = self.source.derived(e.name, FP8_DERIVED) if self.source is not None else None
            model_dir, derive = (found, False) if found is not None else (e.snapshot, self.source is not None)
        spec = e.settings.load_spec(model_dir)
        e.derived_load = model_dir != e.snapshot
        asked = time.monotonic()
        deadline = asked + self.comeback_s() if e.preempted else asked + self.settings.server.autoload_timeout
        # Sparing the more wanted ends in time for the rest of the deadline to take any model.
        spare_until = asked + min(ROOM_PATIENCE_S, (deadline - asked) / 2)
        try:
            while True:
                async with self._room:
                    # While a colder model is on its way to being free, spare the more wanted.
                    now = time.monotonic()
                    colder = self._planner.colder_coming(e, self._drains) if now < spare_until else []
                    most = e.claim(now) if colder else None
                    # Each model's next change, taken before any await: one that happens while
                    # the Load below is in the worker wakes the wait at once instead of being missed.
                    changed = {m.name: m.next_change() for m in self.models.values()}
                    loaded, plan = await self._load_or_evict(e, spec, asked, most)
                    if loaded is not None:
                        if derive:
                            self.source.want_derived(e.name, FP8_DERIVED)
                        return loaded
                    # Nothing idle to evict: drain busy models (least wanted first) until what
                    # leaves for this load covers the shortfall, then wait, without the lock, for
                    # a model that may free room to change, until autoload_timeout has passed.
                    # Drains are promised to their load, and one more load than the one ahead
                    # may drain (DRAINING_LOADS_MAX): the next drains its own beside this one's
                    # engine load, instead of queueing behind its wait, but a queue of loads
                    # does not drain every resident model at once. Every change that may make
                    # room wakes it (a model leaving for another load too: that load's end
                    # changes who drains next); refused at once when nothing could ever make
                    # room (no model that may leave, or a load larger than the budget less the
                    # pinned models), and never after draining on a pass past its deadline.
                    # A colder model on its way is waited on too, until the patience runs out
                    # (then every model is a candidate again).
                    waits = self._planner.may_free(exclude=e.name, coming=colder)
                    left = deadline - time.monotonic()
                    if not waits or left <= 0 or self._planner.never_fits(plan.details, exclude=e.name):
                        raise plan.refusal(e.name) from None
                    if len(self._planner.loads_draining(self._drains, exclude=e.name)) < DRAINING_LOADS_MAX:
                        for v in self._planner.to_drain(plan.details["short"], exclude=e.name,
                                                        tokens_to_go=self.worker.tokens_to_go(),
                                                        promised=self._drains, most=most):
                            self._drain_for(v, e.name)
                        waits = self._planner.may_free(exclude=e.name, coming=colder)
                    self._log.info("room_wait", model=e.name, waiting_on=[w.name for w in waits],
                                   colder=[c.name for c in colder], short=plan.details["short"],
                                   left_s=round(left, 3))
                    changes = [asyncio.ensure_future(changed.get(w.name, w.next_change()).wait()) for w in waits]
                    timeout = min(left, spare_until - time.monotonic()) if colder else left
                try:
                    await asyncio.wait(changes, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for c in changes:
                        c.cancel()
        finally:
            self._recall_drains(e.name)

    def _recall_drains(self, load: str) -> None:
        """``load`` ended (loaded, refused, failed or cancelled): forget the drains promised to it,
        and call off those still waiting for their last requests. A drain it no longer needs
        would unload a busy model for nobody (its requests waiting for a reload, the room going
        to whichever load comes next); recalled, it serves again from where it was."""
        for name in [v for v, owner in self._drains.items() if owner == load]:
            v = self.models.get(name)
            if v is None:
                del self._drains[name]
            else:
                self._recall(v, load=load)

    def _recall(self, v: ModelEntry, **why: str) -> None:
        """Call off ``v``'s drain for room (a load's, or an eviction's) while it still waits for
        its requests: it serves again from where it was, never having left the engine."""
        self._drains.pop(v.name, None)
        if v.state is State.DRAINING and v.busy and v.op == "evict":
            self._log.info("drain_recalled", model=v.name, in_flight=v.in_flight, **why)
            v.recalled = True
            v.want_loaded = True  # a worker death before the unload resumes reloads it
            self.worker.expedite(v.name, on=False)
            v.signal_change()

    async def _load_or_evict(self, e: ModelEntry, spec: Any, asked: float,
                             most: float | None) -> tuple[Any, Eviction | None]:
        """Under the room lock: ask the engine to load ``e``, evicting the idle models it names
        as often as it names them; (the Loaded answer, None), or (None, the refusal's plan) when
        evicting idle models cannot make room. Each pass unloads at least one model and none
        loads meanwhile (the lock): the loop ends within as many passes as there are models.
        ``asked``: when the load began asking for room (its ``room`` phase ends at the Load
        that took); ``most``: offer only models wanted no more than that."""
        while True:
            offered = self._planner.evictable(exclude=e.name, most=most)
            try:
                e.in_worker = True
                sent = time.monotonic()
                loaded = await self.worker.load(spec, offered)
                e.phases["room"] = (asked, sent)  # the lock, evictions and room waits before this Load
                return loaded, None
            except WorkerError as ex:
                e.in_worker = False  # answered: whatever happens next is not its load's doing
                if ex.code != "no_room":
                    raise
                plan = self._planner.after_refusal(offered, ex.details)
            if not plan.victims:
                return None, plan
            self._log.info("evict_for_load", model=e.name, evict=list(plan.victims),
                           needed=plan.details["needed"], free=plan.details["free"])
            for name in plan.victims:
                await self._evict(self.models[name], f"evicted to make room for {e.name}")

    async def _evict(self, v: ModelEntry, why: str) -> None:
        """Unload an idle model as its own operation (so the admin API sees it busy)."""
        if v.state is not State.READY or v.in_flight or v.busy:
            return  # it changed since the offer: the retry will be refused if room is still short
        self._log.info("evict", model=v.name, reason=why)
        # draining before any await: no request is admitted past this
        task = self._run(v, "evict", self._unload, v, None, why, state=State.DRAINING, reason=why)
        await asyncio.shield(task)

    def _drain_for(self, v: ModelEntry, load: str) -> None:
        """Unload a busy model for ``load``'s room: preempted at once when it may be
        (:meth:`_preemptible`), else once its requests are done. Either way it admits nothing
        more (requests for it wait for its reload). Drained, the engine steps its requests ahead
        of the others' (``expedite``), so the load waits for their last tokens only, not for a
        natural lull that a saturated node never has (the bf16 density run at b55f48c: room
        waits of seconds behind models that stayed busy, swap p50 5.7 s). Preempted, the load
        waits for nothing: with a warm tier the density run at 9230ff0 still spent 0.83 s (p50)
        of each load's 1.35 s waiting for drains, and its swaps took 1.74 s (p50)."""
        preempt = self._preemptible(v, load)
        why = f"{'preempted' if preempt else 'drained'} to make room for {load}"
        self._drains[v.name] = load
        # draining first: a request resumed by the preemption below finds it on its way out
        self._run(v, "evict", self._unload, v, None, why, state=State.DRAINING, reason=why)
        n = self.worker.preempt(v.name) if preempt else 0
        self._log.info("preempt_for_load" if n else "drain_for_load", model=v.name, load=load,
                       in_flight=v.in_flight)
        if n:
            self.metrics.preemptions.labels(model=v.name).inc(n)
        else:
            self.worker.expedite(v.name)

    def _preemptible(self, v: ModelEntry, load: str) -> bool:
        """Whether ``v``'s requests may be preempted for ``load``'s room: preemption on
        (``server.preempt_for_room``); each request it admitted in the engine and resumable (none
        still on its way there, none with prompt logprobs); the requests bring it back (autoload
        on) as it is (no pull asked meanwhile: the output goes on with the same weights); not
        near idle (``PREEMPT_MIN_TOKENS``); not shutting down (:meth:`end_comebacks`); and
        ``load`` is not itself coming back for requests preempted from it — a model that returns
        drains, so two models never preempt each other in turn."""
        back = self.models.get(load)
        return (self.settings.server.preempt_for_room and self.autoload_enabled(v) and v.in_flight > 0
                and not self._no_comebacks  # shutting down: a drain lets them finish, a comeback never comes
                and not v.needs_pull  # its comeback would pull first: maybe another version's weights
                and self.worker.preemptible(v.name, PREEMPT_MIN_TOKENS) == v.in_flight
                and (back is None or back.preempted == 0))

    async def _pin(self, e: ModelEntry) -> None:
        """Keep the cache from evicting a model that is loaded or loading (idempotent). The
        cache waits for its lock off the loop, with a deadline: CacheBusy past it."""
        if self.source is None or e.pinned:
            return
        try:
            await self.source.pin(e.name)
        except CacheError as ex:
            raise CacheBusy(str(ex), retry_after=5.0) from None
        e.pinned = True

    def _unpin(self, e: ModelEntry) -> None:
        if self.source is not None and e.pinned:
            self.source.unpin(e.name)
            e.pinned = False

    async def _check_files(self, e: ModelEntry) -> None:
        """Refuse to load files that are not the manifest's (sizes; the sha256 of any file
        changed since it was verified): SnapshotBroken, and the entry is marked for repair."""
        if self.source is None:
            return
        try:
            problems = await self.source.check(e.name)
        except CacheError as ex:
            problems = [str(ex)]
        if problems:
            raise SnapshotBroken(f"the cached files of {e.name!r} are broken ({'; '.join(problems[:3])}); "
                                 f"the next load or pull repairs them", retry_after=1.0)

    def on_shared_repair(self, names: list[str]) -> None:
        """A repair replaced a corrupt blob that these models' snapshots linked too (the cache
        relinked or flagged them: cache/disk_cache.py): each one's next load or pull checks every
        sha256. A loaded one read its weights from that inode: said in the log, to reload it."""
        for name in names:
            e = self.models.get(name)
            if e is None:
                continue
            e.needs_repair = True
            if e.state in (State.LOADING, State.READY, State.DRAINING):
                self._log.warning("model_shares_a_repaired_blob", model=name, state=e.state.value,
                                  action="unload and load it to serve the repaired bytes")

    async def _repair_for_load(self, e: ModelEntry, broken: SnapshotBroken) -> None:
        """Fetch again what is wrong with a loading model's cached files (every sha256 read) and
        check them once more: SnapshotBroken still when the repair did not make them whole."""
        self._log.warning("snapshot_repair", model=e.name, problem=str(broken))
        e.move(State.LOADING, "repairing its cached files")
        try:
            e.snapshot = await self.source.pull(e.name, verify=True)
        except CacheError as ex:
            raise SnapshotBroken(f"the cached files of {e.name!r} are broken and the repair failed: {ex}",
                                 retry_after=5.0) from None
        finally:
            self._forget_evicted(e)
        e.needs_repair = False
        await self._check_files(e)
        e.move(State.LOADING)

    def verify_files(self, name: str) -> asyncio.Task[None]:
        """Check every sha256 of a cached model; repair it (fetch what is wrong) unless it is
        loaded. The findings are in ``last_verify``."""
        if self.source is None:
            raise ManagerError("no model store is configured")
        e = self.get(name)
        if e.state not in (State.CACHED, State.FAILED, State.ABSENT, State.READY):
            raise ManagerError(f"{name} is {e.state.value}", retry_after=1.0)
        return self._run(e, "verify", self._verify_files, e)

    async def _verify_files(self, e: ModelEntry) -> None:
        cached = e.snapshot is not None and e.snapshot.exists()
        try:
            problems = await self.source.check(e.name, rehash=True) if cached else ["not cached"]
        except CacheError as ex:
            problems = [str(ex)]
        repaired = False
        if problems and e.state is State.READY:
            e.needs_repair = True  # in use: repaired by the next load
        elif problems or e.needs_repair:
            await self._pull(e, verify=True)
            repaired = e.state is State.CACHED
        e.last_verify = {"ok": not problems, "problems": problems, "repaired": repaired}
        self._log.info("model_verify", model=e.name, **e.last_verify)

    async def _wait_worker(self) -> None:
        # Woken by the worker's Hello (a load sent then starts at once, not at the next poll).
        if not self.worker.alive and not await self.worker.wait_alive(WORKER_WAIT_S):
            raise WorkerError("the engine worker did not come up", "worker_down")
        if self.worker.state.engine_error:
            raise WorkerError(f"the engine is unavailable: {self.worker.state.engine_error}", "no_engine")

    def unload(self, name: str, drain_s: float | None = None) -> asyncio.Task[None] | None:
        """Start draining (up to ``drain_s``, default ``server.drain_timeout``; then what is left
        is aborted) and unloading; None when it is not loaded."""
        e = self.get(name)
        if e.state is State.FAILED and not e.want_loaded and not e.busy:
            # Nothing of it is in the engine: unloading clears the failure.
            e.refusal = {}
            e.move(e.at_rest, "unloaded after a failure")
            return None
        queued = self._queued_loads.pop(name, None)
        if queued is not None:  # the later word wins: a load waiting for this model's operation is off
            queued.cancel()
        if e.state in (State.CACHED, State.ABSENT):
            return None
        if e.busy and e.op in _UNLOADS:  # on its way out already: asking again joins it
            assert e.task is not None
            return e.task
        if e.state is not State.READY:
            raise ManagerError(f"{name} is {e.state.value}", retry_after=1.0)
        return self._run(e, "unload", self._unload, e, drain_s, "", state=State.DRAINING)

    def _load_after(self, e: ModelEntry, load: Callable[[], asyncio.Task[None] | None]) -> asyncio.Task[None]:
        """A load queued behind ``e``'s operation under way (an unload, a pull, a verify): a task
        that waits for it to end, however it ends, then starts ``load()`` and waits for that;
        their ``?wait`` waits for both. An unload meanwhile cancels it (the later word wins), as
        does the manager's close; a refusal then (the model forgotten, asked for other options
        meanwhile) ends it with the entry's state as it is."""
        before = e.task

        async def queued() -> None:
            try:
                if before is not None:
                    await asyncio.wait([before])  # never cancels ``before``, unlike awaiting it
            finally:
                if self._queued_loads.get(e.name) is task:
                    del self._queued_loads[e.name]
            if self._closing:
                return
            try:
                started = load()
            except ManagerError as ex:
                self._log.info("queued_load_refused", model=e.name, error=str(ex))
                return
            if started is not None:
                await asyncio.wait([started])

        task = asyncio.create_task(queued(), name=f"load-after-{e.op}-{e.name}")
        self._queued_loads[e.name] = task
        return task

    async def _unload(self, e: ModelEntry, drain_s: float | None, reason: str) -> None:
        """Drain (up to ``drain_s``), unload from the engine, give back what the load gave."""
        e.move(State.DRAINING, reason)
        e.want_loaded = False
        deadline = time.monotonic() + (self.settings.server.drain_timeout if drain_s is None else drain_s)
        # requests preempted from it wait for its comeback outside the engine: not for them
        while e.in_flight > e.preempted and not e.recalled and (left := deadline - time.monotonic()) > 0:
            await e.wait_change(left)  # the last request out signals, a preempted one leaving, and a recall
        # Its drain is over either way: a promise of it to a load ends here, never to recall a
        # later unload of this model (an operator's, keep-alive's) that the load outlives.
        self._drains.pop(e.name, None)
        if e.recalled:  # the load it drained for no longer needs it (_recall_drains): it stays
            e.want_loaded = True
            e.move(State.READY, "drain called off: the load it was drained for ended without it")
            return
        if e.in_flight > e.preempted:
            self._log.warning("drain_timeout", model=e.name, in_flight=e.in_flight - e.preempted)
        e.move(State.UNLOADING, reason)
        try:
            if self.worker.alive:
                await self.worker.unload(e.name)  # aborts whatever did not drain in time
        except WorkerError as ex:
            self._log.warning("unload_error", model=e.name, error=str(ex))
        self._forget_load(e)
        e.move(e.at_rest, reason)

    def set_pin(self, name: str, pinned: bool | None) -> ModelEntry:
        """Pin (never evicted, never unloaded when idle) or unpin; None goes back to the config."""
        e = self.get(name)
        e.pin_override = pinned
        self._log.info("model_pin", model=name, pinned=e.pin)
        if e.pin:  # never evicted: a drain for room under way is called off (an operator's unload is not)
            self._recall(e, pinned="true")
        return e

    async def drop_prefix_cache(self, name: str) -> int:
        """Forget a ready model's prefix cache (requests running keep what they hold); the
        entries it had."""
        e = self.get(name)
        if e.state is not State.READY:
            raise ManagerError(f"model {name!r} is {e.state.value}, not ready: it has no prefix cache")
        try:
            entries = await self.worker.drop_prefix_cache(name)
        except (WorkerError, asyncio.TimeoutError) as ex:
            raise ManagerError(f"the engine did not drop {name!r}'s prefix cache: {ex}") from None
        self._log.info("prefix_cache_dropped", model=name, entries=entries)
        return entries

    def start(self) -> None:
        """Start the keep-alive task (needs a running loop); ``close`` stops it."""
        if self._keep_alive is None:
            self._keep_alive = asyncio.create_task(self.run_keep_alive(), name="keep-alive")

    def unload_broken(self) -> None:
        """Unload every ready model the engine says cannot run (its runner could not be rebuilt
        after a failed load's pool resize: its requests would only be aborted). It comes back at
        the next request that needs it (autoload) or load, with a runner built afresh."""
        for e, why in self._planner.broken(self.worker.broken_models()):
            self._log.error("model_broken", model=e.name, reason=why)
            reason = f"unloaded: it could not run ({why})"
            self._run(e, "broken", self._unload, e, 0.0, reason, state=State.DRAINING, reason=reason)

    async def run_keep_alive(self, tick: float = KEEP_ALIVE_TICK_S) -> None:
        """Background task: unload idle models once their keep_alive has passed, and models the
        engine says cannot run."""
        while True:
            await asyncio.sleep(tick)
            try:
                self.unload_broken()
            except Exception as ex:  # noqa: BLE001 - one tick's failure must not end the idle unloads
                self._log.error("unload_broken_failed", error=f"{type(ex).__name__}: {ex}")
            for e in self._planner.idle_expired(time.monotonic()):
                self._log.info("keep_alive_unload", model=e.name, idle_s=round(e.idle_for(time.monotonic()), 3),
                               keep_alive_s=e.settings.keep_alive)
                why = "idle past keep_alive"
                self._run(e, "idle", self._unload, e, None, why, state=State.DRAINING, reason=why)

    async def preload(self) -> None:
        """Load every ``preload`` model; returns when each is ready or failed."""
        tasks = []
        for m in self.settings.models:
            if m.preload:
                try:
                    t = self.load(m.name)
                except ManagerError as ex:  # e.g. a load already started through the admin API
                    self._log.warning("preload_skipped", model=m.name, error=str(ex))
                    continue
                if t is not None:
                    tasks.append(t)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def preload_ready(self) -> bool:
        return all(self.models[m.name].state is State.READY for m in self.settings.models if m.preload)

    # --- worker events ----------------------------------------------------------------------

    async def on_worker_down(self) -> None:
        for e in self.models.values():
            if e.state in (State.READY, State.DRAINING, State.UNLOADING) or (e.state is State.LOADING and e.want_loaded):
                # its load (or the canary's first decode) was in the worker when it died; one
                # waiting for the worker or the room lock was not
                in_engine_load = e.in_worker
                if e.busy:
                    e.task.cancel()
                if in_engine_load:
                    e.crashed_loads += 1
                if e.want_loaded and e.crashed_loads >= CRASH_LOOP_LOADS:
                    e.want_loaded = False
                    self._forget_load(e)
                    e.move(State.FAILED, f"the engine worker died during {e.crashed_loads} of its loads; "
                                         "not reloaded automatically (load it to try again)")
                elif e.want_loaded:
                    e.info = None  # the new worker holds nothing of it until its reload's engine load
                    e.move(State.LOADING, "the engine worker restarted; reloading")
                else:  # it was on its way out anyway: finish the unload's bookkeeping
                    e.move(State.UNLOADING, "the engine worker exited")
                    self._forget_load(e)
                    e.move(e.at_rest)

    async def on_worker_up(self) -> None:
        """Reload what was loaded when the worker died, one model at a time in priority order
        (pinned, then preload, then the most recently used), so the first back serve first and
        a model that cannot come back does not hold the others behind a shared failure. Each
        reload is its model's own operation (busy to the admin API), queued behind the one ahead."""
        before: asyncio.Task[None] | None = None
        for e in self.reload_order([e for e in self.models.values()
                                    if e.state is State.LOADING and e.want_loaded and not e.busy]):
            before = self._run(e, "reload", self._reload_after, e, before)

    @staticmethod
    def reload_order(entries: list[ModelEntry]) -> list[ModelEntry]:
        """Pinned first, then preload, then by last use (most recent first)."""
        return sorted(entries, key=lambda e: (not e.pin, not e.settings.preload, -e.last_used_mono))

    async def _reload_after(self, e: ModelEntry, before: asyncio.Task[None] | None) -> None:
        """Reload ``e`` once the reload ahead of it (``before``) has ended, however it ended."""
        if before is not None:
            await asyncio.wait([before])  # never cancels ``before``, unlike awaiting it
        if e.state is State.LOADING and e.want_loaded:  # not failed or unloaded meanwhile
            await self._load(e)

    # --- admission --------------------------------------------------------------------------

    def admit(self, name: str, choices: int = 1) -> Admission:
        """Reserve ``choices`` slots (the engine requests one HTTP request starts: prompts × n)
        for one request; raise UnknownModel, ModelNotReady or QueueFull. A model with nothing in
        flight admits any one request, so a request wider than the limit is slow, not refused."""
        e = self.models.get(name)
        if e is None:
            raise UnknownModel(f"the model {name!r} does not exist")
        if e.state is not State.READY:
            # Cached (autoload off): an operator's load or a keep-alive reload may bring it back.
            retry = 2.0 if e.state in (State.LOADING, State.PULLING) else 1.0 if e.state in (
                State.DRAINING, State.UNLOADING) else 5.0 if e.state is State.CACHED else None
            why = f" ({e.reason})" if e.reason else ""
            raise ModelNotReady(f"the model {name!r} is {e.state.value}{why}", retry_after=retry)
        if e.in_flight and e.in_flight + choices > e.queue_limit:
            raise QueueFull(f"the model {name!r} has {e.in_flight} requests in flight; try again shortly",
                            retry_after=1.0)
        return Admission(e, choices)

    def autoload_enabled(self, e: ModelEntry) -> bool:
        a = e.settings.autoload
        return self.settings.server.autoload if a is None else a

    async def admit_wait(self, name: str, timeout: float | None = None, choices: int = 1) -> Admission:
        """Like ``admit``; with autoload on, a configured model that is not loaded is loaded
        first, pulled first when it is only in the store.

        The request waits for the load, at most ``timeout`` (``server.autoload_timeout``); then
        ModelNotReady (503 + Retry-After) while the pull and load go on. A model failed by a crash
        loop is not retried for a request (an operator's load is).
        """
        e = self.models.get(name)
        if e is None or e.state is State.READY or not self.autoload_enabled(e):
            return self.admit(name, choices)
        limit = self.settings.server.autoload_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        e.load_waiters += choices  # queued for the gateway's picker (agent/gateway_metrics.py)
        e.load_requests += 1
        try:
            await self._wait_ready(e, name, limit, deadline)
        finally:
            e.load_waiters -= choices
            e.load_requests -= 1
            if not e.load_waiters:
                e.signal_change()  # the last waiter in: a load waiting on it may drain it now
        return self.admit(name, choices)

    def comeback_s(self) -> float:
        """How long a preempted model's comeback may take: an autoload's time and a drain's on
        top, since it never preempts (it drains, up to ``server.drain_timeout``) — a request that
        would have finished had its model been drained must not time out because it was
        preempted."""
        return self.settings.server.autoload_timeout + self.settings.server.drain_timeout

    async def wait_back(self, name: str, choices: int) -> int:
        """Wait until ``name``, preempted for another model's room (``choices`` of its admitted
        engine requests waiting), is ready again, loading it as a request's autoload does (its
        room waited for up to :meth:`comeback_s`, counted from the comeback load's start, as the
        load counts it, not from the preemption); its context length then (a comeback may get a
        smaller one). Raises ModelNotReady when it is not back by then, or cannot be loaded, or
        came back on other files (a pull or a load from another folder while the requests were
        paused: their output is not resumed on other weights)."""
        e = self.get(name)
        limit = self.comeback_s()
        weights = self._weights_of(e)
        e.preempted += choices
        e.signal_change()  # its unload waits for the requests in flight less these
        try:
            if not self._no_comebacks:
                await self._wait_ready(e, name, limit, time.monotonic() + limit, from_load=True)
        except ShuttingDown:
            pass
        finally:
            e.preempted -= choices
            e.signal_change()
        if self._no_comebacks:
            raise WorkerError(f"the server is shutting down; the request, preempted for another model's room, "
                              f"was not resumed", "shutting_down")
        if e.state is not State.READY:
            why = f" ({e.reason})" if e.reason else ""
            raise ModelNotReady(f"the model {name!r} is {e.state.value}{why}", retry_after=max(1.0, limit / 4))
        if self._weights_of(e) != weights:  # pulled or loaded from elsewhere while they were paused
            raise ModelNotReady(f"the model {name!r} came back with other files than the request began on (a "
                                f"pull or a load from another folder meanwhile); it was not resumed on them",
                                retry_after=1.0)
        assert e.info is not None  # ready
        return e.info.max_model_len

    def _weights_of(self, e: ModelEntry) -> tuple[str | None, Path | None]:
        """What names the files ``e`` serves: the cache's version of it and its folder."""
        return (self.source.version(e.name) if self.source is not None else None), e.snapshot

    def end_comebacks(self) -> None:
        """Shutting down: requests preempted for room stop waiting for their models (each ends
        with ``shutting_down``) and start no load; the drain then waits only for the others."""
        self._no_comebacks = True
        for e in self.models.values():
            if e.preempted:
                e.signal_change()

    async def _wait_ready(self, e: ModelEntry, name: str, limit: float, deadline: float,
                          from_load: bool = False) -> None:
        """``admit_wait``'s wait: until ``e`` is ready (loading it as needed), the deadline, or a
        state ``admit`` refuses with its reason; ``ShuttingDown`` once comebacks end
        (:meth:`end_comebacks`). ``from_load`` (a comeback): once the model's load is under way the
        deadline is the load's own (its room wait counts ``limit`` from its own start, its engine
        load and first decode are bounded on their own): the wait ends with that load. (Loading
        without an operation, waiting for a worker to come back, keeps the deadline.)"""
        while e.state is not State.READY:
            if self._no_comebacks:
                raise ShuttingDown(f"the server is shutting down; the model {name!r} is {e.state.value}",
                                   retry_after=SHUTDOWN_RETRY_S)
            if e.state is State.FAILED and e.crashed_loads >= CRASH_LOOP_LOADS:
                return  # admit refuses it with its reason
            wait = e.retry_in()
            if wait > 0:  # its last load failed on its own: not again yet
                raise ModelNotReady(f"the model {name!r} could not be loaded ({e.reason}); a request retries it "
                                    f"in {wait:.0f} s (an operator's load goes at once)", retry_after=max(1.0, wait))
            if not e.busy:
                startable = e.state is State.CACHED or (e.state in (State.ABSENT, State.FAILED) and (
                    self.source is not None or (e.snapshot is not None and e.state is State.FAILED)))
                if not startable and e.state in (State.ABSENT, State.FAILED):
                    return  # nowhere to pull it from: admit refuses it as not ready
                if startable:
                    self.load(name)  # pulls first when its files are not (all) in the cache
            left = deadline - time.monotonic()
            if from_load and e.state is State.LOADING and e.busy:
                left = max(left, 1.0)  # its load under way: that load's deadlines hold (re-checked each second)
            elif left <= 0:
                why = f" ({e.reason})" if e.reason else ""
                raise ModelNotReady(f"the model {name!r} did not become ready within {limit:g} s "
                                    f"(it is {e.state.value}){why}", retry_after=max(1.0, limit / 4))
            await e.wait_change(left)  # a transition, or the operation's end (it may leave no trace)
            if e.state is State.FAILED:
                wait = e.retry_in()
                raise ModelNotReady(f"the model {name!r} could not be loaded: {e.reason}",
                                    retry_after=max(1.0, wait if wait > 0 else limit / 4))

    async def close(self) -> None:
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            await asyncio.gather(self._keep_alive, return_exceptions=True)
        self._closing = True
        queued = list(self._queued_loads.values())
        for task in queued:  # first: none may start a load while the operations end
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        for e in self.models.values():
            if e.busy:
                e.task.cancel()
        await asyncio.gather(*(e.task for e in self.models.values() if e.task is not None), return_exceptions=True)
