"""Tool calls in the model's words (text/tool_calls.py): which format a template's model writes,
reading calls back from an answer, streaming that holds back exactly the call, and how a history
with calls is shown to templates with and without tool support."""

from __future__ import annotations

import json
import random

import pytest

from text.tool_calls import ToolFormat, ToolStream, default_tool_prompt, history_view, tool_format

KNOWN = {"get_weather", "get_time"}
HERMES = ToolFormat("hermes", True)
LLAMA = ToolFormat("llama3", True)
MISTRAL = ToolFormat("mistral", True)


@pytest.mark.parametrize("src, name, native", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", False),
    ("{% if tools %}<tool_call>{{ tools | tojson }}</tool_call>{% endif %}", "hermes", True),
    ("{% if tools %}[TOOL_CALLS]{% endif %}", "mistral", True),
    ("{% if tools %}<|python_tag|>{% endif %}", "llama3", True),
    ("{% if tools %}ipython{% endif %}", "llama3", True),
    (None, "hermes", False),
])
def test_the_format_follows_the_template(src, name, native) -> None:
    assert tool_format(src) == ToolFormat(name, native)


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, 'ok.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "ok.",
     [("get_weather", {"city": "Paris"})]),
    (HERMES, '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_call>\n'
             '{"name":"get_weather","arguments":"{\\"city\\": \\"Oslo\\"}"}\n</tool_call>', None,
     [("get_time", {"zone": 1}), ("get_weather", {"city": "Oslo"})]),
    (HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', None, []),  # not offered
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}', None, []),  # cut short
    (LLAMA, ' {"name": "get_time", "parameters": {"zone": -3}}', None, [("get_time", {"zone": -3})]),
    (LLAMA, "it is sunny", None, []),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 2}}]', None, [("get_time", {"zone": 2})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": 5}]', None, []),
])
def test_calls_are_read_back_and_anything_else_stays_text(fmt, text, content, calls) -> None:
    got_content, got = fmt.parse(text, KNOWN)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (content if calls else text)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("fmt, text", [
    (HERMES, 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    (HERMES, "a < b and <tool but no call"),
    (LLAMA, '{"name": "get_time", "parameters": {"zone": 0}}'),
    (LLAMA, "{ not json"),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 4}}]'),
    (MISTRAL, "[TOOL_ no"),
])
def test_streaming_sends_the_text_and_holds_back_only_the_call(fmt, text) -> None:
    content, calls = fmt.parse(text, KNOWN)
    for seed in range(5):
        rng, stream, sent, i = random.Random(seed), ToolStream(fmt, KNOWN), "", 0
        while i < len(text):
            n = rng.randint(1, 6)
            sent += stream.feed(text[i:i + n])
            i += n
        rest, got = stream.finish()
        sent += rest
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]
        assert sent.strip() == (content or "").strip() if calls else sent == text


def test_lark_grammars_wrap_the_call_json() -> None:
    schema = {"type": "object"}
    assert HERMES.lark(schema, False).startswith('start: call\ncall: "<tool_call>\\n" %json {"type":"object"}')
    assert '("\\n" call)*' in HERMES.lark(schema, True)
    assert '"maxItems":1' in MISTRAL.lark(schema, False) and "maxItems" not in MISTRAL.lark(schema, True)
    assert LLAMA.lark(schema, True) == 'start: %json {"type":"object"}\n'


def test_history_for_templates_with_and_without_tools() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}
    msgs = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    native = history_view(msgs, HERMES)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"zone": 1}  # an object, as HF templates expect
    assert native[2] == msgs[2]
    plain = history_view(msgs, ToolFormat("hermes", False))
    assert plain[1] == {"role": "assistant",
                        "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'}
    assert plain[2] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    prompt = default_tool_prompt([{"name": "get_time", "parameters": {"type": "object"}}])
    assert '"name": "get_time"' in prompt and "<tool_call>" in prompt
