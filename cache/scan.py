"""Cache maintenance (blocking; run in a thread): scan and stale-partial cleanup.

The scan reports sizes, last use and integrity of every cached model. The size of each blob is
always checked; ``rehash`` re-reads every blob and checks its sha256.
``repair`` drops models with a problem (and the bad blobs), so the next pull fetches them again.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

from cache import manifest as mf
from cache import snapshot
from cache.locks import FileLock

if TYPE_CHECKING:
    from cache.disk_cache import DiskCache


def scan_cache(cache: "DiskCache", rehash: bool = False, repair: bool = False,
               on_file: Callable[[str], None] | None = None) -> dict[str, Any]:
    sizes = cache._blob_sizes()
    hashed: dict[str, bool] = {}
    bad_blobs: set[str] = set()
    models = []
    referenced: set[str] = set()
    for name in cache.model_names():
        problems: list[str] = []
        m = snapshot.read_manifest(cache.models_dir, name)
        if m is None:
            models.append({"name": name, "ok": False, "problems": ["manifest.json unreadable"], "size_bytes": 0,
                           "last_used": snapshot.last_used(cache.models_dir, name), "pinned": cache.is_pinned(name)})
            continue
        referenced |= set(m.unique_blobs())
        snap = cache.models_dir / name / "snapshot"
        for f in m.files:
            blob = cache.blobs_dir / f.sha256
            if f.sha256 not in sizes:
                problems.append(f"{f.path}: blob missing")
                continue
            if sizes[f.sha256] != f.size:
                problems.append(f"{f.path}: blob is {sizes[f.sha256]} bytes, expected {f.size}")
                bad_blobs.add(f.sha256)
                continue
            link = snap / f.path
            try:
                if not os.path.samefile(link, blob):
                    problems.append(f"{f.path}: snapshot entry is not the blob")
            except FileNotFoundError:
                problems.append(f"{f.path}: missing from the snapshot")
            if rehash:
                if f.sha256 not in hashed:
                    if on_file:
                        on_file(f.path)
                    hashed[f.sha256] = mf.hash_file(blob)[1] == f.sha256
                if not hashed[f.sha256]:
                    problems.append(f"{f.path}: sha256 mismatch")
                    bad_blobs.add(f.sha256)
        models.append({"name": name, "ok": not problems, "problems": problems,
                       "size_bytes": sum(m.unique_blobs().values()),
                       "last_used": snapshot.last_used(cache.models_dir, name), "pinned": cache.is_pinned(name)})
    repaired = []
    if repair:
        for entry in models:
            if not entry["ok"] and not cache._pinned_anywhere(entry["name"]):
                snapshot.remove(cache.models_dir, entry["name"])
                repaired.append(entry["name"])
        for d in bad_blobs:
            (cache.blobs_dir / d).unlink(missing_ok=True)
    partials = sorted(p.name for p in cache.partial_dir.glob("*.partial"))
    return {
        "max_bytes": cache.max_bytes,
        "used_bytes": cache.used_bytes(),
        "models": models,
        "orphan_blobs": sorted(d for d in sizes if d not in referenced),
        "partials": partials,
        "removed": repaired,
    }


def clean_partials(cache: "DiskCache") -> int:
    """Remove partial downloads untouched for ``partial_ttl_s`` whose blob lock is free."""
    removed = 0
    now = time.time()
    for p in cache.partial_dir.glob("*.partial"):
        digest = p.name[: -len(".partial")]
        try:
            if now - p.stat().st_mtime < cache.partial_ttl_s:
                continue
        except FileNotFoundError:
            continue
        lock = FileLock(cache.locks_dir / f"blob-{digest}.lock")
        if not lock.try_acquire():  # being downloaded right now
            continue
        try:
            p.unlink(missing_ok=True)
            (cache.partial_dir / f"{digest}.state").unlink(missing_ok=True)
            removed += 1
        finally:
            lock.release()
    snapshot.clean_leftovers(cache.models_dir)
    return removed
