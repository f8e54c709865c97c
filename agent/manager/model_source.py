"""The model manager's view of the disk cache and the store (``ModelSource`` over ``DiskCache``),
and the builds of derived artifacts (cache/derived.py) it starts in the background."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from agent.config import Settings
from agent.log import get_logger
from cache.derived import DerivedStore, content_digest

# A build runs at a low CPU priority: it competes with nothing the agent or the worker does on time.
_NICE = ["nice", "-n", "10"] if shutil.which("nice") else []
DERIVED_FRACTION = 0.6  # an FP8 checkpoint's size against its bf16 source, rounded up


class CacheSource:
    """Pull through ``DiskCache`` from the configured store; pins keep loaded models cached."""

    def __init__(self, cache: Any, store: Any) -> None:
        self.cache = cache
        self.store = store
        self.derived_store = DerivedStore(cache.dir)
        self._builds: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._build_lock: asyncio.Lock | None = None  # one build at a time (made on the loop)
        self._log = get_logger("derived")

    @classmethod
    def from_settings(cls, settings: Settings) -> "CacheSource":
        from cache.disk_cache import DiskCache
        from cache.store import open_store

        store = open_store(settings.store.url, settings.store.endpoint_url or None, settings.store.region,
                           settings.store.path_style)
        return cls(DiskCache(settings.cache.dir, settings.cache.max_bytes), store)

    def snapshot(self, name: str) -> Path | None:
        return self.cache.snapshot_path(name)

    def cached_names(self) -> list[str]:
        return self.cache.model_names()

    def version(self, name: str) -> str | None:
        """The digest of the cached manifest of ``name`` (which published version the cache
        holds); None when it holds none."""
        m = self.cache.manifest(name)
        return m.digest() if m is not None else None

    async def pull(self, name: str, verify: bool = False) -> Path:
        return await self.cache.pull(self.store, name, verify=verify)

    async def check(self, name: str, rehash: bool = False) -> list[str]:
        """What is wrong with the cached files (empty: nothing); ``rehash`` reads every sha256
        and checks the blobs too, else sizes and the hashes of files changed since verified."""
        return (await self.cache.check(name, rehash=rehash, blobs=rehash)).problems()

    async def pin(self, name: str) -> None:
        await self.cache.pin(name)

    def unpin(self, name: str) -> None:
        self.cache.unpin(name)

    def pull_progress(self, name: str) -> dict[str, Any] | None:
        """Bytes done/total, rate and ETA of a pull in progress in this process, else None."""
        return self.cache.pulls_in_progress().get(name)

    def stats(self) -> dict[str, int]:
        """The cache's quota and use (derived artifacts are part of the use: cache/layout.py)."""
        s = self.cache.stats()
        return {"max_bytes": int(s["max_bytes"]), "used_bytes": int(s["used_bytes"])}

    # --- derived artifacts ---------------------------------------------------------------------

    def derived(self, name: str, scheme: str) -> Path | None:
        """The folder of ``scheme`` computed from ``name``'s cached version, when it is whole."""
        m = self.cache.manifest(name)
        return self.derived_store.lookup(scheme, content_digest(m)) if m is not None else None

    def want_derived(self, name: str, scheme: str) -> None:
        """Build ``scheme`` of ``name``'s cached version in the background unless it is there or
        on its way (one build at a time, at low priority; a failure is logged, never raised)."""
        m = self.cache.manifest(name)
        if m is None:
            return
        key = (scheme, content_digest(m))
        running = self._builds.get(key)
        if (running is not None and not running.done()) or self.derived_store.lookup(*key) is not None:
            return
        self._builds[key] = asyncio.get_running_loop().create_task(self._build(name, *key), name=f"derive-{name}")

    def drop_derived(self, name: str, scheme: str) -> None:
        """Remove ``scheme`` of ``name``'s cached version (a load could not read it): the next
        load reads the snapshot and asks for it to be built again."""
        m = self.cache.manifest(name)
        if m is not None:
            self.derived_store.remove(scheme, content_digest(m), why="a load could not read it")
            self._log.warning("derived_dropped", model=name, scheme=scheme)

    async def _build(self, name: str, scheme: str, source: str) -> None:
        if self._build_lock is None:
            self._build_lock = asyncio.Lock()
        async with self._build_lock:
            if self.derived_store.lookup(scheme, source) is not None:
                return
            t0 = time.monotonic()
            await self.cache.pin(name)  # its files stay while they are read
            try:
                src = self.cache.snapshot_path(name)
                m = self.cache.manifest(name)
                if src is None or m is None or content_digest(m) != source:
                    return  # it changed meanwhile: the next FP8 load asks again
                # an artifact never takes the cache past its quota: ~60 % of the model (e4m3
                # projections, the rest as it is); without room it is not built (loads quantize)
                need = int(m.total_size * DERIVED_FRACTION)
                if self.stats()["used_bytes"] + need > self.cache.max_bytes:
                    self._log.warning("derive_skipped", model=name, scheme=scheme, need_bytes=need,
                                      reason="the cache has no room for it within cache.max_bytes")
                    return
                tmp = await asyncio.to_thread(self.derived_store.building, scheme, source)
                proc = await asyncio.create_subprocess_exec(
                    *_NICE, sys.executable, "-m", "engine.weights.fp8_writer", str(src), str(tmp),
                    "--layout", scheme.split("-", 1)[1],
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
                try:
                    _, err = await proc.communicate()
                except asyncio.CancelledError:
                    proc.kill()
                    await proc.wait()
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                if proc.returncode != 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                    self._log.warning("derive_failed", model=name, scheme=scheme,
                                      error=err.decode(errors="replace")[-2000:])
                    return
                path = await asyncio.to_thread(self.derived_store.commit, scheme, source, tmp)
                # what no cached model needs any longer goes (a model evicted since its build)
                live = {content_digest(m) for m in map(self.cache.manifest, self.cache.model_names()) if m}
                await asyncio.to_thread(self.derived_store.sweep, live)
                self._log.info("derived", model=name, scheme=scheme, path=str(path),
                               seconds=round(time.monotonic() - t0, 3))
            except Exception as e:  # noqa: BLE001 - an optimisation: never a reason to fail anything
                self._log.warning("derive_failed", model=name, scheme=scheme, error=f"{type(e).__name__}: {e}")
            finally:
                self.cache.unpin(name)

    async def close_builds(self) -> None:
        """Stop the builds in flight (their partial folders are removed)."""
        for t in self._builds.values():
            t.cancel()
        await asyncio.gather(*self._builds.values(), return_exceptions=True)

    def close(self) -> None:
        self.store.close()
