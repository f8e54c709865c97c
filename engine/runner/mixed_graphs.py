"""Mixed-step CUDA graphs: the model forward of any step of up to a bucket of tokens, replayed.

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

A graph holds the forward up to the final norm's hidden states; the LM head and the sampler
run eagerly on the sampled rows only (a graph with a fixed row count would pay the LM head for
``max_num_seqs`` rows every step). Graphs share the decode graphs' memory pool: they replay one
at a time. The largest bucket is captured at load (so the load's measured workspace includes the
pool's size); the others at their first use.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.runner.cuda_graphs import CudaGraphError, GraphSet
from engine.models.llama import AttentionMetadata

if TYPE_CHECKING:  # the runner imports this module
    from engine.runner.model_runner import ModelRunner

# Token buckets: dense where serving steps live (the running batch plus one prompt chunk).
DEFAULT_MIXED_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                         1280, 1536, 1792, 2048)


class MixedGraphs(GraphSet):
    """The captured mixed-step graphs of one runner, by token bucket."""

    kind = "mixed-step graph"

    def __init__(self, device: torch.device, pool=None, streams=None) -> None:
        super().__init__(device, pool, streams)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _keep(self, bucket: int, graph: torch.cuda.CUDAGraph, outputs) -> None:
        self.graphs[bucket] = (graph, outputs)

    @staticmethod
    def meta(r: "ModelRunner", bucket: int) -> AttentionMetadata:
        """The metadata every replay of ``bucket`` reads: full-size sequence buffers. The
        ``max_query_len`` of 2 routes attention to the prefill kernel too, whose grid ignores it."""
        return AttentionMetadata(slot_mapping=r._slots[:bucket], query_start_loc=r._qsl,
                                 seq_lens=r._seq_lens, block_tables=r._block_tables,
                                 max_query_len=2, max_seq_len=r.max_model_len)

    @staticmethod
    def _fill_padding(r: "ModelRunner", bucket: int) -> None:
        """Inputs a capture (or warm-up) runs on: every token padding, every sequence empty."""
        r._input_ids[:bucket].zero_()
        r._positions[:bucket].zero_()
        r._slots[:bucket].fill_(-1)
        r._qsl.zero_()
        r._seq_lens.zero_()
        r._block_tables.zero_()

    @classmethod
    def _forward(cls, r: "ModelRunner", bucket: int) -> torch.Tensor:
        return r.model(r._input_ids[:bucket], r._positions[:bucket], r.kv, cls.meta(r, bucket))

    @torch.inference_mode()
    def capture(self, r: "ModelRunner", buckets: tuple[int, ...]) -> None:
        """Warm the kernels up eagerly at the largest and smallest bucket (no compile may happen
        inside a capture), capture the largest now and defer the rest to their first use."""
        if not buckets:
            return
        order = sorted(set(buckets), reverse=True)
        t0 = time.perf_counter()
        self._warm(r, order)
        try:
            self._capture_one(r, order[0])
            torch.cuda.synchronize(self.device)
        except RuntimeError as e:
            self.graphs.clear()
            raise CudaGraphError(f"mixed-step graph capture failed: {e}") from e
        self.deferred = set(order[1:])
        self.capture_seconds = time.perf_counter() - t0

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the bucket's forward on the runner's buffers; the [bucket, hidden] output."""
        entry = self.graphs.get(bucket)
        if entry is None:
            raise CudaGraphError(f"no mixed-step graph for {bucket} tokens")
        entry[0].replay()
        return entry[1]
