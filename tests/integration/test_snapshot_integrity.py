"""Cached files changed behind the daemon's back, and weights that cannot decode: a real daemon.

A deleted file, or weights rewritten in place (caught by their sha256: the file's stamp changed
since it was verified), are repaired by the load that finds them, which then goes on (not a 503
first and a working load after); ``infire-agent verify`` checks and repairs; a model whose
logits are not finite never becomes ready.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from tests.integration.agent_harness import REPO, Daemon, publish_tiny

MODEL, NAN = "tiny", "nan-tiny"
TOKEN = {"Authorization": "Bearer test-admin-token"}
CLI = REPO / ".venv" / "bin" / "infire-agent"


def nan_weights(path: Path) -> None:
    """Every tensor byte 0xFF (NaN in fp32, fp16 and bf16); the header stays valid."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        size = path.stat().st_size - 8 - n
        f.write(b"\xff" * size)


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-integrity")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    bad = tmp / "nan-model"
    shutil.copytree(make_tiny_model("llama"), bad)
    for p in bad.glob("*.safetensors"):
        nan_weights(p)
    from cache.publish import publish_model
    from cache.store import open_store

    store = open_store(url)
    try:
        publish_model(store, bad, NAN)
    finally:
        store.close()
    d = Daemon(tmp, store_url=url, models=[{"name": MODEL, "max_model_len": 256}])
    d.start(timeout=120)
    yield d
    d.stop()


def _snapshot(d: Daemon) -> Path:
    return d.tmp / "cache" / "models" / MODEL / "snapshot"


def _weights(d: Daemon) -> Path:
    return sorted(_snapshot(d).glob("*.safetensors"))[0]


def _manifest_sha(d: Daemon, rel: str) -> str:
    m = json.loads((d.tmp / "cache" / "models" / MODEL / "manifest.json").read_text())
    return next(f["sha256"] for f in m["files"] if f["path"] == rel)


def _op(d: Daemon, op: str, query: str = "") -> tuple[int, dict]:
    return d.post(f"/admin/v1/models/{MODEL}/{op}?wait=true{query}", headers=TOKEN, timeout=120)


def test_a_deleted_file_is_restored_by_the_load_that_finds_it(daemon) -> None:
    assert _op(daemon, "pull")[0] == 200
    w = _weights(daemon)
    w.unlink()
    code, body = _op(daemon, "load")
    assert code == 200 and body["model"]["state"] == "ready", body
    assert hashlib.sha256(w.read_bytes()).hexdigest() == _manifest_sha(daemon, w.name)
    assert _op(daemon, "unload")[0] == 200
    w.unlink()  # a pull restores it too
    code, body = _op(daemon, "pull")
    assert code == 200 and body["model"]["state"] == "cached", body
    assert hashlib.sha256(w.read_bytes()).hexdigest() == _manifest_sha(daemon, w.name)


def test_weights_rewritten_in_place_are_repaired_by_the_first_load(daemon) -> None:
    w = _weights(daemon)
    nan_weights(w)  # same size: only the sha256 tells, and the changed mtime says to read it
    code, body = _op(daemon, "load")  # finds it, fetches the file again (every sha256 read), loads
    assert code == 200 and body["model"]["state"] == "ready", body
    assert hashlib.sha256(w.read_bytes()).hexdigest() == _manifest_sha(daemon, w.name)
    assert "snapshot_repair" in daemon.logs()
    code, body = daemon.post("/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2})
    assert code == 200, body
    assert _op(daemon, "unload")[0] == 200


def test_verify_action_and_cli_check_and_repair(daemon) -> None:
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/verify", headers=TOKEN, timeout=60)
    assert code == 200 and body["verify"] == {"ok": True, "problems": [], "repaired": False}, body
    (_snapshot(daemon) / "config.json").unlink()
    env = {k: v for k, v in daemon.env.items() if k != "INFIRE_SERVER__ADMIN_TOKEN"}
    r = subprocess.run([str(CLI), "verify", MODEL], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "config.json: missing from the snapshot" in r.stdout, (r.stdout, r.stderr)
    assert f"{MODEL}: repaired" in r.stdout
    assert (_snapshot(daemon) / "config.json").is_file()
    r = subprocess.run([str(CLI), "verify", MODEL], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"{MODEL}: ok", (r.stdout, r.stderr)
    r = subprocess.run([str(CLI), "verify", "never-heard-of"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr, (r.stdout, r.stderr)


def test_pull_verify_reads_every_sha256(daemon) -> None:
    # Bytes changed in place with the file's stamp put back: only reading the sha256 tells.
    assert _op(daemon, "pull")[0] == 200
    w = _weights(daemon)
    st = w.stat()
    with open(w, "r+b") as f:
        f.seek(st.st_size - 4)
        tail = f.read(4)
        f.seek(st.st_size - 4)
        f.write(bytes(b ^ 0xFF for b in tail))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    env = {k: v for k, v in daemon.env.items() if k != "INFIRE_SERVER__ADMIN_TOKEN"}
    r = subprocess.run([str(CLI), "pull", MODEL, "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert hashlib.sha256(w.read_bytes()).hexdigest() != _manifest_sha(daemon, w.name)  # sizes and stamp agree
    r = subprocess.run([str(CLI), "pull", MODEL, "--quiet", "--verify"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert hashlib.sha256(w.read_bytes()).hexdigest() == _manifest_sha(daemon, w.name)


def test_a_model_with_non_finite_logits_never_becomes_ready(daemon) -> None:
    code, body = daemon.post(f"/admin/v1/models/{NAN}/load?wait=true", headers=TOKEN, timeout=120)
    assert code >= 400 and body["model"]["state"] == "failed", body
    assert "decode" in body["model"]["reason"], body
    assert daemon.get(f"/readyz/{NAN}")[0] == 503
    code, body = daemon.post("/v1/completions", {"model": NAN, "prompt": "x", "max_tokens": 1})
    assert code == 503, body
