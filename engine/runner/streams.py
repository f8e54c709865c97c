"""The CUDA streams one model's steps run on, so several models' steps run side by side.

With every model on one stream, a quiet model's prefill queued behind a flooded model's step
already in flight, and behind the one launched ahead of it (asynchronous steps): its TTFT was two
of the other model's steps plus its own. Each runner has two streams of its own, one at the
device's lowest priority and one at its highest; the core launches a step on the urgent one when
its model is the least loaded of those with work (engine.core.engine_core), so the GPU's block scheduler
hands that step's blocks out first while the other model's kernels drain.

Ordering rules, all by stream waits (no host sync):
- every launch waits for the caller's current stream: what a load, a pool resize or a capture
  queued there (weights, zeroed pages, input buffers) comes before the step;
- a launch on the other stream of the same runner waits for the last one, and the device ids it
  carries over (the previous step's sampled ids, read by placeholder fills) are recorded on the
  new stream, so the caching allocator does not hand their memory out while it is still read.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from engine.runner.capture_gate import CaptureGate


# A lower number is a higher priority; torch maps one beyond the device's range to its highest.
URGENT_PRIORITY = -64


class StreamPool:
    """Streams lent to the runners of one device, taken back when their borrower is collected.

    cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has run a matmul on, for the
    life of the process, outside anything a model owns. With a fresh stream per load (the step
    streams, each graph set's capture stream, the load thread's) every load/unload cycle left
    32-96 MiB of device memory behind (docs/perf.md, the memory probe row). A lent stream goes back to the
    pool when the object that borrowed it is collected, and the next runner reuses it, workspace
    included, so the workspaces stop at the number of models loaded at once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[int, list[torch.cuda.Stream]] = {}
        self.created = 0
        # The device's capture gate travels with the pool every runner and graph set already
        # holds (engine/runner/capture_gate.py): the loader shuts it, the graph sets read it.
        self.gate = CaptureGate()

    def take(self, borrower: object, priority: int = 0) -> torch.cuda.Stream:
        """A stream of ``priority`` for as long as ``borrower`` lives. Safe from several threads
        (a list's pop and append are atomic)."""
        free = self._free.setdefault(priority, [])
        try:
            stream = free.pop()
        except IndexError:
            stream = torch.cuda.Stream(device=self.device, priority=priority)
            self.created += 1
        weakref.finalize(borrower, free.append, stream)
        return stream


class StepStreams:
    """A runner's normal and urgent streams on ``device`` and the one its last step used."""

    def __init__(self, device: torch.device, pool: StreamPool) -> None:
        """``pool``: the core's, shared by its runners (the streams go back to it with this object)."""
        self.device = device
        self.normal = pool.take(self, 0)
        self.urgent = pool.take(self, URGENT_PRIORITY)
        self.last: torch.cuda.Stream | None = None
        self.urgent_steps = 0

    def enter(self, urgent: bool, carried: torch.Tensor | None) -> torch.cuda.Stream:
        """The stream for the next step, ordered after the caller's stream and the last step."""
        s = self.urgent if urgent else self.normal
        s.wait_stream(torch.cuda.current_stream(self.device))
        if self.last is not None and self.last is not s:
            s.wait_stream(self.last)
            if carried is not None:
                carried.record_stream(s)
        self.last = s
        self.urgent_steps += 1 if urgent else 0
        return s

    def wait(self) -> None:
        """Block until every step launched on this runner's streams has run."""
        self.normal.synchronize()
        self.urgent.synchronize()

    @contextlib.contextmanager
    def on_last(self) -> Iterator[None]:
        """Run work that belongs after the last step (a deferred capture, logprobs) on its stream."""
        if self.last is None:
            yield
            return
        with torch.cuda.stream(self.last):
            yield
