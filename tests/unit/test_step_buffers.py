"""engine.runner.step_buffers: a step's arrays land in named regions of one arena (cast to each
region's dtype, shaped as given), regions never overlap, and a region refuses more than it holds.
(The pinned twin and its single copy run on CUDA: tests/gpu's engine tests go through them.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.runner.step_buffers import Arena, StepBuffers


def test_regions_are_aligned_views_of_one_buffer_and_do_not_overlap() -> None:
    bufs = StepBuffers(torch.device("cpu"), max_step_tokens=64, max_seqs=8, max_pages=4, max_model_len=64, vocab_size=32)
    views = [bufs.qsl, bufs.seq_lens, bufs.rows, bufs.fill_dst, bufs.fill_src, bufs.input_ids, bufs.positions,
             bufs.slots, bufs.block_tables]
    base = bufs.inputs.device_bytes.data_ptr()
    spans = sorted((v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size()) for v in views)
    assert all(start % 16 == 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= bufs.inputs.nbytes
    assert bufs.block_tables.shape == (8, 4) and bufs.slots.eq(-1).all()


def test_stage_casts_shapes_and_bounds() -> None:
    a = Arena(torch.device("cpu"), [("x", torch.int32, 6), ("y", torch.float32, 4), ("z", torch.int64, 3)])
    t = a.stage("x", np.arange(6, dtype=np.int64).reshape(2, 3))
    assert t.dtype == torch.int32 and t.shape == (2, 3) and t.tolist() == [[0, 1, 2], [3, 4, 5]]
    y = a.stage("y", np.array([0.5, 1.5], dtype=np.float64))
    assert y.dtype == torch.float32 and y.tolist() == [0.5, 1.5]
    z = a.stage("z", np.array([2 ** 40], dtype=np.int64))
    a.upload()
    assert z.tolist() == [2 ** 40] and a.tensors["x"][:6].tolist() == list(range(6))
    with pytest.raises(ValueError, match="holds 4"):
        a.stage("y", np.zeros(5))


def test_graph_outputs_are_made_at_their_first_use_and_kept():
    bufs = StepBuffers(torch.device("cpu"), max_step_tokens=64, max_seqs=8, max_pages=4, max_model_len=64, vocab_size=32)
    assert bufs._outputs is None  # a runner without graphs never pays for them
    logits, ids = bufs.graph_outputs()
    assert logits.shape == (8, 32) and logits.dtype == torch.float32 and ids.shape == (8,)
    assert bufs.graph_outputs()[0] is logits
