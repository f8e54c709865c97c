"""The OpenAI API of a real daemon on loopback (CPU, tiny model), through the official client."""

from __future__ import annotations

import http.client
import json
import stat
import subprocess
import sys
import time

import pytest

from tests.integration.agent_harness import REPO, Daemon, publish_tiny

openai = pytest.importorskip("openai")

MODEL = "tiny"
CTX = 256


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-openai")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    d = Daemon(tmp, store_url=url,
               models=[{"name": MODEL, "preload": True, "max_model_len": CTX, "max_num_seqs": 2}])
    d.start(timeout=120)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list(client) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_completion_text_and_token_ids(client) -> None:
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    r2 = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens == 4 and r2.usage.completion_tokens == 3


def test_seed_reproducible_and_n(client) -> None:
    kw = dict(model=MODEL, prompt="abc", max_tokens=8, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    r = client.completions.create(**{**kw, "n": 3})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.choices[0].text == a.choices[0].text  # choice i uses seed + i
    assert r.usage.completion_tokens == 24


def test_chat_stream_matches_non_stream_with_usage(client) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_with_n_and_logprobs(client) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="two", max_tokens=5, n=2, seed=5, logprobs=1,
                                            stream=True, extra_body={"ignore_eos": True}))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert sum(len(c.logprobs.tokens) for c in mine if c.logprobs) == 5


def test_stop_string(client) -> None:
    base = client.completions.create(model=MODEL, prompt="stop test", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    if len(base) < 8:
        pytest.skip("the random model produced too little text to cut")
    stop = base[4:7]
    expected = base[: base.find(stop)]
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="stop test", max_tokens=24, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            assert finish == ["stop"]
        else:
            r = client.completions.create(**kw)
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        assert text == expected


def test_logprobs(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)
    c = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.token_logprobs) == 3


def test_errors_through_the_client(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=99)
    assert e.value.body["param"] == "n"


BAD = [
    ("/v1/completions", {"prompt": "x", "n": 9}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": CTX}, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * CTX, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 6], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 9}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 257}, "stop"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 1025}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1_000_001}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": CTX},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bounds_rejected_with_openai_error(daemon, path, body, param) -> None:
    code, resp = daemon.post(path, {"model": MODEL, **body})
    assert code == 400, resp
    err = resp["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_malformed_bodies(daemon) -> None:
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    code, resp = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x", "user": deep})
    assert code == 400 and "deep" in resp["error"]["message"]
    code, resp = daemon.post("/v1/completions", raw=b"{not json")
    assert code == 400 and resp["error"]["code"] == "invalid_json"
    code, resp = daemon.post("/v1/completions", raw=b"[1, 2]")
    assert code == 400
    code, resp = daemon.post("/v1/completions", raw=b'{"model": "' + b"x" * (9 << 20) + b'"}')
    assert code == 413 and resp["error"]["code"] == "body_too_large"


def test_header_limits(daemon) -> None:
    code, _ = daemon.get("/v1/models", {"X-Big": "a" * (17 * 1024)})
    assert code in (400, 431)
    code, _ = daemon.get("/v1/models", {f"X-H{i}": "1" for i in range(120)})
    assert code in (400, 431)


def test_disconnect_mid_stream_frees_the_request(daemon) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    body = {"model": MODEL, "prompt": "go", "max_tokens": CTX - 8, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    assert daemon.engine_stats(MODEL)["in_flight"] == 1
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = daemon.engine_stats(MODEL)
        if m["in_flight"] == 0 and m["running"] == 0 and m["waiting"] == 0:
            break
        time.sleep(0.05)
    assert (m["in_flight"], m["running"], m["waiting"]) == (0, 0, 0), m


def test_queue_full_is_503_with_retry_after(daemon) -> None:
    limit = daemon.engine_stats(MODEL)["queue_limit"]
    conns = []
    body = {"model": MODEL, "prompt": "q", "max_tokens": CTX - 8, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        for _ in range(limit):
            c = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
            c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            assert r.status == 200
            conns.append(c)
        code, resp = daemon.post("/v1/completions", {**body, "stream": False})
        assert code == 503 and resp["error"]["code"] == "queue_full"
    finally:
        for c in conns:
            c.close()
    c = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    c.request("POST", "/v1/completions", json.dumps({**body, "stream": False, "max_tokens": 1}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status == 503:
        assert r.getheader("Retry-After") is not None


def test_admin_auth(daemon) -> None:
    assert daemon.get("/admin/v1/status")[0] == 401
    assert daemon.get("/admin/v1/status", {"Authorization": "Bearer wrong"})[0] == 401
    code, body = daemon.post("/admin/v1/models/tiny/unload")
    assert code == 401 and body["error"]["type"] == "authentication_error"
    st = daemon.status()
    assert {"version", "uptime_s", "worker", "budget", "cache", "models"} <= set(st)
    assert st["worker"]["alive"] and st["worker"]["pid"]
    assert st["budget"]["total_bytes"] == 256 << 20 and 0 < st["budget"]["used_bytes"] <= 256 << 20
    # the node's gauges are status's figures (the ledger's use, the KV pool whole), not a second sum
    code, text = daemon.get("/metrics")
    gauges = dict(line.split(" ") for line in text.splitlines() if line.startswith("infire_gpu_"))
    assert float(gauges["infire_gpu_used_bytes"]) == daemon.status()["budget"]["used_bytes"]
    assert float(gauges["infire_gpu_budget_bytes"]) == 256 << 20
    m = next(m for m in st["models"] if m["name"] == MODEL)
    assert {"name", "state", "device_bytes", "kv_pages", "in_flight", "last_used"} <= set(m)
    assert m["state"] == "ready" and m["device_bytes"] > 0
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660


def test_request_id_header(daemon) -> None:
    code, _ = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                          headers={"X-Request-Id": "abc-123"})
    assert code == 200
    import urllib.request

    req = urllib.request.Request(daemon.base + "/v1/completions", method="POST", data=json.dumps(
        {"model": MODEL, "prompt": "x"}).encode(), headers={"Content-Type": "application/json", "X-Request-Id": "abc-123"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["X-Request-Id"] == "abc-123"
        assert json.loads(r.read())["usage"]["completion_tokens"] <= 16  # the completions default


def test_status_cli(daemon) -> None:
    env = {**daemon.env}
    env.pop("INFIRE_SERVER__ADMIN_TOKEN")  # the CLI goes through the unix socket
    run = lambda *a: subprocess.run([sys.executable, "-m", "agent.cli", *a], cwd=REPO, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=30)
    r = run("status")
    assert r.returncode == 0, r.stderr
    assert MODEL in r.stdout and "ready" in r.stdout and "MODEL" in r.stdout
    r = run("status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["models"][0]["name"] == MODEL
    r = run("models")
    assert r.returncode == 0 and MODEL in r.stdout
    down = {**env, "INFIRE_SERVER__RUNTIME_DIR": str(daemon.tmp / "nowhere")}
    r = subprocess.run([sys.executable, "-m", "agent.cli", "status"], cwd=REPO, env=down, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1 and "not running" in r.stderr


def test_metrics(daemon, client) -> None:
    client.completions.create(model=MODEL, prompt="m", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    code, text = daemon.get("/metrics")
    assert code == 200
    assert f'infire_requests_total{{model="{MODEL}",status="200"}}' in text
    assert f'infire_model_state{{model="{MODEL}",state="ready"}} 1.0' in text
    for name in ("infire_time_to_first_token_seconds_bucket", "infire_e2e_request_latency_seconds_count",
                 "infire_generation_tokens_total", "infire_kv_pages_total", "infire_worker_up 1.0",
                 "infire_model_load_seconds_count", "infire_running_sequences"):
        assert name in text, name


def test_readyz(daemon) -> None:
    assert daemon.get("/readyz")[0] == 200
    assert daemon.get(f"/readyz/{MODEL}")[0] == 200
    assert daemon.get("/readyz/nope")[0] == 404
    assert daemon.get("/livez")[0] == 200


def _raw_post(daemon, body: dict, version: str = "1.1", rcvbuf: int | None = None, pause_s: float = 0.0) -> bytes:
    """POST over a plain socket; the whole answer, read after ``pause_s`` (a reader that lags)."""
    import socket

    payload = json.dumps(body).encode()
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(60)
    s.connect(("127.0.0.1", daemon.port))
    s.sendall(f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    time.sleep(pause_s)
    out = b""
    while chunk := s.recv(1 << 16):
        out += chunk
    s.close()
    return out


def _events(raw: bytes, chunked: bool) -> list:
    head, _, data = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"200", head
    assert (b"transfer-encoding: chunked" in head.lower()) == chunked
    if chunked:
        body, rest = b"", data
        while True:
            size, rest = rest.split(b"\r\n", 1)
            if int(size, 16) == 0:
                break
            body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]
        data = body
    from agent.http.sse import DONE, parse_line
    events = [parse_line(line) for line in data.split(b"\n")]
    events = [e for e in events if e is not None]
    assert events[-1] is DONE and DONE not in events[:-1]
    return events[:-1]


def test_http_1_0_client_gets_the_whole_stream_without_chunking(daemon) -> None:
    kw = {"model": MODEL, "prompt": "one two", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    code, full = daemon.post("/v1/completions", kw)
    assert code == 200
    events = _events(_raw_post(daemon, {**kw, "stream": True}, version="1.0"), chunked=False)
    assert "".join(e["choices"][0]["text"] for e in events) == full["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_reader_that_lags_gets_every_event_in_order(daemon) -> None:
    # Four choices with logprobs in one stream, the client reading only after the answer is
    # made: every event arrives once, in order, as the non-streamed answer has it. (Loopback's
    # socket buffers hold this much; the hand-over to the handler's drain past the high-water
    # mark is tested with a small send buffer in tests/unit/test_event_stream.py.)
    n, tokens = 4, 120
    kw = {"model": MODEL, "prompt": "lag", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
          "n": n, "logprobs": 5}
    code, answer = daemon.post("/v1/completions", kw)
    assert code == 200
    events = _events(_raw_post(daemon, {**kw, "stream": True, "stream_options": {"include_usage": True}},
                               rcvbuf=4096, pause_s=1.5), chunked=True)
    assert events[-1]["usage"]["completion_tokens"] == n * tokens
    for i in range(n):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert len(mine) == tokens  # one event per token, none lost or doubled
        assert "".join(c["text"] for c in mine) == answer["choices"][i]["text"]
        assert [t for c in mine for t in c["logprobs"]["tokens"]] == answer["choices"][i]["logprobs"]["tokens"]
