"""Decode CUDA graphs: one graph per batch bucket, captured at model load, replayed for decode steps.

A decode-only step (every sequence one token, all sampling) is padded by the runner to the
smallest bucket ≥ its batch (:meth:`engine.runner.model_runner.ModelRunner.prepare` with ``pad_to``):
the inputs land in prefixes of the runner's persistent buffers, which are exactly the tensors
each graph was captured on. A graph holds the model forward, the LM head on every row of the
bucket, and the greedy argmax; a step with sampling rows runs the sampler eagerly on the graph's
logits. Mixed prefill+decode steps never come here.

Capture: the Triton kernels and cuBLAS are warmed up eagerly at the largest and the smallest
bucket first (compiles and workspace allocations cannot happen inside a capture; every kernel
shape constant is a model constant, so two warm-ups reach every compiled variant: the decode
reduce only runs when a bucket is small enough to split), then the largest bucket and the
buckets not deferred are captured, largest first, into one shared memory pool, so the smaller
graphs reuse the largest one's activations. Deferred buckets (the runner defers those above
``INFIRE_GRAPHS_AT_LOAD_MAX``) are captured into the same pool by :meth:`DecodeGraphs.capture_deferred`
just before the first step that needs them. Captures use ``CUDAGraph.capture_begin/end`` on a
side stream, without ``torch.cuda.graph``'s synchronize + gc + empty_cache per graph. Decode attention is captured with ``max_seq_len = max_model_len``, which is valid
for every replay whose sequences are no longer (docs/kernels.md, "CUDA graphs").

Padding rows (slot -1, one token at position 0 of page 0) write nothing and are never read back.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import EngineError

if TYPE_CHECKING:  # the runner imports this module
    from engine.runner.model_runner import ModelRunner
    from engine.runner.streams import StreamPool

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CudaGraphError(EngineError):
    """Capturing or replaying a decode graph failed."""


def set_triton_cache_dir(cache_dir: str | os.PathLike) -> str:
    """Point Triton's compile cache at ``<cache_dir>/triton`` unless TRITON_CACHE_DIR is already set.

    Call before the first kernel compiles (the worker does it at start), so a restart finds
    every kernel compiled. Returns the directory in effect.
    """
    current = os.environ.get("TRITON_CACHE_DIR")
    if current:
        return current
    path = Path(cache_dir) / "triton"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return str(path)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] float32, written by each replay
    ids: torch.Tensor  # [bucket] int64 greedy ids, written by each replay


class GraphSet:
    """Graphs of one runner by bucket, in one memory pool, some deferred to their first use.

    A subclass gives ``_fill_padding(r, b)`` (the inputs a capture runs on), ``_forward(r, b)``
    (what is recorded; its outputs are kept) and ``_keep(b, graph, outputs)``."""

    kind = "graph"

    def __init__(self, device: torch.device, pool=None, streams: "StreamPool | None" = None) -> None:
        if device.type != "cuda":
            raise CudaGraphError(f"{self.kind}s need a CUDA device")
        self.device = device
        self.capture_seconds = 0.0  # at load (warm-ups excluded)
        self.warmup_seconds = 0.0
        self.deferred: set[int] = set()  # buckets captured at their first use instead of at load
        self.deferred_capture_seconds = 0.0
        self._pool = pool
        self._streams = streams
        self._stream: torch.cuda.Stream | None = None

    def _capture_stream(self) -> torch.cuda.Stream:
        """The side stream captures record on: one per graph set, lent by the runner's pool
        (engine/runner/streams.py: every new stream costs a cuBLAS workspace for good)."""
        if self._stream is None:
            self._stream = (self._streams.take(self) if self._streams is not None
                            else torch.cuda.Stream(device=self.device))
        return self._stream

    def _capture_one(self, r: "ModelRunner", b: int) -> None:
        """One bucket into the shared pool. Unlike ``torch.cuda.graph`` no synchronize, gc or
        empty_cache per graph: the inputs are written on the current stream before the capture
        stream starts recording, and nothing executes while it records. Thread-local mode: other
        threads' CUDA calls (a load thread's copies, NCCL's watchdog polling its events under
        tensor parallelism) must neither fail nor abort the capture; only this thread's work is
        recorded in either mode."""
        self._fill_padding(r, b)
        g = torch.cuda.CUDAGraph()
        self._capture_stream().wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            if self._pool is None:
                g.capture_begin(capture_error_mode="thread_local")
            else:
                g.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                outputs = self._forward(r, b)
            finally:
                g.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if self._pool is None:
            self._pool = g.pool()
        self._keep(b, g, outputs)

    def _warm(self, r: "ModelRunner", order: list[int]) -> None:
        """Run the largest and smallest bucket eagerly first: Triton compiles and cuBLAS
        workspace allocations cannot happen inside a capture (every kernel constant is a model
        constant, so two sizes reach every compiled variant)."""
        for b in sorted({order[0], order[-1]}, reverse=True):
            self._fill_padding(r, b)
            self._forward(r, b)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture_deferred(self, r: "ModelRunner", bucket: int) -> None:
        """Capture a deferred bucket now (the runner calls this before preparing the step that
        needs it, since a capture writes padding into the input buffers)."""
        if bucket not in self.deferred:
            return
        self.deferred.discard(bucket)
        t = time.perf_counter()
        try:
            self._capture_one(r, bucket)
        except RuntimeError as e:
            raise CudaGraphError(f"{self.kind} capture of bucket {bucket} failed: {e}") from e
        self.deferred_capture_seconds += time.perf_counter() - t

    def _fill_padding(self, r: "ModelRunner", bucket: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _forward(self, r: "ModelRunner", bucket: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def _keep(self, bucket: int, graph: torch.cuda.CUDAGraph, outputs) -> None:  # pragma: no cover
        raise NotImplementedError


class DecodeGraphs(GraphSet):
    """The captured decode graphs of one runner, by batch bucket."""

    kind = "decode graph"

    def __init__(self, device: torch.device, streams: "StreamPool | None" = None) -> None:
        super().__init__(device, streams=streams)
        self.graphs: dict[int, _Graph] = {}

    def _keep(self, bucket: int, graph: torch.cuda.CUDAGraph, outputs) -> None:
        self.graphs[bucket] = _Graph(graph, *outputs)

    @staticmethod
    def _fill_padding(r: "ModelRunner", bucket: int) -> None:
        """The padded-decode inputs a capture runs on: every row a padding row."""
        r._input_ids[:bucket].zero_()
        r._positions[:bucket].zero_()
        r._slots[:bucket].fill_(-1)
        r._qsl[:bucket + 1].copy_(torch.arange(bucket + 1, dtype=torch.int32, device=r.device))
        r._seq_lens[:bucket].fill_(1)
        r._block_tables[:bucket].zero_()

    @staticmethod
    def _forward(r: "ModelRunner", bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = r.decode_meta(bucket)
        hidden = r.model(r._input_ids[:bucket], r._positions[:bucket], r.kv, meta)
        logits = r.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self, r: "ModelRunner", buckets: tuple[int, ...], defer: tuple[int, ...] = ()) -> None:
        """Warm up, then capture every bucket of runner ``r`` (largest first, one shared pool)
        except those in ``defer``, which :meth:`capture_deferred` captures at their first use.

        The graphs keep no reference to the runner (no cycle: an unloaded model's memory goes
        when its runner does)."""
        if not buckets:
            return
        order = sorted(set(buckets), reverse=True)
        t0 = time.perf_counter()
        self._warm(r, order)
        t1 = time.perf_counter()
        self._capture_stream()
        now = [b for b in order if b not in set(defer) or b == order[0]]
        self.deferred = {b for b in order if b not in now}
        try:
            for b in now:
                self._capture_one(r, b)
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            self.graphs.clear()
            self.deferred.clear()
            raise CudaGraphError(f"decode graph capture failed: {e}") from e
        self.warmup_seconds = t1 - t0
        self.capture_seconds = time.perf_counter() - t1

    def replay(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the bucket's graph on the inputs already in the runner's buffers: (logits, ids)."""
        g = self.graphs.get(bucket)
        if g is None:
            raise CudaGraphError(f"no decode graph for batch {bucket}")
        g.graph.replay()
        return g.logits, g.ids
