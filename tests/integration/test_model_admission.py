"""Which model names the agent takes in, and what a failed load leaves: a real daemon on loopback.

Names are matched whole (no trailing newline); a name the store does not know leaves nothing
behind (no entry, metrics series or lock file) and /v1 answers 404 for it; a configured model
that is only cached answers 503 with Retry-After when autoload is off; timeouts are finite seconds; a pin lock held
by another process neither freezes the agent nor leaves the model stuck.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny

MODEL = "tiny"
TOKEN = {"Authorization": "Bearer test-admin-token"}


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-admission")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    # autoload off: a request for the cached model is refused, not loaded (autoload is on by default)
    d = Daemon(tmp, store_url=url, models=[{"name": MODEL, "max_model_len": 256, "autoload": False}])
    d.start(timeout=120)
    yield d
    d.stop()


def _files(d: Daemon) -> set[str]:
    return {p.relative_to(d.tmp / "cache").as_posix() for p in (d.tmp / "cache").rglob("*")}


def test_a_name_with_a_trailing_newline_is_refused_and_creates_nothing(daemon) -> None:
    before = _files(daemon)
    for op in ("load", "pull", "unload", "verify"):
        code, body = daemon.post(f"/admin/v1/models/{MODEL}%0a/{op}?wait=true", headers=TOKEN)
        assert code == 400 and body["error"]["code"] == "invalid_value", (op, code, body)
    assert daemon.get(f"/admin/v1/models/{MODEL}%0a", TOKEN)[0] == 400
    assert [m["name"] for m in daemon.status()["models"]] == [MODEL]
    assert _files(daemon) == before
    assert 'model="tiny\\n"' not in daemon.get("/metrics")[1]


def test_a_name_unknown_to_the_store_leaves_nothing_behind(daemon) -> None:
    before = _files(daemon)
    code, body = daemon.post("/admin/v1/models/no-such-model/load?wait=true", headers=TOKEN, timeout=60)
    assert code == 404 and body["error"]["code"] == "model_not_found", body
    assert "not in the store" in body["error"]["message"]
    assert daemon.get("/admin/v1/models/no-such-model", TOKEN)[0] == 404
    assert [m["name"] for m in daemon.status()["models"]] == [MODEL]
    assert "no-such-model" not in daemon.get("/metrics")[1]
    assert _files(daemon) == before  # no lock file, no model folder
    code, body = daemon.post("/v1/completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 1})
    assert code == 404 and body["error"]["code"] == "model_not_found", body


def test_a_configured_model_only_cached_answers_503_with_retry_after(daemon) -> None:
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/pull?wait=true", headers=TOKEN, timeout=60)
    assert code == 200 and body["model"]["state"] == "cached", body
    import urllib.error
    import urllib.request
    import json

    req = urllib.request.Request(daemon.base + "/v1/completions", method="POST",
                                 data=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=10)
    assert ei.value.code == 503 and int(ei.value.headers["Retry-After"]) >= 1
    assert json.loads(ei.value.read())["error"]["code"] == "model_not_ready"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "1e9", "abc"])
def test_admin_timeouts_must_be_finite_seconds(daemon, value) -> None:
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true&timeout={value}", headers=TOKEN)
    assert code == 400 and body["error"]["code"] == "invalid_value", body
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/unload?drain_timeout={value}", headers=TOKEN)
    assert code == 400 and body["error"]["code"] == "invalid_value", body


HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_pin_lock_held_by_another_process_neither_freezes_nor_sticks(daemon) -> None:
    lock = daemon.tmp / "cache" / "locks" / f"pin-{MODEL}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(
            r=daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true", headers=TOKEN, timeout=60)))
        t.start()
        worst = 0.0
        while t.is_alive():  # the agent answers while the load waits for the lock
            t0 = time.monotonic()
            assert daemon.get("/livez", timeout=5)[0] == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.2)
        t.join()
        assert worst < 1.0, f"/livez took {worst:.2f}s while a load waited for the pin lock"
        code, body = result["r"]
        assert code == 503 and body["error"]["code"] == "cache_busy", body
        assert body["model"]["state"] == "failed" and "held by another process" in body["model"]["reason"]
    finally:
        holder.stdin.close()
        holder.wait(10)
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true", headers=TOKEN, timeout=120)
    assert code == 200 and body["model"]["state"] == "ready", body
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/unload?wait=true", headers=TOKEN, timeout=60)
    assert code == 200 and body["model"]["state"] == "cached", body
