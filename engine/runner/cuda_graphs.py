"""The CUDA graphs of a runner's steps: decode graphs by batch bucket, mixed-step graphs by token
bucket, both captured on the runner's :class:`~engine.runner.step_buffers.StepBuffers` and
replayed on whatever a step wrote there.

**Decode graphs.** A decode-only step (every sequence one token, all sampling) is padded by the
runner to the smallest bucket ≥ its batch (:meth:`engine.runner.model_runner.ModelRunner.prepare`
with ``pad_to``): the inputs land in prefixes of the persistent buffers, which are exactly the
tensors each graph was captured on. A graph holds the model forward, the LM head on every row of
the bucket, and the greedy argmax, written into the step buffers' one pair (``graph_outputs()``)
(every graph's outputs, instead of outputs kept per bucket); a step with sampling rows runs the
sampler eagerly on the graph's logits. Mixed prefill+decode steps never use them.

Capture: the Triton kernels and cuBLAS are warmed up eagerly at the largest and the smallest
bucket first (workspace allocations cannot happen inside a capture; the decode reduce's block
follows the split count, so buckets between compile theirs inside their capture, at load), then
the largest bucket and the buckets not deferred are captured, largest first, into one shared memory pool, so the smaller
graphs reuse the largest one's activations. Deferred buckets (the runner defers those above
``engine.runner.model_runner.GRAPHS_AT_LOAD_MAX``) are captured into the same pool by
:meth:`GraphSet.capture_deferred` just before the first step that needs them. Captures use
``CUDAGraph.capture_begin/end`` on a side stream, without ``torch.cuda.graph``'s synchronize + gc
+ empty_cache per graph. Decode attention is captured with ``max_seq_len = max_model_len``, which
is valid for every replay whose sequences are no longer (docs/kernels.md, "CUDA graphs").

Padding rows (slot -1, one token at position 0 of page 0) write nothing and are never read back.

**Cascade variants.** A bucket whose steps can carry a cascade plan (engine/runner/cascade.py: 16
rows and more, on the Triton kernels; every mixed bucket then) may get a second graph that
launches the cascade kernel over the plan's static tile grid and merges it. The warm-up runs the
cascade forward too (at one bucket of each form the decode kernels take: unsplit, and split with
the reduce's block over the splits), so its kernels are compiled at load, and a variant is then
captured by the first step that needs it, on that step's staged inputs (a capture runs nothing,
so they survive it), and replayed at once. A workload that shares nothing never captures one,
and loads capture no more than before (on the H200 capturing both variants of every bucket
doubled the deferred captures' time in a c200 run, 0.54 → 1.60 s). Before, the first step of
each bucket with a plan ran eagerly to compile them (23 eager steps, ~0.8 s of a 27.5 s
shared-prompt c200 run on the H200; docs/perf.md).

**Mixed-step graphs**: the model forward of any step of up to a bucket of tokens, replayed.
Under steady serving load nearly every step is *mixed*: the running sequences' decodes plus a
chunk of a newly arrived prompt. Run eagerly such a step costs ~14 ms of host time for ~400
kernel launches on an 8B model, more than the GPU needs for it, so the GPU waits on Python.
These graphs remove that cost for steps of up to ``max(buckets)`` tokens.

What makes one graph valid for every mix of sequences at its token bucket ``N``: every kernel's
grid depends only on ``N`` and on the runner's ``max_num_seqs`` (fixed per runner), and the
batch layout is read from device buffers at replay. Attention runs two kernels over all
``max_num_seqs`` sequence slots, each taking the rows that are its own by their query length
read on the device: the decode kernel the one-token queries (grid ``max_num_seqs`` × KV heads ×
the splits for ``max_model_len``), the prefill kernel the longer ones (``cdiv(N, TPT) +
max_num_seqs`` work items, each locating its sequence by a binary search over
``query_start_loc``). The runner fills ``query_start_loc`` for all ``max_num_seqs`` entries
(unused sequences are empty and their work items exit at once), the block tables at full width,
and pads the tokens to ``N`` with slot -1 (no KV write). Padding tokens belong to no sequence:
their rows carry garbage through row-wise ops only (linear layers, norms, RoPE, activation) and
are never sampled.

A mixed graph holds the forward, the gather of the rows to sample (``bufs.rows``, padded to
``min(N, max_num_seqs)`` with row 0), the LM head on them and the greedy picks; the sampler
runs on its logits as on a decode graph's. The LM head was eager once (only the sampled rows):
on the H200 each eager cuBLAS call spun ~1 ms in the driver (``cuKernelSetAttribute`` under
``cublasLtMatmul``, py-spy --native over the c200 serve bench at 79d127b), ~10 % of the worker's
CPU, for a GEMM that in the graph costs at most ~0.2 ms more at 256 rows than at the rows
sampled. Mixed graphs share the decode graphs' memory pool: they replay one at a time. The
largest bucket is captured at load (so the load's measured workspace includes the pool's size);
the others at their first use.

The graph sets keep no reference to the runner (no cycle: an unloaded model's memory goes when
its runner does): they hold the buffers, the model and its KV cache.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import EngineError
from engine.kv.kv_cache import KVCache
from engine.runner.step_buffers import StepBuffers

if TYPE_CHECKING:
    from engine.runner.streams import StreamPool

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# Token buckets of the mixed-step graphs: dense where serving steps live (the running batch plus
# one prompt chunk).
DEFAULT_MIXED_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                         1280, 1536, 1792, 2048)


class CudaGraphError(EngineError):
    """Capturing or replaying a step graph failed."""


class _CollectorHold:
    """Python's cycle collector held off while any capture records. A collection runs on whichever
    thread allocates past its threshold, the capturing one included, and runs the finalizers of
    what it frees there: a warm tier's arena unregistering its pages (``cudaHostUnregister``), a
    graph or stream of an unloaded model. Such a call on a capturing thread invalidates the
    capture ("operation failed due to a previous error during capture"), at random, as the
    thresholds fall: tests/gpu failed once so (docs/perf.md, 2d889af) where the same test had
    passed an hour before. Counted, because captures run on two threads (the loop's deferred
    ones, a load thread's runner build); the collector's own state before the first hold is
    restored after the last. Garbage waits a capture's length (milliseconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holds == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                if self._holds == 0 and self._was_enabled:
                    gc.enable()


no_collection = _CollectorHold()


def _stop_recording(device: torch.device, pool) -> None:
    """After a capture whose end failed (the driver invalidated it): stop the allocator sending
    allocations to the graphs' pool, which torch leaves on when the end raises, so the set's next
    capture can begin (it would fail "already recording to mempool_id")."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        try:
            end(device.index if device.index is not None else torch.cuda.current_device(), pool)
        except RuntimeError as e:  # not recording (torch ended it after all): nothing to undo
            log.debug("graph pool %s: %s", pool, e)


def _sampled_outputs(bufs: StepBuffers, model: Any, hidden: torch.Tensor,
                     rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head of ``rows`` hidden rows and their greedy picks into the buffers' graph
    outputs; the two prefixes."""
    logits_buf, ids_buf = bufs.graph_outputs()
    logits = model.compute_logits(hidden, out=logits_buf[:rows])
    ids = ids_buf[:rows]
    ids.copy_(logits.argmax(dim=-1))
    return logits, ids


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, vocab] float32, a prefix of the buffers' logits, written by each replay
    ids: torch.Tensor  # [rows] int64 greedy ids, a prefix of the buffers' ids


class GraphSet:
    """Graphs of one runner's steps by bucket, in one memory pool, some deferred to their first use.

    ``bufs`` are the runner's step buffers (what every capture and replay reads), ``model`` and
    ``kv`` what is run, ``streams`` the core's pool the capture stream is lent from, ``pool`` a
    graph memory pool to share (None: the first capture's own). A kind gives
    ``_fill_padding(bufs, b)`` (the inputs a capture runs on) and ``_forward(bufs, model, kv, b,
    cascade)`` (what is recorded: it returns (logits, ids), prefixes of the buffers' pair);
    ``graphs`` and ``cascade_graphs`` hold the captures by bucket.

    A step asks :meth:`capture_deferred` before its inputs are staged, then :meth:`ready` (which
    captures a missing cascade variant on the staged inputs) and :meth:`replay`s when it says so;
    otherwise it runs the same forward eagerly (:meth:`run_eager`, or the runner's own). A bucket
    whose capture failed has no graph and runs eagerly, the step that asked included; it is not
    tried again. While the device's capture gate is shut (a load thread at work:
    engine/runner/capture_gate.py) nothing is captured by a step: it runs eagerly and the capture
    waits for a later one."""

    kind = "graph"

    def __init__(self, device: torch.device, bufs: StepBuffers, model: Any, kv: KVCache,
                 streams: "StreamPool", pool=None) -> None:
        if device.type != "cuda":
            raise CudaGraphError(f"{self.kind}s need a CUDA device")
        self.device = device
        self.bufs = bufs
        self.model = model
        self.kv = kv
        self.capture_seconds = 0.0  # at load (warm-ups excluded)
        self.warmup_seconds = 0.0
        self.deferred: set[int] = set()  # buckets captured at their first use instead of at load
        self.cascade_failed: set[int] = set()  # buckets whose cascade variant failed to capture
        self.failed: dict[int, str] = {}  # deferred buckets whose capture failed (they run eagerly): why
        self.deferred_capture_seconds = 0.0
        self.graphs: dict[int, _Graph] = {}
        self.cascade_graphs: dict[int, _Graph] = {}  # the buckets' cascade variants
        self._pool = pool
        self._streams = streams
        self.gate = streams.gate  # shut while a load thread works on the device: no capture then
        self._stream: torch.cuda.Stream | None = None

    @property
    def pool(self):
        """The graphs' memory pool (None before the first capture), for another set to share."""
        return self._pool

    def _capture_stream(self) -> torch.cuda.Stream:
        """The side stream captures record on: one per graph set, lent by the runner's pool
        (engine/runner/streams.py: every new stream costs a cuBLAS workspace for good)."""
        if self._stream is None:
            self._stream = self._streams.take(self)
        return self._stream

    def _capture_one(self, b: int, cascade: bool = False, staged: bool = False) -> None:
        """One graph into the shared pool. Unlike ``torch.cuda.graph`` no synchronize, gc or
        empty_cache per graph (the cycle collector is held off instead: :data:`no_collection`):
        the inputs are written on the current stream before the capture stream starts
        recording, and nothing executes while it records. Thread-local mode: other
        threads' CUDA calls (a load thread's copies, NCCL's watchdog polling its events under
        tensor parallelism) must neither fail nor abort the capture; only this thread's work is
        recorded in either mode. ``staged``: a step's inputs are in the buffers, left as they are
        (nothing runs during a capture); otherwise padding is written first.

        Captures run on two threads (the loop's deferred ones, a load thread's runner build beside
        its weights), so no code that may run beside one synchronizes the whole device: a device
        synchronize waits on the other thread's capturing stream, which fails it ("operation not
        permitted when stream is capturing"). Graph code waits on its own streams only."""
        if not staged:
            self._fill_padding(self.bufs, b)
        g = torch.cuda.CUDAGraph()
        # The pool's id before the first capture too: a capture whose end fails leaves the
        # allocator recording into its pool, and only the id lets that be undone.
        pool = self._pool if self._pool is not None else torch.cuda.graph_pool_handle()
        self._capture_stream().wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream), no_collection():
            g.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                outputs = self._forward(self.bufs, self.model, self.kv, b, cascade)
            finally:
                try:
                    g.capture_end()
                except RuntimeError:
                    _stop_recording(self.device, pool)
                    raise
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._pool = pool
        (self.cascade_graphs if cascade else self.graphs)[b] = _Graph(g, *outputs)

    def _warm(self, order: list[int]) -> None:
        """Run the largest and smallest bucket eagerly first (cuBLAS workspace allocations
        cannot happen inside a capture; kernels compile outside it), and the cascade forward at
        one bucket of each decode form that can carry a plan: its variants are captured by
        serving steps, on their staged inputs, and a compile there would stall the step. (The
        plain decode graphs of the few-row buckets, whose reduce differs by split count, still
        compile theirs inside their captures, at load: a thread-local capture allows it.)"""
        runs = [(b, False) for b in sorted({order[0], order[-1]}, reverse=True)]
        runs += [(b, True) for b in self._cascade_warm(order)]
        for b, cascade in runs:
            self._fill_padding(self.bufs, b)
            self.run_eager(b, cascade)
        torch.cuda.current_stream(self.device).synchronize()  # never device-wide: see _capture_one

    def ready(self, bucket: int, cascade: bool = False) -> bool:
        """Whether a step of ``bucket`` can replay its graph (the cascade variant when the step
        staged a plan). A missing variant of a captured bucket is captured now, on the step's
        staged inputs (a capture runs nothing, so they are intact whatever happens); one whose
        capture failed is logged, never tried again, and its steps run eagerly."""
        if bucket in (self.cascade_graphs if cascade else self.graphs):
            return True
        if not cascade or bucket not in self.graphs or bucket in self.cascade_failed or not self.gate.open:
            return False
        t = time.perf_counter()
        try:
            with torch.inference_mode():
                self._capture_one(bucket, cascade=True, staged=True)
        except Exception as e:  # noqa: BLE001 - any failure: this bucket's plans run eagerly
            self.cascade_failed.add(bucket)
            log.warning("%s capture of bucket %d (cascade) failed; its steps with a plan run eagerly: %s",
                        self.kind, bucket, e)
            return False
        self.deferred_capture_seconds += time.perf_counter() - t
        return True

    def run_eager(self, bucket: int, cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run what a graph of ``bucket`` records (its cascade variant: ``cascade``) without a
        graph, on the inputs in the step buffers: the (logits, ids) a replay gives. What a warm-up
        runs, and a step of a bucket left without its graph."""
        return self._forward(self.bufs, self.model, self.kv, bucket, cascade)

    def replay(self, bucket: int, cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the bucket's graph (its cascade variant: the step staged a plan) on the inputs in
        the step buffers: (logits, ids) of its rows, the step's sampled rows first."""
        g = (self.cascade_graphs if cascade else self.graphs).get(bucket)
        if g is None:
            raise CudaGraphError(f"no {self.kind} for bucket {bucket}" + (" (cascade)" if cascade else ""))
        g.graph.replay()
        return g.logits, g.ids

    @torch.inference_mode()
    def capture_deferred(self, bucket: int) -> bool:
        """Capture a deferred bucket now (the runner calls this before preparing the step that
        needs it, since a capture writes padding into the input buffers). False when nothing was
        tried: not deferred, or the capture gate is shut (a load thread is at work: the bucket
        stays deferred and this step runs eagerly). A failed capture is logged and the bucket
        runs eagerly from then on (``failed``); the step that asked goes on."""
        if bucket not in self.deferred or not self.gate.open:
            return False
        self.deferred.discard(bucket)
        t = time.perf_counter()
        try:
            self._capture_one(bucket)
        except RuntimeError as e:
            self.failed[bucket] = str(e)
            log.warning("%s capture of bucket %d failed; its steps run eagerly: %s", self.kind, bucket, e)
            return True
        self.deferred_capture_seconds += time.perf_counter() - t
        return True

    @staticmethod
    def _fill_padding(bufs: StepBuffers, bucket: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _cascade_warm(self, order: list[int]) -> list[int]:  # pragma: no cover - abstract
        """Of the buckets (largest first), those whose eager cascade forwards compile every
        kernel form a cascade variant of the set can launch (none: no bucket can carry a plan)."""
        raise NotImplementedError

    @staticmethod
    def _forward(bufs: StepBuffers, model: Any, kv: KVCache, bucket: int, cascade: bool):  # pragma: no cover
        raise NotImplementedError


class DecodeGraphs(GraphSet):
    """The captured decode graphs of one runner, by batch bucket."""

    kind = "decode graph"

    def _cascade_warm(self, order: list[int]) -> list[int]:
        """Of the buckets that can carry a plan (16 rows and more), one per form of the decode
        kernels (unsplit, or split with the reduce's block over the splits; the split count falls
        as the batch grows): on the H200 with the 8B, 16 (4 splits), 32 (2) and the largest."""
        planned = [b for b in order if self.bufs.cascade_tiles_for(b) > 0]
        if not planned:
            return []
        from engine.kernels.attention_triton import decode_forms

        k = self.kv.k(0)  # [pages, block, this rank's KV heads, head dim]
        return decode_forms(planned, k.shape[3], self.model.dtype, k.shape[2], self.bufs.max_model_len, self.device)

    @staticmethod
    def _fill_padding(bufs: StepBuffers, bucket: int) -> None:
        """The padded-decode inputs a capture runs on: every row a padding row."""
        bufs.input_ids[:bucket].zero_()
        bufs.positions[:bucket].zero_()
        bufs.slots[:bucket].fill_(-1)
        bufs.qsl[:bucket + 1].copy_(torch.arange(bucket + 1, dtype=torch.int32, device=bufs.device))
        bufs.seq_lens[:bucket].fill_(1)
        bufs.block_tables[:bucket].zero_()
        bufs.kv_lo[:bucket].zero_()
        bufs.cascade_tiles[:, 1] = 0

    @staticmethod
    def _forward(bufs: StepBuffers, model: Any, kv: KVCache, bucket: int,
                 cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        meta = bufs.decode_meta(bucket, cascade)
        hidden = model(bufs.input_ids[:bucket], bufs.positions[:bucket], kv, meta)
        return _sampled_outputs(bufs, model, hidden, bucket)

    @torch.inference_mode()
    def capture(self, buckets: tuple[int, ...], defer: tuple[int, ...] = ()) -> None:
        """Warm up, then capture every bucket (largest first, one shared pool) except those in
        ``defer``, which :meth:`capture_deferred` captures at their first use."""
        if not buckets:
            return
        order = sorted(set(buckets), reverse=True)
        t0 = time.perf_counter()
        self._warm(order)
        t1 = time.perf_counter()
        self._capture_stream()
        now = [b for b in order if b not in set(defer) or b == order[0]]
        self.deferred = {b for b in order if b not in now}
        try:
            for b in now:
                self._capture_one(b)
            torch.cuda.current_stream(self.device).synchronize()  # never device-wide: see _capture_one
        except RuntimeError as e:
            self.graphs.clear()
            self.cascade_graphs.clear()
            self.deferred.clear()
            raise CudaGraphError(f"decode graph capture failed: {e}") from e
        self.warmup_seconds = t1 - t0
        self.capture_seconds = time.perf_counter() - t1


class MixedGraphs(GraphSet):
    """The captured mixed-step graphs of one runner, by token bucket."""

    kind = "mixed-step graph"

    def _cascade_warm(self, order: list[int]) -> list[int]:
        # a mixed step's plan covers every sequence slot: whatever the bucket, the same kernels
        # over max_seqs rows, so the cheapest bucket compiles them
        return order[-1:] if self.bufs.cascade_tiles_for(self.bufs.max_seqs) > 0 else []

    @staticmethod
    def _fill_padding(bufs: StepBuffers, bucket: int) -> None:
        """Inputs a capture (or warm-up) runs on: every token padding, every sequence empty."""
        bufs.input_ids[:bucket].zero_()
        bufs.positions[:bucket].zero_()
        bufs.slots[:bucket].fill_(-1)
        bufs.qsl.zero_()
        bufs.seq_lens.zero_()
        bufs.block_tables.zero_()
        bufs.kv_lo.zero_()
        bufs.cascade_tiles[:, 1] = 0

    @staticmethod
    def _forward(bufs: StepBuffers, model: Any, kv: KVCache, bucket: int,
                 cascade: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward a mixed graph records: the hidden states of the rows in ``bufs.rows``
        (``bufs.sampled_rows(bucket)`` of them, the step's sampled rows first), the LM head and
        the greedy picks; (logits, ids), prefixes of ``bufs.graph_outputs()``."""
        hidden = model(bufs.input_ids[:bucket], bufs.positions[:bucket], kv, bufs.mixed_meta(bucket, cascade))
        rows = bufs.sampled_rows(bucket)
        return _sampled_outputs(bufs, model, hidden.index_select(0, bufs.rows[:rows]), rows)

    @torch.inference_mode()
    def capture(self, buckets: tuple[int, ...]) -> None:
        """Warm the kernels up eagerly at the largest and smallest bucket (no compile may happen
        inside a capture), capture the largest now and defer the rest to their first use."""
        if not buckets:
            return
        order = sorted(set(buckets), reverse=True)
        t0 = time.perf_counter()
        self._warm(order)
        try:
            self._capture_one(order[0])
            torch.cuda.current_stream(self.device).synchronize()  # never device-wide: see _capture_one
        except RuntimeError as e:
            self.graphs.clear()
            self.cascade_graphs.clear()
            raise CudaGraphError(f"mixed-step graph capture failed: {e}") from e
        self.deferred = set(order[1:])
        self.capture_seconds = time.perf_counter() - t0
