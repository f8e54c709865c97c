"""engine/core/heap.py: what is frozen is skipped by plain collections and freed by collect()."""

from __future__ import annotations

import gc
import weakref

from engine.core import heap


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_frozen_cycle_outlives_a_plain_collection_and_collect_frees_it():
    gc.collect()
    ref = _cycle()  # unreachable already, but only the cycle collector can free it
    heap.freeze()
    try:
        gc.collect()
        assert ref() is not None  # frozen: no collection walks it
        assert heap.collect() >= 2
        assert ref() is None
        assert gc.get_freeze_count() > 0  # what survived is frozen again
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0


def test_objects_made_after_a_freeze_are_collected_as_usual():
    heap.freeze()
    try:
        ref = _cycle()
        gc.collect()
        assert ref() is None
    finally:
        heap.thaw()
