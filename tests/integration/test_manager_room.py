"""ModelManager against a real daemon (CPU, tiny models) under a memory budget that holds two:
LRU eviction that spares pinned models and drains busy ones, refusals with the numbers, drain before
unload, keep_alive and autoload."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any
import urllib.error
import urllib.request

import pytest

from cache.publish import publish_model
from cache.store import open_store
from tests.integration.agent_harness import Daemon, publish_tiny
from tests.integration.manager_helpers import (
    CTX, SEQS, TOKEN, admin, budget_for_two, complete, model, open_stream, read_stream, wait_engine_empty,
    wait_state,
)

NAMES = ("m-a", "m-b", "m-c", "m-k", "m-auto", "m-huge", "m-nan", "m-badcfg")


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("manager-room")
    src = make_tiny_model("llama")
    publish_tiny(make_tiny_model, tmp / "store", NAMES[:-3])
    store = open_store((tmp / "store").as_uri())
    try:  # a model larger than the whole budget (the small preset: ~4x a tiny one), and one
        # that loads but decodes nothing (every norm weight NaN: the canary refuses it)
        publish_model(store, make_tiny_model("llama", "small"), "m-huge")
        publish_model(store, _nan_norms(src, tmp / "nan"), "m-nan")
        publish_model(store, _bad_heads(src, tmp / "badcfg"), "m-badcfg")  # refused by its config, as published
    finally:
        store.close()
    # autoload off but for m-auto: these tests drive loads through the admin API
    base = {"max_model_len": CTX, "max_num_seqs": SEQS, "keep_alive": -1, "autoload": False}
    models = [{**base, "name": "m-a", "pin": True}, {**base, "name": "m-b"}, {**base, "name": "m-c"},
              {**base, "name": "m-k", "keep_alive": "1s"}, {**base, "name": "m-auto", "autoload": True},
              {**base, "name": "m-huge", "autoload": True}, {**base, "name": "m-nan", "autoload": True},
              {**base, "name": "m-badcfg", "autoload": True}]
    d = Daemon(tmp, models=models, env={"INFIRE_GPU__CPU_MEMORY_BUDGET": str(budget_for_two(src)),
                                        "INFIRE_SERVER__AUTOLOAD_TIMEOUT": "20s",
                                        "INFIRE_SERVER__PREEMPT_FOR_ROOM": "true"})
    d.start(timeout=120)
    for n in NAMES:
        assert admin(d, n, "pull")[0] == 200
    yield d
    d.stop()


def _nan_norms(src, dst):
    """A copy of ``src`` whose norm weights are all NaN: it loads, and decodes nothing."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: torch.full_like(v, float("nan")) if "norm" in k else v for k, v in t.items()}, f,
                  metadata={"format": "pt"})
    return dst


def _bad_heads(src, dst):
    """A copy of ``src`` whose config asks for one attention head more than its KV heads divide."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_attention_heads"] = 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) + 1
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _reset(d: Daemon) -> None:
    """Every model cached and nothing held in the engine."""
    for n in NAMES:
        if model(d, n)["state"] in ("ready", "failed"):
            code, body = admin(d, n, "unload")
            assert code == 200, body
    for n in NAMES:
        wait_state(d, n, {"cached", "failed"})
    assert wait_engine_empty(d, gone=NAMES)["models"] == {}


def _load(d: Daemon, name: str) -> dict:
    code, body = admin(d, name, "load")
    assert code == 200 and body["model"]["state"] == "ready", body
    return body["model"]


def test_lru_eviction_spares_pinned_and_busy_models(daemon) -> None:
    _reset(daemon)
    _load(daemon, "m-a")  # pinned in the config, and the least recently used of all
    _load(daemon, "m-b")
    assert complete(daemon, "m-b")[0] == 200
    _load(daemon, "m-c")  # no room for three: the LRU idle unpinned model goes, not the pinned one
    b = model(daemon, "m-b")
    assert b["state"] == "cached" and "evicted to make room for m-c" in b["reason"], b
    assert model(daemon, "m-a")["state"] == "ready" and model(daemon, "m-a")["pinned"] is True
    wait_engine_empty(daemon, gone=("m-b",))

    # m-c busy, m-a pinned: nothing may go now. Loading m-b drains m-c (a busy model is never
    # cut: it admits nothing more, its request runs to its end, ahead of any other model's),
    # waits for that, then loads into its room.
    conn, resp = open_stream(daemon, "m-c")
    assert model(daemon, "m-c")["in_flight"] == 1
    code, body = admin(daemon, "m-b", "load", wait=False)
    assert code == 202, body
    wait_state(daemon, "m-c", {"draining"})
    assert model(daemon, "m-b")["state"] == "loading"
    code, body = complete(daemon, "m-c")  # admits nothing more (autoload is off here: 503)
    assert code == 503 and "draining" in body["error"]["message"], body
    chunks, done = read_stream(resp)
    conn.close()
    assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"  # never cut
    wait_state(daemon, "m-b", {"ready"})
    c = model(daemon, "m-c")
    assert c["state"] == "cached" and "drained to make room for m-b" in c["reason"], c
    logs = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    drains = [r for r in logs if r.get("event") == "drain_for_load" and r.get("load") == "m-b"]
    assert [r["model"] for r in drains] == ["m-c"] and drains[0]["in_flight"] == 1, drains
    waits = [r for r in logs if r.get("event") == "room_wait" and r.get("model") == "m-b"]
    assert waits and waits[0]["waiting_on"] == ["m-c"], waits

    # m-a and m-b pinned: no model could ever make room, so loading m-c is refused at once,
    # with the numbers.
    assert daemon.post("/admin/v1/models/m-b/pin", headers=TOKEN)[0] == 200
    t = time.monotonic()
    code, body = admin(daemon, "m-c", "load")
    assert time.monotonic() - t < 10  # not the autoload_timeout's 20 s: nothing to wait for
    assert code == 507 and body["error"]["code"] == "no_room", body
    d = body["error"]["details"]
    assert d["needed"] > d["free"] > 0 and d["short"] > 0 and d["evictable"] == 0 and d["budget"] > 0, d
    assert f"({d['needed']} B)" in body["error"]["message"] and "short by" in body["error"]["message"]
    assert body["model"]["state"] == "failed" and body["model"]["refusal"]["needed"] == d["needed"]
    assert {model(daemon, n)["state"] for n in ("m-a", "m-b")} == {"ready"}

    # Both unpinned through the admin API, m-a used after m-b: now m-b is the one to go.
    for n in ("m-a", "m-b"):
        code, body = daemon.post(f"/admin/v1/models/{n}/unpin", headers=TOKEN)
        assert code == 200 and body["model"]["pinned"] is False
    time.sleep(0.01)
    assert complete(daemon, "m-a")[0] == 200
    _load(daemon, "m-c")
    assert model(daemon, "m-b")["state"] == "cached" and model(daemon, "m-a")["state"] == "ready"
    _, metrics = daemon.get("/metrics")
    assert 'infire_model_state{model="m-b",state="cached"} 1.0' in metrics
    assert 'infire_model_state{model="m-c",state="ready"} 1.0' in metrics
    assert daemon.post("/admin/v1/models/m-a/pin", headers=TOKEN)[0] == 200
    logs = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    evictions = [r["model"] for r in logs if r.get("event") == "evict"]
    assert evictions == ["m-b", "m-b"], evictions  # m-c was drained (above), not evicted


def test_unload_during_streaming_drains_then_frees(daemon) -> None:
    _reset(daemon)
    _load(daemon, "m-b")
    conn, resp = open_stream(daemon, "m-b")
    code, body = admin(daemon, "m-b", "unload", wait=False)
    assert code == 202 and body["model"]["state"] == "draining", body
    code, body = complete(daemon, "m-b")
    assert code == 503 and body["error"]["code"] == "model_not_ready", body
    chunks, done = read_stream(resp)  # drained: the stream ran to its end
    conn.close()
    assert done and sum(len(c["choices"][0]["text"]) >= 0 for c in chunks) >= CTX // 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_state(daemon, "m-b", {"cached"})
    mem = wait_engine_empty(daemon, gone=("m-b",))["memory"]  # the engine's own books, via status
    assert mem is not None and mem["kv_used"] == 0 and "m-b" not in mem["models"], mem
    # m-b's tensors stay as a vacancy for the next load of its kind (engine/core/vacancy.py)
    assert mem["vacant"] > 0 and mem["used"] == sum(
        m["weights"] + m["workspace"] for m in mem["models"].values()) + mem["vacant"] + mem["kv"], mem


def test_keep_alive_unloads_an_idle_model(daemon) -> None:
    _reset(daemon)
    _load(daemon, "m-a")  # pinned, keep_alive -1: stays
    _load(daemon, "m-k")
    assert complete(daemon, "m-k")[0] == 200
    t0 = time.monotonic()
    assert model(daemon, "m-k")["state"] == "ready"
    m = wait_state(daemon, "m-k", {"cached"}, timeout=10)
    assert time.monotonic() - t0 >= 0.5 and m["reason"] == "idle past keep_alive", m
    assert model(daemon, "m-a")["state"] == "ready"
    wait_engine_empty(daemon, gone=("m-k",))


def test_autoload_waits_then_serves_and_503_when_it_cannot(daemon) -> None:
    _reset(daemon)
    code, body = daemon.get("/v1/models")  # what a request may name: ready, or loaded when asked for
    listed = {m["id"]: m["state"] for m in body["data"]}
    assert code == 200 and listed["m-auto"] == listed["m-huge"] == "cached", listed
    assert all(state == "ready" for name, state in listed.items()
               if name not in ("m-auto", "m-huge", "m-nan", "m-badcfg")), listed
    assert daemon.get("/v1/models/m-auto")[1]["state"] == "cached"
    code, body = complete(daemon, "m-c")  # autoload is off for m-c
    assert code == 503 and body["error"]["code"] == "model_not_ready"
    code, body = complete(daemon, "m-auto")  # cached, not loaded: the request loads it and waits
    assert code == 200 and body["usage"]["completion_tokens"] == 4, body
    assert model(daemon, "m-auto")["state"] == "ready"
    assert admin(daemon, "m-auto", "unload")[0] == 200
    # No room it may take: m-a pinned by config, m-b pinned through the API.
    _load(daemon, "m-a")
    _load(daemon, "m-b")
    assert daemon.post("/admin/v1/models/m-b/pin", headers=TOKEN)[0] == 200
    try:
        t0 = time.monotonic()
        code, body = complete(daemon, "m-auto")
        assert code == 503 and body["error"]["code"] == "model_not_ready", body
        assert "no room" in body["error"]["message"] and time.monotonic() - t0 < 20
        code, _ = daemon.get("/v1/models")
        assert model(daemon, "m-auto")["state"] == "failed"
    finally:
        daemon.post("/admin/v1/models/m-b/unpin", headers=TOKEN)
    assert model(daemon, "m-b")["state"] == "ready" and model(daemon, "m-a")["state"] == "ready"
    code, body = admin(daemon, "m-auto", "unload")  # nothing in the engine: clears the failure
    assert code == 200 and body["model"]["state"] == "cached" and body["model"]["refusal"] is None, body


def test_unload_past_its_drain_deadline_aborts_and_frees(daemon) -> None:
    _reset(daemon)
    _load(daemon, "m-c")
    assert daemon.post("/admin/v1/models/m-c/unload?drain_timeout=-1", headers=TOKEN)[0] == 400
    conn, resp = open_stream(daemon, "m-c")
    t0 = time.monotonic()
    code, body = daemon.post("/admin/v1/models/m-c/unload?wait=true&drain_timeout=0.05", headers=TOKEN)
    assert code == 200 and body["model"]["state"] == "cached", body
    chunks, done = read_stream(resp)  # cut short: the engine aborted it, and the stream says so
    conn.close()
    assert time.monotonic() - t0 < 10
    assert not done or chunks[-1]["choices"][0]["finish_reason"] != "length", chunks[-2:]
    assert model(daemon, "m-c")["in_flight"] == 0
    wait_engine_empty(daemon, gone=("m-c",))
    logs = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    assert any(r.get("event") == "drain_timeout" and r.get("model") == "m-c" for r in logs)


def test_a_model_larger_than_the_budget_is_refused_at_once_without_draining_busy_models(daemon) -> None:
    """No model leaving could ever make room for it: the busy models keep serving (a drain would
    unload them for nobody, its streams cut at the drain's timeout), and the request for it is
    answered at once with the numbers, through the admin API and through autoload alike."""
    _reset(daemon)
    _load(daemon, "m-b")
    _load(daemon, "m-c")
    conns = [open_stream(daemon, n) for n in ("m-b", "m-c")]
    t = time.monotonic()
    code, body = admin(daemon, "m-huge", "load")
    assert code == 507 and body["error"]["code"] == "no_room", body
    d = body["error"]["details"]
    assert d["needed"] > d["budget"] and "more than the whole budget" in body["error"]["message"], body
    code, body = daemon.post("/v1/completions", {"model": "m-huge", "prompt": "hi", "max_tokens": 2})
    assert code == 503 and "more than the whole budget" in body["error"]["message"], body
    assert time.monotonic() - t < 10  # not the autoload_timeout's 20 s, and no drain's
    for n in ("m-b", "m-c"):
        assert model(daemon, n)["state"] == "ready", model(daemon, n)  # never drained
    for conn, resp in conns:
        chunks, done = read_stream(resp)
        conn.close()
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"  # never cut
    logs = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    assert not [r for r in logs if r.get("event") == "drain_for_load" and r.get("load") == "m-huge"]


def test_a_model_whose_load_fails_is_not_loaded_again_by_every_request(daemon) -> None:
    """Its load fails on its own (here the canary: it decodes nothing). The next requests are
    answered at once with the reason and a Retry-After until LOAD_RETRY_S has passed, and take
    no room meanwhile: the healthy model its first load evicted is not evicted again for it. An
    operator's load still goes at once."""
    _reset(daemon)
    _load(daemon, "m-b")
    _load(daemon, "m-c")
    assert complete(daemon, "m-c")[0] == 200  # m-b the least recently used
    code, body = complete(daemon, "m-nan")
    assert code == 503 and "could not decode a token" in body["error"]["message"], body
    assert model(daemon, "m-b")["state"] == "cached"  # its room went to m-nan's (failed) load
    _load(daemon, "m-b")
    for _ in range(3):
        t = time.monotonic()
        req = urllib.request.Request(daemon.base + "/v1/completions", method="POST",
                                     data=json.dumps({"model": "m-nan", "prompt": "hi", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as ex:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(ex.value.read())
        assert ex.value.code == 503 and "retries it in" in body["error"]["message"], body
        assert time.monotonic() - t < 2 and 1 <= float(ex.value.headers["Retry-After"]) <= 5, ex.value.headers
    assert {model(daemon, n)["state"] for n in ("m-b", "m-c")} == {"ready"}  # nothing evicted for it
    m = model(daemon, "m-nan")
    assert m["state"] == "failed" and m["failed_loads"] == 1 and 0 < m["retry_in_s"] <= 5, m
    logs = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    evicts = [r for r in logs if r.get("event") == "evict" and "m-nan" in r.get("reason", "")]
    assert len(evicts) == 1, evicts
    code, body = admin(daemon, "m-nan", "load")  # an operator's load: at once, and it fails again
    assert code != 200 and model(daemon, "m-nan")["failed_loads"] == 2, body
    assert 5 < model(daemon, "m-nan")["retry_in_s"] <= 10


def test_a_model_whose_published_files_fail_is_repaired_once_then_backed_off(daemon) -> None:
    """A load failing on its files (its config, here) marks them suspect: the next request's load
    verifies every sha256 and fetches what is wrong, at once. When the bytes as published are
    what fails, that repair fails too, and from then on requests back off like any failure of
    the model's own: the review of the first version found every such load re-verifying the
    whole snapshot, request after request."""
    _reset(daemon)
    code, body = complete(daemon, "m-badcfg")
    assert code == 503 and "could not be loaded" in body["error"]["message"], body
    m = model(daemon, "m-badcfg")
    assert m["state"] == "failed" and m["failed_loads"] == 0 and m["retry_in_s"] is None, m  # repair next
    code, body = complete(daemon, "m-badcfg")  # the repair load: it verifies, and fails the same way
    assert code == 503, body
    m = model(daemon, "m-badcfg")
    assert m["failed_loads"] == 1 and 0 < m["retry_in_s"] <= 5, m
    code, body = complete(daemon, "m-badcfg")
    assert code == 503 and "retries it in" in body["error"]["message"], body


def test_pinning_a_model_drained_for_room_calls_the_drain_off(daemon) -> None:
    """A pin means never evicted: pinned while it drains for another model's room, the model
    serves again (its stream runs to its end, it stays ready) and the load that wanted its room
    is refused, instead of the pinned model being unloaded and /readyz left 503 for it."""
    _reset(daemon)
    _load(daemon, "m-a")  # pinned in the config
    _load(daemon, "m-c")
    conn, resp = open_stream(daemon, "m-c")
    code, body = admin(daemon, "m-b", "load", wait=False)
    assert code == 202, body
    wait_state(daemon, "m-c", {"draining"})
    code, body = daemon.post("/admin/v1/models/m-c/pin", headers=TOKEN)
    assert code == 200 and body["model"]["pinned"] is True, body
    try:
        assert wait_state(daemon, "m-c", {"ready"})["state"] == "ready"
        chunks, done = read_stream(resp)
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
        b = wait_state(daemon, "m-b", {"failed"})
        assert "no room" in b["reason"], b
        time.sleep(1.0)
        assert model(daemon, "m-c")["state"] == "ready"  # and it stays so
    finally:
        conn.close()
        assert daemon.post("/admin/v1/models/m-c/unpin", headers=TOKEN)[0] == 200


def _preemptions(d: Daemon, name: str) -> float:
    _, text = d.get("/metrics")
    line = next((ln for ln in text.splitlines() if ln.startswith(f'infire_preemptions_total{{model="{name}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def _seeded(d: Daemon, name: str, stream: bool) -> Any:
    """The same seeded completion, streamed (the open connection and response, after its first
    chunk) or whole (its text)."""
    body = {"model": name, "prompt": "go on", "max_tokens": CTX - 16, "temperature": 1.0, "seed": 11,
            "ignore_eos": True, "stream": stream}
    if not stream:
        code, out = d.post("/v1/completions", body, timeout=60)
        assert code == 200, out
        return out["choices"][0]["text"]
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline().startswith(b"data: ")
    return conn, resp


def test_a_load_preempts_a_busy_model_whose_requests_resume_where_they_were(daemon) -> None:
    """A load that needs a busy model's room takes it at once when the model's requests can
    resume (autoload on): they leave the engine, the load goes ahead, and once the model is back
    (here: evicting the idle model that took its room) each goes on from the output it had —
    a seeded stream's text is the text of the same request run alone. A request is preempted
    once at most: the next load that needs that room drains the model."""
    _reset(daemon)
    _load(daemon, "m-a")  # pinned in the config: the budget's other model is m-auto's, then m-b's
    _load(daemon, "m-auto")
    alone = _seeded(daemon, "m-auto", stream=False)
    seen = len(daemon.logs().splitlines())  # this test's log lines come after
    before = _preemptions(daemon, "m-auto")
    conn, resp = _seeded(daemon, "m-auto", stream=True)
    try:
        code, body = admin(daemon, "m-b", "load")  # waits: ready long before the stream could end
        assert code == 200 and body["model"]["state"] == "ready", body
        # m-auto comes back for its request (evicting m-b, idle), which resumes; a request is
        # preempted once at most: loading m-b again now drains m-auto instead
        wait_state(daemon, "m-auto", {"ready"})
        code, body = admin(daemon, "m-b", "load", wait=False)
        assert code == 202, body
        chunks, done = read_stream(resp)
    finally:
        conn.close()
    assert done and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-2:]
    # the first chunk (read by _seeded) held the first token's text; the rest came after
    rest = "".join(c["choices"][0]["text"] for c in chunks)
    assert alone.endswith(rest) and len(rest) > len(alone) // 2, (alone, rest)
    wait_state(daemon, "m-b", {"ready"})
    logs = [json.loads(line) for line in daemon.logs().splitlines()[seen:] if line.startswith("{")]
    taken = [(r["event"], r["model"]) for r in logs if r.get("event") in ("preempt_for_load", "drain_for_load")
             and r.get("load") == "m-b"]
    assert taken == [("preempt_for_load", "m-auto"), ("drain_for_load", "m-auto")], taken
    assert model(daemon, "m-auto")["state"] == "cached"
    assert _preemptions(daemon, "m-auto") == before + 1
    assert model(daemon, "m-auto")["in_flight"] == 0


def test_a_preempted_request_whose_model_cannot_come_back_ends_with_the_reason(daemon) -> None:
    """Preempted for a pinned model's room beside another pinned one, the model can never come
    back: its stream ends with an error event naming why (model_not_ready), not silence."""
    _reset(daemon)
    _load(daemon, "m-a")  # pinned in the config
    _load(daemon, "m-auto")
    assert daemon.post("/admin/v1/models/m-b/pin", headers=TOKEN)[0] == 200
    try:
        conn, resp = _seeded(daemon, "m-auto", stream=True)
        try:
            code, body = admin(daemon, "m-b", "load")
            assert code == 200 and body["model"]["state"] == "ready", body
            chunks, done = read_stream(resp)
        finally:
            conn.close()
        assert not done and chunks, chunks[-2:]
        assert model(daemon, "m-auto")["preempted"] == 0  # its wait ended with the error
        err = chunks[-1].get("error")
        assert err and err["code"] == "model_not_ready" and "m-auto" in err["message"], chunks[-1]
        assert model(daemon, "m-auto")["in_flight"] == 0
    finally:
        assert daemon.post("/admin/v1/models/m-b/unpin", headers=TOKEN)[0] == 200
