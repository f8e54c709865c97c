"""Long-lived objects kept out of the cycle collector's walks.

A worker holds a few hundred thousand Python objects that live until an unload or for good
(torch's and Triton's modules, each model, its graphs and kernel launchers); the agent, its
framework's. Python's cycle collector walks its oldest generation — all of them — whenever
enough younger objects have survived, and a busy process makes and drops a step's worth of
outputs every few ms: a full collection costs ~70 ms on a loaded worker. On this repository's
CPU box, a loop making and dropping 200 small output objects a step with torch imported (166k
objects) spent 37 % of its time in collections, 16 % with them frozen, and ran 1.8× faster
(``python -m ops.bench.host_costs``, docs/perf.md).

:func:`freeze` moves every object that exists now to the permanent generation, which no
collection walks (``gc.freeze``, O(1)): a process calls it once started and after each load.
:func:`collect` is the full collection an unload or a pool resize runs to free device memory a
reference cycle may hold: a frozen cycle is never collected, so it thaws everything first,
collects, then freezes what is left. :func:`thaw` undoes :func:`freeze` (a process that
outlives what it froze: tests running an app in process).
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Leave every object that exists now out of later collections."""
    gc.freeze()


def thaw() -> None:
    """Let every frozen object be collected again (an app torn down inside a longer process)."""
    gc.unfreeze()


def collect() -> int:
    """A full collection, frozen objects included (they are frozen again after); the number of
    unreachable objects found."""
    gc.unfreeze()
    try:
        return gc.collect()
    finally:
        gc.freeze()
