"""Wakes a selector loop when a yielded step's ids are ready (:meth:`engine.core.engine_core.EngineCore.yielded`).

While a quiet model is active the busy model's next step waits for its step in flight, and
``step()`` returns instead of blocking on it. The loop must then sleep until either that step is
done or a new request arrives; the step's completion cannot be selected on, so one thread calls
its ``wait()`` (on CUDA a blocking-sync event: the thread sleeps, no core spins) and writes a byte
to the loop's wake-up pipe when it returns. The loop hands the yielded step over on every pass
while it stays yielded (each request that arrives meanwhile is a pass); a step already being
waited on is not queued again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol


class Waitable(Protocol):
    """What :meth:`EngineCore.yielded` returns: ``wait()`` blocks until the step's ids are in."""

    def wait(self) -> None: ...


class StepWaiter:
    """A daemon thread that waits on the yielded steps it is given and calls ``wake`` after each."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._events: queue.SimpleQueue[Waitable | None] = queue.SimpleQueue()
        self._waiting: Waitable | None = None  # the step handed over last, until its wake-up is sent
        self._thread = threading.Thread(target=self._run, name="engine-step-waiter", daemon=True)
        self._thread.start()

    def watch(self, step: Waitable) -> None:
        """Wake the loop once ``step.wait()`` has returned."""
        if step is self._waiting:
            return
        self._waiting = step
        self._events.put(step)

    def close(self) -> None:
        self._events.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            event = self._events.get()
            if event is None:
                return
            try:
                event.wait()
            except Exception:  # the device failed: the loop's next step reports it
                pass
            if self._waiting is event:
                self._waiting = None
            self._wake()
