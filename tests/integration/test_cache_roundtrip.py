"""publish → pull through real HTTP (moto behind the fault proxy), the file store, and the CLI."""

from __future__ import annotations

import asyncio
import filecmp
import json
import os

import pytest

from agent.cli import main
from cache.disk_cache import DiskCache
from cache.errors import NotFoundError, StoreError
from cache.file_store import FileStore
from cache.progress import Progress
from cache.store import open_store
from cache.progress import render_bar
from cache.publish import publish_model
from tests.s3_fault_proxy import bucket, fast_download, make_model, moto_endpoint, proxy, s3_store  # noqa: F401


def _same_tree(a, b) -> None:
    for rel in ("config.json", "model.safetensors", "tokenizer/tokenizer.json"):
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


async def test_s3_publish_pull_round_trip(tmp_path, proxy, bucket):
    src = make_model(tmp_path / "src", data_bytes=1 << 20)
    store = s3_store(proxy.url, bucket)
    m = publish_model(store, src, "tiny")
    assert {f.path for f in m.files} == {"config.json", "model.safetensors", "tokenizer/tokenizer.json"}
    # Published again: every blob is already there, only the manifest is written.
    proxy.clear()
    publish_model(store, src, "tiny")
    assert [x for x in proxy.log if x[0] == "PUT"] == [("PUT", f"/{bucket}/store/models/tiny/manifest.json", "", 200)]

    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    proxy.clear()
    path = await cache.pull(store, "tiny")
    assert path == tmp_path / "cache" / "models" / "tiny" / "snapshot"
    _same_tree(src, path)
    assert proxy.total_blob_bytes() == m.total_size  # each byte once
    # Parts were ranged GETs pinned to the ETag, all answered 206.
    ranged = [x for x in proxy.log if x[0] == "GET" and "/blobs/" in x[1]]
    assert len(ranged) >= m.total_size // (64 << 10) and all(s == 206 for *_, s in ranged)
    st = cache.stats()
    assert st["used_bytes"] == m.total_size and st["models"][0]["name"] == "tiny"
    assert os.path.samefile(path / "model.safetensors",
                            tmp_path / "cache/blobs/sha256" / next(f.sha256 for f in m.files
                                                                   if f.path == "model.safetensors"))
    # A second pull of an unchanged model downloads nothing.
    proxy.clear()
    assert await cache.pull(store, "tiny") == path
    assert proxy.total_blob_bytes() == 0
    report = await cache.scan(rehash=True)
    assert report["models"][0]["ok"] and not report["partials"] and not report["orphan_blobs"]
    store.close()


async def test_multipart_publish_and_new_version(tmp_path, proxy, bucket):
    src = make_model(tmp_path / "src", data_bytes=11 << 20)
    store = s3_store(proxy.url, bucket)  # multipart above 8 MiB, 5 MiB parts
    publish_model(store, src, "big")
    assert any("uploadId" in x[1] or x[0] == "POST" for x in proxy.log)
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download(part_size=1 << 20))
    path = await cache.pull(store, "big")
    _same_tree(src, path)
    # A new version replaces the snapshot; the old weights blob becomes unreferenced.
    make_model(src, data_bytes=1 << 20, seed=1)
    publish_model(store, src, "big")
    path2 = await cache.pull(store, "big")
    _same_tree(src, path2)
    report = await cache.scan()
    assert len(report["orphan_blobs"]) == 3  # old config, weights and tokenizer
    store.close()


async def test_file_store_round_trip_and_missing_model(tmp_path):
    src = make_model(tmp_path / "src", data_bytes=300_000)
    store = FileStore(tmp_path / "store")
    publish_model(store, src, "tiny")
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    _same_tree(src, await cache.pull(store, "tiny"))
    with pytest.raises(NotFoundError):
        await cache.pull(store, "absent")
    assert cache.snapshot_path("absent") is None


def test_cli_publish_and_pull(tmp_path, proxy, bucket, monkeypatch, capsys):
    src = make_model(tmp_path / "src", data_bytes=200_000)
    monkeypatch.setenv("INFIRE_STORE__ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("INFIRE_STORE__PATH_STYLE", "true")
    monkeypatch.setenv("INFIRE_STORE__REGION", "us-east-1")
    url = f"s3://{bucket}/cli"
    assert main(["publish", str(src), "--name", "cli-model", "--store", url]) == 0
    cache_dir = tmp_path / "cache"
    assert main(["pull", "cli-model", "--store", url, "--cache-dir", str(cache_dir), "--part-size", "64KiB"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("models/cli-model/snapshot")
    assert "cli-model [" in err and "100%" in err  # the progress bar
    _same_tree(src, cache_dir / "models/cli-model/snapshot")
    manifest = json.loads((cache_dir / "models/cli-model/manifest.json").read_text())
    assert manifest["name"] == "cli-model" and manifest["version"] == 1
    # Bad input: exit 2 and nothing written.
    assert main(["pull", "Bad/Name", "--store", url, "--cache-dir", str(tmp_path / "c2")]) == 2
    assert not (tmp_path / "c2").exists()
    # Store failures: exit 1 with the reason.
    assert main(["pull", "absent", "--store", url, "--cache-dir", str(tmp_path / "c3"), "--quiet"]) == 1
    assert "model 'absent' is not in the store" in capsys.readouterr().err
    assert main(["publish", str(src), "--name", "x", "--store", "s3://no-such-bucket-here/p", "--quiet"]) == 1
    assert "NoSuchBucket" in capsys.readouterr().err
    (src / "weights.bin").write_bytes(b"pickle")
    assert main(["publish", str(src), "--name", "evil", "--store", url]) == 2
    assert "pickle" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://x/y", "s3://", "s3://Bad_Bucket/p", "file://host/dir", "ftp://a"])
def test_open_store_refuses_bad_urls(url):
    with pytest.raises(StoreError):
        open_store(url)


async def test_progress_reports_bytes_rate_and_eta(tmp_path):
    src = make_model(tmp_path / "src", data_bytes=300_000)
    store = FileStore(tmp_path / "store")
    m = publish_model(store, src, "tiny")
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    progress = Progress("tiny")
    await cache.pull(store, "tiny", progress)
    snap = progress.snapshot()
    assert snap["state"] == "done" and snap["done_bytes"] == snap["total_bytes"] == m.total_size
    assert snap["downloaded_bytes"] == m.total_size and snap["eta_s"] == 0.0
    again = Progress("tiny")
    await cache.pull(store, "tiny", again)  # cached: everything counts as resumed, nothing downloaded
    assert again.snapshot()["resumed_bytes"] == m.total_size and again.snapshot()["downloaded_bytes"] == 0
    mid = {"name": "x", "total_bytes": 4 << 30, "done_bytes": 1 << 30, "rate_bytes_s": 100 << 20, "eta_s": 30.7}
    assert render_bar(mid, width=8) == "x [##......]  25% 1.0 GiB/4.0 GiB 100.0 MiB/s ETA 31s"
    blob = tmp_path / "cache/blobs/sha256" / m.files[0].sha256
    assert blob.stat().st_mode & 0o777 == 0o444


async def test_event_loop_stays_free_during_a_pull(tmp_path, proxy, bucket):
    """Store calls, writes and hashing run in threads: a ticker on the loop keeps ticking."""
    src = make_model(tmp_path / "src", data_bytes=6 << 20)
    store = s3_store(proxy.url, bucket)
    publish_model(store, src, "tiny")
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download(part_size=256 << 10))
    lags: list[float] = []

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - t - 0.01)

    tick = asyncio.create_task(ticker())
    await cache.pull(store, "tiny")
    await cache.scan(rehash=True)
    tick.cancel()
    assert len(lags) > 10
    # One stall is the shared box's (a 0.53 s one came in a CI run of a 2-core box, with the
    # in-process S3 server's thread and the loop taking turns at the GIL); work done on the loop
    # stalls it at every part.
    assert sorted(lags)[-2] < 0.25 and max(lags) < 2.0, sorted(lags)[-5:]
    store.close()


async def test_one_folder_published_under_several_names_is_read_once(tmp_path, proxy, bucket, monkeypatch):
    from cache import manifest as mf
    from cache.errors import ManifestError

    src = make_model(tmp_path / "src", data_bytes=1 << 20)
    store = s3_store(proxy.url, bucket)
    reads = []
    real = mf.from_directory
    monkeypatch.setattr(mf, "from_directory", lambda d, n: reads.append(n) or real(d, n))
    with pytest.raises(ManifestError):  # a bad alias: refused before anything is written
        publish_model(store, src, "a", also_as=("b", "Bad/Name"))
    assert not [x for x in proxy.log if x[0] == "PUT"] and reads == []
    m = publish_model(store, src, "a", also_as=("b", "c"))
    assert reads == ["a"]  # hashed once
    puts = [x[1] for x in proxy.log if x[0] == "PUT" and x[1].endswith("manifest.json")]
    assert puts == [f"/{bucket}/store/models/{n}/manifest.json" for n in "abc"]
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    paths = [await cache.pull(store, n) for n in "abc"]
    for p in paths:
        _same_tree(src, p)
    assert proxy.total_blob_bytes() == m.total_size  # one copy of the bytes for all three names
    store.close()


async def test_a_store_blob_corrupted_in_place_is_refused_and_a_reupload_repairs_it(tmp_path, capsys):
    """Other bytes of the same size in the store under a blob's name: every pull refuses them
    (the hash), a plain publish skips the blob (the size matches), and ``publish --reupload``
    sends it again, after which the pull works."""
    from cache.errors import IntegrityError

    src = make_model(tmp_path / "src", data_bytes=300_000)
    store = FileStore(tmp_path / "store")
    m = publish_model(store, src, "tiny")
    big = max(m.files, key=lambda f: f.size)
    blob = tmp_path / "store" / "blobs" / "sha256" / big.sha256
    blob.chmod(0o644)
    blob.write_bytes(bytes(big.size))  # same size, other bytes
    cache = DiskCache(tmp_path / "cache", 1 << 30, download=fast_download())
    with pytest.raises(IntegrityError, match="publish the model again with --reupload"):
        await cache.pull(store, "tiny")
    assert main(["publish", str(src), "--name", "tiny", "--store", store.url, "--quiet"]) == 0
    with pytest.raises(IntegrityError):
        await cache.pull(store, "tiny")  # skipped: the store still has the bad copy
    assert main(["publish", str(src), "--name", "tiny", "--store", store.url, "--quiet", "--reupload"]) == 0
    _same_tree(src, await cache.pull(store, "tiny"))
