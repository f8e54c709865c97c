"""The persistent device buffers a runner's steps read their inputs from, and their host staging.

Every step's flat inputs and attention metadata are copied into prefixes of these tensors, sized
once for the largest step the runner takes: a captured CUDA graph (:mod:`engine.runner.cuda_graphs`)
reads the same addresses at every replay, so the runner that fills them and the graphs that
replay on them share this one object. On CUDA each buffer has a pinned host twin the copies go
through asynchronously; :attr:`StepBuffers.copies_done` marks when the last step's copies have
left the staging memory, before the next step overwrites it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.llama import AttentionMetadata


class StepBuffers:
    """Device tensors of the largest step (tokens, sequences, block-table width) on ``device``."""

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_pages: int,
                 max_model_len: int) -> None:
        self.device = device
        self.max_model_len = max_model_len
        dev = device
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_tokens, dtype=i64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=i64, device=dev)
        self.slots = torch.full((max_tokens,), -1, dtype=i64, device=dev)
        self.qsl = torch.zeros(max_seqs + 1, dtype=i32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=i32, device=dev)
        self.block_tables = torch.zeros(max_seqs, max_pages, dtype=i32, device=dev)
        self.rows = torch.zeros(max_seqs, dtype=i64, device=dev)
        self.fill_dst = torch.zeros(max_seqs, dtype=i64, device=dev)
        self.fill_src = torch.zeros(max_seqs, dtype=i64, device=dev)
        # Host staging of the same sizes, pinned on CUDA so the copies are async.
        self.pinned = dev.type == "cuda"
        self._staging: dict[int, torch.Tensor] = {}
        for buf in (self.input_ids, self.positions, self.slots, self.qsl, self.seq_lens, self.block_tables,
                    self.rows, self.fill_dst, self.fill_src):
            host = torch.empty(buf.numel(), dtype=buf.dtype)
            self._staging[id(buf)] = host.pin_memory() if self.pinned else host
        self.copies_done = torch.cuda.Event() if self.pinned else None

    def to_device(self, dst: torch.Tensor, values: np.ndarray) -> torch.Tensor:
        """Copy a host array into a contiguous prefix of the persistent buffer ``dst``; return that view."""
        src = torch.from_numpy(values)
        n = src.numel()
        view = dst.view(-1)[:n].view(src.shape)
        if self.pinned:
            stage = self._staging[id(dst)][:n].view(src.shape)
            stage.copy_(src)
            view.copy_(stage, non_blocking=True)
        else:
            view.copy_(src)
        return view

    def decode_meta(self, bucket: int) -> AttentionMetadata:
        """Metadata of a padded decode step of ``bucket`` rows, on the buffers' fixed prefixes."""
        return AttentionMetadata(slot_mapping=self.slots[:bucket], query_start_loc=self.qsl[:bucket + 1],
                                 seq_lens=self.seq_lens[:bucket], block_tables=self.block_tables[:bucket],
                                 max_query_len=1, max_seq_len=self.max_model_len)

    def mixed_meta(self, bucket: int) -> AttentionMetadata:
        """The metadata every mixed-step replay of ``bucket`` tokens reads: full-size sequence
        buffers. The ``max_query_len`` of 2 routes attention to the prefill kernel too, whose
        grid ignores it."""
        return AttentionMetadata(slot_mapping=self.slots[:bucket], query_start_loc=self.qsl,
                                 seq_lens=self.seq_lens, block_tables=self.block_tables,
                                 max_query_len=2, max_seq_len=self.max_model_len)
