"""The cycle collector is held off while a CUDA graph records (engine/runner/cuda_graphs.py
``no_collection``): a finalizer run by a collection on the capturing thread may make a CUDA call
that invalidates the capture. Captures on two threads nest; the collector's own state comes back."""

from __future__ import annotations

import gc
import threading

from engine.runner.cuda_graphs import no_collection


def test_the_collector_is_off_until_the_last_capture_ends_across_threads() -> None:
    assert gc.isenabled()
    inside, release, seen = threading.Event(), threading.Event(), []

    def other_capture() -> None:
        with no_collection():
            inside.set()
            release.wait(10)
            seen.append(gc.isenabled())

    t = threading.Thread(target=other_capture)
    with no_collection():
        t.start()
        assert inside.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # this capture ended; the other thread's still records
    release.set()
    t.join(10)
    assert seen == [False] and gc.isenabled()


def test_a_collector_disabled_before_stays_disabled_and_an_error_still_releases() -> None:
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    try:
        with no_collection():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()


def test_no_cycle_is_collected_automatically_while_held() -> None:
    """What the hold is for: with thresholds that would collect at once, a cycle with a finalizer
    is not finalized inside the held region, and is at the next collection after it."""
    ran = []

    class Node:
        def __del__(self) -> None:
            ran.append(1)

    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1, 1, 1)
    try:
        with no_collection():
            a, b = Node(), Node()
            a.other, b.other = b, a
            del a, b
            junk = [[i] for i in range(1000)]  # allocations past every threshold
            del junk
            assert ran == []
        gc.collect()
        assert ran == [1, 1]
    finally:
        gc.set_threshold(*old)
