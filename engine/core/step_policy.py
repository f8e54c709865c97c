"""How the engine treats a quiet model next to a busy one: which step goes on the high-priority
stream (engine/runner/streams.py), when a busy model's steps are capped (``shared_step_tokens``), and
when it yields (its next step waits for the one in flight, EngineCore.parked). A mixin of
:class:`engine.core.engine_core.EngineCore`; it reads the core's ``_slots`` and ``quiet_window_s``.
docs/multi-model.md has the measurements behind each rule.
"""

from __future__ import annotations

import os
import time

from engine.core.slot import ModelSlot
from engine.errors import EngineError


def quiet_window(seconds: float | None) -> float:
    """The quiet window in seconds: ``seconds``, or (None) ``INFIRE_QUIET_WINDOW_MS`` / 1000, unset 0."""
    if seconds is None:
        raw = os.environ.get("INFIRE_QUIET_WINDOW_MS", "").strip()
        try:
            seconds = float(raw) / 1000 if raw else 0.0
        except ValueError:
            raise EngineError(f"INFIRE_QUIET_WINDOW_MS must be a number of milliseconds, got {raw!r}") from None
        if not 0 <= seconds <= 60:
            raise EngineError(f"INFIRE_QUIET_WINDOW_MS must be between 0 and 60000 ms, got {raw!r}")
    elif isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 60:
        raise EngineError("quiet_window_s must be a number of seconds between 0 and 60")
    return float(seconds)


# A model yields to another only when it has at least this many times that one's requests: two
# about equally busy models (both saturated, both at light load) keep launching ahead.
QUIET_RATIO = 4


def cap_when() -> str:
    """``INFIRE_SHARED_CAP``: when the shared step cap holds, ``active`` (default) or ``loaded``."""
    raw = os.environ.get("INFIRE_SHARED_CAP", "active").strip() or "active"
    if raw not in ("active", "loaded"):
        raise EngineError(f"INFIRE_SHARED_CAP must be 'active' or 'loaded', got {raw!r}")
    return raw


def requests(slot: ModelSlot) -> int:
    """A model's requests in the engine: running and waiting."""
    return slot.scheduler.num_running + slot.scheduler.num_waiting


class QuietPolicy:
    """The rules; the core supplies ``_slots`` (name -> ModelSlot) and ``quiet_window_s``."""

    _slots: dict[str, ModelSlot]
    quiet_window_s: float
    cap_when: str

    def _urgent(self, slot: ModelSlot) -> bool:
        """Whether the step goes on its runner's high-priority stream (engine/runner/streams.py):
        its model has fewer requests than every other model with work (the quiet one next to a
        flooded one), so its kernels are served first while the other's step drains."""
        if len(self._slots) < 2:
            return False
        mine = requests(slot)
        others = [requests(s) for s in self._slots.values() if s is not slot and s.scheduler.has_unfinished()]
        return bool(others) and mine < min(others)

    def _capped(self, slot: ModelSlot) -> bool:
        """Whether ``slot``'s steps are capped at ``shared_step_tokens``: while another model is
        active (``INFIRE_SHARED_CAP=active``, the default: a model beside idle ones keeps its full
        steps) or merely loaded (``loaded``: a quiet model's first request after a lull never finds
        an uncapped step running; docs/perf.md, the 4c78b73 row, has the runs behind both)."""
        if self.cap_when == "loaded":
            return len(self._slots) > 1
        return self._others_active(slot)

    def _others_active(self, slot: ModelSlot) -> bool:
        """Whether another model has requests, or had one within the quiet window."""
        since = time.perf_counter() - self.quiet_window_s
        return any(s is not slot and (s.scheduler.has_unfinished() or s.last_request_t >= since)
                   for s in self._slots.values())

    def _yields(self, slot: ModelSlot) -> bool:
        """Whether ``slot``'s next step waits until its step in flight is collected (the other
        models are scheduled meanwhile, and :meth:`step` returns instead of blocking on it while
        nothing else has work: :meth:`parked`): some model with at most a ``QUIET_RATIO``-th of
        its requests had one within ``quiet_window_s``.

        Launching ahead queues the busy model's next step before the host can see a request that
        arrives while the current one runs; the quiet model's prefill then shares the GPU with that
        step, or waits for it. Yielding costs the busy model its launch-ahead (the host's prepare
        time idles the GPU) only while a quieter model is active; two equally busy models keep it."""
        if not self.quiet_window_s or len(self._slots) < 2:
            return False
        since = time.perf_counter() - self.quiet_window_s
        mine = requests(slot)
        return any(s is not slot and s.last_request_t >= since and requests(s) * QUIET_RATIO <= mine
                   for s in self._slots.values())
