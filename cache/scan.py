"""Cache maintenance (blocking; run in a thread): scan and stale-partial cleanup.

The scan reports sizes, last use and integrity of every cached model. The size of each blob is
always checked; ``rehash`` re-reads every blob and checks its sha256.
``repair`` drops models with a problem (and the bad blobs), so the next pull fetches them again.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from cache import manifest as mf
from cache import snapshot
from cache.layout import CacheLayout
from cache.locks import FileLock


def scan_cache(layout: CacheLayout, max_bytes: int, *, pinned_here: Callable[[str], bool],
               pinned_anywhere: Callable[[str], bool], rehash: bool = False, repair: bool = False,
               on_file: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``pinned_here``: pinned by this process (reported); ``pinned_anywhere``: by any (kept by a repair)."""
    sizes = layout.blob_sizes()
    hashed: dict[str, bool] = {}
    bad_blobs: set[str] = set()
    models = []
    referenced: set[str] = set()
    for name in layout.model_names():
        problems: list[str] = []
        m = snapshot.read_manifest(layout.models_dir, name)
        if m is None:
            models.append({"name": name, "ok": False, "problems": ["manifest.json unreadable"], "size_bytes": 0,
                           "last_used": snapshot.last_used(layout.models_dir, name), "pinned": pinned_here(name)})
            continue
        referenced |= set(m.unique_blobs())
        snap = layout.models_dir / name / "snapshot"
        for f in m.files:
            blob = layout.blobs_dir / f.sha256
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
                       "last_used": snapshot.last_used(layout.models_dir, name), "pinned": pinned_here(name)})
    repaired = []
    if repair:
        for entry in models:
            if not entry["ok"] and not pinned_anywhere(entry["name"]):
                snapshot.remove(layout.models_dir, entry["name"])
                repaired.append(entry["name"])
        for d in bad_blobs:
            (layout.blobs_dir / d).unlink(missing_ok=True)
    partials = sorted(p.name for p in layout.partial_dir.glob("*.partial"))
    return {
        "max_bytes": max_bytes,
        "used_bytes": layout.used_bytes(),
        "models": models,
        "orphan_blobs": sorted(d for d in sizes if d not in referenced),
        "partials": partials,
        "removed": repaired,
    }


def clean_partials(layout: CacheLayout, ttl_s: float) -> int:
    """Remove partial downloads untouched for ``ttl_s`` whose blob lock is free, and the state
    files of downloads that finished."""
    removed = 0
    now = time.time()
    for p in layout.partial_dir.glob("*.partial"):
        digest = p.name[: -len(".partial")]
        try:
            if now - p.stat().st_mtime < ttl_s:
                continue
        except FileNotFoundError:
            continue
        lock = FileLock(layout.locks_dir / f"blob-{digest}.lock")
        if not lock.try_acquire():  # being downloaded right now
            continue
        try:
            p.unlink(missing_ok=True)
            (layout.partial_dir / f"{digest}.state").unlink(missing_ok=True)
            removed += 1
        finally:
            lock.release()
    # A state whose download finished (its blob is in place, no partial): a process killed
    # between the blob's rename and the state's unlink left it behind.
    for st in layout.partial_dir.glob("*.state"):
        digest = st.name[: -len(".state")]
        if (layout.partial_dir / f"{digest}.partial").exists() or not (layout.blobs_dir / digest).exists():
            continue
        lock = FileLock(layout.locks_dir / f"blob-{digest}.lock")
        if lock.try_acquire():
            try:
                st.unlink(missing_ok=True)
            finally:
                lock.release()
    snapshot.clean_leftovers(layout.models_dir)
    return removed
