"""LRU eviction for the disk cache: ``plan`` decides (pure), ``evict`` applies it.

Usage is the bytes of blobs plus partial files. When a pull would bring usage above the high
watermark, whole models are evicted, least recently used first, until usage plus the incoming
bytes is under the low watermark. Blobs no model references (left by an interrupted pull or a
replaced model version) go first. A disk with less free than the incoming bytes (smaller than
the quota, or shared with other data) has models evicted the same way until the shortfall is
covered. Pinned models, the model being pulled and blobs it needs are never chosen. If even
evicting everything allowed cannot make room under ``max_bytes`` and on the disk, nothing is
evicted and CacheFullError is raised.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog

from cache import snapshot
from cache.derived import DerivedStore, content_digest
from cache.errors import CacheFullError
from cache.layout import CacheLayout


@dataclass(frozen=True)
class ModelUse:
    name: str
    blobs: frozenset[str]
    last_used: float
    pinned: bool
    content: str = ""  # its files' digest (cache/derived.py): its derived artifacts go with the last such model


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]  # to remove, in order
    blobs: tuple[str, ...]  # to delete afterwards
    freed: int


def plan(models: list[ModelUse], blob_sizes: dict[str, int], orphan_mtimes: dict[str, float], used: int,
         incoming: int, max_bytes: int, high: float, low: float, keep_blobs: frozenset[str] = frozenset(),
         keep_models: frozenset[str] = frozenset(), derived_sizes: dict[str, int] | None = None,
         disk_free: int | None = None) -> Plan:
    """``derived_sizes``: bytes of derived artifacts by the content digest they were computed
    from; evicting the last model of a content frees them too. ``disk_free``: what the cache's
    disk has free now (None: not limiting). The quota is made room in as the module says; a
    disk with less free than the incoming bytes (one smaller than the quota, or shared) has
    models evicted, least recently used first, until what they free covers the shortfall too."""
    derived_sizes = derived_sizes or {}
    if incoming > max_bytes:
        raise CacheFullError(f"{incoming} bytes do not fit in a cache of {max_bytes} bytes")
    over_quota = used + incoming > high * max_bytes
    disk_short = 0 if disk_free is None else max(0, incoming - disk_free)
    if not over_quota and not disk_short:
        return Plan((), (), 0)
    target = low * max_bytes if over_quota else max_bytes

    def enough(freed: int) -> bool:
        return used - freed + incoming <= target and freed >= disk_short

    refs: dict[str, int] = {}
    contents: dict[str, int] = {}
    for m in models:
        for b in m.blobs:
            refs[b] = refs.get(b, 0) + 1
        contents[m.content] = contents.get(m.content, 0) + 1
    freed = 0
    victims: list[str] = []
    dead: list[str] = []
    for b in sorted(orphan_mtimes, key=lambda b: orphan_mtimes[b]):
        if enough(freed):
            break
        if b in keep_blobs or refs.get(b):
            continue
        dead.append(b)
        freed += blob_sizes.get(b, 0)
    for m in sorted(models, key=lambda m: m.last_used):
        if enough(freed):
            break
        if m.pinned or m.name in keep_models:
            continue
        victims.append(m.name)
        contents[m.content] -= 1
        if contents[m.content] == 0:
            freed += derived_sizes.get(m.content, 0)
        for b in m.blobs:
            refs[b] -= 1
            if refs[b] == 0 and b not in keep_blobs:
                dead.append(b)
                freed += blob_sizes.get(b, 0)
    limit = (f"the cache holds {used} of {max_bytes}" if used - freed + incoming > max_bytes
             else f"the cache disk has {disk_free} free" if freed < disk_short else None)
    if limit is not None:
        pinned = [m.name for m in models if m.pinned]
        also = (f" (pinned: {', '.join(pinned)}: a model's files stay cached while it is loaded or loading; "
                "unload one, or raise cache.max_bytes)") if pinned else ""
        raise CacheFullError(f"need {incoming} bytes; {limit} and evicting every unpinned model frees only {freed}"
                             + also)
    return Plan(tuple(victims), tuple(dead), freed)


@dataclass(frozen=True)
class Quota:
    max_bytes: int
    high: float  # a pull that would bring usage above high * max_bytes evicts ...
    low: float  # ... until usage plus the incoming bytes is under low * max_bytes


def live_blobs(layout: CacheLayout, active_blobs: Collection[str]) -> set[str]:
    """Blobs referenced by a committed model or in ``active_blobs`` (needed by a pull of this process)."""
    live = set(active_blobs)
    for name in layout.model_names():
        m = snapshot.read_manifest(layout.models_dir, name)
        if m is not None:
            live |= set(m.unique_blobs())
    return live


def evict(layout: CacheLayout, quota: Quota, incoming: int, keep: frozenset[str], keep_blobs: frozenset[str], *,
          active_blobs: Collection[str], pinned: Callable[[str], bool]) -> list[str]:
    """Plan and apply an eviction; the caller holds ``cache.lock``. Returns the evicted models.

    ``pinned(name)``: the model is pinned by this process or another one."""
    log = structlog.get_logger("cache").bind(cache_dir=str(layout.root))
    sizes = layout.blob_sizes()
    uses: list[ModelUse] = []
    referenced: set[str] = set()
    for name in layout.model_names():
        m = snapshot.read_manifest(layout.models_dir, name)
        if m is None:
            continue
        blobs = frozenset(m.unique_blobs())
        referenced |= blobs
        uses.append(ModelUse(name, blobs, snapshot.last_used(layout.models_dir, name), pinned=pinned(name),
                             content=content_digest(m)))
    protected = keep_blobs | frozenset(active_blobs)
    orphans = {}
    for d in sizes:
        if d not in referenced and d not in protected:
            try:
                orphans[d] = (layout.blobs_dir / d).stat().st_mtime
            except FileNotFoundError:
                pass
    derived = DerivedStore(layout.root)  # derived artifacts count against the quota too
    used = sum(sizes.values()) + layout.partial_bytes() + derived.used_bytes()
    p = plan(uses, sizes, orphans, used, incoming, quota.max_bytes, quota.high, quota.low,
             keep_blobs=protected, keep_models=keep, derived_sizes=derived.sizes_by_source(),
             disk_free=shutil.disk_usage(layout.root).free)
    for name in p.models:
        lock = layout.pin_lock(name)
        if not lock.try_acquire():  # pinned meanwhile by another process: leave it
            continue
        try:
            snapshot.remove(layout.models_dir, name)
        finally:
            lock.release()
        log.info("cache.evict", model=name)
    live = live_blobs(layout, active_blobs)
    for d in p.blobs:
        if d not in live:
            (layout.blobs_dir / d).unlink(missing_ok=True)
    if p.models:  # an evicted version's derived artifacts go with it
        kept = (snapshot.read_manifest(layout.models_dir, n) for n in layout.model_names())
        derived.sweep({content_digest(m) for m in kept if m is not None})
    return list(p.models)


def drop_unreferenced_blobs(layout: CacheLayout, active_blobs: Collection[str]) -> int:
    live = live_blobs(layout, active_blobs)
    dropped = 0
    for d in layout.blob_sizes():
        if d not in live:
            (layout.blobs_dir / d).unlink(missing_ok=True)
            dropped += 1
    return dropped
