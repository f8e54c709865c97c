"""DiskCache: verified, content-addressed model cache under a byte quota.

Layout (:mod:`cache.layout`; docs/architecture.md, "Disk cache")::

    blobs/sha256/<hex>                 verified, immutable blobs
    partial/<hex>.partial, .state      resumable downloads
    models/<name>/manifest.json        the committed version of a model
    models/<name>/snapshot/...         HF folder of links into blobs (the engine loads this)
    models/<name>/.last_used           its mtime drives LRU
    locks/                             cross-process flock files

All public coroutines keep the event loop free: store calls, hashing and file work run in
threads. One pull per model and one download per blob run at a time, across coroutines (shared
task) and across processes (flock). ``pin`` holds a shared flock, so a model pinned by the agent
is safe from eviction by a CLI pull in another process too.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import structlog

from cache import eviction, integrity, snapshot
from cache import manifest as mf
from cache.downloader import DownloadConfig, PartLimiter, download_blob
from cache.errors import CacheError, CacheFullError, ModelNotInStore, NotFoundError
from cache.integrity import Report, check as check_snapshot
from cache.layout import CacheLayout
from cache.locks import FileLock
from cache.progress import Progress
from cache.retry import call_with_retries
from cache.safetensors_check import check_file
from cache.scan import clean_partials, scan_cache
from cache.object_store import Store, manifest_key

PIN_WAIT_S = 10.0  # how long a pin waits for another process's exclusive hold of the pin lock


class DiskCache:
    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, *, high_watermark: float = 0.95,
                 low_watermark: float = 0.85, download: DownloadConfig | None = None,
                 partial_ttl_s: float = 24 * 3600.0, progress_log_interval_s: float = 5.0) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.high, self.low = high_watermark, low_watermark
        self.download = download or DownloadConfig()
        self.partial_ttl_s = partial_ttl_s
        self.progress_log_interval_s = progress_log_interval_s
        self.layout = CacheLayout(self.dir)
        self.layout.create()
        self._log = structlog.get_logger("cache").bind(cache_dir=str(self.dir))
        # Told the other models whose snapshots linked a blob a repair found corrupt (see
        # _relink_sharers): a loaded one was read from those bytes.
        self.on_shared_repair: Callable[[list[str]], None] | None = None
        self._pins: dict[str, tuple[int, FileLock]] = {}
        self._inflight: dict[str, tuple[asyncio.Task, list[int]]] = {}
        self._progress: dict[str, Progress] = {}
        self._active_blobs: dict[str, int] = {}  # digests needed by pulls of this process

    # ------------------------------------------------------------ queries

    def snapshot_path(self, name: str) -> Path | None:
        """The snapshot folder of a cached model (complete and verified at pull), else None."""
        mf.validate_name(name)
        p = self.layout.models_dir / name / "snapshot"
        return p if (self.layout.models_dir / name / "manifest.json").is_file() and p.is_dir() else None

    def manifest(self, name: str) -> mf.Manifest | None:
        return snapshot.read_manifest(self.layout.models_dir, mf.validate_name(name))

    def model_names(self) -> list[str]:
        return self.layout.model_names()

    def pulls_in_progress(self) -> dict[str, dict]:
        return {name: p.snapshot() for name, p in self._progress.items()}

    def used_bytes(self) -> int:
        return self.layout.used_bytes()

    def stats(self) -> dict[str, Any]:
        """``{"max_bytes", "used_bytes", "models": [{"name", "size_bytes", "last_used", "pinned", "files"}]}``."""
        sizes = self.layout.blob_sizes()
        models = []
        for name in self.model_names():
            m = snapshot.read_manifest(self.layout.models_dir, name)
            if m is None:
                continue
            models.append({"name": name, "size_bytes": sum(m.unique_blobs().values()),
                           "last_used": snapshot.last_used(self.layout.models_dir, name),
                           "pinned": name in self._pins, "files": len(m.files)})
        return {"max_bytes": self.max_bytes, "used_bytes": self.layout.used_bytes(),
                "models": models, "pulls": self.pulls_in_progress()}

    # ------------------------------------------------------------ pins and LRU

    async def pin(self, name: str, timeout: float = PIN_WAIT_S) -> None:
        """Mark a model loaded/loading: never evicted until the matching ``unpin``.

        Eviction and removal hold the model's pin lock exclusively only briefly; one held longer
        (another process stuck, or hostile) is waited for without blocking the loop, at most
        ``timeout`` seconds, then CacheError.
        """
        mf.validate_name(name)
        count, lock = self._pins.get(name, (0, None))
        if lock is None:
            lock = self.layout.pin_lock(name)
            try:
                await asyncio.wait_for(lock.acquire_async(shared=True), timeout)
            except TimeoutError:
                raise CacheError(f"{name}: its cache pin lock {lock.path} has been held by another process "
                                 f"for over {timeout:g} s (an eviction or removal that did not finish)") from None
        self._pins[name] = (count + 1, lock)
        snapshot.touch(self.layout.models_dir, name)

    def unpin(self, name: str) -> None:
        count, lock = self._pins.get(name, (0, None))
        if lock is None:
            return
        if count <= 1:
            del self._pins[name]
            lock.release()
        else:
            self._pins[name] = (count - 1, lock)
        snapshot.touch(self.layout.models_dir, name)

    def is_pinned(self, name: str) -> bool:
        return name in self._pins

    def touch(self, name: str) -> None:
        """Record a use (LRU)."""
        snapshot.touch(self.layout.models_dir, mf.validate_name(name))

    async def evict_to_fit(self, incoming_bytes: int, keep: frozenset[str] = frozenset(),
                           keep_blobs: frozenset[str] = frozenset()) -> list[str]:
        """Make room for ``incoming_bytes`` under the watermarks; returns the evicted model names.

        Raises CacheFullError (evicting nothing) when the room cannot be made.
        """
        async with FileLock(self.layout.locks_dir / "cache.lock"):
            return await asyncio.to_thread(
                eviction.evict, self.layout, eviction.Quota(self.max_bytes, self.high, self.low), incoming_bytes,
                keep, keep_blobs, active_blobs=self._active_blobs, pinned=self.pinned_anywhere)

    def pinned_anywhere(self, name: str) -> bool:
        """Pinned by this process or by another one (its shared pin flock is held)."""
        return name in self._pins or self.layout.pinned_by_some_process(name)

    # ------------------------------------------------------------ pull

    async def pull(self, store: Store, name: str, progress: Progress | None = None, *, verify: bool = False) -> Path:
        """Make ``name`` complete and verified in the cache; returns its snapshot folder.

        A model already cached is checked first (:mod:`cache.integrity`: sizes, and the sha256 of
        files changed since they were verified; every sha256 with ``verify``) and repaired when
        something is wrong: bad blobs are dropped and fetched again, the snapshot is rebuilt.
        Concurrent calls for one model share a single pull (and the first caller's ``progress``);
        the pull is cancelled only when every caller is. Raises ManifestError (nothing written),
        NotFoundError (not in the store: nothing written, no lock file either), StoreError,
        IntegrityError, CacheFullError, SafetensorsError.
        """
        mf.validate_name(name)
        if name not in self._inflight:
            task = asyncio.create_task(self._pull(store, name, progress or Progress(name), verify))
            entry = (task, [0])
            self._inflight[name] = entry
            task.add_done_callback(lambda _t: self._inflight.pop(name, None)
                                   if self._inflight.get(name) is entry else None)
        task, waiters = self._inflight[name]
        waiters[0] += 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if waiters[0] == 1 and not task.done():
                task.cancel()
                # Return only once the download threads have stopped and the locks are free.
                await asyncio.wait([task])
            raise
        finally:
            waiters[0] -= 1

    async def _pull(self, store: Store, name: str, progress: Progress, verify: bool) -> Path:
        self._progress[name] = progress
        started = time.monotonic()
        logger = asyncio.create_task(self._log_progress(progress))
        try:
            # The manifest first: a name the store does not know leaves nothing behind.
            manifest = await self._fetch_manifest(store, name, progress)
            async with FileLock(self.layout.locks_dir / f"model-{name}.lock"):
                path = await self._pull_locked(store, manifest, progress, verify)
            secs = time.monotonic() - started
            got = progress.downloaded_bytes
            self._log.info("pull.done", model=name, seconds=round(secs, 3), downloaded_bytes=got,
                           mb_s=round(got / secs / 1e6, 1) if secs > 0 else None)
            progress.set_state("done")
            return path
        except asyncio.CancelledError:
            progress.set_state("cancelled")
            self._log.info("pull.cancelled", model=name)
            raise
        except BaseException as e:
            progress.set_state("failed")
            self._log.warning("pull.failed", model=name, error=str(e) or type(e).__name__)
            raise
        finally:
            logger.cancel()
            self._progress.pop(name, None)

    async def _log_progress(self, progress: Progress) -> None:
        while True:
            await asyncio.sleep(self.progress_log_interval_s)
            self._log.info("pull.progress", **{k: v for k, v in progress.snapshot().items() if k != "elapsed_s"})

    async def _fetch_manifest(self, store: Store, name: str, progress: Progress) -> mf.Manifest:
        """The manifest, read in a thread of its own that a cancelled pull leaves at once: told to
        stop retrying, it ends by itself (a read in progress within the store's read timeout) and,
        writing nothing, holds neither the pull nor the process's exit (a hung store kept a
        stopped agent alive for its eight retries, minutes, when the read ran in the loop's
        executor, whose threads an exit waits for)."""
        progress.set_state("manifest")
        abort = threading.Event()
        try:
            raw = await _in_own_thread(lambda: call_with_retries(
                lambda: store.get_bytes(manifest_key(name), mf.MAX_MANIFEST_BYTES), self.download.retry,
                f"manifest of {name}", abort=abort), "manifest")
        except NotFoundError:
            raise ModelNotInStore(f"model {name!r} is not in the store {store.url}", status=404) from None
        except asyncio.CancelledError:
            abort.set()
            raise
        return mf.parse(raw, expected_name=name)

    async def check(self, name: str, rehash: bool = False, blobs: bool = False) -> Report:
        """The integrity of a cached model's snapshot (:mod:`cache.integrity`): as the engine
        reads it, or with ``blobs`` as a pull would keep it; CacheError when it is not cached."""
        m = self.manifest(name)
        if m is None or self.snapshot_path(name) is None:
            raise CacheError(f"{name} is not cached")
        blobs_dir = self.layout.blobs_dir if blobs else None
        return await _in_own_thread(lambda: check_snapshot(self.layout.models_dir / name, m, rehash=rehash,
                                                           blobs_dir=blobs_dir), "cache-check")

    async def _pull_locked(self, store: Store, manifest: mf.Manifest, progress: Progress, verify: bool) -> Path:
        name = manifest.name
        cfg = self.download
        progress.set_total(manifest.total_size)
        current = snapshot.read_manifest(self.layout.models_dir, name)
        bad: set[str] = set()  # blobs whose bytes were wrong: other snapshots may link them too
        if current == manifest and self.snapshot_path(name) is not None:
            progress.set_state("verifying")
            report = await _in_own_thread(lambda: check_snapshot(
                self.layout.models_dir / name, manifest, rehash=verify, blobs_dir=self.layout.blobs_dir), "cache-check")
            if report.ok:
                progress.add_resumed(manifest.total_size)
                self.touch(name)
                return self.layout.models_dir / name / "snapshot"
            self._log.warning("pull.repair", model=name, problems=report.problems())
            for f in report.findings:  # wrong bytes: fetched again below
                if f.bad_blob is not None:
                    bad.add(f.bad_blob)
                    (self.layout.blobs_dir / f.bad_blob).unlink(missing_ok=True)
        self._log.info("pull.start", model=name, files=len(manifest.files), total_bytes=manifest.total_size)
        blobs = manifest.unique_blobs()
        for d in blobs:
            self._active_blobs[d] = self._active_blobs.get(d, 0) + 1
        try:
            await self.cleanup_partials()
            for _round in range(3):
                have = await asyncio.to_thread(self._present, blobs)
                missing = {d: s for d, s in blobs.items() if d not in have}
                await self._reserve(missing, frozenset({name}), frozenset(blobs))
                for f in manifest.files:
                    if f.sha256 in have:
                        progress.add_resumed(f.size)
                        have.discard(f.sha256)  # count a shared blob once
                await self._fetch_blobs(store, manifest, missing, progress)
                progress.set_state("verifying")
                await asyncio.to_thread(self._check_safetensors, manifest)
                path: Path | None = None
                async with FileLock(self.layout.locks_dir / "cache.lock"):
                    # Another process may have evicted an unreferenced blob of ours meanwhile.
                    if len(await asyncio.to_thread(self._present, blobs)) == len(blobs):
                        path = await asyncio.to_thread(snapshot.commit, self.layout.models_dir, self.layout.blobs_dir,
                                                       manifest, cfg.fsync)
                if path is not None:
                    if bad:
                        await self._relink_sharers(bad, name)
                    return path
            raise CacheError(f"{name}: blobs kept disappearing while the snapshot was committed")
        finally:
            for d in blobs:
                self._active_blobs[d] -= 1
                if not self._active_blobs[d]:
                    del self._active_blobs[d]

    async def _relink_sharers(self, bad: set[str], repaired: str) -> None:
        """Every other snapshot that links a blob just found corrupt: flagged, then relinked.

        A repair never writes into the corrupt inode (a reader could see half-written bytes, a
        loaded model maps it): the good bytes came as a new blob, so the hard links of every other
        snapshot still name the corrupt inode. Each such snapshot first loses its record of
        verified files (its next check hashes every file: the corrupt one is found whatever its
        stamp), then is rebuilt over the blobs now in the cache, which records it verified again.
        A snapshot whose model lock is held (being pulled) or whose rebuild fails stays flagged."""
        touched: list[str] = []
        for other in self.model_names():
            m = self.manifest(other) if other != repaired else None
            if m is None or not bad & set(m.unique_blobs()):
                continue
            model_dir = self.layout.models_dir / other
            await asyncio.to_thread(integrity.forget, model_dir)
            touched.append(other)
            lock = FileLock(self.layout.locks_dir / f"model-{other}.lock")
            if not lock.try_acquire():
                self._log.warning("pull.shared_blob_flagged", model=other, repaired_with=repaired)
                continue
            try:
                async with FileLock(self.layout.locks_dir / "cache.lock"):
                    if snapshot.read_manifest(self.layout.models_dir, other) == m:
                        await asyncio.to_thread(snapshot.commit, self.layout.models_dir, self.layout.blobs_dir,
                                                m, self.download.fsync)
                self._log.warning("pull.shared_blob_relinked", model=other, repaired_with=repaired)
            except CacheError as e:
                self._log.warning("pull.shared_blob_flagged", model=other, repaired_with=repaired, error=str(e))
            finally:
                lock.release()
        if touched and self.on_shared_repair is not None:
            self.on_shared_repair(touched)

    def _present(self, blobs: dict[str, int]) -> set[str]:
        out = set()
        for d, size in blobs.items():
            try:
                if (self.layout.blobs_dir / d).stat().st_size == size:
                    out.add(d)
            except FileNotFoundError:
                pass
        return out

    async def _reserve(self, missing: dict[str, int], keep: frozenset[str], keep_blobs: frozenset[str]) -> None:
        """Quota (evicting LRU models) and free disk space for the missing blobs, before any write."""
        partial_have = 0
        for d in missing:
            try:
                partial_have += (self.layout.partial_dir / f"{d}.partial").stat().st_blocks * 512
            except FileNotFoundError:
                pass
        incoming = max(0, sum(missing.values()) - partial_have)
        if not incoming:
            return
        await self.evict_to_fit(incoming, keep, keep_blobs)
        free = shutil.disk_usage(self.dir).free
        if incoming > free:
            raise CacheFullError(f"need {incoming} bytes, the cache disk has {free} free")

    async def _fetch_blobs(self, store: Store, manifest: mf.Manifest, missing: dict[str, int],
                           progress: Progress) -> None:
        """Download missing blobs, ``parallel_blobs`` at a time under one shared part limit.

        Small files go first (their latency overlaps the big ones). After a failure no new blob
        starts, the ones in flight finish (verified blobs are kept for the next try), and the first
        error is raised.
        """
        limiter = PartLimiter(self.download)
        gate = asyncio.Semaphore(self.download.parallel_blobs)
        errors: list[BaseException] = []

        async def one(digest: str, size: int) -> None:
            async with gate:
                if errors:
                    return
                paths = [f.path for f in manifest.files if f.sha256 == digest]
                progress.set_state("downloading", paths[0])
                # A bad safetensors header is refused before the blob enters the cache.
                check = check_file if any(p.endswith(".safetensors") for p in paths) else None
                try:
                    await self._fetch_blob(store, digest, size, progress, check, limiter)
                except Exception as e:  # noqa: BLE001 - re-raised below, after the others settle
                    errors.append(e)

        blobs = [asyncio.ensure_future(one(d, s)) for d, s in sorted(missing.items(), key=lambda kv: kv[1])]
        try:
            await asyncio.gather(*blobs)
        except asyncio.CancelledError:
            # gather ends at the first blob that finished cancelling; the others may still be
            # stopping their threads and holding their blob locks, which a cancel promises free
            for b in blobs:
                b.cancel()
            await asyncio.wait(blobs)
            raise
        if errors:
            raise errors[0]

    async def _fetch_blob(self, store: Store, digest: str, size: int, progress: Progress,
                          check: Callable[[Path], Any] | None, limiter: PartLimiter) -> None:
        async with FileLock(self.layout.locks_dir / f"blob-{digest}.lock"):
            abort = threading.Event()
            fut = _in_own_thread(lambda: download_blob(store, digest, size, self.layout.partial_dir, self.layout.blobs_dir,
                                                       self.download, progress, abort, check, limiter),
                                 "blob-download")
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                abort.set()  # stop the part threads before the blob lock is let go
                try:
                    await fut
                except BaseException:  # noqa: BLE001 - it was cancelled; its error is moot
                    pass
                raise

    def _check_safetensors(self, manifest: mf.Manifest) -> None:
        for f in manifest.files:
            if f.path.endswith(".safetensors"):
                check_file(self.layout.blobs_dir / f.sha256)

    async def cleanup_partials(self) -> int:
        """Remove partial downloads untouched for ``partial_ttl_s`` (and dead commit leftovers)."""
        return await asyncio.to_thread(clean_partials, self.layout, self.partial_ttl_s)

    async def remove(self, name: str) -> None:
        """Drop a model (refused while pinned); its blobs go when no other model uses them."""
        mf.validate_name(name)
        if self.pinned_anywhere(name):
            raise CacheError(f"{name} is pinned (loaded or loading)")
        async with FileLock(self.layout.locks_dir / "cache.lock"):
            await asyncio.to_thread(snapshot.remove, self.layout.models_dir, name)
            await asyncio.to_thread(eviction.drop_unreferenced_blobs, self.layout, self._active_blobs)

    async def scan(self, rehash: bool = False, repair: bool = False,
                   on_file: Callable[[str], None] | None = None) -> dict[str, Any]:
        return await _in_own_thread(lambda: scan_cache(  # a re-hash takes minutes
            self.layout, self.max_bytes, pinned_here=self.is_pinned, pinned_anywhere=self.pinned_anywhere,
            rehash=rehash, repair=repair, on_file=on_file), "cache-scan")


def _in_own_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """Run ``fn`` in a new daemon thread named ``name``, not the loop's default executor.

    A blob download holds its thread for minutes; on a small machine the default executor has
    only a handful of threads, and the agent's other ``to_thread`` work must not queue behind it.
    An exit does not wait for it (the executor's threads it joins).
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut
