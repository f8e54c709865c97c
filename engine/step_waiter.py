"""Wakes a selector loop when a parked step's ids are ready (:meth:`engine.core.EngineCore.parked`).

While a quiet model is active the busy model's next step waits for its step in flight, and
``step()`` returns instead of blocking on it. The loop must then sleep until either that step is
done or a new request arrives; a CUDA event cannot be selected on, so one thread waits on it
(a blocking-sync event: the thread sleeps, no core spins) and writes a byte to the loop's wake-up
pipe when it fires. One wait at a time: the loop hands over the next event only after the last.
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
        self._thread = threading.Thread(target=self._run, name="engine-step-waiter", daemon=True)
        self._thread.start()

    def watch(self, event: Any) -> None:
        """Wake the loop once ``event`` (a ``torch.cuda.Event``) has fired."""
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
            self._wake()
