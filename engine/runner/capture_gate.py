"""Whether a serving step may capture a CUDA graph now: never while a load thread works on the device.

A capture records its own thread's launches, but the driver judges some calls of *other* threads
against it, and the failure lands on whichever side is unlucky. On the H200, twelve bf16 8Bs
swapping under traffic (the allocator at the budget, so a load's allocations free cached
segments): deferred mixed-step captures on the stepping thread failed
(``cudaErrorStreamCaptureInvalidated``), and the load thread beside them failed its own work
(``cudaErrorStreamCaptureIsolation``, ``cudaErrorCapturedEvent``) — 114 of 431 requests lost in
120 s (docs/perf.md, density bf16 at 187541c). No single call was to blame that we could point
at; the cure is by construction instead: the loader shuts the gate on the stepping thread before
its load thread starts and opens it from that thread once the thread's device work is over
(weights, rope cache, a prebuilt runner), and a step that would capture a deferred graph or a
cascade variant while it is shut runs the same forward eagerly (a few ms of host time) and leaves
the capture to a later step. Captures at load need no gate: a load beside other models builds
its runner on the stepping thread after its thread is done, and one that prebuilds on its thread
does so only while no other model is on the engine.

One load runs at a time (``ModelLoader.begin_load``), so the gate is a flag, not a count; it is
read on the stepping thread and written by the loader's two threads (a bool store is atomic).
"""

from __future__ import annotations


class CaptureGate:
    """Shut while a load thread may launch device work; steps capture only while it is open."""

    def __init__(self) -> None:
        self._shut_for: str | None = None

    @property
    def open(self) -> bool:
        return self._shut_for is None

    @property
    def shut_for(self) -> str | None:
        """The model whose load holds the gate shut (None: open)."""
        return self._shut_for

    def shut(self, model: str) -> None:
        """Before ``model``'s load thread starts (on the stepping thread)."""
        self._shut_for = model

    def reopen(self) -> None:
        """Once the load thread launches nothing more (on that thread, or where it failed to start)."""
        self._shut_for = None
