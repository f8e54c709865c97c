"""Resume after the puller is SIGKILLed mid-file: finished parts are not downloaded again."""

from __future__ import annotations

import asyncio
import filecmp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cache.disk_cache import DiskCache
from cache.publish import publish_model
from tests.s3_fault_proxy import (Fault, bucket, fast_download, make_model, moto_endpoint, proxy,  # noqa: F401
                                  s3_store)

REPO = Path(__file__).resolve().parents[2]
PART = 64 << 10
PULLER = """
import asyncio, sys
from cache.disk_cache import DiskCache
from tests.s3_fault_proxy import fast_download, s3_store
store = s3_store(sys.argv[1], sys.argv[2], read_timeout=60)
cache = DiskCache(sys.argv[3], 1 << 30, download=fast_download(concurrency=2, max_concurrency=2))
asyncio.run(cache.pull(store, "m"))
"""


def _done_parts(state: Path) -> set[int]:
    lines = state.read_bytes().split(b"\n")
    return {int(x) for x in lines[1:-1] if x}


async def test_sigkill_mid_pull_then_resume(tmp_path, proxy, bucket):
    src = make_model(tmp_path / "src", data_bytes=1 << 20)
    store = s3_store(proxy.url, bucket)
    m = publish_model(store, src, "m")
    w = next(f for f in m.files if f.path == "model.safetensors")
    nparts = (w.size + PART - 1) // PART
    path = f"/{bucket}/store/blobs/sha256/{w.sha256}"
    # The sixth part request hangs (which part that is depends on how the two workers' requests
    # interleave); the other worker keeps finishing parts, then the puller is killed.
    proxy.clear()
    proxy.add(Fault("stall", after=1000, delay=30.0, skip=5, match=w.sha256))
    cache_dir = tmp_path / "cache"
    state = cache_dir / "partial" / f"{w.sha256}.state"
    proc = subprocess.Popen([sys.executable, "-c", PULLER, proxy.url, bucket, str(cache_dir)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if state.exists() and len(_done_parts(state)) >= nparts - 4:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the puller made no progress")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first_run = proxy.body_bytes[path]
    done = _done_parts(state)
    assert nparts - 4 <= len(done) < nparts  # the stalled part (and any in flight) not recorded
    assert (cache_dir / "partial" / f"{w.sha256}.partial").stat().st_size == w.size
    assert not (cache_dir / "models" / "m").exists()

    proxy.clear()
    cache = DiskCache(cache_dir, 1 << 30, download=fast_download())
    snap = await cache.pull(store, "m")
    assert filecmp.cmp(src / "model.safetensors", snap / "model.safetensors", shallow=False)
    done_bytes = sum(min(PART, w.size - i * PART) for i in done)
    # Exactly the parts not recorded as finished crossed the network again; nothing else.
    assert proxy.body_bytes[path] == w.size - done_bytes
    assert first_run >= done_bytes
    assert not os.listdir(cache_dir / "partial")
    store.close()


async def test_partial_with_other_etag_starts_over(tmp_path, proxy, bucket):
    """A state file recorded against another ETag (the blob was re-uploaded) is not trusted."""
    src = make_model(tmp_path / "src", data_bytes=300_000)
    store = s3_store(proxy.url, bucket)
    m = publish_model(store, src, "m")
    w = next(f for f in m.files if f.path == "model.safetensors")
    partial = tmp_path / "cache" / "partial"
    partial.mkdir(parents=True)
    (partial / f"{w.sha256}.partial").write_bytes(b"\0" * w.size)
    header = ('{"digest": "%s", "etag": "\\"stale\\"", "part_size": %d, "size": %d, "v": 1}\n'
              % (w.sha256, PART, w.size))
    (partial / f"{w.sha256}.state").write_text(header + "0\n1\n2\n")
    proxy.clear()
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    snap = await cache.pull(store, "m")
    assert filecmp.cmp(src / "model.safetensors", snap / "model.safetensors", shallow=False)
    assert proxy.body_bytes[f"/{bucket}/store/blobs/sha256/{w.sha256}"] == w.size
    store.close()


async def test_a_state_left_by_a_kill_after_the_rename_goes_with_the_next_pull(tmp_path, proxy, bucket):
    """Killed between a blob's rename into blobs/ and the unlink of its state: the blob is whole,
    the next pull takes it as it is and removes the state left behind (seen on the 2-core box:
    the SIGKILL test's second pull left partial/ holding a small blob's state)."""
    src = make_model(tmp_path / "src", data_bytes=300_000)
    store = s3_store(proxy.url, bucket)
    publish_model(store, src, "m")
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    snap = await cache.pull(store, "m")
    cfg = next(p for p in (tmp_path / "cache" / "blobs").rglob("*") if p.is_file()
               and filecmp.cmp(p, snap / "config.json", shallow=False))
    # the kill's leftover, and the model's folder gone so the pull fetches again what it lacks
    state = tmp_path / "cache" / "partial" / f"{cfg.name}.state"
    state.write_text('{"v": 1}\n0\n')
    import shutil

    shutil.rmtree(tmp_path / "cache" / "models" / "m")
    proxy.clear()
    snap = await DiskCache(tmp_path / "cache", 1 << 30, download=fast_download()).pull(store, "m")
    assert filecmp.cmp(src / "config.json", snap / "config.json", shallow=False)
    assert not os.listdir(tmp_path / "cache" / "partial")
    store.close()
