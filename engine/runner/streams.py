"""The CUDA streams the models' steps run on, so a quiet model's step goes out beside a busy one's.

With every model on one stream, a quiet model's prefill queued behind a flooded model's step
already in flight, and behind the one launched ahead of it (asynchronous steps): its TTFT was two
of the other model's steps plus its own. The device has two step streams, one at its lowest
priority and one at its highest, shared by every runner; the core launches a step on the urgent
one when its model is the least loaded of those with work (engine.core.engine_core), so the GPU's
block scheduler hands that step's blocks out first while the other model's kernels drain.

Why two for the device and not two per model: the caching allocator keeps a freed block for the
stream it was allocated on. An eager step's activations (a prompt-logprobs step, a bucket whose
graph is not captured) are freed into its stream's cache once it is launched and stay there, of
use to later steps on that stream only; with streams per model, N models could keep 2N steps'
activations cached beyond the books (engine/core/ledger.py books two steps of the largest for all
models), and every stream held a cuBLAS workspace (32 MiB on Hopper) of its own. Shared, what the
steps leave cached is at most two steps' worth whatever the number of models. What per-model
streams gave beyond the urgent one: two non-urgent models' steps overlapping on the device (the
one in flight and the one launched behind it), now queued one after the other on the normal
stream: both read their weights at the device's bandwidth, so overlapping them bought little.

Ordering rules, all by stream waits (no host sync):
- every launch waits for the caller's current stream: what a load, a pool resize or a capture
  queued there (weights, zeroed pages, input buffers) comes before the step;
- a launch on the other stream than a runner's last one waits for the runner's own work there
  (an event it records after each of its steps, not the stream whole: that holds other models'
  steps too), and the device ids it carries over (the previous step's sampled ids, read by placeholder fills) are recorded on the
  new stream, so the caching allocator does not hand their memory out while it is still read.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

from engine.runner.capture_gate import CaptureGate


# A lower number is a higher priority; torch maps one beyond the device's range to its highest.
URGENT_PRIORITY = -64


class StreamPool:
    """The device's two step streams (:meth:`step_streams`), and streams lent to the graph sets,
    runner builds and loads of one device, taken back when their borrower is collected.

    cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has run a matmul on, for the
    life of the process, outside anything a model owns. With a fresh stream per load (then its step
    streams, each graph set's capture stream, the load thread's) every load/unload cycle left
    32-96 MiB of device memory behind (docs/perf.md, the memory probe row). A lent stream goes back
    to the pool when the object that borrowed it is collected, and the next borrower reuses it,
    workspace included, so the workspaces stop at the number of models loaded at once (and the
    step streams' two).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[int, list[torch.cuda.Stream]] = {}
        self.created = 0
        self._steps: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._lock = threading.Lock()
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

    def step_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The device's (normal, urgent) step streams, the same pair for every runner: made at the
        first ask (runners are built on the stepping thread and on build threads)."""
        with self._lock:
            if self._steps is None:
                self._steps = (torch.cuda.Stream(device=self.device, priority=0),
                               torch.cuda.Stream(device=self.device, priority=URGENT_PRIORITY))
                self.created += 2
            return self._steps


class StepStreams:
    """The device's normal and urgent step streams as one runner uses them: the one its last step
    went on, and how many of its steps were urgent."""

    def __init__(self, device: torch.device, pool: StreamPool) -> None:
        """``pool``: the core's, shared by its runners."""
        self.device = device
        self.normal, self.urgent = pool.step_streams()
        self.last: torch.cuda.Stream | None = None
        # Recorded on ``last`` where this runner's work queued so far ends (:meth:`done`).
        self._done = torch.cuda.Event()
        self.urgent_steps = 0

    def enter(self, urgent: bool, carried: torch.Tensor | None) -> torch.cuda.Stream:
        """The stream for the next step, ordered after the caller's stream and the runner's own
        work on the other one. The caller marks where its work ends with :meth:`done`."""
        s = self.urgent if urgent else self.normal
        s.wait_stream(torch.cuda.current_stream(self.device))
        if self.last is not None and self.last is not s:
            # This runner's work, not the whole stream: the streams are shared, and a quiet model's
            # urgent step that waited for the normal stream whole would queue behind the busy
            # model's steps there (0.76 s for a 0.75 s step on an H100; its own work: 0).
            s.wait_event(self._done)
            if carried is not None:
                carried.record_stream(s)
        self.last = s
        self.urgent_steps += 1 if urgent else 0
        return s

    def done(self) -> None:
        """Mark the end of this runner's work queued so far on its last stream."""
        if self.last is not None:
            self._done.record(self.last)

    def wait(self) -> None:
        """Block until this runner's work marked by :meth:`done` has run."""
        if self.last is not None:
            self._done.synchronize()

    @contextlib.contextmanager
    def on_last(self) -> Iterator[None]:
        """Run work that belongs after the last step (a deferred capture, logprobs) on its stream."""
        if self.last is None:
            yield
            return
        try:
            with torch.cuda.stream(self.last):
                yield
        finally:
            self.done()
