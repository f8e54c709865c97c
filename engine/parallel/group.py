"""The tensor-parallel process group: one process per rank, torch.distributed underneath.

Two groups per TP set: ``device_group`` carries the tensor collectives of the forward pass
(NCCL on CUDA, gloo on CPU) and ``cpu_group`` (always gloo) carries rank 0's control messages,
so broadcasting a step's plan never touches the GPU stream or forces a device sync.
``NCCL_NVLS_ENABLE=0`` (NVLink multicast off) is set in the environment before any group exists,
whatever the caller had.

The collectives here take no host decisions from device data, so a CUDA graph can capture them.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.errors import EngineError
from engine.runner.streams import StreamPool

DEFAULT_TIMEOUT_S = 600.0
# [world*rows, c] ← every rank's [rows, c] (the newer name where torch has it).
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPError(EngineError):
    """A tensor-parallel group or step failed (setup, a peer's load, the control channel)."""


class TPConfigError(TPError):
    """The model cannot be split this way (heads, KV heads or MLP width not divisible), or bad ranks."""


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel set and the groups it talks over."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    device_group: Any  # torch ProcessGroup for tensors on ``device``
    cpu_group: Any  # gloo ProcessGroup for host tensors (control channel, load agreement)

    @functools.cached_property
    def streams(self) -> StreamPool | None:
        """This rank's stream pool, for every shard it builds: a runner's streams come back to it
        when the runner goes and the next shard's reuses them (engine/runner/streams.py); a new
        pool per load left each load's streams, cuBLAS workspaces and all, behind."""
        return StreamPool(self.device) if self.device.type == "cuda" else None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it (no-op for one rank)."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.device_group)
        return t

    def all_gather_cols(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, c] on every rank → [rows, world * c], rank r's block at columns r*c.. (a new tensor)."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        rows, cols = t.shape
        out = torch.empty((self.world_size * rows, cols), dtype=t.dtype, device=t.device)
        _gather_single(out, t, group=self.device_group)
        return out.view(self.world_size, rows, cols).permute(1, 0, 2).reshape(rows, self.world_size * cols)

    def connect_all(self) -> None:
        """One collective on each group, so every connection exists now (before a sandbox denies
        new sockets): NCCL's lazy transport setup and gloo's pairs both happen here."""
        t = torch.zeros(1, device=self.device)
        dist.all_reduce(t, group=self.device_group)
        dist.all_reduce(torch.zeros(1), group=self.cpu_group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def min_over_ranks(self, values: list[int]) -> list[int]:
        """Element-wise minimum of a few host integers over the ranks (on the CPU group)."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [int(x) for x in t.tolist()]


def init_tp_group(rank: int, world_size: int, init_method: str, device: str | torch.device = "cpu",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the TP set (a collective: every rank calls it with the same ``init_method``).

    ``device`` is this rank's device (``cuda:<r>`` on GPU, ``cpu`` for the gloo test path);
    ``init_method`` is a torch.distributed URL (``tcp://127.0.0.1:PORT`` or ``file:///path``).
    Returns after one collective on each group (:meth:`TPGroup.connect_all`), so a sandbox that
    denies new sockets can go on right after.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TPConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise TPConfigError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # multicast off in every run, whatever the caller set
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")  # connect at init, not at the first collective
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TPError(f"rank {rank}: device {dev} asked for but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif dev.type == "cpu":
        backend = "gloo"
    else:
        raise TPConfigError(f"tensor parallelism runs on cuda or cpu, not {dev.type}")
    if dist.is_initialized():
        raise TPError("a torch.distributed group already exists in this process")
    timeout = dt.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
        default = dist.group.WORLD
        cpu = default if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, ValueError) as e:
        raise TPError(f"rank {rank}/{world_size}: process group setup failed: {e}") from e
    group = TPGroup(rank, world_size, dev, backend, default, cpu)
    try:
        group.connect_all()
    except RuntimeError as e:
        raise TPError(f"rank {rank}/{world_size}: first collective failed: {e}") from e
    return group


def destroy_tp_group() -> None:
    """Leave the TP set (after the last collective); safe when none exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
