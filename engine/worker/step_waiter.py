"""Wakes a selector loop when a parked step's ids are ready (:meth:`engine.core.engine_core.EngineCore.parked`).

While a quiet model is active the busy model's next step waits for its step in flight, and
``step()`` returns instead of blocking on it. The loop must then sleep until either that step is
done or a new request arrives; a CUDA event cannot be selected on, so one thread waits on it
(a blocking-sync event: the thread sleeps, no core spins) and writes a byte to the loop's wake-up
pipe when it fires. The loop hands the event over on every pass while the step stays parked (each
request that arrives meanwhile is a pass); an event already being waited on is not queued again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class StepWaiter:
    """A daemon thread that synchronizes on the events it is given and calls ``wake`` after each."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: Any = None  # the event handed over last, until its wake-up is sent
        self._thread = threading.Thread(target=self._run, name="engine-step-waiter", daemon=True)
        self._thread.start()

    def watch(self, event: Any) -> None:
        """Wake the loop once ``event`` (a ``torch.cuda.Event``) has fired."""
        if event is self._waiting:
            return
        self._waiting = event
        self._events.put(event)

    def close(self) -> None:
        self._events.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            event = self._events.get()
            if event is None:
                return
            try:
                event.synchronize()
            except Exception:  # the device failed: the loop's next step reports it
                pass
            if self._waiting is event:
                self._waiting = None
            self._wake()
