"""A model's runner (its CUDA graphs) built while its weights are still being copied in.

On a reload from the warm tier the weights are one PCIe copy (~0.3 s for 16 GB) and building
the runner (buffers, graph warm-up and capture, ~0.15-0.3 s of host time) used to follow it; on a
restart's load from the page cache the weights take ~1 s and the runner (its Triton kernels
loaded from their cache in a fresh process) 1.0-1.4 s.
Capturing needs the weights' addresses, not their values, so the load thread starts this build
as soon as the model's tensors are allocated and restores the weights beside it; the graphs'
warm-up runs read half-copied weights, which only makes their (discarded) outputs garbage: the
decode graphs' sampling is an argmax, which no value can make fail.

Used only when the load skips its measured warm-up (the warm tier or the load notes on disk
hold this model's workspace figure at this shape): a fresh measurement must see the runner's
graph memory, and runs after the weights. The build runs on its own stream and thread; a capture there is thread-local, so
the caller's thread keeps stepping other models. Its result is checked against the pool's
``generation`` at install: a resize in between rebuilds the runner on the new memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.errors import EngineError
from engine.runner.streams import StreamPool

log = logging.getLogger(__name__)


def prebuild_wanted(device: torch.device, known_workspace: object | None, allow_cpu: bool = False) -> bool:
    """Whether a load builds its runner beside the weights: when the workspace figure of these
    weights at this shape is known (the warm tier's note, or the load notes kept on disk from an
    earlier process), so the load skips its warm-up. Only on CUDA, unless ``allow_cpu`` (CPU
    tests of the overlap)."""
    return known_workspace is not None and (device.type == "cuda" or allow_cpu)


class RunnerBuild:
    """``make()`` run on a thread of its own, on CUDA under a stream lent by the core's pool;
    :meth:`result` joins it and returns what ``make`` returned, or None when it failed (the
    caller builds the runner the usual way then; the failure is logged)."""

    def __init__(self, make: Callable[[], Any], device: torch.device, name: str,
                 streams: StreamPool | None) -> None:
        """``streams``: the core's stream pool; required on CUDA (None elsewhere)."""
        if device.type == "cuda" and streams is None:
            raise EngineError("a runner build on CUDA needs the core's stream pool")
        self._result: Any = None
        self._streams = streams
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(make, device), name=f"engine-runner-{name}",
                                        daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], Any], device: torch.device) -> None:
        t0 = time.perf_counter()
        try:
            with contextlib.ExitStack() as ctx:
                if device.type == "cuda":
                    ctx.enter_context(torch.cuda.device(device))
                    stream = self._streams.take(self)
                    stream.wait_stream(torch.cuda.current_stream(device))  # the rope cache built there
                    ctx.enter_context(torch.cuda.stream(stream))
                result = make()
                if device.type == "cuda":
                    # Its buffers were initialised on this stream: done before anyone uses them.
                    torch.cuda.current_stream(device).synchronize()
            self._result = result
        except Exception as e:  # any failure: the install builds the runner itself
            self.error = e
            log.warning("building the runner beside the weights failed (%s); it is built after them", e)
        self.seconds = time.perf_counter() - t0

    def result(self) -> Any:
        self._thread.join()
        result, self._result = self._result, None
        return result
