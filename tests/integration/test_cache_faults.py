"""Store faults during a pull (through the fault proxy): each one is survived or refused cleanly."""

from __future__ import annotations

import filecmp
import time

import boto3
import pytest

from cache.disk_cache import DiskCache

from cache.errors import IntegrityError, StoreError
from cache.progress import Progress
from cache.publish import publish_model
from tests.s3_fault_proxy import (Fault, bucket, fast_download, make_model, moto_endpoint, proxy,  # noqa: F401
                                  s3_store, tree_files)

DATA = 1 << 20  # ~17 parts of 64 KiB


@pytest.fixture
def published(tmp_path, proxy, bucket):
    src = make_model(tmp_path / "src", data_bytes=DATA)
    store = s3_store(proxy.url, bucket, read_timeout=0.5)
    m = publish_model(store, src, "m")
    weights = next(f for f in m.files if f.path == "model.safetensors")
    proxy.clear()
    yield src, store, m, weights
    store.close()


async def _pull_ok(tmp_path, store, src, **cfg):
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download(**cfg))
    progress = Progress("m")
    path = await cache.pull(store, "m", progress)
    assert filecmp.cmp(src / "model.safetensors", path / "model.safetensors", shallow=False)
    assert not list((tmp_path / "cache" / "partial").iterdir())
    return cache, progress


def _blob_match(weights) -> str:
    return f"/blobs/sha256/{weights.sha256}"


def _nothing_committed(tmp_path, weights) -> None:
    files = tree_files(tmp_path / "cache")
    assert not any(f.startswith("models/") for f in files), files
    assert f"blobs/sha256/{weights.sha256}" not in files
    assert not any(f.startswith("partial/") for f in files), files


async def test_503_slowdown_is_retried(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("status", status=503, times=3, match=_blob_match(w)))
    _, progress = await _pull_ok(tmp_path, store, src)
    assert proxy.statuses().count(503) == 3 and progress.snapshot()["retries"] >= 3
    assert proxy.total_blob_bytes() == m.total_size


async def test_429_retry_after_is_honoured(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("status", status=429, headers={"Retry-After": "0.4"}, match=_blob_match(w), times=1))
    t0 = time.monotonic()
    await _pull_ok(tmp_path, store, src)
    # Backoffs are at most 50 ms in these tests: only Retry-After explains the wait.
    assert time.monotonic() - t0 >= 0.4
    assert 429 in proxy.statuses()


async def test_connection_reset_mid_body(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("reset", after=20_000, times=2, match=_blob_match(w)))
    await _pull_ok(tmp_path, store, src)
    # The part resumes where the bytes stopped: at most the lost in-flight bytes are fetched twice.
    assert m.total_size <= proxy.total_blob_bytes() <= m.total_size + 2 * 20_000


async def test_truncated_body(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("truncate", after=30_000, times=2, match=_blob_match(w)))
    await _pull_ok(tmp_path, store, src)
    assert m.total_size <= proxy.total_blob_bytes() <= m.total_size + 2 * 30_000


async def test_server_ignoring_range(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("ignore_range", times=2, match=_blob_match(w)))
    await _pull_ok(tmp_path, store, src)
    assert proxy.statuses().count(200) >= 2  # two whole-object answers were refused, then retried


async def test_wrong_content_range(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("wrong_range", times=2, match=_blob_match(w)))
    _, progress = await _pull_ok(tmp_path, store, src)
    assert progress.snapshot()["retries"] >= 2


async def test_etag_answer_changed_restarts_blob(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("etag", skip=3, times=1, match=_blob_match(w)))
    await _pull_ok(tmp_path, store, src)
    heads = [x for x in proxy.log if x[0] == "HEAD" and w.sha256 in x[1]]
    assert len(heads) == 2  # the blob started over with a fresh HEAD


async def test_object_replaced_mid_pull_same_bytes(tmp_path, proxy, published, bucket, moto_endpoint):
    """A re-upload (multipart: another ETag, same bytes) mid-pull: 412, clean restart, success."""
    src, store, m, w = published
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    key = f"store/blobs/sha256/{w.sha256}"
    data = (src / "model.safetensors").read_bytes()

    def reupload() -> None:
        up = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        e = s3.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=data)["ETag"]
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up,
                                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e}]})

    proxy.add(Fault("hook", hook=reupload, skip=4, match=_blob_match(w)))
    await _pull_ok(tmp_path, store, src)
    assert 412 in proxy.statuses()


async def test_object_replaced_by_other_bytes_is_refused(tmp_path, proxy, published, bucket, moto_endpoint):
    src, store, m, w = published
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    other = bytes(b ^ 0xFF for b in (src / "model.safetensors").read_bytes())
    proxy.add(Fault("hook", hook=lambda: s3.put_object(Bucket=bucket, Key=f"store/blobs/sha256/{w.sha256}",
                                                       Body=other), skip=4, match=_blob_match(w)))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    with pytest.raises(IntegrityError, match="nothing was committed"):
        await cache.pull(store, "m")
    _nothing_committed(tmp_path, w)


async def test_stalled_body_is_retried(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("stall", after=10_000, delay=6.0, match=_blob_match(w)))
    t0 = time.monotonic()
    await _pull_ok(tmp_path, store, src)
    assert time.monotonic() - t0 < 4.0  # the 6 s stall (read timeout 0.5 s) was cut short, not waited out


async def test_flipped_byte_commits_nothing(tmp_path, proxy, published):
    src, store, m, w = published
    # every answer for the blob flipped, not only the first: a part retried under a loaded CI box
    # (a read timeout) once fetched clean bytes and the pull succeeded
    proxy.add(Fault("flip", after=12_345, times=1000, match=_blob_match(w)))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    with pytest.raises(IntegrityError, match=w.sha256):
        await cache.pull(store, "m")
    _nothing_committed(tmp_path, w)
    assert cache.snapshot_path("m") is None


async def test_access_denied_is_not_retried(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("status", status=403, times=100, match=_blob_match(w)))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    with pytest.raises(StoreError, match="403"):
        await cache.pull(store, "m")
    assert proxy.statuses().count(403) <= 4  # one per part already in flight, no retries
    assert cache.snapshot_path("m") is None


async def test_persistent_503_gives_up(tmp_path, proxy, published):
    src, store, m, w = published
    proxy.add(Fault("status", status=503, times=1000, match=_blob_match(w)))
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    with pytest.raises(StoreError, match="gave up after 6 tries"):
        await cache.pull(store, "m")
    assert cache.snapshot_path("m") is None


async def test_publish_retries_throttled_uploads(tmp_path, proxy, bucket):
    src = make_model(tmp_path / "src2", data_bytes=200_000)
    store = s3_store(proxy.url, bucket)
    proxy.add(Fault("status", method="PUT", status=503, times=2, match="/blobs/"))
    proxy.add(Fault("status", method="PUT", status=429, times=1, match="manifest.json",
                    headers={"Retry-After": "Thu, 01 Jan 1970 00:00:00 GMT"}))  # a date in the past: no wait
    publish_model(store, src, "p")
    assert proxy.statuses().count(503) == 2 and proxy.statuses().count(429) == 1
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    path = await cache.pull(store, "p")
    assert filecmp.cmp(src / "model.safetensors", path / "model.safetensors", shallow=False)
    store.close()


def test_retry_after_forms():
    from cache.s3_store import _retry_after

    assert _retry_after({"retry-after": "2.5"}) == 2.5
    assert _retry_after({"retry-after": "Thu, 01 Jan 1970 00:00:00 GMT"}) == 0.0
    assert 50 < _retry_after({"retry-after": __import__("email.utils").utils.formatdate(time.time() + 60,
                                                                                        usegmt=True)}) <= 60
    assert _retry_after({"retry-after": "soon"}) is None and _retry_after({}) is None
