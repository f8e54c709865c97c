"""Hostile and malformed request bodies: each gets a fast 4xx naming the problem, and the
server stays healthy after every one."""

from __future__ import annotations

import time

import pytest

from tests.reliability.rel_helpers import CTX, MODEL, healthy, idle

FAST_S = 2.0
NUMBERS = {  # field -> (endpoint, values that must be refused)
    "max_tokens": ("c", [0, -1, 10**9, 10**30, "twelve", 1.5, True, "5", None]),
    "n": ("c", [0, -1, 9, 10**9, "two", 2.5, True, "2"]),
    "logprobs": ("c", [-1, 21, 10**9, "five", 1.5]),
    "top_logprobs": ("chat", [-1, 21, 10**9, "five", 1.5]),
    "temperature": ("c", [-0.1, 2.01, 1e308, -1e308, "hot", [], {}]),
    "top_p": ("c", [0, -0.5, 1.01, 1e308, "x", []]),
    "seed": ("c", [-1, 2**63, "seven", 1.5]),
    "top_k": ("c", [-2, 2**21, "k"]),
}
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]


def _body(endpoint: str, field: str, value: object) -> tuple[str, dict]:
    if endpoint == "chat":
        b = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        if field == "top_logprobs":
            b["logprobs"] = True
        b[field] = value
        return "/v1/chat/completions", b
    b = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    b[field] = value
    return "/v1/completions", b


def _refused(daemon, path: str, body=None, raw: bytes | None = None, param: str | None = None) -> dict:
    t0 = time.monotonic()
    code, resp = daemon.post(path, body, raw=raw)
    took = time.monotonic() - t0
    assert 400 <= code < 500, (code, resp, body, raw and raw[:200])
    assert took < FAST_S, f"refusal took {took:.2f}s"
    err = resp["error"]
    assert err["message"] and err["type"] == "invalid_request_error", resp
    if param is not None:
        assert err["param"] == param, resp
    return err


@pytest.mark.parametrize("field", sorted(NUMBERS))
def test_sampling_fields_out_of_range(daemon, tally, field) -> None:
    endpoint, values = NUMBERS[field]
    for v in values:
        path, body = _body(endpoint, field, v)
        if field == "max_tokens" and v is None:
            continue  # null means "the default"
        _refused(daemon, path, body, param=field)
        tally["bad_inputs"] += 1
    for lit in NON_FINITE:  # Python's json accepts these literals: the schema must not
        path, body = _body(endpoint, field, 0)
        raw = json_with_literal(body, field, lit)
        _refused(daemon, path, raw=raw, param=field)
        tally["bad_inputs"] += 1
    healthy(daemon)
    tally["requests"] += 2 * (len(values) + len(NON_FINITE)) + 1


def json_with_literal(body: dict, field: str, literal: str) -> bytes:
    import json

    marker = "__LITERAL__"
    return json.dumps({**body, field: marker}).replace(f'"{marker}"', literal).encode()


def test_prompts_empty_special_and_too_long(daemon, tally) -> None:
    # An empty text prompt still tokenizes to BOS: served like OpenAI does, or refused; no 5xx.
    code, resp = daemon.post("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2})
    assert code == 200 or (code == 400 and resp["error"]["param"] == "prompt"), (code, resp)
    _refused(daemon, "/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 2}, param="prompt")
    _refused(daemon, "/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 2}, param="messages")
    vocab = daemon.engine_stats(MODEL)["vocab_size"]
    _refused(daemon, "/v1/completions", {"model": MODEL, "prompt": [vocab], "max_tokens": 2}, param="prompt")
    _refused(daemon, "/v1/completions", {"model": MODEL, "prompt": [-1], "max_tokens": 2}, param="prompt")
    # Only special tokens (BOS, EOS as text and as ids): served or refused, never a 5xx.
    for prompt in ["<s></s><s>", "<|endoftext|>" * 4, [0, 1, 2], [1] * 8]:
        code, resp = daemon.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert code in (200, 400), (code, resp)
    # Over the context, three times in a row, by text and by ids: a clear 400 each time.
    for _ in range(3):
        err = _refused(daemon, "/v1/completions", {"model": MODEL, "prompt": [5] * (CTX + 10), "max_tokens": 2})
        assert err["code"] == "context_length_exceeded"
        err = _refused(daemon, "/v1/completions", {"model": MODEL, "prompt": "word " * (CTX * 4), "max_tokens": 2})
        assert err["code"] == "context_length_exceeded"
        err = _refused(daemon, "/v1/completions", {"model": MODEL, "prompt": [5] * 10, "max_tokens": CTX})
        assert err["code"] == "context_length_exceeded"
    idle(daemon)
    healthy(daemon)
    tally["bad_inputs"] += 18
    tally["requests"] += 19


def test_malformed_documents(daemon, tally) -> None:
    deep = b'{"model":"tiny","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nests too deeply" in _refused(daemon, "/v1/completions", raw=deep)["message"]
    deep_obj = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    _refused(daemon, "/v1/chat/completions", raw=deep_obj)
    for raw in [b'{"model":"tiny","prompt":"\xff\xfe\xc3\x28"}', b"\xef\xbb\xbf{}", b"", b"null", b"[1,2]",
                b'"str"', b'{"model":"tiny","prompt":"hi"', b'{"model":"tiny","prompt":"\\ud800"}']:
        _refused(daemon, "/v1/completions", raw=raw)
    # Messages with unknown roles, non-text parts, extra keys, a template smuggled in.
    for body in [
        {"model": MODEL, "messages": [{"role": "root", "content": "hi"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi", "extra": 1}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 7*7 }}"},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "chat_template_kwargs": {"x": 1}},
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": []},  # at least one tool
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
    ]:
        _refused(daemon, "/v1/chat/completions", body)
    err = _refused(daemon, "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": "x"})
    assert err["param"] == "chat_template"
    # Unknown model names, including hostile ones: 404, never a file look-up.
    for name in ["../../etc/passwd", "/etc/passwd", "tiny\x00", "x" * 129, "nope"]:
        code, resp = daemon.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
        assert code in (400, 404), (name, code, resp)
    healthy(daemon)
    tally["bad_inputs"] += 24
    tally["requests"] += 25
