"""The model manager's view of the disk cache and the store (``ModelSource`` over ``DiskCache``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.config import Settings


class CacheSource:
    """Pull through ``DiskCache`` from the configured store; pins keep loaded models cached."""

    def __init__(self, cache: Any, store: Any) -> None:
        self.cache = cache
        self.store = store

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
        s = self.cache.stats()
        return {"max_bytes": int(s["max_bytes"]), "used_bytes": int(s["used_bytes"])}

    def close(self) -> None:
        self.store.close()
