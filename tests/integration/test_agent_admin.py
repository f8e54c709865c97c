"""Admin API and CLI against a real daemon: pull, load, unload (with drain), failures, API keys."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time

import pytest

from tests.integration.agent_harness import REPO, Daemon, publish_tiny

MODEL = "tiny"
TOKEN = {"Authorization": "Bearer test-admin-token"}
KEY = {"Authorization": "Bearer key-two"}


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-admin")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    from cache.publish import publish_model
    from cache.store import open_store
    from engine.weights.fp8_writer import quantize_folder

    store = open_store(url)
    try:  # a pre-quantized FP8 checkpoint beside it
        publish_model(store, quantize_folder(make_tiny_model("llama"), tmp / "fp8ck", "channel"), "tiny-fp8")
    finally:
        store.close()
    d = Daemon(tmp, store_url=url, models=[{"name": MODEL, "max_model_len": 256}],
               env={"INFIRE_SERVER__API_KEYS": json.dumps(["key-one", "key-two"])})
    d.start(timeout=120)
    yield d
    d.stop()


def _model(d: Daemon) -> dict:
    code, body = d.get(f"/admin/v1/models/{MODEL}", TOKEN)
    assert code == 200
    return body["model"]


def _cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in d.env.items() if k != "INFIRE_SERVER__ADMIN_TOKEN"}
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_pull_load_unload_cycle(daemon) -> None:
    assert _model(daemon)["state"] == "absent"
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/pull", headers=TOKEN)
    assert code in (200, 202) and body["model"]["state"] in ("pulling", "cached")
    deadline = time.monotonic() + 30
    while _model(daemon)["state"] != "cached":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true", headers=TOKEN, timeout=120)
    assert code == 200 and body["model"]["state"] == "ready", body
    budget = daemon.status()["budget"]  # the worker's figures came ahead of its answer: no lag
    assert budget["weights_bytes"] > 0 and budget["kv_pool_bytes"] > 0, budget
    # "ready" includes one decode, so the model's probe is green at once.
    assert daemon.get(f"/readyz/{MODEL}")[0] == 200
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load", headers=TOKEN)
    assert code == 200 and body["model"]["state"] == "ready"  # idempotent
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/unload?wait=true", headers=TOKEN, timeout=60)
    assert code == 200 and body["model"]["state"] == "cached"
    budget = daemon.status()["budget"]
    assert budget["weights_bytes"] == 0 and budget["vacant_bytes"] > 0, budget  # kept for the next load of its kind
    assert daemon.get(f"/readyz/{MODEL}")[0] == 503
    # autoload (the default): a request for a model that is not loaded brings it back
    code, body = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}, headers=KEY)
    assert code == 200 and _model(daemon)["state"] == "ready", body
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/unload?wait=true", headers=TOKEN, timeout=60)
    assert code == 200 and body["model"]["state"] == "cached"


def test_cli_load_unload_pull(daemon) -> None:
    r = _cli(daemon, "load", MODEL)
    assert r.returncode == 0 and f"{MODEL}: ready" in r.stdout, r.stderr
    r = _cli(daemon, "pull", MODEL)  # through the agent: already cached and loaded
    assert r.returncode == 0 and "snapshot" in r.stdout, r.stderr
    r = _cli(daemon, "unload", MODEL)
    assert r.returncode == 0 and f"{MODEL}: cached" in r.stdout
    r = _cli(daemon, "load", "no-such-model")
    assert r.returncode == 2 and "not in the store" in r.stderr, r.stderr
    r = _cli(daemon, "load", "Bad Name")
    assert r.returncode == 2


def test_load_failure_is_reported(daemon) -> None:
    # Not in the store: 404 with the reason, and nothing of the name is kept
    # (tests/integration/test_model_admission.py has the rest).
    code, body = daemon.post("/admin/v1/models/missing-model/load?wait=true", headers=TOKEN, timeout=60)
    assert code == 404 and body["error"]["code"] == "model_not_found" and "not in the store" in body["error"]["message"]
    assert daemon.get("/admin/v1/models/missing-model", TOKEN)[0] == 404
    assert daemon.get("/admin/v1/models/never-heard-of", TOKEN)[0] == 404


def test_unload_drains_in_flight_requests(daemon) -> None:
    code, _ = daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true", headers=TOKEN, timeout=120)
    assert code == 200
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    body = {"model": MODEL, "prompt": "drain", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **KEY})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        r=daemon.post(f"/admin/v1/models/{MODEL}/unload?wait=true", headers=TOKEN, timeout=60)))
    t.start()
    time.sleep(0.2)
    assert _model(daemon)["state"] in ("draining", "unloading", "cached")
    events = [line[6:].strip() for line in resp if line.startswith(b"data: ")]
    conn.close()
    t.join(60)
    assert events[-1] == b"[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length"
    assert result["r"][0] == 200 and result["r"][1]["model"]["state"] == "cached"


def test_api_keys(daemon) -> None:
    code, body = daemon.get("/v1/models")
    assert code == 401 and body["error"]["code"] == "invalid_api_key"
    assert daemon.get("/v1/models", {"Authorization": "Bearer key-three"})[0] == 401
    assert daemon.get("/v1/models", KEY)[0] == 200
    assert daemon.get("/v1/models", {"Authorization": "Bearer key-one"})[0] == 200
    # Probes and metrics stay open for the orchestrator.
    assert daemon.get("/livez")[0] == 200 and daemon.get("/metrics")[0] == 200


def test_a_load_can_ask_for_fp8_weights_and_kv_cache(daemon) -> None:
    """``?quantization=fp8&kv_cache_dtype=fp8`` (on the CPU: the reference path) loads the model
    with FP8 projections and an e4m3 KV cache, it serves, and status says so; another
    quantization of a loaded model is a conflict until it is unloaded."""
    daemon.post(f"/admin/v1/models/{MODEL}/unload?wait=true", headers=TOKEN, timeout=60)
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?quantization=int4", headers=TOKEN)
    assert code == 400 and body["error"]["code"] == "invalid_value" and "fp8, none" in body["error"]["message"]
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true", headers=TOKEN, timeout=120)
    assert code == 200 and body["model"]["quantization"] is None
    plain_bytes = body["model"]["device_bytes"]
    daemon.post(f"/admin/v1/models/{MODEL}/unload?wait=true", headers=TOKEN, timeout=60)
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true&quantization=fp8&kv_cache_dtype=fp8",
                             headers=TOKEN, timeout=120)
    assert code == 200 and body["model"]["state"] == "ready", body
    assert body["model"]["quantization"] == "fp8" and body["model"]["kv_cache_dtype"] == "fp8"
    # at once: the status the worker sent before this load (of the bf16 load) is not read for it
    assert 0 < body["model"]["device_bytes"] < plain_bytes, (body["model"]["device_bytes"], plain_bytes)
    code, out = daemon.post("/v1/completions", {"model": MODEL, "prompt": "fp8", "max_tokens": 8, "ignore_eos": True},
                            headers=KEY, timeout=60)
    assert code == 200 and out["usage"]["completion_tokens"] == 8
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?quantization=none", headers=TOKEN)
    assert code == 409 and "unload it first" in body["error"]["message"]
    code, _ = daemon.post(f"/admin/v1/models/{MODEL}/unload?wait=true", headers=TOKEN, timeout=60)
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/load?wait=true&quantization=none&kv_cache_dtype=none",
                             headers=TOKEN, timeout=120)
    assert code == 200 and body["model"]["quantization"] is None and body["model"]["kv_cache_dtype"] is None


def test_a_pre_quantized_checkpoint_reports_the_format_it_runs_in(daemon) -> None:
    """Its format decides (the engine loads it as FP8 whatever the load asked): status says fp8,
    asking for it again is no conflict, asking for none is one."""
    code, body = daemon.post("/admin/v1/models/tiny-fp8/load?wait=true&quantization=none", headers=TOKEN, timeout=120)
    assert code == 200 and body["model"]["state"] == "ready", body
    assert body["model"]["quantization"] == "fp8"
    code, body = daemon.post("/admin/v1/models/tiny-fp8/load?quantization=fp8", headers=TOKEN)
    assert code == 200 and body["model"]["quantization"] == "fp8"
    code, body = daemon.post("/admin/v1/models/tiny-fp8/load?quantization=none", headers=TOKEN)
    assert code == 409 and "quantization fp8; unload it first" in body["error"]["message"]
    code, out = daemon.post("/v1/completions", {"model": "tiny-fp8", "prompt": "x", "max_tokens": 4, "ignore_eos": True},
                            headers=KEY, timeout=60)
    assert code == 200 and out["usage"]["completion_tokens"] == 4
    daemon.post("/admin/v1/models/tiny-fp8/unload?wait=true", headers=TOKEN, timeout=60)
