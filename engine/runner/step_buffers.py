"""The persistent device buffers a runner's steps read their inputs from, and their host staging.

Every step's flat inputs and attention metadata are written into prefixes of these tensors, sized
once for the largest step the runner takes: a captured CUDA graph (:mod:`engine.runner.cuda_graphs`)
reads the same addresses at every replay, so the runner that fills them and the graphs that
replay on them share this one object.

The buffers are views of one byte arena (:class:`Arena`); a step stages its arrays into the
arena's pinned host twin and :meth:`Arena.upload` sends them in **one** copy. One copy per buffer
(nine a step, each a ``from_numpy``, a staging copy and an async copy) was ~10 % of the worker's
CPU at concurrency 200 on the H200 (py-spy over the c200 serve bench at f23c06b: ``to_device``
173 of 1,745 samples). The sampling parameters have an arena of their own: they are staged after
the step's forward pass is queued.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.llama import AttentionMetadata
from engine.runner import cascade

_ALIGN = 16  # bytes: every region starts aligned for any dtype's view


def to_device_async(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array of a step's (row and token indices: KBs, up to the ruled rows' whole token
    lists) on ``device`` without waiting for the stream: on CUDA through page-locked memory (the
    caching host allocator keeps the block until the copy has read it, and reuses it after). A
    copy from pageable memory waits for the stream first (CUDA's rule for pageable host-to-device
    copies), and a step's sampling is staged while its forward pass runs: such a copy holds the
    host until the forward ends."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class Arena:
    """Named device tensors carved from one byte buffer, filled from a host twin by one copy.

    ``stage(name, values)`` writes a host array (cast to the region's dtype) into a prefix of the
    region's host twin and returns the device view of that prefix; ``upload()`` copies the host
    bytes up to the furthest staged byte in one asynchronous copy. Bytes between staged prefixes
    are copied too, from whatever the host twin last held there: a step reads only what it staged.
    On CUDA there are two pinned twins, used in turn: a round stages into the one whose copy was
    queued two uploads ago (long done, so this never waits in practice; it waits on a blocking
    event if it must). One twin would make every step wait for the previous step's copy, which
    with asynchronous steps sits behind a whole forward pass: the host spun through the GPU's
    step (the worker at 1.0 core at concurrency 1 on the H200). On CPU the twin *is* the device
    buffer (no copy).
    """

    def __init__(self, device: torch.device, layout: list[tuple[str, torch.dtype, int]]) -> None:
        self.device = device
        self._regions: dict[str, tuple[int, torch.dtype, int, int]] = {}  # offset, dtype, numel, bytes
        off = 0
        for name, dtype, numel in layout:
            off = -(-off // _ALIGN) * _ALIGN
            size = numel * torch.empty((), dtype=dtype).element_size()
            self._regions[name] = (off, dtype, numel, size)
            off += size
        self.nbytes = off
        self.pinned = device.type == "cuda"
        if self.pinned:
            self.device_bytes = torch.zeros(off, dtype=torch.uint8, device=device)
            twins = [torch.zeros(off, dtype=torch.uint8).pin_memory() for _ in range(2)]
        else:
            self.device_bytes = torch.zeros(off, dtype=torch.uint8)
            twins = [self.device_bytes]
        self.tensors = {name: self.device_bytes[o:o + size].view(dtype)
                        for name, (o, dtype, _, size) in self._regions.items()}
        self._twins = twins
        self._host = [self._views(t) for t in twins]
        self._copied = [torch.cuda.Event(blocking=True) for _ in twins] if self.pinned else []
        self._queued = [False] * len(twins)  # whose copy has been queued and not yet waited for
        self._turn = 0
        self._hi = 0
        self.waits = 0  # stages that had to wait for a twin's copy (none in steady stepping)

    def _views(self, twin: torch.Tensor) -> dict[str, np.ndarray]:
        flat = twin.numpy()
        return {name: flat[o:o + size].view(torch.empty(0, dtype=dtype).numpy().dtype)
                for name, (o, dtype, _, size) in self._regions.items()}

    def stage(self, name: str, values: np.ndarray) -> torch.Tensor:
        """Put ``values`` at the start of region ``name``; the device view of them, their shape."""
        t = self._turn
        if self._queued[t]:
            if not self._copied[t].query():  # that twin's copy (two uploads ago) is still reading it
                self.waits += 1
                self._copied[t].synchronize()
            self._queued[t] = False
        off, _, numel, _ = self._regions[name]
        k = values.size
        if k > numel:
            raise ValueError(f"{name}: {k} values, the buffer holds {numel}")
        host = self._host[t][name]
        host[:k] = values.reshape(-1)
        self._hi = max(self._hi, off + k * host.itemsize)
        return self.tensors[name][:k].view(values.shape)

    def upload(self) -> None:
        """Send what was staged since the last upload (one copy, queued on the current stream)."""
        if self._hi and self.pinned:
            t = self._turn
            self.device_bytes[:self._hi].copy_(self._twins[t][:self._hi], non_blocking=True)
            self._copied[t].record()
            self._queued[t] = True
            self._turn = 1 - t
        self._hi = 0


class StepBuffers:
    """Device tensors of the largest step (tokens, sequences, block-table width) on ``device``,
    and where a graph's outputs land.

    ``cascade_rows`` (rows per cascade tile, engine/runner/cascade.py; 0: no cascade plans)
    sizes the plan's regions: the cascade variant of a graph of at least ``cascade.MIN_ROWS`` rows
    runs the cascade kernel over ``max_tiles(rows)`` tiles read from them.

    :meth:`graph_outputs` ([max_seqs, vocab_size] float32 logits and [max_seqs] int64 greedy picks,
    made at its first call: a runner without graphs never pays for them) are what every captured
    graph writes for its sampled rows (prefixes of them): one pair for all buckets instead of
    outputs kept per graph (the mixed graphs' would be ~2 GB for an 8B). A step's outputs are read
    before the next step of the runner is launched (the sampler right behind the replay on its
    stream; logprobs and grammar masks before any later launch)."""

    def __init__(self, device: torch.device, max_step_tokens: int, max_seqs: int, max_pages: int,
                 max_model_len: int, vocab_size: int, cascade_rows: int = 0) -> None:
        self.device = device
        self.max_model_len = max_model_len
        self.max_seqs = max_seqs
        self.cascade_rows = cascade_rows if max_seqs >= cascade.MIN_ROWS else 0
        width = 2 + self.cascade_rows
        tiles = cascade.max_tiles(max_seqs, self.cascade_rows) if self.cascade_rows else 0
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        # Small regions first, the block tables last: a step's one copy ends where its tables do.
        self.inputs = Arena(device, [
            ("qsl", i32, max_seqs + 1), ("seq_lens", i32, max_seqs), ("rows", i64, max_seqs),
            ("fill_dst", i64, max_seqs), ("fill_src", i64, max_seqs),
            ("kv_lo", i32, max_seqs), ("cascade_tiles", i32, tiles * width),
            ("input_ids", i64, max_step_tokens), ("positions", i64, max_step_tokens),
            ("slots", i64, max_step_tokens),
            ("block_tables", i32, max_seqs * max_pages),
        ])
        t = self.inputs.tensors
        self.qsl, self.seq_lens, self.rows = t["qsl"], t["seq_lens"], t["rows"]
        self.fill_dst, self.fill_src = t["fill_dst"], t["fill_src"]
        self.input_ids, self.positions, self.slots = t["input_ids"], t["positions"], t["slots"]
        self.block_tables = t["block_tables"].view(max_seqs, max_pages)
        self.kv_lo = t["kv_lo"]
        self.cascade_tiles = t["cascade_tiles"].view(tiles, width)
        self.cascade_tiles[:, 1] = 0  # no tile active until a step stages a plan
        self.slots.fill_(-1)
        self._vocab_size = vocab_size
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.sampling = Arena(device, [
            ("temperature", f32, max_seqs), ("top_p", f32, max_seqs), ("min_p", f32, max_seqs),
            ("top_k", i32, max_seqs), ("seed", i64, max_seqs), ("step", i64, max_seqs),
        ])

    def graph_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (logits, ids) pair every graph writes (made at the first call, outside any
        capture: each graph set's eager warm-up calls it first)."""
        if self._outputs is None:
            self._outputs = (torch.empty((self.max_seqs, self._vocab_size), dtype=torch.float32, device=self.device),
                             torch.zeros(self.max_seqs, dtype=torch.int64, device=self.device))
        return self._outputs

    def sampled_rows(self, tokens: int) -> int:
        """The rows a mixed graph of ``tokens`` tokens samples: its LM head's fixed row count
        (a step samples at most one row a sequence, and at most one a token)."""
        return min(tokens, self.max_seqs)

    def cascade_tiles_for(self, rows: int) -> int:
        """Tiles of the cascade plan of a step of ``rows`` rows (0: such a step has no plan)."""
        if not self.cascade_rows or rows < cascade.MIN_ROWS:
            return 0
        return cascade.max_tiles(rows, self.cascade_rows)

    def cascade_meta(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The plan views a step (or graph) of ``rows`` rows reads, or None when it has none."""
        tiles = self.cascade_tiles_for(rows)
        return (self.cascade_tiles[:tiles], self.kv_lo[:rows]) if tiles else None

    def decode_meta(self, bucket: int, cascade: bool = False) -> AttentionMetadata:
        """Metadata of a padded decode step of ``bucket`` rows, on the buffers' fixed prefixes
        (``cascade``: with the plan views, for a bucket that has them)."""
        return AttentionMetadata(slot_mapping=self.slots[:bucket], query_start_loc=self.qsl[:bucket + 1],
                                 seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket],
                                 max_query_len=1, max_seq_len=self.max_model_len,
                                 cascade=self.cascade_meta(bucket) if cascade else None)

    def mixed_meta(self, bucket: int, cascade: bool = False) -> AttentionMetadata:
        """The metadata every mixed-step replay of ``bucket`` tokens reads: full-size sequence
        buffers. The ``max_query_len`` of 2 routes attention to the prefill kernel too, whose
        grid ignores it."""
        return AttentionMetadata(slot_mapping=self.slots[:bucket], query_start_loc=self.qsl,
                                 seq_lens=self.seq_lens, block_tables=self.block_tables,
                                 max_query_len=2, max_seq_len=self.max_model_len,
                                 cascade=self.cascade_meta(self.max_seqs) if cascade else None)
