"""A blob two models' snapshots share (one folder published under two names), corrupted on disk
with its stamp kept (bit rot: same size, same mtime, same inode): a repair found through one model
fixes or flags every snapshot that links it, so the other never serves the corrupt inode. Real
files: the file store, the disk cache, hard links."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

from cache.disk_cache import DiskCache
from cache.file_store import FileStore
from cache.locks import FileLock
from cache.publish import publish_model
from tests.s3_fault_proxy import fast_download, make_model

WEIGHTS = "model.safetensors"


def _rot(path: Path) -> None:
    """Flip bytes in the middle of the file and put its mtime back: only a sha256 can tell."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        chunk = f.read(64)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


async def _two_models(tmp_path: Path) -> tuple[Path, FileStore, DiskCache, list[list[str]]]:
    src = make_model(tmp_path / "src", data_bytes=300_000)
    store = FileStore(tmp_path / "store")
    publish_model(store, src, "a", also_as=("b",))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    told: list[list[str]] = []
    cache.on_shared_repair = told.append
    a, b = await cache.pull(store, "a"), await cache.pull(store, "b")
    assert os.path.samefile(a / WEIGHTS, b / WEIGHTS)  # one inode, two snapshots
    return src, store, cache, told


async def test_a_repair_through_one_model_relinks_the_other(tmp_path) -> None:
    src, store, cache, told = await _two_models(tmp_path)
    snap_a, snap_b = cache.snapshot_path("a"), cache.snapshot_path("b")
    _rot(snap_a / WEIGHTS)
    assert (await cache.check("b")).ok  # the stamp is the same: a plain check cannot see it

    await cache.pull(store, "a", verify=True)  # finds the bad blob through a, fetches it again

    assert filecmp.cmp(src / WEIGHTS, snap_a / WEIGHTS, shallow=False)
    # b no longer names the corrupt inode: its snapshot links the fresh blob, verified.
    assert filecmp.cmp(src / WEIGHTS, snap_b / WEIGHTS, shallow=False)
    assert os.path.samefile(snap_a / WEIGHTS, snap_b / WEIGHTS)
    assert (await cache.check("b", rehash=True, blobs=True)).ok
    assert told == [["b"]]
    store.close()


async def test_a_sharer_that_cannot_be_relinked_now_is_flagged(tmp_path) -> None:
    """b's model lock is held (another process pulls it): b is not rebuilt under it, but its next
    check hashes every file and finds the corrupt one, so its load refuses and repairs it."""
    src, store, cache, told = await _two_models(tmp_path)
    snap_b = cache.snapshot_path("b")
    _rot(cache.snapshot_path("a") / WEIGHTS)
    held = FileLock(cache.layout.locks_dir / "model-b.lock")
    assert held.try_acquire()
    try:
        await cache.pull(store, "a", verify=True)
    finally:
        held.release()
    report = await cache.check("b")  # no rehash asked: the flag makes it hash
    assert [f.path for f in report.findings] == [WEIGHTS], report.problems()
    assert told == [["b"]]
    await cache.pull(store, "b")  # the repair a load would start
    assert filecmp.cmp(src / WEIGHTS, snap_b / WEIGHTS, shallow=False)
    assert (await cache.check("b", rehash=True, blobs=True)).ok
    store.close()
