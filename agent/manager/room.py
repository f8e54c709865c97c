"""Room for models: the memory budget, LRU eviction, keep-alive and autoload of the ModelManager.

One global ``asyncio.Lock`` (the room lock) covers "plan → evict → load" so two loads never plan
on the same free bytes; pulls, tokenizer loads and the post-load check stay outside it, so
different models still load in parallel up to the engine step. The engine knows the bytes, the
manager knows who is idle: a ``Load`` offers the evictable models (ready, unpinned, nothing in
flight, no operation running, least recently used first); a refusal (``WorkerError`` with code
``no_room``) names the shortest prefix of that offer that makes room. Those are drained and
unloaded, and the load is tried once more; a second refusal, or one that eviction cannot cure,
fails the load with the engine's numbers.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from agent.manager.entries import ModelEntry, ModelNotReady, NoRoom, State
from agent.worker.client import WorkerError

if TYPE_CHECKING:
    from agent.manager.manager import ModelManager

KEEP_ALIVE_TICK_S = 0.25


def _fmt(n: Any) -> str:
    v = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} GiB"


def refusal_reason(model: str, d: dict[str, Any]) -> str:
    """One line with the numbers of a refused load (readable and exact bytes)."""
    return (f"no room to load {model!r}: needs {_fmt(d.get('needed'))} ({d.get('needed')} B), "
            f"{_fmt(d.get('free'))} free of a {_fmt(d.get('budget'))} budget; idle models that may be "
            f"evicted free {_fmt(d.get('evictable'))}; short by {_fmt(d.get('short'))} ({d.get('short')} B)")


class RoomMixin:
    """Budget planning, eviction, keep-alive and autoload; mixed into ModelManager."""

    def evictable(self: ModelManager, exclude: str = "") -> list[str]:
        """Models a load may evict now, least recently used first.

        Never a pinned model, one with requests in flight, or one with an operation (load,
        unload, pull) running."""
        out = [e for e in self.models.values()
               if e.state is State.READY and not e.pin and e.in_flight == 0 and e.name != exclude
               and not e.lock.locked() and (e.task is None or e.task.done())]
        return [e.name for e in sorted(out, key=lambda e: e.last_used_mono)]

    async def _engine_load(self: ModelManager, e: ModelEntry) -> Any:
        """Load ``e`` in the worker under the room lock, evicting what the engine names once."""
        s = e.settings
        async with self._room:
            for attempt in (1, 2):
                offered = self.evictable(exclude=e.name)
                try:
                    return await self.worker.load(e.name, str(e.snapshot), max_model_len=s.max_model_len,
                                                  max_num_seqs=s.max_num_seqs, weight=s.weight, evictable=offered)
                except WorkerError as ex:
                    if ex.code != "no_room":
                        raise
                    details = {k: ex.details.get(k) for k in ("needed", "free", "evictable", "budget", "short")}
                    victims = [n for n in ex.details.get("evict") or [] if n in offered]
                    if attempt == 2 or not victims or victims != list(ex.details.get("evict") or []):
                        raise NoRoom(refusal_reason(e.name, details), details=details) from None
                self._log.info("evict_for_load", model=e.name, evict=victims, needed=details["needed"],
                               free=details["free"])
                for name in victims:
                    await self._evict(self.models[name], f"evicted to make room for {e.name}")
        raise NoRoom(f"no room to load {e.name!r}")  # not reached: the second attempt returns or raises

    async def _evict(self: ModelManager, v: ModelEntry, why: str) -> None:
        """Unload an idle model as its own operation (so the admin API sees it busy)."""
        if v.state is not State.READY or v.in_flight or (v.task is not None and not v.task.done()):
            return  # it changed since the offer: the retry will be refused if room is still short
        self._log.info("evict", model=v.name, reason=why)
        v.task = asyncio.create_task(self._unload(v, reason=why), name=f"evict-{v.name}")
        self._set(v, State.DRAINING, why)  # before any await: no request is admitted past this
        await asyncio.shield(v.task)

    # --- keep-alive ---------------------------------------------------------------------------

    def idle_expired(self: ModelManager, now: float) -> list[ModelEntry]:
        """Ready, unpinned models idle for longer than their keep_alive (-1: never)."""
        return [e for e in self.models.values()
                if e.state is State.READY and not e.pin and e.settings.keep_alive >= 0 and e.in_flight == 0
                and (e.task is None or e.task.done()) and not e.lock.locked()
                and e.idle_for(now) > e.settings.keep_alive]

    async def run_keep_alive(self: ModelManager, tick: float = KEEP_ALIVE_TICK_S) -> None:
        """Background task: unload idle models once their keep_alive has passed."""
        while True:
            await asyncio.sleep(tick)
            for e in self.idle_expired(time.monotonic()):
                self._log.info("keep_alive_unload", model=e.name, idle_s=round(e.idle_for(time.monotonic()), 3),
                               keep_alive_s=e.settings.keep_alive)
                e.task = asyncio.create_task(self._unload(e, reason="idle past keep_alive"), name=f"idle-{e.name}")
                self._set(e, State.DRAINING, "idle past keep_alive")

    # --- autoload -----------------------------------------------------------------------------

    def autoload_enabled(self: ModelManager, e: ModelEntry) -> bool:
        a = e.settings.autoload
        return self.settings.server.autoload if a is None else a

    async def admit_wait(self: ModelManager, name: str, timeout: float | None = None) -> Any:
        """Like ``admit``; with autoload on, a cached model that is not loaded is loaded first.

        The request waits for the load, at most ``timeout`` (``server.autoload_timeout``); then
        ModelNotReady (503 + Retry-After). Models not in the cache are not pulled for a request.
        """
        e = self.models.get(name)
        if e is None or e.state is State.READY or not self.autoload_enabled(e):
            return self.admit(name)
        limit = self.settings.server.autoload_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while e.state is not State.READY:
            if e.state in (State.CACHED, State.FAILED) and e.snapshot is not None and (e.task is None or e.task.done()):
                self.load(name)
            elif e.state is State.ABSENT:
                return self.admit(name)  # not cached: refused as not ready, never pulled here
            left = deadline - time.monotonic()
            if left <= 0:
                why = f" ({e.reason})" if e.reason else ""
                raise ModelNotReady(f"the model {name!r} did not become ready within {limit:g} s "
                                    f"(it is {e.state.value}){why}", retry_after=max(1.0, limit / 4))
            task = e.task
            if task is not None and not task.done():
                await asyncio.wait([asyncio.ensure_future(asyncio.shield(task))], timeout=min(left, 0.5))
            else:
                await asyncio.sleep(min(left, 0.05))
            if e.state is State.FAILED:
                raise ModelNotReady(f"the model {name!r} could not be loaded: {e.reason}", retry_after=max(1.0, limit / 4))
        return self.admit(name)
