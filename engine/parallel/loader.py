"""Sharded weight loading: each rank reads only its slices of the safetensors tensors.

Every tensor name of the checkpoint falls under one rule (:func:`split_rule`):

- ``rows``: q/k/v and gate/up projections (weights and biases) — this rank's contiguous block of
  output rows, one byte range of the file, streamed straight into the fused destination like the
  unsharded loader does (:func:`engine.weights.weight_stream.stream_to_device`);
- ``vocab``: embedding and LM head — this rank's block of vocabulary rows (the last rank's
  block may be short; its padding rows stay zero);
- ``cols``: o_proj and down_proj weights — this rank's block of *input* columns of every row,
  read through a memory map as a strided view, so only the pages holding those columns are
  touched;
- ``rank0``: o_proj and down_proj biases — read by rank 0 only (the all-reduce adds them once);
- ``replicated``: norms (incl. Qwen3's q/k norms) — read whole by every rank.

Headers are validated (:func:`cache.safetensors_check.check_file`) and every tensor's *full*
shape checked before a byte is read; missing, repeated, unknown or misshapen tensors raise
:class:`~engine.errors.WeightsError` as in :mod:`engine.weights.loader`.
"""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path

import numpy as np
import torch

from engine.errors import WeightsError
from engine.weights.loader import checked_tensors, weight_files
from engine.weights.slots import CheckpointMap
from engine.parallel.shard import TPModel
from engine.weights.weight_stream import CopyJob, stream_to_device

# safetensors dtype → (torch dtype, numpy dtype of the same width for the strided reads)
_DTYPES = {"F32": (torch.float32, np.float32), "F16": (torch.float16, np.float16),
           "BF16": (torch.bfloat16, np.uint16)}
_ROW_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def split_rule(name: str) -> str:
    """How tensor ``name`` splits over ranks: rows | vocab | cols | rank0 | replicated."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "vocab"
    parts = name.rsplit(".", 2)
    if len(parts) == 3 and parts[1] in _ROW_PARTS:
        return "rows"
    if len(parts) == 3 and parts[1] in ("o_proj", "down_proj"):
        return "cols" if parts[2] == "weight" else "rank0"
    return "replicated"


def _strided_copy(path: Path, begin: int, full_shape: tuple[int, ...], st_dtype: str, col0: int, ncols: int,
                  dest: torch.Tensor) -> None:
    """dest ← file tensor[:, col0:col0+ncols], reading through a read-only memory map."""
    tdtype, ndtype = _DTYPES[st_dtype]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        count = full_shape[0] * full_shape[1]
        arr = np.frombuffer(mm, dtype=ndtype, count=count, offset=begin).reshape(full_shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: only ever read here
            src = torch.from_numpy(arr[:, col0:col0 + ncols])
        if src.dtype != tdtype:
            src = src.view(tdtype)
        dest.copy_(src)
        del src, arr  # the views must go before the map closes


def load_shard(model: TPModel, model_dir: str | Path, *, threads: int = 4, streams: int = 2) -> int:
    """Fill ``model``'s shard from the folder's safetensors; returns this rank's weight bytes."""
    plan = model.plan
    tp, rank = plan.world_size, plan.rank
    slots = model.weight_slots()
    filled: set[str] = set()
    jobs: list[CopyJob] = []
    strided: list[tuple] = []
    for path in weight_files(model_dir):
        for info, slot in checked_tensors(path, CheckpointMap(slots, {}), filled):
            name = info.name
            dest, start, rows = slot
            tail = tuple(dest.shape[1:])
            rule = split_rule(name)
            if rule == "rows":
                want = (rows * tp, *tail)
            elif rule == "vocab":
                want = (plan.full.vocab_size, *tail)
            elif rule == "cols":
                want = (dest.shape[0], dest.shape[1] * tp)
            else:
                want = (rows, *tail)
            if tuple(info.shape) != want:
                raise WeightsError(f"{path.name}: tensor {name!r} has shape {list(info.shape)}, expected {list(want)}")
            src_dtype = _DTYPES[info.dtype][0]
            cast = None if src_dtype == dest.dtype else src_dtype
            row_bytes = (info.end - info.begin) // want[0]
            if rule == "cols":
                strided.append((path, info.begin, want, info.dtype, rank * dest.shape[1], dest.shape[1], dest.data))
                continue
            if rule == "rows":
                r0, n = rank * rows, rows
            elif rule == "vocab":
                r0, n = plan.vocab_start, plan.vocab_end - plan.vocab_start
            elif rule == "rank0" and rank != 0:
                continue
            else:
                r0, n = 0, rows
            jobs.append(CopyJob(path, info.begin + r0 * row_bytes, n * row_bytes, dest.data[start:start + n],
                                src_dtype=cast))
    missing = sorted(set(slots) - filled)
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{model_dir}: missing weights {', '.join(missing[:3])}{more}")
    stream_to_device(jobs, threads=threads, streams=streams)
    with torch.no_grad():
        for args in strided:
            _strided_copy(*args)
    return model.nbytes
