"""Room for models: which idle models a load may evict, and which have outlived their keep_alive.

The engine knows the bytes, the manager knows who is idle. :class:`RoomPlanner` answers the
manager's questions from its entries and changes nothing: the models a ``Load`` may offer for
eviction (ready, unpinned, nothing in flight, no operation running, least recently used first),
those a refused load may wait for (busy, or on their way out), the busy ones to drain for it,
what a refusal (``WorkerError`` with code ``no_room``, naming the shortest prefix of that offer
that makes room) calls for, and which models are idle past their keep_alive. The
:class:`~agent.manager.manager.ModelManager` applies the answers: it drains and unloads.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.manager.entries import ModelEntry, NoRoom, State
from cache.sizes import human_bytes

REFUSAL_FIGURES = ("needed", "free", "evictable", "budget", "short")
# A busy model with more tokens to go than this (one of its requests may produce that many) is
# drained only when no other will do: its drain is stepped ahead of every other model's
# (EngineCore.expedite), ~5 ms a token for an 8B, so 1,024 tokens hold the others ~5 s.
DRAIN_TOKENS_MAX = 1024


def refusal_reason(model: str, d: dict[str, Any]) -> str:
    """One line with the numbers of a refused load (readable and exact bytes)."""
    def b(k: str) -> str:
        return human_bytes(d.get(k) or 0)

    line = (f"no room to load {model!r}: needs {b('needed')} ({d.get('needed')} B), {b('free')} free of a "
            f"{b('budget')} budget; idle models that may be evicted free {b('evictable')}; short by {b('short')} "
            f"({d.get('short')} B)")
    if isinstance(d.get("needed"), int) and isinstance(d.get("budget"), int) and d["needed"] > d["budget"]:
        line += "; more than the whole budget: it cannot be loaded under it"
    return line


@dataclass(frozen=True)
class Eviction:
    """What a load refused for room calls for: evict ``victims`` and try once more."""

    victims: tuple[str, ...]  # empty: evicting what was offered cannot cure the refusal
    details: dict[str, Any]  # the engine's figures: needed, free, evictable, budget, short

    def refusal(self, model: str) -> NoRoom:
        """The error a load fails with when it is not (or no longer) cured by eviction."""
        return NoRoom(refusal_reason(model, self.details), details=self.details)


class RoomPlanner:
    """Reads the manager's entries (the same mapping, kept current by the manager)."""

    def __init__(self, models: Mapping[str, ModelEntry]) -> None:
        self._models = models

    def evictable(self, exclude: str = "", most: float | None = None) -> list[str]:
        """Models a load may evict now, least wanted first (``ModelEntry.wanted``: requests
        admitted, decayed), then least recently used. By recency alone, the most asked-for of
        twelve 8Bs under Zipf traffic (a third of the requests) was drained or evicted and
        loaded again every ~25 s (H100, 4 resident: docs/perf.md, b45544f). ``most``: only
        those wanted no more than that (see :meth:`colder_coming`).

        Never a pinned model, one with requests in flight or waiting for it (a model that just
        loaded for them), or one with an operation (load, unload, pull) running."""
        now = time.monotonic()
        out = [e for e in self._models.values()
               if e.state is State.READY and not e.pin and e.in_flight == 0 and e.load_waiters == 0
               and e.name != exclude and not e.lock.locked() and not e.busy
               and (most is None or e.wanted(now) <= most)]
        return [e.name for e in sorted(out, key=lambda e: (e.wanted(now), e.last_used_mono))]

    def colder_coming(self, load: ModelEntry, promised: Mapping[str, str]) -> list[ModelEntry]:
        """Models no more wanted than ``load`` asks for (``ModelEntry.claim``) that hold room, or
        are about to, and will soon be free to go: ready with requests (in flight or waiting for
        it: a drain or an eviction once they end), or loading past their room (their load running,
        its engine load sent, or a model drained for it). While there is one, a load takes its room from
        models no more wanted than itself and waits for the rest (``ROOM_PATIENCE_S`` at most):
        taking the room of a more wanted model stops its admissions until it is back (a drain
        admits nothing; its next request waits for a whole reload). Unguarded, the density run
        at 9dac9ac (H100, 12 x 8B under Zipf, 4 resident) reloaded the second most asked-for
        model 17 times in 120 s, each time because the only other ready model was the most
        asked-for one while three colder loads held the rest. A load of a model loading
        without its room is not counted: two such loads would wait for each other."""
        now = time.monotonic()
        most = load.claim(now)
        rooms = set(promised.values())
        return [e for e in self._models.values() if e is not load and not e.pin and e.claim(now) <= most and (
            (e.state is State.READY and (e.in_flight or e.load_waiters or e.busy))
            or (e.state is State.LOADING and e.busy and (e.in_worker or e.name in rooms)))]

    def may_free(self, exclude: str = "", coming: list[ModelEntry] | tuple = ()) -> list[ModelEntry]:
        """Models not evictable now whose next change may make room: ready and unpinned but busy
        (requests in flight, an operation running), on their way out (draining, unloading), or
        unpinned and loading past their engine load (their room is held; ready next, evictable
        once idle: two loads racing for the last room, the second was refused at once while
        the first was in its canary); then those of ``coming`` (:meth:`colder_coming`) not among
        them. A load still waiting for room itself is none of these (two such loads would wait
        on each other)."""
        evictable = set(self.evictable(exclude))
        out = [e for e in self._models.values() if e.name != exclude and e.name not in evictable and (
            (e.state is State.READY and not e.pin) or e.state in (State.DRAINING, State.UNLOADING)
            or (e.state is State.LOADING and not e.pin and e.info is not None))]
        return out + [c for c in coming if c not in out]

    def never_fits(self, refusal: Mapping[str, Any], exclude: str = "") -> bool:
        """Whether no model leaving could make room for a refused load: it needs more than the
        budget less what pinned models hold (a pinned model never leaves for a load). Then
        draining a busy model only unloads it for nobody (its streams cut at the drain's
        timeout, its next request waiting for a reload), so the load is refused at once."""
        needed, budget = refusal.get("needed"), refusal.get("budget")
        if not isinstance(needed, int) or not isinstance(budget, int) or budget <= 0:
            return False  # an older peer's refusal without the figures: no proof
        # in the engine: ready, or loading past its engine load (its info is set then; the
        # tokenizer and the canary still to come, the room lock free meanwhile)
        pinned = sum(e.info.device_bytes for e in self._models.values()
                     if e.name != exclude and e.pin and e.info is not None
                     and e.state in (State.READY, State.LOADING))
        return needed > budget - pinned

    def to_drain(self, short: int | None, exclude: str = "", tokens_to_go: Mapping[str, int] | None = None,
                 promised: Mapping[str, str] | None = None, most: float | None = None) -> list[ModelEntry]:
        """Busy models to drain so that a refused load gets its room, until their bytes at load
        cover ``short`` (the refusal's bytes missing beyond the idle models offered) less what
        models already leaving for this load will free (``promised``: drained model → the load it
        was drained for). Candidates: ready, unpinned, requests in flight, none waiting for it, no
        operation running, none paused for its comeback (``preempted``: just back, their requests
        not resumed yet; drained now, they would wait for a second comeback). Order: those with at
        most DRAIN_TOKENS_MAX tokens to go first (a drain is stepped ahead of every model: a long
        generation would hold them all up), then the least wanted (``ModelEntry.wanted``, to the
        nearest request), the nearest to idle (``tokens_to_go``, the engine's; a model without a
        figure after those with one), the least recently used. ``most``: only those wanted no more
        than that, and none with a long
        generation (a load sparing the more wanted waits for a cheap drain, not for a long one).
        Empty when what is leaving covers it or none is busy."""
        to_go, promised = tokens_to_go or {}, promised or {}
        others = [e for e in self._models.values() if e.name != exclude]
        need = (short if short is not None else 1) - sum(
            e.info.device_bytes for e in others if e.info is not None and e.state in (State.DRAINING, State.UNLOADING)
            and promised.get(e.name, exclude) == exclude)
        out: list[ModelEntry] = []
        now = time.monotonic()

        def order(e: ModelEntry) -> tuple:
            left = to_go.get(e.name, float("inf"))
            return left > DRAIN_TOKENS_MAX, round(e.wanted(now)), left, e.last_used_mono

        for e in sorted((e for e in others if e.state is State.READY and not e.pin and e.in_flight > 0
                         and e.load_waiters == 0 and e.preempted == 0 and not e.busy and not e.lock.locked()
                         and (most is None or (e.wanted(now) <= most and to_go.get(e.name, 0) <= DRAIN_TOKENS_MAX))),
                        key=order):
            if need <= 0:
                break
            out.append(e)
            need -= max(1, e.info.device_bytes if e.info is not None else 0)
        return out

    def loads_draining(self, promised: Mapping[str, str], exclude: str = "") -> set[str]:
        """The loads other than ``exclude``'s with a model still leaving for them (``promised``:
        drained model → the load it was drained for)."""
        return {load for v, load in promised.items() if load != exclude and (e := self._models.get(v)) is not None
                and e.state in (State.DRAINING, State.UNLOADING)}

    def after_refusal(self, offered: list[str], refusal: Mapping[str, Any]) -> Eviction:
        """The eviction a ``no_room`` refusal names, when all of it is among ``offered``."""
        details = {k: refusal.get(k) for k in REFUSAL_FIGURES}
        named = list(refusal.get("evict") or [])
        victims = [n for n in named if n in offered]
        return Eviction(tuple(victims) if victims and victims == named else (), details)

    def broken(self, reasons: Mapping[str, str]) -> list[tuple[ModelEntry, str]]:
        """Ready models, free of any operation, that the engine says cannot run (``reasons``:
        ``WorkerClient.broken_models``), with the reason."""
        return [(e, reasons[e.name]) for e in self._models.values()
                if e.name in reasons and e.state is State.READY and not e.busy and not e.lock.locked()]

    def idle_expired(self, now: float) -> list[ModelEntry]:
        """Ready, unpinned models idle for longer than their keep_alive (-1: never)."""
        return [e for e in self._models.values()
                if e.state is State.READY and not e.pin and e.settings.keep_alive >= 0 and e.in_flight == 0
                and not e.busy and not e.lock.locked()
                and e.idle_for(now) > e.settings.keep_alive]
