"""LRU eviction for the disk cache: ``plan`` decides (pure), ``evict`` applies it.

Usage is the bytes of blobs plus partial files. When a pull would bring usage above the high
watermark, whole models are evicted, least recently used first, until usage plus the incoming
bytes is under the low watermark. Blobs no model references (left by an interrupted pull or a
replaced model version) go first. Pinned models, the model being pulled and blobs it needs are
never chosen. If even evicting everything allowed cannot make room under ``max_bytes``, nothing
is evicted and CacheFullError is raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache import snapshot
from cache.errors import CacheFullError
from cache.locks import FileLock

if TYPE_CHECKING:
    from cache.disk_cache import DiskCache


@dataclass(frozen=True)
class ModelUse:
    name: str
    blobs: frozenset[str]
    last_used: float
    pinned: bool


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]  # to remove, in order
    blobs: tuple[str, ...]  # to delete afterwards
    freed: int


def plan(models: list[ModelUse], blob_sizes: dict[str, int], orphan_mtimes: dict[str, float], used: int,
         incoming: int, max_bytes: int, high: float, low: float, keep_blobs: frozenset[str] = frozenset(),
         keep_models: frozenset[str] = frozenset()) -> Plan:
    if incoming > max_bytes:
        raise CacheFullError(f"{incoming} bytes do not fit in a cache of {max_bytes} bytes")
    if used + incoming <= high * max_bytes:
        return Plan((), (), 0)
    target = low * max_bytes
    refs: dict[str, int] = {}
    for m in models:
        for b in m.blobs:
            refs[b] = refs.get(b, 0) + 1
    freed = 0
    victims: list[str] = []
    dead: list[str] = []
    for b in sorted(orphan_mtimes, key=lambda b: orphan_mtimes[b]):
        if used - freed + incoming <= target:
            break
        if b in keep_blobs or refs.get(b):
            continue
        dead.append(b)
        freed += blob_sizes.get(b, 0)
    for m in sorted(models, key=lambda m: m.last_used):
        if used - freed + incoming <= target:
            break
        if m.pinned or m.name in keep_models:
            continue
        victims.append(m.name)
        for b in m.blobs:
            refs[b] -= 1
            if refs[b] == 0 and b not in keep_blobs:
                dead.append(b)
                freed += blob_sizes.get(b, 0)
    if used - freed + incoming > max_bytes:
        pinned = [m.name for m in models if m.pinned]
        raise CacheFullError(
            f"need {incoming} bytes; the cache holds {used} of {max_bytes} and evicting every unpinned model "
            f"frees only {freed}" + (f" (pinned: {', '.join(pinned)})" if pinned else ""))
    return Plan(tuple(victims), tuple(dead), freed)


def live_blobs(cache: "DiskCache") -> set[str]:
    """Blobs referenced by a committed model or needed by a pull of this process."""
    live = set(cache._active_blobs)
    for name in cache.model_names():
        m = snapshot.read_manifest(cache.models_dir, name)
        if m is not None:
            live |= set(m.unique_blobs())
    return live


def evict(cache: "DiskCache", incoming: int, keep: frozenset[str], keep_blobs: frozenset[str]) -> list[str]:
    """Plan and apply an eviction; the caller holds ``cache.lock``. Returns the evicted models."""
    sizes = cache._blob_sizes()
    uses: list[ModelUse] = []
    referenced: set[str] = set()
    for name in cache.model_names():
        m = snapshot.read_manifest(cache.models_dir, name)
        if m is None:
            continue
        blobs = frozenset(m.unique_blobs())
        referenced |= blobs
        uses.append(ModelUse(name, blobs, snapshot.last_used(cache.models_dir, name),
                             pinned=cache._pinned_anywhere(name)))
    protected = keep_blobs | frozenset(cache._active_blobs)
    orphans = {}
    for d in sizes:
        if d not in referenced and d not in protected:
            try:
                orphans[d] = (cache.blobs_dir / d).stat().st_mtime
            except FileNotFoundError:
                pass
    used = sum(sizes.values()) + cache._partial_bytes()
    p = plan(uses, sizes, orphans, used, incoming, cache.max_bytes, cache.high, cache.low,
             keep_blobs=protected, keep_models=keep)
    for name in p.models:
        lock = FileLock(cache.locks_dir / f"pin-{name}.lock")
        if not lock.try_acquire():  # pinned meanwhile by another process: leave it
            continue
        try:
            snapshot.remove(cache.models_dir, name)
        finally:
            lock.release()
        cache._log.info("cache.evict", model=name)
    live = live_blobs(cache)
    for d in p.blobs:
        if d not in live:
            (cache.blobs_dir / d).unlink(missing_ok=True)
    return list(p.models)


def drop_unreferenced_blobs(cache: "DiskCache") -> int:
    live = live_blobs(cache)
    dropped = 0
    for d in cache._blob_sizes():
        if d not in live:
            (cache.blobs_dir / d).unlink(missing_ok=True)
            dropped += 1
    return dropped
