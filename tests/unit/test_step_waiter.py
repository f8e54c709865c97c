"""The worker's loop while a step is yielded (EngineCore.yielded): it sleeps in its selector until
the yielded step's event fires (a waiter thread writes to the wake-up pipe) or a request comes,
instead of spinning on step() calls."""

from __future__ import annotations

import os
import select
import threading

from engine.worker.step_waiter import StepWaiter
from engine.worker.main import STATUS_INTERVAL_S, Worker


class _Event:
    """Stands in for EngineCore.yielded()'s step: wait() returns once fire() was called."""

    def __init__(self) -> None:
        self._fired = threading.Event()

    def fire(self) -> None:
        self._fired.set()

    def wait(self) -> None:
        self._fired.wait(10)


class _Core:
    def __init__(self, event) -> None:
        self.event = event

    def yielded(self):
        return self.event

    def has_unfinished_requests(self) -> bool:
        return True


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_a_yielded_step_lets_the_loop_sleep_until_its_event_fires():
    event = _Event()
    w = Worker(conn=None, core=_Core(event))
    try:
        assert w._wait_for(w._busy()) == STATUS_INTERVAL_S  # yielded: sleep, the waiter wakes the loop
        assert not _readable(w._wake_r, 0.2)  # nothing yet: the step is still running
        event.fire()
        assert _readable(w._wake_r, 5)  # done: the loop wakes to collect it
        w._drain_wake()
        w.core.event = None  # not yielded, work left: poll without sleeping
        assert w._wait_for(w._busy()) == 0
    finally:
        w._waiter.close()
        os.close(w._wake_r)
        os.close(w._wake_w)


def test_the_waiter_wakes_once_per_event_in_order():
    woke: list[int] = []
    done = threading.Event()
    waiter = StepWaiter(lambda: (woke.append(len(woke)), len(woke) == 2 and done.set()))
    first, second = _Event(), _Event()
    waiter.watch(first)
    waiter.watch(second)
    second.fire()
    assert not done.wait(0.1) and woke == []  # the first is still pending
    first.fire()
    assert done.wait(5) and woke == [0, 1]
    waiter.close()
