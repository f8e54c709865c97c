"""The disk cache's folders and what can be read off them (blocking calls)::

    blobs/sha256/<hex>                 verified, immutable blobs
    partial/<hex>.partial, .state      resumable downloads
    models/<name>/...                  manifest.json, snapshot/, .last_used
    locks/                             cross-process flock files

:class:`~cache.disk_cache.DiskCache` owns one; the maintenance passes it runs under its locks
(:mod:`cache.eviction`, :mod:`cache.scan`) are handed the layout, not the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from cache.derived import DerivedStore
from cache.locks import FileLock


class CacheLayout:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs_dir = root / "blobs" / "sha256"
        self.partial_dir = root / "partial"
        self.models_dir = root / "models"
        self.locks_dir = root / "locks"

    def create(self) -> None:
        for d in (self.blobs_dir, self.partial_dir, self.models_dir, self.locks_dir):
            d.mkdir(parents=True, exist_ok=True)

    def model_names(self) -> list[str]:
        """Models with a committed manifest."""
        return sorted(p.name for p in self.models_dir.iterdir()
                      if not p.name.startswith(".") and (p / "manifest.json").is_file())

    def blob_sizes(self) -> dict[str, int]:
        out = {}
        with os.scandir(self.blobs_dir) as it:
            for e in it:
                if not e.name.startswith("."):
                    out[e.name] = e.stat().st_size
        return out

    def partial_bytes(self) -> int:
        """Disk blocks held by partial downloads (sparse files count what is written)."""
        with os.scandir(self.partial_dir) as it:
            return sum(e.stat().st_blocks * 512 for e in it if e.name.endswith(".partial"))

    def used_bytes(self) -> int:
        """What counts against the quota: blobs, partial downloads and derived artifacts
        (cache/derived.py)."""
        return sum(self.blob_sizes().values()) + self.partial_bytes() + DerivedStore(self.root).used_bytes()

    def pin_lock(self, name: str) -> FileLock:
        """The flock a pin holds shared; eviction and removal take it exclusively."""
        return FileLock(self.locks_dir / f"pin-{name}.lock")

    def pinned_by_some_process(self, name: str) -> bool:
        lock = self.pin_lock(name)
        if lock.try_acquire():
            lock.release()
            return False
        return True
