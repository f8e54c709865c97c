"""The published OpenAPI document, and a hypothesis fuzzer driven by it against a live daemon
(used in place of schemathesis to keep CI fast and dependency-free): no 5xx other than
deliberate 503s, and every JSON answer matches the documented response schema."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.http.openapi import build_spec
from tests.reliability.rel_helpers import ADMIN, MODEL, ensure_loaded, healthy
from tests.reliability.schema_fuzz import SchemaStrategies

RUNS = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _call(base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
          ) -> tuple[int, str, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _conforms(spec: dict[str, Any], path: str, method: str, code: int, ctype: str, raw: bytes) -> None:
    responses = spec["paths"][path][method]["responses"]
    assert str(code) in responses, f"{method.upper()} {path} answered undocumented {code}: {raw[:300]!r}"
    if "json" not in ctype:
        assert "text/event-stream" in ctype or "text/plain" in ctype, ctype
        return
    schema = responses[str(code)]["content"]["application/json"]["schema"]
    resolver_doc = {**schema, "components": spec["components"]}
    jsonschema.validate(json.loads(raw), resolver_doc)


def test_spec_is_served_and_valid(daemon) -> None:
    from openapi_spec_validator import validate

    code, body = daemon.get("/openapi.json")
    assert code == 200
    validate(body)
    assert body == json.loads(json.dumps(build_spec()))
    assert {"/v1/completions", "/v1/chat/completions", "/admin/v1/models/{name}/load"} <= set(body["paths"])


def _fuzz(daemon, tally, path: str, schema_name: str, broken: bool) -> None:
    spec = build_spec()
    strat = SchemaStrategies(spec, overrides={"model": st.sampled_from([MODEL, MODEL, "nope"]),
                                              "max_tokens": st.one_of(st.none(), st.integers(1, 4)),
                                              "max_completion_tokens": st.one_of(st.none(), st.integers(1, 4))})
    schema = {"$ref": f"#/components/schemas/{schema_name}"}
    bodies = strat.broken(schema) if broken else strat.valid(schema)
    seen: list[int] = []

    @RUNS
    @given(body=bodies)
    def run(body: Any) -> None:
        code, ctype, raw = _call(daemon.base, "POST", path, body)
        seen.append(code)
        assert code < 500 or code == 503, (code, raw[:300], body)
        _conforms(spec, path, "post", code, ctype, raw)

    run()
    tally["requests"] += len(seen)
    tally["fuzz_requests"] += len(seen)
    tally["deliberate_503"] += seen.count(503)
    if broken:
        tally["bad_inputs"] += len(seen)
    healthy(daemon)


def test_fuzz_completions_valid(daemon, tally) -> None:
    _fuzz(daemon, tally, "/v1/completions", "CompletionRequest", broken=False)


def test_fuzz_completions_broken(daemon, tally) -> None:
    _fuzz(daemon, tally, "/v1/completions", "CompletionRequest", broken=True)


def test_fuzz_chat_valid(daemon, tally) -> None:
    _fuzz(daemon, tally, "/v1/chat/completions", "ChatCompletionRequest", broken=False)


def test_fuzz_chat_broken(daemon, tally) -> None:
    _fuzz(daemon, tally, "/v1/chat/completions", "ChatCompletionRequest", broken=True)


def test_get_endpoints_and_admin_match_the_spec(daemon, tally) -> None:
    spec = build_spec()
    n = 0
    for path in ["/v1/models", "/livez", "/readyz", "/readyz/tiny", "/readyz/nope", "/metrics", "/openapi.json",
                 "/admin/v1/status", "/admin/v1/models", "/admin/v1/models/tiny", "/admin/v1/models/nope"]:
        template = "/readyz/{model}" if path.startswith("/readyz/") else (
            "/admin/v1/models/{name}" if path.startswith("/admin/v1/models/") else path)
        for headers in ({}, ADMIN):
            code, ctype, raw = _call(daemon.base, "GET", path, headers=headers)
            _conforms(spec, template, "get", code, ctype, raw)
            n += 1
    for op in ("pull", "load", "unload", "load"):
        for query in ("", "?wait=true&timeout=30", "?wait=true&timeout=abc"):
            code, ctype, raw = _call(daemon.base, "POST", f"/admin/v1/models/{MODEL}/{op}{query}", headers=ADMIN)
            assert code < 500 or code == 503, (op, query, code, raw)
            _conforms(spec, f"/admin/v1/models/{{name}}/{op}", "post", code, ctype, raw)
            n += 1
    ensure_loaded(daemon)
    tally["requests"] += n
    healthy(daemon)
