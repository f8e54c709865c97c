"""Fast weight loading: file byte ranges → destination tensors through a ring of pinned buffers.

``stream_to_device(jobs)`` copies each :class:`CopyJob` (a byte range of a file) into its
destination tensor, which may be a view of a fused weight (a row range of qkv or gate-up).
On CUDA, reader threads ``pread`` fixed-size chunks into a ring of pinned host buffers, and the
calling thread issues the host-to-device copies on ``streams`` CUDA streams round robin; a buffer
goes back to the ring only after the event recorded behind its copy has completed, so the disk,
the page cache and PCIe overlap. A job whose file dtype differs from the destination's is staged
on the device and cast there (all its chunks on one stream, the cast after the last); a job with
``scale`` (an FP8 destination) is quantized there instead, one scale per row.
For CPU destinations the readers ``pread`` straight into the tensors' bytes (no ring).

Loader use: for each safetensors tensor (``TensorInfo.begin/end`` from
``cache.safetensors_check.check_file``) make ``CopyJob(path, info.begin, info.end - info.begin,
dest[start:start + rows], src_dtype=<file dtype>)`` and make one call per model.

The call returns when every byte has landed (all streams synchronised), with :class:`StreamStats`.
Errors (short files, bad jobs, read failures, ``cancel`` set) raise :class:`WeightStreamError`
before or after the copies; nothing is left running. The copy streams first wait for the
calling thread's current stream: destinations allocated there may reuse memory that kernels
queued on it (another model's step, when a load runs beside the step loop) still read.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import WeightsError
from engine.kernels.fp8 import quantize_rows
from engine.kernels.fp8_format import FP8, Fp8Rows


class WeightStreamError(WeightsError):
    """A copy job is malformed, its file is too short, or a read failed."""


@dataclass(frozen=True)
class CopyJob:
    """``nbytes`` bytes at ``offset`` of ``path`` into ``dst`` (contiguous; any device).

    ``src_dtype`` is the dtype of the bytes in the file when it differs from ``dst.dtype``
    (the copy then casts); by default the bytes are ``dst``'s own dtype. ``scale`` ([rows],
    float32, with an e4m3 ``dst`` of [rows, ...] and a ``src_dtype``): the rows are quantized
    (engine.kernels.fp8.quantize_rows) into ``dst`` and their scales into ``scale``.
    ``transposed``: the file holds ``dst``'s transpose ([K, N] bytes for a [N, K] ``dst``: one
    expert of a fused experts tensor); the bytes are staged and written transposed.
    """

    path: str | os.PathLike
    offset: int
    nbytes: int
    dst: torch.Tensor
    src_dtype: torch.dtype | None = None
    scale: torch.Tensor | None = None
    transposed: bool = False

    @property
    def staged(self) -> bool:
        """Whether the bytes go through a staging buffer (a cast or a transpose) before ``dst``."""
        return self.transposed or self.src_dtype not in (None, self.dst.dtype)

    def finish(self, staged: torch.Tensor) -> None:
        """Write the staged file bytes (``src_dtype``) into the destination: cast, transpose or quantize."""
        src = staged.view(self.src_dtype or self.dst.dtype)
        src = src.view(self.dst.shape[1], self.dst.shape[0]).t() if self.transposed else src.view(self.dst.shape)
        with torch.no_grad():
            if self.scale is None:
                self.dst.copy_(src)
            else:
                n = self.dst.shape[0]
                quantize_rows(src.reshape(n, -1).contiguous(), Fp8Rows(self.dst.view(n, -1), self.scale.view(n, 1)))


@dataclass(frozen=True)
class StreamStats:
    bytes: int
    seconds: float
    chunks: int


@dataclass(frozen=True)
class _Chunk:
    job: int
    start: int  # byte offset inside the job
    length: int


def _validate(jobs: list[CopyJob]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for i, j in enumerate(jobs):
        where = f"copy job {i} ({Path(j.path).name} @ {j.offset})"
        if not isinstance(j.dst, torch.Tensor) or not j.dst.is_contiguous():
            raise WeightStreamError(f"{where}: destination must be a contiguous tensor")
        src_dtype = j.src_dtype or j.dst.dtype
        if j.scale is not None and (j.dst.dtype != FP8 or j.src_dtype in (None, FP8) or j.dst.dim() < 1
                                    or j.scale.shape != (j.dst.shape[0],) or j.scale.dtype != torch.float32
                                    or j.scale.device != j.dst.device or not j.scale.is_contiguous()):
            raise WeightStreamError(f"{where}: a quantizing job needs an e4m3 destination, a source dtype and "
                                    f"float32 scales of one per row on the destination's device")
        if j.transposed and j.dst.dim() != 2:
            raise WeightStreamError(f"{where}: a transposing job needs a 2-D destination")
        if j.scale is None and j.dst.dtype == FP8 and src_dtype != FP8:
            raise WeightStreamError(f"{where}: an e4m3 destination of {src_dtype} bytes needs scales")
        want = j.dst.numel() * torch.empty((), dtype=src_dtype).element_size()
        if j.offset < 0 or j.nbytes != want:
            raise WeightStreamError(f"{where}: {j.nbytes} bytes at offset {j.offset}, destination needs {want}")
        key = os.fspath(j.path)
        if key not in sizes:
            try:
                sizes[key] = os.stat(key).st_size
            except OSError as e:
                raise WeightStreamError(f"{where}: cannot stat: {e.strerror}") from None
        if j.offset + j.nbytes > sizes[key]:
            raise WeightStreamError(f"{where}: range ends at {j.offset + j.nbytes}, file has {sizes[key]} bytes")
    return sizes


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise WeightStreamError(f"{where}: file ended {len(view) - done} bytes early")
        done += n


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _chunks(jobs: list[CopyJob], chunk_bytes: int) -> list[_Chunk]:
    # file order: sequential reads per file are what the disk and readahead like
    order = sorted(range(len(jobs)), key=lambda i: (os.fspath(jobs[i].path), jobs[i].offset))
    out = []
    for i in order:
        for start in range(0, jobs[i].nbytes, chunk_bytes):
            out.append(_Chunk(i, start, min(chunk_bytes, jobs[i].nbytes - start)))
    return out


class _Readers:
    """Reader threads: take chunks from a queue, read each into a buffer, report done/failed."""

    def __init__(self, jobs: list[CopyJob], threads: int):
        self.jobs = jobs
        self.fds: dict[str, int] = {}
        for j in jobs:
            key = os.fspath(j.path)
            if key not in self.fds:
                self.fds[key] = os.open(key, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self.fds[key], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.threads = threads
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def read(self, chunk: _Chunk, view: memoryview) -> None:
        j = self.jobs[chunk.job]
        _pread_into(self.fds[os.fspath(j.path)], view, j.offset + chunk.start, f"{Path(j.path).name}")

    def run(self, target, *args) -> list[threading.Thread]:
        def guarded():
            try:
                target(*args)
            except BaseException as e:  # reported to the caller, which raises it
                self.errors.append(e)
                self.stop.set()
        ts = [threading.Thread(target=guarded, name=f"weight-reader-{i}", daemon=True) for i in range(self.threads)]
        for t in ts:
            t.start()
        return ts

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def raise_first(self) -> None:
        if self.errors:
            e = self.errors[0]
            if isinstance(e, WeightStreamError):
                raise e
            raise WeightStreamError(f"weight read failed: {e}") from e


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise WeightStreamError("weight read cancelled")


def _cpu_stream(jobs: list[CopyJob], threads: int, chunk_bytes: int, cancel: threading.Event | None) -> int:
    readers = _Readers(jobs, threads)
    work: queue.SimpleQueue = queue.SimpleQueue()
    chunks = _chunks(jobs, chunk_bytes)
    staging = {i: torch.empty(j.nbytes, dtype=torch.uint8) for i, j in enumerate(jobs) if j.staged}
    for c in chunks:
        work.put(c)
    for _ in range(threads):
        work.put(None)

    def reader():
        while not readers.stop.is_set():
            c = work.get()
            if c is None:
                return
            _check_cancel(cancel)
            dst = staging.get(c.job)
            if dst is None:
                dst = _byte_view(jobs[c.job].dst)
            readers.read(c, memoryview(dst[c.start:c.start + c.length].numpy()))

    try:
        for t in readers.run(reader):
            t.join()
        readers.raise_first()
        for i, buf in staging.items():
            jobs[i].finish(buf)
    finally:
        readers.close()
    return len(chunks)


class _DoneEvent:
    """Stands in for a CUDA event when the ring runs on CPU (copies there are synchronous)."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _ring_stream(jobs: list[CopyJob], threads: int, ring_bytes: int, chunk_bytes: int, nstreams: int,
                 cancel: threading.Event | None) -> int:
    device = jobs[0].dst.device
    cuda = device.type == "cuda"
    chunks = _chunks(jobs, chunk_bytes)
    nslots = max(2, min(len(chunks), ring_bytes // chunk_bytes))
    ring = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(nslots)]
    free: queue.SimpleQueue = queue.SimpleQueue()
    for s in range(nslots):
        free.put(s)
    work: queue.SimpleQueue = queue.SimpleQueue()
    for c in chunks:
        work.put(c)
    for _ in range(threads):
        work.put(None)
    ready: queue.SimpleQueue = queue.SimpleQueue()
    readers = _Readers(jobs, threads)

    def reader():
        while not readers.stop.is_set():
            c = work.get()
            if c is None:
                return
            slot = free.get()
            if slot is None:  # shutdown
                return
            readers.read(c, memoryview(ring[slot][:c.length].numpy()))
            ready.put((c, slot))

    streams = [torch.cuda.Stream(device=device) if cuda else None for _ in range(nstreams)]
    for s in streams:
        if s is not None:
            s.wait_stream(torch.cuda.current_stream(device))  # see the module's docstring
    staged_stream: dict[int, int] = {}
    staging: dict[int, torch.Tensor] = {}
    remaining = {i: (j.nbytes + chunk_bytes - 1) // chunk_bytes for i, j in enumerate(jobs)}
    inflight: deque = deque()  # (event, slot), in issue order
    rr = 0
    ts = readers.run(reader)
    try:
        for _ in range(len(chunks)):
            while True:
                readers.raise_first()
                _check_cancel(cancel)
                # give back ring slots whose copies are done, oldest first
                while inflight and inflight[0][0].query():
                    free.put(inflight.popleft()[1])
                try:
                    c, slot = ready.get(timeout=0.0005 if inflight else 0.05)
                    break
                except queue.Empty:
                    if inflight and free.qsize() == 0:
                        inflight[0][0].synchronize()  # readers are starved: wait for the oldest copy
            j = jobs[c.job]
            staged = j.staged
            if staged:
                si = staged_stream.setdefault(c.job, c.job % nstreams)  # one stream per staged job
            else:
                si, rr = rr, (rr + 1) % nstreams
            s = streams[si]
            with torch.cuda.stream(s) if cuda else contextlib.nullcontext():
                if staged:
                    if c.job not in staging:
                        staging[c.job] = torch.empty(j.nbytes, dtype=torch.uint8, device=device)
                    dst = staging[c.job]
                else:
                    dst = _byte_view(j.dst)
                dst[c.start:c.start + c.length].copy_(ring[slot][:c.length], non_blocking=True)
                remaining[c.job] -= 1
                if staged and remaining[c.job] == 0:
                    buf = staging.pop(c.job)
                    j.finish(buf)
                    if cuda:
                        buf.record_stream(s)  # freed here, reused only after this stream's finish
                ev = torch.cuda.Event() if cuda else _DoneEvent()
                ev.record(s)
            inflight.append((ev, slot))
    finally:
        readers.stop.set()
        for _ in range(threads):
            free.put(None)  # wake readers blocked on the ring
        for t in ts:
            t.join()
        for s in streams:
            if s is not None:
                s.synchronize()
        readers.close()
    readers.raise_first()
    return len(chunks)


# While weights stream, a thread that wants the GIL gets it within this many seconds (Python's
# default is 5 ms). Every chunk takes the GIL a few times (reader and copier hand it between
# them); beside a thread running Python — the runner's build beside a restart's load — each of
# those waits out the busy thread's interval: on the H200, 8 MiB chunks beside such a thread moved
# 0.1-0.4 GB/s against 31-35 alone (docs/perf.md, load_bench at 12ec5ef).
SWITCH_INTERVAL_S = 0.0005
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


@contextlib.contextmanager
def _responsive_gil():
    """The GIL's switch interval at SWITCH_INTERVAL_S while any stream runs, then restored."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, SWITCH_INTERVAL_S))
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


def stream_to_device(jobs: list[CopyJob], threads: int = 4, ring_bytes: int = 256 << 20, streams: int = 2,
                     chunk_bytes: int = 16 << 20, use_ring: bool | None = None,
                     cancel: threading.Event | None = None) -> StreamStats:
    """Copy every job's file bytes into its destination; returns when all have landed.

    CUDA destinations go through ``ring_bytes`` of pinned buffers (``chunk_bytes`` each) and
    ``streams`` copy streams; CPU destinations are read into directly unless ``use_ring`` (the
    ring with plain buffers and synchronous copies: how the CPU tests drive the ring logic).
    All destinations of one call must be on one device. ``cancel``: checked before each chunk.
    """
    if threads < 1 or streams < 1 or chunk_bytes < 4096 or ring_bytes < chunk_bytes:
        raise WeightStreamError("need threads >= 1, streams >= 1, chunk_bytes >= 4096, ring_bytes >= chunk_bytes")
    _validate(jobs)
    jobs = [j for j in jobs if j.nbytes > 0]
    t0 = time.perf_counter()
    if not jobs:
        return StreamStats(0, 0.0, 0)
    devices = {j.dst.device for j in jobs}
    if len(devices) > 1:
        raise WeightStreamError(f"destinations span several devices: {sorted(map(str, devices))}")
    dev = devices.pop()
    if dev.type not in ("cuda", "cpu"):
        raise WeightStreamError(f"unsupported destination device {dev}")
    with _responsive_gil():
        if dev.type == "cuda" or use_ring:
            n = _ring_stream(jobs, threads, ring_bytes, chunk_bytes, streams, cancel)
        else:
            n = _cpu_stream(jobs, threads, chunk_bytes, cancel)
    return StreamStats(sum(j.nbytes for j in jobs), time.perf_counter() - t0, n)
