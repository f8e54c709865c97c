"""``response_format`` through the official openai client against a real daemon on loopback
(CPU, tiny random-weight llama): every sampled seed gives JSON valid for the schema (random
weights write noise: only the grammar can make that true), streamed equals non-streamed, and bad
schemas are 400s naming the parameter that leave the daemon serving."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MODEL = "tiny"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "population": {"type": "integer", "minimum": 0, "maximum": 100000},
                         "capital": {"type": "boolean"},
                         "climate": {"enum": ["dry", "wet", "cold"]}},
          "required": ["city", "population", "capital", "climate"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "describe a city as JSON"}]


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-structured")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    d = Daemon(tmp, store_url=url,
               models=[{"name": MODEL, "preload": True, "max_model_len": 2048, "max_num_seqs": 8}])
    d.start(timeout=120)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_json_schema_valid_for_every_seed(client) -> None:
    for seed in range(8):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=1.0, seed=seed, max_tokens=200,
                                           response_format=FORMAT)
        c = r.choices[0]
        assert c.finish_reason == "stop", (seed, c.message.content)
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_completions_json_schema_and_n(client) -> None:
    r = client.completions.create(model=MODEL, prompt="a city:", temperature=1.0, seed=7, max_tokens=200, n=3,
                                  extra_body={"response_format": FORMAT})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_stream_equals_non_stream(client) -> None:
    kw = dict(model=MODEL, messages=MSGS, temperature=1.0, seed=3, max_tokens=200, response_format=FORMAT)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_json_object_gives_an_object(client) -> None:
    """Any object: with random weights it may run to max_tokens, but it starts as one and, when
    it ends by itself, is one."""
    ended = 0
    for seed in range(6):
        c = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=1.0, seed=seed, max_tokens=120,
                                           response_format={"type": "json_object"}).choices[0]
        assert c.message.content.startswith("{")
        if c.finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(c.message.content), dict)
    assert ended, "no json_object answer ended by itself in 6 seeds"


def test_free_requests_are_unchanged_beside_constrained_ones(client) -> None:
    kw = dict(model=MODEL, messages=MSGS, temperature=1.0, seed=11, max_tokens=12, extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(**kw).choices[0].message.content
    r = client.chat.completions.create(**kw, response_format={"type": "text"})
    assert r.choices[0].message.content == alone


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                             "schema": {"type": "string", "format": "no-such-format"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
     "response_format.json_schema.schema"),
    ({"type": "xml"}, "response_format.type"),
    # no finite value satisfies these: once a 200 with "" or "{" and finish_reason "stop"
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": False, "schema": {
        "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
        "$ref": "#/$defs/a"}}}, "response_format.json_schema.schema"),
    # a lower bound past 64 bits was clamped: 9223372036854775807 came back as "strict" output
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "integer", "minimum": 10 ** 300, "maximum": 10 ** 300 + 5}}}, "response_format.json_schema.schema"),
])
def test_bad_formats_are_400s_naming_the_parameter(client, fmt, param) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, response_format=fmt)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"  # the daemon serves on


def test_oversized_and_deep_schemas_are_refused(client) -> None:
    deep: dict = {"type": "object"}
    for _ in range(13):  # 27 levels: over the schema's bound, under the whole body's
        deep = {"type": "object", "properties": {"a": deep}}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200}
                                             for i in range(400)}}
    for schema in (deep, huge):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert e.value.body["param"] == "response_format.json_schema.schema"


def test_lenient_schema_keeps_what_it_can_enforce(client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "s": {"type": "string", "format": "no-such-format", "maxLength": 4}},
              "required": ["n", "s"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=1.0, seed=1, max_tokens=100,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema,
                                                                        "strict": False}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"n", "s"} and 0 <= value["n"] <= 9 and len(value["s"]) <= 4


def test_metrics_count_constrained_requests(daemon, client) -> None:
    client.chat.completions.create(model=MODEL, messages=MSGS, seed=0, max_tokens=200, response_format=FORMAT)
    deadline = time.monotonic() + 10
    while True:  # the worker's figures come with its next status (every 0.25 s)
        code, text = daemon.get("/metrics")
        assert code == 200
        values = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
                  if ln.startswith(("infire_constrained_requests_total", "infire_grammar_"))}
        if values.get(f'infire_grammar_masked_rows{{model="{MODEL}"}}', 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert values[f'infire_constrained_requests_total{{model="{MODEL}"}}'] >= 1
    assert values[f'infire_grammar_compiles{{model="{MODEL}"}}'] >= 1
    assert values[f'infire_grammar_masked_rows{{model="{MODEL}"}}'] > 0
    assert values[f'infire_grammar_mask_seconds{{model="{MODEL}"}}'] > 0
    assert values[f'infire_grammar_masked_steps{{model="{MODEL}"}}'] > 0


# --- tools ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                  "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


def _check_calls(message, names) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_tool_choice_gives_valid_calls_for_every_seed(client) -> None:
    for seed in range(6):
        c = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=200).choices[0]
        assert c.finish_reason == "tool_calls", c
        _check_calls(c.message, {"get_weather", "get_time"})


def test_a_named_tool_is_the_one_called_once_without_parallel_calls(client) -> None:
    for seed in range(4):
        c = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], seed=seed,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           parallel_tool_calls=False, temperature=1.0, max_tokens=200).choices[0]
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message, {"get_time"})
        assert len(c.message.tool_calls) == 1


def test_streamed_tool_calls_equal_the_non_streamed_ones(client) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=5,
              max_tokens=200)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                got = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                got["name"] += (tc.function.name or "") if tc.function else ""
                got["arguments"] += (tc.function.arguments or "") if tc.function else ""
            if ch.finish_reason:
                finish.append(ch.finish_reason)
    assert finish == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in full]


def test_tool_choice_none_answers_in_text_and_a_history_with_calls_renders(client) -> None:
    c = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city":"Paris","unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason in ("length", "tool_calls") and r.usage.prompt_tokens > 40


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
])
def test_bad_tool_requests_are_400s_naming_the_parameter(daemon, extra, param) -> None:
    code, body = daemon.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra})
    assert code == 400, body
    assert body["error"]["param"] == param, body


# --- calls cut by max_tokens (issue 36, item 6) --------------------------------------------------------------
FRAMING = ("<tool_call>", "</tool_call>", "<tool_response>", "<tool_c", "</tool")


def _whole(client, **kw) -> dict:
    c = client.chat.completions.create(**kw).choices[0]
    calls = [(t.type, t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    return {"content": c.message.content or None, "tool_calls": calls, "finish_reason": c.finish_reason}


def _streamed(client, **kw) -> dict:
    content, calls, finish = "", {}, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                got = calls.setdefault(tc.index, ["", "", ""])
                got[0] = tc.type or got[0]
                got[1] += (tc.function.name or "") if tc.function else ""
                got[2] += (tc.function.arguments or "") if tc.function else ""
            if ch.finish_reason:
                finish.append(ch.finish_reason)
    assert len(finish) == 1, finish
    return {"content": content or None, "tool_calls": [tuple(c) for _, c in sorted(calls.items())],
            "finish_reason": finish[0]}


def _cut_answers(client, kw: dict, limits) -> list[dict]:
    """The answer at each of ``limits`` max_tokens: a cut call is a call with the arguments so far and
    finish_reason length, no framing in content, streamed field by field equal to non-streamed."""
    out = []
    for limit in limits:
        whole = _whole(client, **kw, max_tokens=limit)
        assert _streamed(client, **kw, max_tokens=limit) == whole, limit
        assert whole["finish_reason"] == "length", (limit, whole)
        assert not any(f in (whole["content"] or "") for f in FRAMING), (limit, whole)
        out.append(whole)
    return out


def test_a_forced_call_cut_by_max_tokens_is_a_call_with_partial_arguments(client) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=5)
    full = _whole(client, **kw, max_tokens=200)
    assert full["finish_reason"] == "tool_calls" and len(full["tool_calls"]) >= 1
    args = full["tool_calls"][0][2]
    n = client.chat.completions.create(**kw, max_tokens=200).usage.completion_tokens
    cuts = _cut_answers(client, kw, range(1, n))
    partial = [w["tool_calls"][0] for w in cuts if w["tool_calls"]]
    assert partial, cuts  # the one offered tool is the call from its first token on
    for kind, name, got in partial:
        assert kind == "function" and name == "get_weather"
    # the arguments grow with the limit, each a beginning of the whole (a character cut in its bytes
    # ends as U+FFFD, as any text cut there)
    assert all(args.startswith(got.rstrip("\ufffd")) for _, _, got in partial), (args, partial)
    assert any(0 < len(got) < len(args) for _, _, got in partial)


def test_a_named_call_cut_by_max_tokens(client) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=2,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    n = client.chat.completions.create(**kw, max_tokens=200).usage.completion_tokens
    cuts = _cut_answers(client, kw, range(1, n))
    assert [c["tool_calls"][0][1] for c in cuts if c["tool_calls"]] and \
        all(c["tool_calls"][0][1] == "get_time" for c in cuts if c["tool_calls"])


def test_a_second_parallel_call_cut_by_max_tokens(client) -> None:
    """With parallel calls the grammar lets the model go on to a second call: one whose second call is
    cut returns both, the first whole, the second with its arguments so far."""
    base = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0)
    for seed in range(40):
        full = _whole(client, **base, seed=seed, max_tokens=300)
        if len(full["tool_calls"]) >= 2:
            break
    else:
        pytest.fail("no seed in 40 wrote two calls")
    kw = {**base, "seed": seed}
    n = client.chat.completions.create(**kw, max_tokens=300).usage.completion_tokens
    cuts = _cut_answers(client, kw, range(max(1, n - 30), n, 2))  # the second call is under 30 tokens
    two = [c for c in cuts if len(c["tool_calls"]) >= 2]
    assert two and any(c["tool_calls"][1] != full["tool_calls"][1] for c in two), cuts
    for c in two:
        assert c["tool_calls"][0] == full["tool_calls"][0]
