"""Faults during a pull while the agent serves another model: an object store answering 5xx,
resetting and stalling connections (through the S3 fault proxy in front of moto), a store that
refuses outright, and a cache disk that fills up (a real tmpfs where mounting is allowed)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny
from tests.reliability.rel_helpers import ADMIN, MODEL, healthy
from tests.s3_fault_proxy import Fault, bucket, moto_endpoint, proxy, s3_store  # noqa: F401
from tests.tmpfs import small_tmpfs

OTHER = "other"


class _Traffic:
    """Completions on the served model in a thread, counting status codes."""

    def __init__(self, d: Daemon) -> None:
        self.d, self.stop, self.codes = d, threading.Event(), Counter()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            code, _ = self.d.post("/v1/completions", {"model": MODEL, "prompt": "pull", "max_tokens": 4,
                                                      "stream": True, "ignore_eos": True})
            self.codes[code] += 1

    def __enter__(self) -> "_Traffic":
        self.t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.t.join()


def _pull(d: Daemon) -> tuple[int, dict]:
    return d.post(f"/admin/v1/models/{OTHER}/pull?wait=true&timeout=60", headers=ADMIN, timeout=90)


def test_store_faults_during_a_pull_while_serving(make_tiny_model, tmp_path, proxy, bucket, tally) -> None:  # noqa: F811
    store = s3_store(proxy.url, bucket)
    try:
        from cache.publish import publish_model

        publish_model(store, make_tiny_model("llama"), MODEL)
        m = publish_model(store, make_tiny_model("llama", seed=1), OTHER)
    finally:
        store.close()
    weights = next(f for f in m.files if f.path.endswith(".safetensors"))
    proxy.clear()
    d = Daemon(tmp_path, store_url=f"s3://{bucket}/store", models=[
        {"name": MODEL, "preload": True, "max_model_len": 256}],
        env={"INFIRE_STORE__ENDPOINT_URL": proxy.url, "INFIRE_STORE__PATH_STYLE": "true",
             "INFIRE_STORE__REGION": "us-east-1"}).start(timeout=120)
    try:
        blob = f"/blobs/sha256/{weights.sha256}"
        with _Traffic(d) as traffic:
            for fault in [Fault("status", status=503, times=3, match=blob),
                          Fault("status", status=500, times=2, match=blob),
                          Fault("reset", after=20_000, times=2, match=blob),
                          Fault("truncate", after=30_000, times=1, match=blob),
                          Fault("stall", after=10_000, delay=2.0, match=blob)]:
                proxy.add(fault)
                code, body = _pull(d)
                assert code == 200 and body["model"]["state"] == "cached", (fault.kind, code, body)
                assert fault.fired == fault.times, fault
                _evict(d)
                tally["faults"] += fault.times
            # A store that refuses outright: the pull fails with a clear reason, nothing else does.
            proxy.add(Fault("status", status=403, times=1000, match=blob))
            code, body = _pull(d)
            assert code == 500 and body["model"]["state"] == "failed", (code, body)
            assert "pull failed" in body["model"]["reason"], body
            proxy.clear()
            tally["faults"] += 1
        assert set(traffic.codes) == {200}, traffic.codes
        assert sum(traffic.codes.values()) > 5, traffic.codes
        tally["requests"] += sum(traffic.codes.values())
        healthy(d)
    finally:
        d.stop()


def _evict(d: Daemon) -> None:
    """Drop the pulled copy so the next fault meets a fresh download."""
    import shutil

    cache = d.tmp / "cache"
    shutil.rmtree(cache / "models" / OTHER, ignore_errors=True)
    for b in (cache / "blobs" / "sha256").glob("*"):
        if b.is_file() and not _used_by_served(cache, b.name):
            b.unlink()


def _used_by_served(cache, digest: str) -> bool:
    return any(digest in p.read_text() for p in (cache / "models" / MODEL).rglob("manifest.json"))


@pytest.fixture
def small_fs(tmp_path):
    with small_tmpfs(tmp_path, "1m") as mnt:
        yield mnt


def test_disk_full_during_a_pull_while_serving(make_tiny_model, tmp_path, small_fs, tally) -> None:
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    publish_tiny(lambda arch: make_tiny_model(arch, seed=1), tmp_path / "store", OTHER)
    d = Daemon(tmp_path, store_url=url, models=[{"name": MODEL, "preload": True, "max_model_len": 256}],
               env={"INFIRE_CACHE__DIR": str(small_fs / "cache")}).start(timeout=120)
    try:
        with _Traffic(d) as traffic:
            code, body = _pull(d)
            assert code == 500 and body["model"]["state"] == "failed", (code, body)
            assert "pull failed" in body["model"]["reason"], body
        assert set(traffic.codes) == {200}, traffic.codes
        partial = small_fs / "cache" / "partial"
        assert not partial.exists() or not any(p.is_file() for p in partial.rglob("*")), list(partial.rglob("*"))
        tally["faults"] += 1
        tally["requests"] += sum(traffic.codes.values())
        healthy(d)
    finally:
        d.stop()
