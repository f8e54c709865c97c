"""Single flight: concurrent pulls of one model fetch each byte once (coroutines and processes)."""

from __future__ import annotations

import asyncio
import filecmp
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cache.disk_cache import DiskCache
from cache.publish import publish_model
from tests.s3_fault_proxy import (Fault, bucket, fast_download, make_model, moto_endpoint, proxy,  # noqa: F401
                                  s3_store)

REPO = Path(__file__).resolve().parents[2]
PULLER = """
import asyncio, sys
from cache.disk_cache import DiskCache
from tests.s3_fault_proxy import fast_download, s3_store
store = s3_store(sys.argv[1], sys.argv[2])
print(asyncio.run(DiskCache(sys.argv[3], 1 << 30, download=fast_download()).pull(store, "m")))
"""


@pytest.fixture
def published(tmp_path, proxy, bucket):
    src = make_model(tmp_path / "src", data_bytes=1 << 20)
    store = s3_store(proxy.url, bucket)
    m = publish_model(store, src, "m")
    proxy.clear()
    yield src, store, m
    store.close()


async def test_coroutines_share_one_pull(tmp_path, proxy, published):
    src, store, m = published
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    paths = await asyncio.gather(*(cache.pull(store, "m") for _ in range(5)))
    assert len(set(paths)) == 1
    assert proxy.total_blob_bytes() == m.total_size
    manifests = [x for x in proxy.log if x[1].endswith("manifest.json")]
    assert len(manifests) == 1  # one pull ran; the others waited on it


async def test_two_cache_objects_on_one_dir_use_the_file_locks(tmp_path, proxy, published):
    src, store, m = published
    # Slow the first blob so the second pull arrives while the first holds the model lock.
    proxy.add(Fault("hook", hook=lambda: time.sleep(0.3), match="/blobs/"))
    a = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    b = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    pa, pb = await asyncio.gather(a.pull(store, "m"), b.pull(store, "m"))
    assert pa == pb
    assert proxy.total_blob_bytes() == m.total_size


async def test_cancelled_waiter_does_not_cancel_the_others(tmp_path, proxy, published):
    src, store, m = published
    proxy.add(Fault("hook", hook=lambda: time.sleep(0.3), match="/blobs/"))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    first = asyncio.create_task(cache.pull(store, "m"))
    second = asyncio.create_task(cache.pull(store, "m"))
    await asyncio.sleep(0.1)
    first.cancel()
    path = await second
    assert filecmp.cmp(src / "model.safetensors", path / "model.safetensors", shallow=False)
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_cancelling_the_only_waiter_stops_the_pull(tmp_path, proxy, published):
    src, store, m = published
    proxy.add(Fault("hook", hook=lambda: time.sleep(0.2), match="/blobs/", times=1000))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    task = asyncio.create_task(cache.pull(store, "m"))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cache.snapshot_path("m") is None and not cache._inflight
    await asyncio.sleep(0.4)  # the proxy may still be flushing an answer the client already dropped
    sent = proxy.total_blob_bytes()
    await asyncio.sleep(0.6)
    assert proxy.total_blob_bytes() == sent  # no thread kept downloading after the cancel


async def test_cancelling_a_pull_stops_its_manifest_retries(tmp_path, proxy, published):
    """A store that answers the manifest with 503 (Retry-After 1 s): the pull waits to try again;
    cancelled (a stopping agent cancels its pulls), it returns at once and no thread goes on
    asking the store for it (one did, eight times, and the agent's exit waited for it)."""
    from cache.retry import RetryPolicy

    src, store, m = published
    proxy.add(Fault("status", match="manifest.json", status=503, headers={"Retry-After": "1"}, times=1000))
    retry = RetryPolicy(attempts=8, base_delay=0.5, max_delay=1.0, max_retry_after=1.0)
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download(retry=retry))
    task = asyncio.create_task(cache.pull(store, "m"))

    def asked() -> int:
        return sum(1 for x in proxy.log if x[1].endswith("manifest.json"))

    while asked() == 0:
        await asyncio.sleep(0.02)
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t0 < 0.5
    n = asked()
    await asyncio.sleep(2.5)  # two retries' worth
    assert asked() == n


async def test_two_processes_download_each_byte_once(tmp_path, proxy, published, bucket):
    src, store, m = published
    proxy.add(Fault("hook", hook=lambda: time.sleep(0.5), match="/blobs/"))
    cache_dir = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", PULLER, proxy.url, bucket, str(cache_dir)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = await asyncio.to_thread(p.communicate, timeout=60)
        assert p.returncode == 0, err.decode()[-2000:]
        outs.append(out.decode().strip().splitlines()[-1])  # log lines come first
    assert outs[0] == outs[1] == str(cache_dir / "models" / "m" / "snapshot")
    assert proxy.total_blob_bytes() == m.total_size
    assert filecmp.cmp(src / "model.safetensors", Path(outs[0]) / "model.safetensors", shallow=False)


async def test_two_models_sharing_a_blob_fetch_it_once(tmp_path, proxy, bucket):
    """Different models, one identical weights file: the blob lock makes one download of it."""
    store = s3_store(proxy.url, bucket)
    a = make_model(tmp_path / "a", data_bytes=1 << 20, seed=3)
    b = make_model(tmp_path / "b", data_bytes=1 << 20, seed=3)
    (b / "config.json").write_text('{"model_type": "qwen2"}\n')
    ma, mb = publish_model(store, a, "ma"), publish_model(store, b, "mb")
    shared = next(f for f in ma.files if f.path == "model.safetensors")
    assert shared in mb.files
    proxy.clear()
    proxy.add(Fault("hook", hook=lambda: time.sleep(0.3), match=shared.sha256))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    pa, pb = await asyncio.gather(cache.pull(store, "ma"), cache.pull(store, "mb"))
    assert proxy.body_bytes[f"/{bucket}/store/blobs/sha256/{shared.sha256}"] == shared.size
    assert (pa / "model.safetensors").stat().st_ino == (pb / "model.safetensors").stat().st_ino
    assert cache.stats()["used_bytes"] == sum({f.sha256: f.size for f in ma.files + mb.files}.values())
    store.close()


async def _cancelled_pull(cache: DiskCache, store, started) -> float:
    """Pull "m", cancel it 0.3 s after ``started()`` holds; the seconds the cancel took."""
    task = asyncio.create_task(cache.pull(store, "m"))
    deadline = time.monotonic() + 10
    while not started() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return time.monotonic() - t0


async def test_cancelling_a_pull_ends_a_read_stalled_mid_body_at_once(tmp_path, proxy, published):
    """A blob whose body stalls (the store sends a little, then nothing): cancelled, the pull
    returns at once, its part threads gone (a blocked read used to hold the cancel, and the
    agent's exit, until the store's read timeout)."""
    src, store, m = published
    proxy.add(Fault("stall", match="/blobs/", after=4096, delay=8, times=1000))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    # once the reads block on the stalled bodies
    assert await _cancelled_pull(cache, store, lambda: proxy.total_blob_bytes() > 0) < 2.0
    assert cache.snapshot_path("m") is None and not cache._inflight


async def test_cancelling_a_pull_leaves_a_request_without_an_answer_behind(tmp_path, proxy, published):
    """The store answers the first ranged GETs, then waits, sending not even the headers, for
    longer than the read timeout: cancelled, the pull returns at once instead of after that
    timeout, leaving those requests' threads behind, and the next pull of the same model resumes
    the parts already recorded and completes with the right bytes while they still wait."""
    from cache.progress import Progress

    src, store, m = published
    hang = proxy.add(Fault("hang", match="/blobs/", skip=6, delay=20, times=1000))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    assert await _cancelled_pull(cache, store, lambda: hang.fired > 0) < 3.0  # once parts wait for headers
    assert cache.snapshot_path("m") is None and not cache._inflight
    hang.times = hang.fired  # the store answers again; the first pull's requests still hang
    progress = Progress("m")
    snap = await cache.pull(store, "m", progress)
    assert progress.snapshot()["resumed_bytes"] > 0
    assert any(t.name.startswith("blob-part") for t in threading.enumerate())  # still waiting, left behind
    for f in m.files:
        assert (snap / f.path).read_bytes() == (src / f.path).read_bytes()
