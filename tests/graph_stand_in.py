"""A runner's CUDA graph set stood in for where graphs cannot be captured (CPU) or where a test
wants the eager twin of a captured graph (GPU): the real :class:`GraphSet` bookkeeping (buckets
deferred to first use, cascade variants captured by ``ready`` on a step's staged inputs), with a
'capture' that only records it and a 'replay' that runs eagerly the
forward a capture records (``_forward`` of the kind stood in for) on the runner's buffers.

``events`` lists ``("capture", bucket, cascade)`` and ``("replay", bucket, cascade)`` in order;
``staged`` the buckets captured on a step's staged inputs."""

from __future__ import annotations

import torch

from engine.runner.capture_gate import CaptureGate
from engine.runner.cuda_graphs import GraphSet


class StandInGraphs(GraphSet):
    def __init__(self, runner, kind: type[GraphSet], buckets, deferred=(), gate: CaptureGate | None = None,
                 fail: set[int] | None = None) -> None:
        """``kind``: DecodeGraphs or MixedGraphs; ``buckets`` 'captured' now except ``deferred``;
        ``gate``: the device's capture gate (an open one of its own by default); ``fail``: buckets
        whose capture raises as the driver's invalidated capture does."""
        # no GraphSet.__init__: it refuses a device without CUDA and makes a capture stream
        self.kind, self._forward = kind.kind, kind._forward
        self.bufs, self.model, self.kv = runner.bufs, runner.model, runner.kv
        self.deferred, self.cascade_failed, self.failed = set(deferred), set(), {}
        self.gate = gate if gate is not None else CaptureGate()
        self._fail = fail or set()
        self.graphs = {b: None for b in buckets if b not in self.deferred}
        self.cascade_graphs = {}
        self.deferred_capture_seconds = 0.0
        self.events: list[tuple[str, int, bool]] = []
        self.staged: list[int] = []  # buckets captured on a step's staged inputs

    def _capture_one(self, b: int, cascade: bool = False, staged: bool = False) -> None:
        if b in self._fail:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.events.append(("capture", b, cascade))
        if staged:
            self.staged.append(b)
        (self.cascade_graphs if cascade else self.graphs)[b] = None

    def replay(self, bucket: int, cascade: bool = False):
        assert bucket in (self.cascade_graphs if cascade else self.graphs), (bucket, cascade)
        self.events.append(("replay", bucket, cascade))
        with torch.inference_mode():
            return self._forward(self.bufs, self.model, self.kv, bucket, cascade)

    @property
    def replayed(self) -> list[int]:
        """The buckets replayed, in order."""
        return [b for kind, b, _ in self.events if kind == "replay"]
