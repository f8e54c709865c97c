"""Quota, LRU eviction with pins, stale partials, scan, and a full disk (tmpfs or an ENOSPC quota)."""

from __future__ import annotations

import errno
import os
import time

import pytest

from cache.disk_cache import DiskCache

from cache.errors import CacheError, CacheFullError

from cache.file_store import FileStore
from cache.publish import publish_model
from tests.s3_fault_proxy import fast_download, make_model, tree_files
from tests.tmpfs import small_tmpfs

MIB = 1 << 20


@pytest.fixture
def store(tmp_path):
    s = FileStore(tmp_path / "store")
    sizes = {}
    for i, name in enumerate("abcde"):
        m = publish_model(s, make_model(tmp_path / f"src-{name}", data_bytes=MIB, seed=i), name)
        sizes[name] = m.total_size
    s.sizes = sizes
    return s


def _cache(tmp_path, max_bytes, **kw) -> DiskCache:
    return DiskCache(tmp_path / "cache", max_bytes, download=fast_download(part_size=256 << 10), **kw)


async def test_lru_eviction_keeps_pinned_and_recent(tmp_path, store):
    one = store.sizes["a"]
    cache = _cache(tmp_path, int(one * 4), high_watermark=0.95, low_watermark=0.85)
    for name in "abc":
        await cache.pull(store, name)
        time.sleep(0.02)
    await cache.pin("b")  # b is the least recently pulled, but loaded
    time.sleep(0.02)
    cache.touch("a")
    await cache.pull(store, "d")  # 4 models > 95 %: evict down to 85 %, i.e. one model
    assert [m["name"] for m in cache.stats()["models"]] == ["a", "b", "d"]
    assert cache.snapshot_path("c") is None
    blobs = set(os.listdir(tmp_path / "cache/blobs/sha256"))
    assert blobs == {f.sha256 for n in "abd" for f in cache.manifest(n).files}  # c's blobs went too
    st = cache.stats()
    assert st["used_bytes"] == sum(store.sizes[n] for n in "abd") and st["max_bytes"] == int(one * 4)
    assert next(m for m in st["models"] if m["name"] == "b")["pinned"]


async def test_everything_pinned_means_cache_full_and_nothing_changes(tmp_path, store):
    cache = _cache(tmp_path, int(store.sizes["a"] * 2.5))
    for name in "ab":
        await cache.pull(store, name)
        await cache.pin(name)
    before = tree_files(tmp_path / "cache")
    with pytest.raises(CacheFullError, match="pinned: a, b"):
        await cache.pull(store, "c")
    assert tree_files(tmp_path / "cache") == before
    cache.unpin("a")
    await cache.pull(store, "c")  # now a may go
    assert cache.snapshot_path("a") is None and cache.snapshot_path("b") and cache.snapshot_path("c")


async def test_pin_held_by_another_process_blocks_eviction(tmp_path, store):
    cache = _cache(tmp_path, int(store.sizes["a"] * 2.5))
    await cache.pull(store, "a")
    await cache.pull(store, "b")
    agent = _cache(tmp_path, int(store.sizes["a"] * 2.5))  # another holder of the same folder
    await agent.pin("a")
    await agent.pin("b")
    with pytest.raises(CacheFullError):
        await cache.pull(store, "c")
    with pytest.raises(CacheError, match="pinned"):
        await cache.remove("a")
    agent.unpin("b")
    await cache.pull(store, "c")
    assert cache.snapshot_path("b") is None and cache.snapshot_path("a") is not None


async def test_model_larger_than_quota_writes_nothing(tmp_path, store):
    cache = _cache(tmp_path, MIB // 2)
    with pytest.raises(CacheFullError, match="do not fit"):
        await cache.pull(store, "a")
    assert tree_files(tmp_path / "cache") == []


async def test_stale_partials_are_cleaned_after_ttl(tmp_path, store):
    cache = _cache(tmp_path, 100 * MIB, partial_ttl_s=3600)
    part = tmp_path / "cache/partial"
    stale, fresh = part / f"{'1' * 64}.partial", part / f"{'2' * 64}.partial"
    for p in (stale, fresh):
        p.write_bytes(b"x" * 1000)
        p.with_suffix(".state").write_text("{}\n")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    await cache.pull(store, "a")
    assert not stale.exists() and not stale.with_suffix(".state").exists()
    assert fresh.exists()


async def test_scan_finds_corruption_and_repair_refetches(tmp_path, store):
    cache = _cache(tmp_path, 100 * MIB)
    await cache.pull(store, "a")
    w = next(f for f in cache.manifest("a").files if f.path == "model.safetensors")
    blob = tmp_path / "cache/blobs/sha256" / w.sha256
    blob.chmod(0o644)  # blobs are read-only; bit rot does not ask
    with open(blob, "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 1]))
    assert (await cache.scan())["models"][0]["ok"]  # sizes agree: only a re-hash can tell
    report = await cache.scan(rehash=True, repair=True)
    assert not report["models"][0]["ok"] and "sha256 mismatch" in report["models"][0]["problems"][0]
    assert report["removed"] == ["a"] and not blob.exists() and cache.snapshot_path("a") is None
    await cache.pull(store, "a")
    assert (await cache.scan(rehash=True))["models"][0]["ok"]


# ------------------------------------------------------------------ a full disk


@pytest.fixture
def small_fs(tmp_path):
    """A real 768 KiB tmpfs (needs CAP_SYS_ADMIN); skipped where mounting is not allowed."""
    with small_tmpfs(tmp_path, "768k") as mnt:
        yield mnt


async def test_disk_smaller_than_quota_fails_before_writing(small_fs, store):
    cache = DiskCache(small_fs / "cache", 100 * MIB, download=fast_download())
    with pytest.raises(CacheFullError, match="free"):
        await cache.pull(store, "a")
    assert tree_files(small_fs / "cache") == []


async def test_enospc_mid_download_on_tmpfs(small_fs, store, monkeypatch):
    """Space vanishes after the free-space check (another writer): real ENOSPC from pwrite."""
    import shutil

    import cache.disk_cache as dc
    import cache.downloader as dl

    real_usage = shutil.disk_usage
    monkeypatch.setattr(dc.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 40))
    # No preallocation (as on filesystems without fallocate), so the write itself hits the wall.
    monkeypatch.setattr(dl.os, "posix_fallocate", lambda fd, o, n: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "no")))
    cache = DiskCache(small_fs / "cache", 100 * MIB, download=fast_download())
    with pytest.raises(CacheFullError, match="no space"):
        await cache.pull(store, "a")
    files = tree_files(small_fs / "cache")
    assert not any(f.startswith(("models/", "partial/")) for f in files), files
    assert cache.snapshot_path("a") is None


async def test_enospc_under_an_emulated_quota(tmp_path, store, monkeypatch):
    """Where no tmpfs can be mounted: pwrite raises ENOSPC once 600 KiB were written."""
    import cache.downloader as dl

    real_pwrite = os.pwrite
    budget = [600 << 10]

    def pwrite(fd, data, offset):
        if budget[0] < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= len(data)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(dl.os, "pwrite", pwrite)
    cache = _cache(tmp_path, 100 * MIB)
    with pytest.raises(CacheFullError):
        await cache.pull(store, "a")
    files = tree_files(tmp_path / "cache")
    assert not any(f.startswith(("models/", "partial/")) for f in files), files


# ------------------------------------------------------------------ the planner alone


def _uses(*spec):
    from cache.eviction import ModelUse

    return [ModelUse(n, frozenset({f"{n}1", f"{n}2"}), t, p) for n, t, p in spec]


def test_planner_watermarks_and_shared_blobs():
    from cache.eviction import ModelUse, plan

    sizes = {f"{n}{i}": 10 for n in "abc" for i in (1, 2)}
    models = _uses(("a", 1.0, False), ("b", 2.0, False), ("c", 3.0, False))
    # 60 used + 30 incoming = 90 <= 95 % of 100: below the high watermark, nothing goes.
    assert plan(models, sizes, {}, 60, 30, 100, 0.95, 0.5).models == ()
    # 60 + 40 = 100 > 95: evict LRU until <= 60 % (two models of 20).
    p = plan(models, sizes, {}, 60, 40, 100, 0.95, 0.6)
    assert p.models == ("a", "b") and p.freed == 40 and set(p.blobs) == {"a1", "a2", "b1", "b2"}
    # A blob shared with a surviving model is kept; an orphan goes before any model.
    shared = models + [ModelUse("d", frozenset({"a1"}), 9.0, True)]
    p = plan(shared, {**sizes, "o": 10}, {"o": 0.0}, 70, 30, 100, 0.95, 0.9)
    assert p.blobs[0] == "o" and "a1" not in p.blobs


def test_planner_refuses_without_evicting_when_it_cannot_fit():
    from cache.eviction import plan

    sizes = {f"{n}{i}": 10 for n in "ab" for i in (1, 2)}
    models = _uses(("a", 1.0, True), ("b", 2.0, False))
    with pytest.raises(CacheFullError, match="pinned: a"):
        plan(models, sizes, {}, 40, 85, 100, 0.95, 0.85)  # b goes, a stays: 20 + 85 > 100
    assert plan(models, sizes, {}, 40, 70, 100, 0.95, 0.85).models == ("b",)  # over low, under max: fine
    with pytest.raises(CacheFullError, match="do not fit"):
        plan(models, sizes, {}, 0, 101, 100, 0.95, 0.85)
    # The model being pulled is never a victim.
    with pytest.raises(CacheFullError):
        plan(_uses(("a", 1.0, False)), sizes, {}, 20, 90, 100, 0.95, 0.85, keep_models=frozenset({"a"}))


def test_planner_makes_room_on_a_disk_with_less_free_than_the_quota_leaves():
    from cache.eviction import plan

    sizes = {f"{n}{i}": 10 for n in "abc" for i in (1, 2)}
    models = _uses(("a", 1.0, False), ("b", 2.0, False), ("c", 3.0, False))
    # The quota is far from full (60 + 30 of 1000) but the disk has 15 free: the least recently
    # used model goes, and no more than the shortfall needs.
    p = plan(models, sizes, {}, 60, 30, 1000, 0.95, 0.85, disk_free=15)
    assert p.models == ("a",) and p.freed == 20
    assert plan(models, sizes, {}, 60, 30, 1000, 0.95, 0.85, disk_free=30).models == ()
    # What the unpinned models free does not cover it: refused, naming the disk, evicting nothing.
    pinned = _uses(("a", 1.0, True), ("b", 2.0, True), ("c", 3.0, False))
    with pytest.raises(CacheFullError, match="the cache disk has 5 free .* frees only 20 .pinned: a, b: .* unload one"):
        plan(pinned, sizes, {}, 60, 30, 1000, 0.95, 0.85, disk_free=5)


async def test_a_pull_evicts_for_a_disk_smaller_than_the_quota(tmp_path, store):
    """A cache whose disk fills before its quota (the default quota is 100 GiB, whatever the
    disk): a pull evicts the least recently used unpinned models until its bytes fit the disk,
    as it does for the quota (it failed with CacheFullError, evicting nothing)."""
    with small_tmpfs(tmp_path, "4m") as mnt:
        cache = DiskCache(mnt / "cache", 100 * MIB, download=fast_download(part_size=256 << 10))
        for name in "abc":
            await cache.pull(store, name)
            time.sleep(0.02)
        cache.touch("a")  # b is now the least recently used
        await cache.pull(store, "d")
        assert cache.snapshot_path("b") is None
        assert sorted(cache.model_names()) == ["a", "c", "d"]


async def test_remove_frees_blobs_only_this_model_used(tmp_path, store):
    cache = _cache(tmp_path, 100 * MIB)
    await cache.pull(store, "a")
    await cache.pull(store, "b")
    await cache.remove("a")
    assert cache.snapshot_path("a") is None and cache.model_names() == ["b"]
    assert set(os.listdir(tmp_path / "cache/blobs/sha256")) == {f.sha256 for f in cache.manifest("b").files}
    assert cache.stats()["used_bytes"] == store.sizes["b"]
