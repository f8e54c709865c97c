"""Parallel, resumable, verified download of one blob into ``blobs/sha256/<hex>``.

The blob is cut into parts fetched by ranged GETs in parallel threads, each pinned to the ETag
seen at the start (If-Match). A part's bytes are written with ``pwrite`` into a preallocated
``partial/<hex>.partial``; when a part is complete the file is fdatasync'd and the part's index
appended (and fsync'd) to ``partial/<hex>.state``, so a restarted process fetches only the parts
that are missing. A hasher follows the parts in file order while they arrive, so verification
overlaps the download; the sha256 of the whole file must match before the file is fsync'd and
renamed into the blob folder (and the folder fsync'd). A changed ETag throws the partial away and
starts over; a digest mismatch throws it away and raises IntegrityError.

This module is blocking: :class:`cache.disk_cache.DiskCache` runs it in a worker thread.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cache.errors import (Aborted, CacheError, CacheFullError, ETagChangedError, IntegrityError, SafetensorsError,
                          StoreError)
from cache.fsync import fsync_dir
from cache.progress import Progress
from cache.retry import RetryPolicy, call_with_retries
from cache.object_store import ObjectInfo, RangeReader, Store, blob_key

STATE_VERSION = 1
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class DownloadConfig:
    part_size: int = 32 << 20  # 16–64 MiB in production; tests use KiB to span many parts
    concurrency: int = 16  # starting number of parts in flight
    min_concurrency: int = 2
    max_concurrency: int = 32
    buffer_size: int = 1 << 20  # socket → pwrite chunk
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_restarts: int = 3  # whole-blob restarts after the object's ETag changed
    parallel_blobs: int = 4  # files of one model downloaded side by side (sharing the part limit)
    fsync: bool = True

    def __post_init__(self) -> None:
        if self.part_size < 1024:
            raise ValueError("part_size must be at least 1 KiB")
        if not 1 <= self.min_concurrency <= self.concurrency <= self.max_concurrency <= 256:
            raise ValueError("need 1 <= min_concurrency <= concurrency <= max_concurrency <= 256")
        if not 1 <= self.parallel_blobs <= 64:
            raise ValueError("parallel_blobs must be in [1, 64]")


class PartLimiter:
    """Additive increase, multiplicative decrease of the parts in flight.

    Throttling (429/503) halves the limit; each run of ``limit`` clean parts raises it by one.
    One limiter may be shared by the blobs of a pull downloaded side by side.
    """

    def __init__(self, cfg: DownloadConfig) -> None:
        self.limit = cfg.concurrency
        self._min, self._max = cfg.min_concurrency, cfg.max_concurrency
        self._active = 0
        self._ok = 0
        self._cond = threading.Condition()

    def acquire(self, abort: threading.Event) -> bool:
        with self._cond:
            while self._active >= self.limit:
                if abort.is_set():
                    return False
                self._cond.wait(0.1)
            if abort.is_set():
                return False
            self._active += 1
            return True

    def release(self, ok: bool) -> None:
        with self._cond:
            self._active -= 1
            if ok:
                self._ok += 1
                if self._ok >= self.limit and self.limit < self._max:
                    self.limit += 1
                    self._ok = 0
            self._cond.notify_all()

    def throttled(self) -> None:
        with self._cond:
            self.limit = max(self._min, self.limit // 2)
            self._ok = 0


def _disk_error(e: OSError, what: str) -> CacheError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheFullError(f"{what}: no space left on the cache disk")
    return CacheError(f"{what}: {e}")


class _State:
    """The ``.state`` file: a JSON header line, then one finished part index per line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, header: dict) -> set[int]:
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return set()
        try:
            if json.loads(lines[0]) != header:
                return set()
            # The last element is what follows the final newline: empty, or a torn write.
            return {int(x) for x in lines[1:-1] if x}
        except ValueError:
            return set()

    def create(self, header: dict, fsync: bool) -> None:
        with open(self.path, "wb") as f:
            f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
            if fsync:
                os.fsync(f.fileno())


def download_blob(store: Store, digest: str, size: int, partial_dir: Path, blobs_dir: Path,
                  cfg: DownloadConfig | None = None, progress: Progress | None = None,
                  abort: threading.Event | None = None, check: Callable[[Path], None] | None = None,
                  limiter: PartLimiter | None = None) -> Path:
    """Fetch blob ``digest`` of ``size`` bytes into ``blobs_dir/<digest>`` and return that path.

    Raises IntegrityError (digest or size mismatch), CacheFullError (ENOSPC), StoreError (after
    retries), Aborted (``abort`` set), or whatever ``check`` raises: it sees the verified file
    before the rename (the safetensors header check). On any failure nothing appears in
    ``blobs_dir``; a partial file stays only when resuming it later can help (transient store
    errors, cancellation).
    """
    cfg = cfg or DownloadConfig()
    progress = progress or Progress()
    abort = abort or threading.Event()
    dest = blobs_dir / digest
    if dest.exists() and dest.stat().st_size == size:
        progress.add_resumed(size)
        return dest
    partial_dir.mkdir(parents=True, exist_ok=True)
    blobs_dir.mkdir(parents=True, exist_ok=True)
    if size == 0:
        if digest != EMPTY_SHA256:
            raise IntegrityError(f"blob {digest}: the manifest gives size 0 but a non-empty digest")
        _commit_empty(dest, cfg)
        return dest
    for restart in range(cfg.max_restarts + 1):
        try:
            return _download_once(store, digest, size, partial_dir, dest, cfg, progress, abort, check, limiter)
        except ETagChangedError:
            # The object was replaced mid-pull: none of the bytes can be trusted to belong together.
            _discard(partial_dir, digest)
            if restart == cfg.max_restarts:
                raise
            progress.add_retry()
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def _discard(partial_dir: Path, digest: str) -> None:
    (partial_dir / f"{digest}.partial").unlink(missing_ok=True)
    (partial_dir / f"{digest}.state").unlink(missing_ok=True)


def _commit_empty(dest: Path, cfg: DownloadConfig) -> None:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        if cfg.fsync:
            os.fsync(f.fileno())
    os.replace(tmp, dest)
    if cfg.fsync:
        fsync_dir(dest.parent)


def _download_once(store: Store, digest: str, size: int, partial_dir: Path, dest: Path, cfg: DownloadConfig,
                   progress: Progress, abort: threading.Event, check: Callable[[Path], None] | None,
                   limiter: PartLimiter | None) -> Path:
    key = blob_key(digest)
    info: ObjectInfo = call_with_retries(lambda: store.head(key), cfg.retry, f"HEAD {key}", abort=abort)
    if info.size != size:
        raise IntegrityError(f"blob {digest}: the store has {info.size} bytes, the manifest says {size}")
    partial = partial_dir / f"{digest}.partial"
    state = _State(partial_dir / f"{digest}.state")
    header = {"v": STATE_VERSION, "digest": digest, "size": size, "etag": info.etag, "part_size": cfg.part_size}
    nparts = (size + cfg.part_size - 1) // cfg.part_size
    done = {i for i in state.load(header) if 0 <= i < nparts}
    if done and not (partial.exists() and partial.stat().st_size == size):
        done = set()
    if done:
        try:
            fd = os.open(partial, os.O_RDWR)
        except OSError:  # e.g. made read-only just before a crash: start over
            done = set()
    if not done:
        _discard(partial_dir, digest)
        try:
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)  # fail now, not after minutes of download
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    os.ftruncate(fd, size)
                else:
                    raise
            state.create(header, cfg.fsync)
        except OSError as e:
            _discard(partial_dir, digest)
            raise _disk_error(e, f"blob {digest}") from None
    else:
        progress.add_resumed(sum(min(cfg.part_size, size - i * cfg.part_size) for i in done))
    try:
        _fetch_and_hash(store, key, info, digest, size, fd, state, done, nparts, cfg, progress, abort, limiter)
        if check is not None:
            check(partial)
        os.fchmod(fd, 0o444)  # blobs are immutable; the snapshot's hard links share this inode
        if cfg.fsync:
            os.fsync(fd)
    except (IntegrityError, CacheFullError, SafetensorsError):
        _discard(partial_dir, digest)
        raise
    finally:
        os.close(fd)
    os.rename(partial, dest)
    if cfg.fsync:
        fsync_dir(dest.parent)
    state.path.unlink(missing_ok=True)
    return dest


def _fetch_and_hash(store: Store, key: str, info: ObjectInfo, digest: str, size: int, fd: int, state: _State,
                    done: set[int], nparts: int, cfg: DownloadConfig, progress: Progress,
                    abort: threading.Event, limiter: PartLimiter | None) -> None:
    ps = cfg.part_size
    finished = [i in done for i in range(nparts)]
    cond = threading.Condition()
    failure: list[BaseException] = []
    stop = threading.Event()  # set on the first failure or on abort
    conc = limiter or PartLimiter(cfg)
    queue = [i for i in range(nparts) if not finished[i]]
    queue.reverse()  # pop() from the end takes the lowest index first: the hasher follows closely
    state_fd = os.open(state.path, os.O_WRONLY | os.O_APPEND)

    readers = _Readers()

    def watch_abort() -> None:
        while not stop.is_set():
            if abort.wait(0.1):
                stop.set()
                readers.interrupt_all()
                with cond:
                    cond.notify_all()

    closed = [False]  # the state file's descriptor closed (under cond): a late part records nothing

    def worker(own_fd: int) -> None:
        buf = bytearray(cfg.buffer_size)
        view = memoryview(buf)
        try:
            while not stop.is_set():
                if not conc.acquire(stop):
                    return
                with cond:
                    if not queue:
                        conc.release(ok=False)
                        return
                    idx = queue.pop()
                ok = False
                try:
                    _fetch_part(store, key, info, idx * ps, min(size, (idx + 1) * ps), own_fd, view, cfg, conc,
                                progress, stop, readers)
                    if cfg.fsync:
                        os.fdatasync(own_fd)  # the part's bytes are durable before it is recorded
                    with cond:
                        if not closed[0]:
                            os.write(state_fd, f"{idx}\n".encode())
                            if cfg.fsync:
                                os.fsync(state_fd)
                            finished[idx] = True
                        cond.notify_all()
                    ok = True
                except BaseException as e:  # noqa: BLE001 - handed to the hashing thread, re-raised there
                    with cond:
                        failure.append(e)
                        stop.set()
                        cond.notify_all()
                finally:
                    conc.release(ok)
        finally:
            os.close(own_fd)

    # Daemon threads, each writing through a descriptor of its own, instead of a pool joined on the
    # way out: a part whose request the store never answers (no headers: nothing to interrupt) held
    # a cancel, and the agent's exit, for the read timeout (30 s). Cancelled, the download leaves
    # such a part behind; it records nothing once the state file is closed, stops before its
    # first read (its reader is interrupted as it opens), and its writes, if any, go to this
    # partial file's inode whatever the closed descriptor's number is reused for.
    nthreads = min(cfg.max_concurrency, len(queue))
    watcher = threading.Thread(target=watch_abort, daemon=True)
    watcher.start()
    h = hashlib.sha256()
    threads: list[threading.Thread] = []
    try:
        try:
            for i in range(nthreads):
                own_fd = os.dup(fd)
                try:
                    t = threading.Thread(target=worker, args=(own_fd,), name=f"blob-part-{i}", daemon=True)
                    t.start()
                except RuntimeError as e:  # "can't start new thread": the started parts stop below
                    os.close(own_fd)
                    raise CacheError(f"blob {digest}: {e}") from None
                threads.append(t)
            _hash_in_order(fd, h, finished, cond, failure, stop, nparts, ps, size)
        except OSError as e:  # no descriptor to spare, or the partial file unreadable
            raise _disk_error(e, f"blob {digest}") from None
        finally:
            stop.set()
            readers.interrupt_all()  # a failure's, as a cancel's: the other parts' reads end now
            with cond:
                cond.notify_all()
            _join_parts(threads, abort)
    finally:
        with cond:
            closed[0] = True
            os.close(state_fd)
        stop.set()
        watcher.join()
    if failure:
        e = failure[0]
        if isinstance(e, OSError):
            raise _disk_error(e, f"blob {digest}") from None
        raise e
    if abort.is_set():
        raise Aborted(f"blob {digest}: download cancelled")
    got = h.hexdigest()
    if got != digest:
        raise IntegrityError(f"blob {digest}: downloaded bytes hash to {got}; nothing was committed (the store's "
                             "copy is not what its name says: publish the model again with --reupload)")


# How long a cancelled download waits for its part threads to see the stop: a read in a body
# returns as soon as its reader is interrupted; longer is a request with no answer yet.
_CANCEL_JOIN_S = 1.0


def _join_parts(threads: list[threading.Thread], abort: threading.Event) -> None:
    """Wait for the part threads: all of them, unless the download is cancelled (before or while
    this waits); then for :data:`_CANCEL_JOIN_S` from the cancel at most, leaving behind those
    still waiting on the store."""
    deadline: float | None = None
    for t in threads:
        while t.is_alive():
            if abort.is_set():
                deadline = deadline or time.monotonic() + _CANCEL_JOIN_S
                if time.monotonic() >= deadline:
                    return
            t.join(0.1)


def _hash_in_order(fd: int, h: "hashlib._Hash", finished: list[bool], cond: threading.Condition,
                   failure: list[BaseException], stop: threading.Event, nparts: int, ps: int, size: int) -> None:
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    for idx in range(nparts):
        with cond:
            while not finished[idx] and not failure and not stop.is_set():
                cond.wait(0.2)
            if not finished[idx]:
                return
        off, end = idx * ps, min(size, (idx + 1) * ps)
        while off < end:
            # Read back from the page cache (the part was just written) into one reused buffer.
            n = os.preadv(fd, [view[: min(len(view), end - off)]], off)
            if n <= 0:
                raise IntegrityError(f"partial file is shorter than expected at {off}")
            h.update(view[:n])
            off += n


class _Readers:
    """The ranged reads of one blob in flight, so a cancel ends a read blocked on a stalled
    connection at once: the part's thread otherwise waited for the store's read timeout (30 s),
    and the cancel, and an agent's exit, with it."""

    def __init__(self) -> None:
        self._open: set[RangeReader] = set()
        self._lock = threading.Lock()
        self._interrupted = False

    def add(self, reader: RangeReader) -> None:
        with self._lock:
            self._open.add(reader)
            if self._interrupted:
                reader.interrupt()

    def discard(self, reader: RangeReader) -> None:
        with self._lock:
            self._open.discard(reader)

    def interrupt_all(self) -> None:
        with self._lock:
            self._interrupted = True
            for r in self._open:
                r.interrupt()


def _fetch_part(store: Store, key: str, info: ObjectInfo, start: int, end: int, fd: int, view: memoryview,
                cfg: DownloadConfig, conc: PartLimiter, progress: Progress, stop: threading.Event,
                readers: _Readers) -> None:
    """Fetch ``[start, end)`` into the file, resuming within the part after transient errors."""
    pos = start
    attempt = 0
    while pos < end:
        if stop.is_set():
            raise Aborted("stopped")
        before = pos
        try:
            reader = store.open_range(key, pos, end, info.etag, info.size)
            readers.add(reader)
            try:
                while pos < end:
                    if stop.is_set():
                        raise Aborted("stopped")
                    n = reader.readinto(view[: min(len(view), end - pos)])
                    if n <= 0:
                        raise StoreError(f"{key}: body ended {end - pos} bytes early", retryable=True)
                    written = 0
                    while written < n:
                        written += os.pwrite(fd, view[written:n], pos + written)
                    pos += n
                    progress.add(n)
            finally:
                readers.discard(reader)
                reader.close()
        except ETagChangedError:
            raise
        except StoreError as e:
            if stop.is_set():  # the download is over (a part left behind by a cancel): count nothing
                raise Aborted("stopped") from None
            if not e.retryable:
                raise
            attempt = 1 if pos > before else attempt + 1  # progress made: the link works, start over
            if attempt >= cfg.retry.attempts:
                raise StoreError(f"{e} (gave up after {attempt} tries)", status=e.status) from None
            if e.status in (429, 503):
                conc.throttled()
            progress.add_retry()
            if stop.wait(cfg.retry.delay(attempt, e)):
                raise Aborted("stopped") from None
