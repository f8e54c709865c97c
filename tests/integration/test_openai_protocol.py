"""The OpenAI API's edges on a real daemon (CPU, tiny model, an API key set): request ids that
clients reuse, headers that are not UTF-8, error bodies of routes and encodings the server does not
serve, ``Expect: 100-continue``, ``models.retrieve``, tool messages, ``stream_options`` and
logprobs of byte tokens."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny

openai = pytest.importorskip("openai")

MODEL = "tiny"
CTX = 256
KEY = "test-api-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-protocol")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    d = Daemon(tmp, store_url=url, env={"INFIRE_SERVER__API_KEYS": json.dumps([KEY])},
               models=[{"name": MODEL, "preload": True, "max_model_len": CTX, "max_num_seqs": 4}])
    d.start(timeout=120)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _raw(port: int, data: bytes, *, read_body: bool = True, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: status, headers, body (up to Content-Length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        want = int(headers.get("content-length", "0"))
        while read_body and len(body) < want:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    return status, headers, body


def _openai_error(body: bytes) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def _post(daemon: Daemon, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(daemon.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --- item 3: a reused X-Request-Id never touches the other request -------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_two_requests_with_one_request_id_both_complete(daemon, stream) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    results: list[tuple[int, dict[str, str], bytes]] = []

    def one() -> None:
        results.append(_post(daemon, "/v1/completions", body, {"X-Request-Id": "same-id-1"}))

    threads = [threading.Thread(target=one) for _ in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert time.monotonic() - t0 < 60 and len(results) == 2
    texts = []
    for code, headers, raw in results:
        assert code == 200, raw[:300]
        assert headers["X-Request-Id"] == "same-id-1"  # the client's id stays for its logs
        if stream:
            events = [json.loads(ln[6:]) for ln in raw.decode().splitlines()
                      if ln.startswith("data: ") and ln != "data: [DONE]"]
            assert raw.rstrip().endswith(b"data: [DONE]") and not any("error" in e for e in events)
            assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
            texts.append("".join(e["choices"][0]["text"] for e in events))
        else:
            r = json.loads(raw)
            assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 24
            texts.append(r["choices"][0]["text"])
    assert texts[0] == texts[1]  # greedy: the same answer, neither cut short


# --- item 4: a non-UTF-8 Authorization header is a 401 ------------------------------------------


@pytest.mark.parametrize("path", ["/admin/v1/status", "/v1/models"])
def test_authorization_that_is_not_utf8_is_401(daemon, path) -> None:
    status, _, body = _raw(daemon.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode()
                           + b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
    assert status == 401
    assert json.loads(body)["error"]["type"] == "authentication_error"
    status, _, body = _raw(daemon.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                           b"Authorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n{}")
    assert status == 401 and _openai_error(body)["code"] == "invalid_api_key"
    assert "Traceback" not in daemon.logs()


# --- item 12: every /v1 answer is in the OpenAI error shape --------------------------------------


def test_unknown_routes_and_methods_answer_openai_errors(daemon) -> None:
    for method, path, want in [("POST", "/v1/embeddings", 404), ("GET", "/v1/nope/deeper", 404),
                               ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)]:
        status, headers, body = _raw(daemon.port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n"
                                     f"Authorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode())
        assert status == want, (method, path, body)
        assert headers["content-type"].startswith("application/json"), (path, headers)
        err = _openai_error(body)
        assert err["type"] == "invalid_request_error"
        if want == 405:
            assert "Allow" in err["message"] or "allow" in headers


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress"])
def test_unsupported_content_encoding_is_an_openai_error(daemon, encoding) -> None:
    data = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
    status, headers, body = _raw(daemon.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 + f"Content-Encoding: {encoding}\r\nContent-Length: {len(data)}\r\n".encode()
                                 + f"Authorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode() + data)
    assert status == 415, body
    assert _openai_error(body)["code"] == "unsupported_content_encoding"


def test_gzip_and_deflate_bodies_are_served_and_bombs_refused(daemon) -> None:
    import gzip
    import zlib

    data = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    for encoding, packed in [("gzip", gzip.compress(data)), ("deflate", zlib.compress(data))]:
        code, _, raw = _post_raw(daemon, packed, {"Content-Encoding": encoding})
        assert code == 200, (encoding, raw[:300])
    bomb = gzip.compress(b" " * (64 << 20))  # 64 MB of spaces in ~64 KB: over the 8 MiB body limit
    code, _, raw = _post_raw(daemon, bomb, {"Content-Encoding": "gzip"})
    assert code == 413 and _openai_error(raw)["code"] == "body_too_large"
    code, _, raw = _post_raw(daemon, b"not gzip at all", {"Content-Encoding": "gzip"})
    assert code == 400 and _openai_error(raw)["code"] == "invalid_encoding"
    # several gzip members are one body (RFC 1952), and their sizes add up against the limit
    half = len(data) // 2
    code, _, raw = _post_raw(daemon, gzip.compress(data[:half]) + gzip.compress(data[half:]),
                             {"Content-Encoding": "gzip"})
    assert code == 200, raw[:300]
    code, _, raw = _post_raw(daemon, gzip.compress(b" " * (6 << 20)) * 2 + gzip.compress(data),
                             {"Content-Encoding": "gzip"})
    assert code == 413 and _openai_error(raw)["code"] == "body_too_large"
    # bytes after the data are an error, not ignored
    for encoding, packed in [("gzip", gzip.compress(data)), ("deflate", zlib.compress(data))]:
        code, _, raw = _post_raw(daemon, packed + b"trailing", {"Content-Encoding": encoding})
        assert code == 400 and "8 bytes after its data" in _openai_error(raw)["message"], raw[:300]


def _post_raw(daemon: Daemon, data: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(daemon.base + "/v1/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **AUTH, **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_malformed_requests_log_one_info_line_not_a_traceback(daemon) -> None:
    before = daemon.logs()
    for _ in range(20):
        _raw(daemon.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    time.sleep(0.5)
    new = daemon.logs()[len(before):]
    assert "Traceback" not in new and '"level": "error"' not in new, new[-2000:]
    lines = [json.loads(ln) for ln in new.splitlines() if '"malformed_request"' in ln]
    assert 1 <= len(lines) < 20, new[-2000:]  # one line with the reason, rate-limited
    assert lines[0]["level"] == "info" and lines[0]["reason"]


# --- item 13: OpenAI compatibility ---------------------------------------------------------------


def test_models_retrieve(client, daemon) -> None:
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    code, _, body = _raw(daemon.port, b"GET /v1/models/tiny HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert code == 401 and _openai_error(body)["code"] == "invalid_api_key"


def test_tool_messages_take_tool_call_id(client) -> None:
    r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "what is the weather?"},
        {"role": "assistant", "content": "checking"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ])
    assert r.choices[0].message.role == "assistant"


def test_stream_options_without_stream_is_400(daemon) -> None:
    for path, extra in [("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        for stream in ({}, {"stream": False}):
            code, _, raw = _post(daemon, path, {"model": MODEL, "max_tokens": 1, **extra, **stream,
                                                "stream_options": {"include_usage": True}})
            assert code == 400 and _openai_error(raw)["param"] == "stream_options", raw


def test_expect_continue_with_an_oversized_body_is_413_before_the_body(daemon) -> None:
    status, headers, body = _raw(daemon.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 + f"Content-Length: {64 << 20}\r\nExpect: 100-continue\r\n".encode()
                                 + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n\r\n".encode())
    assert status == 413, (status, body)
    assert _openai_error(body)["code"] == "body_too_large"
    # A body that fits still gets its 100 Continue and is served.
    data = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                  f"Expect: 100-continue\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode())
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(data)
        rest = b""
        while chunk := s.recv(65536):
            rest += chunk
    assert b" 200 OK" in rest


# --- item 10: logprobs of byte tokens --------------------------------------------------------------


def test_completion_logprobs_return_every_alternative(client, make_tiny_model) -> None:
    from text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(make_tiny_model("llama"))
    seen_bytes = 0
    for seed in range(4):
        r = client.completions.create(model=MODEL, prompt="x y", max_tokens=12, temperature=1.0, seed=seed,
                                      logprobs=20, extra_body={"ignore_eos": True})
        c = r.choices[0]
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        for top in lp.top_logprobs:
            assert len(top) == 20  # no two alternatives share a key
            for key in top:
                assert "\ufffd" not in key, key
                seen_bytes += key.startswith("bytes:")
    assert seen_bytes > 0  # the tiny model's 256 byte tokens show up among 20 alternatives
    # A byte token is shown by its bytes, as vLLM does: "bytes:\xe2" for the single byte 0xE2.
    assert tok.token_bytes(0xE2) == b"\xe2"


def test_chat_logprobs_bytes_are_the_tokens_own(client, make_tiny_model) -> None:
    from text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(make_tiny_model("llama"))
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       temperature=1.0, seed=3, logprobs=True, top_logprobs=20,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    odd = 0
    for item in content:
        alts = item.top_logprobs
        assert len(alts) == 20 and len({a.token for a in alts}) == 20
        for a in alts:
            assert a.bytes != [239, 191, 189] or a.token == "\ufffd"
            if a.token.startswith("bytes:"):
                odd += 1
                raw = bytes(a.bytes)
                assert a.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                with pytest.raises(UnicodeDecodeError):
                    raw.decode("utf-8")
            else:
                assert bytes(a.bytes).decode("utf-8") == a.token
    assert odd > 0
    assert tok.is_byte_level


def test_a_shared_system_prompt_is_reported_as_cached_tokens(client) -> None:
    """The second request with the same system prompt reads it from the prefix cache: usage says
    so (``prompt_tokens_details.cached_tokens``, in the streamed usage chunk too), and the answer
    is the one computed without the cache."""
    system = {"role": "system", "content": "You answer in one word. " * 6}
    first = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                           messages=[system, {"role": "user", "content": "weather?"}])
    again = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                           messages=[system, {"role": "user", "content": "weather?"}])
    u1, u2 = first.usage, again.usage
    assert u1.prompt_tokens == u2.prompt_tokens > 32
    assert u1.prompt_tokens_details.cached_tokens == 0
    assert 16 <= u2.prompt_tokens_details.cached_tokens < u2.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[system, {"role": "user", "content": "rain?"}])
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 16
    text = client.completions.create(model=MODEL, prompt="You answer in one word. " * 6, max_tokens=4, temperature=0)
    assert text.usage.prompt_tokens_details.cached_tokens == 0  # no chat template: another prefix


def test_the_prefix_cache_shows_in_status_and_metrics_and_can_be_dropped(daemon, client) -> None:
    system = {"role": "system", "content": "Always reply with the word yes. " * 5}
    for _ in range(2):
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                       messages=[system, {"role": "user", "content": "ok?"}])
    deadline = time.monotonic() + 10
    while (m := daemon.engine_stats(MODEL))["prefix_cache"].get("hit_tokens", 0) < 16 and time.monotonic() < deadline:
        time.sleep(0.1)  # the engine's figures come with its periodic status
    assert m["prefix_cache"]["enabled"] and m["prefix_cache"]["hit_tokens"] >= 16
    assert m["prefix_cache"]["queried_tokens"] > m["prefix_cache"]["hit_tokens"] and m["kv_pages"]["prefix_cached"] >= 1
    code, metrics = daemon.get("/metrics")
    assert code == 200 and f'infire_prefix_hit_tokens{{model="{MODEL}"}}' in metrics
    admin = {"Authorization": "Bearer test-admin-token"}
    code, body = daemon.post(f"/admin/v1/models/{MODEL}/drop-prefix-cache", headers=admin)
    assert code == 200 and body["entries_dropped"] >= 1, body
    deadline = time.monotonic() + 10
    while daemon.engine_stats(MODEL)["kv_pages"]["prefix_cached"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.engine_stats(MODEL)["kv_pages"]["prefix_cached"] == 0
    again = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                           messages=[system, {"role": "user", "content": "ok?"}])
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # computed again after the drop
    code, body = daemon.post("/admin/v1/models/not-here/drop-prefix-cache", headers=admin)
    assert code == 404, body
