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


# --- calls cut by the length limit (issue 36, item 6) ---------------------------------------------------------
ONE = {"get_time"}
W_ARGS = '{"name":"get_weather","arguments":{"city":"Pa'


@pytest.mark.parametrize("fmt, known, text, content, calls", [
    # a forced call cut inside its arguments: the call, with the arguments written so far
    (HERMES, KNOWN, "<tool_call>\n" + W_ARGS, None, [("get_weather", '{"city":"Pa')]),
    # cut inside the name: the one offered tool it can be
    (HERMES, KNOWN, '<tool_call>\n{"name":"get_w', None, [("get_weather", "")]),
    (HERMES, KNOWN, '<tool_call>\n{"name":"get_weather","argu', None, [("get_weather", "")]),
    # cut before the tool is decided: dropped (our framing is not content)
    (HERMES, KNOWN, '<tool_call>\n{"name":"get_', None, []),
    (HERMES, KNOWN, "<tool_call>\n{", None, []),
    (HERMES, KNOWN, "<tool_call>", None, []),
    (HERMES, KNOWN, "Let me see. <tool_c", "Let me see. ", []),
    (HERMES, KNOWN, "Let me see.\n<tool_call>\n{", "Let me see.", []),
    # ... unless one tool is offered
    (HERMES, ONE, "<tool_call>\n", None, [("get_time", "")]),
    # parallel calls: the first whole, the second cut
    (HERMES, KNOWN, '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_call>\n'
                    '{"name":"get_weather","arguments":{"ci', None, [("get_time", '{"zone":1}'),
                                                                   ("get_weather", '{"ci')]),
    (HERMES, KNOWN, '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_ca', None,
     [("get_time", '{"zone":1}')]),
    (HERMES, KNOWN, '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_call>\n{"na',
     None, [("get_time", '{"zone":1}')]),
    # the arguments whole, the closing tag cut
    (HERMES, KNOWN, '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool', None,
     [("get_time", '{"zone":3}')]),
    # not a call: stays text
    (HERMES, KNOWN, "<tool_call>\nhello there", "<tool_call>\nhello there", []),
    (HERMES, KNOWN, '<tool_call>\n{"name":"rm_rf","arguments":{', '<tool_call>\n{"name":"rm_rf","arguments":{', []),
    (HERMES, KNOWN, "a plain answer cut short", "a plain answer cut short", []),
    (LLAMA, KNOWN, '{"name": "get_time", "parameters": {"zone": -', None, [("get_time", '{"zone": -')]),
    (LLAMA, KNOWN, '{"answer": 4', '{"answer": 4', []),  # a bare "{" is not our framing
    (MISTRAL, KNOWN, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 2}}, {"name": "get_weather", "ar',
     None, [("get_time", '{"zone":2}'), ("get_weather", "")]),
    (MISTRAL, KNOWN, "Sure. [TOOL_CALLS]", "Sure.", []),
    (MISTRAL, KNOWN, "Sure. [TOOL_CA", "Sure. ", []),
])
def test_a_call_cut_at_the_length_limit_is_a_call_with_what_was_written(fmt, known, text, content, calls) -> None:
    got_content, got = fmt.parse(text, known, cut=True)
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == content
    assert not any(m in (got_content or "") for m in ("<tool_call>\n{\"name\":\"get", "</tool_call>", "[TOOL_CALLS]"))


@pytest.mark.parametrize("fmt, text, content", [
    # whatever the model writes after its calls, or as a tool's answer of its own, is not content
    (HERMES, 'Ok.\n<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_response>\n12:00'
             "\n</tool_response>\nIt is noon.", "Ok."),
    (HERMES, "It is <tool_response>\n12:00\n</tool_response>", "It is"),
])
def test_our_framing_after_calls_is_not_content(fmt, text, content) -> None:
    for cut in (False, True):
        assert fmt.parse(text, KNOWN, cut)[0] == content


CUT_TEXTS = [
    (HERMES, "<tool_call>\n" + W_ARGS),
    (HERMES, 'Sure thing.\n\n<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_call>\n'
             '{"name":"get_weather","arguments":{"city":"Rome","unit":"c"}}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_call>\n{"name":"get_w'),
    (HERMES, '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n<tool_response>\nx'),
    (HERMES, "a < b, <tool but no call <tool_c"),
    (HERMES, "<tool_call>\nnot json </tool_call> after"),
    (HERMES, "It is <tool_response>\n12:00\n</tool_response>"),
    (HERMES, "  spaces   \n"),
    (LLAMA, '  {"name": "get_time", "parameters": {"zone": 0}}'),
    (LLAMA, '{"name": "get_time", "parameters": {"zo'),
    (LLAMA, "{ not json"),
    (MISTRAL, 'Well [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 4}}, {"name": "get_time", "arg'),
    (MISTRAL, '[{"name": "get_time", "arguments": {"zone": 4}}]'),
    (MISTRAL, "[TOOL_ no"),
]


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("fmt, text", CUT_TEXTS)
def test_streamed_answers_equal_whole_ones_whether_cut_or_not(fmt, text, cut) -> None:
    """Every split of the text into pieces streams the same content and calls as reading it whole."""
    content, calls = fmt.parse(text, KNOWN, cut)
    for seed in range(8):
        rng, stream, sent, i = random.Random(seed), ToolStream(fmt, KNOWN), "", 0
        while i < len(text):
            n = rng.randint(1, 7)
            sent += stream.feed(text[i:i + n])
            i += n
        rest, got = stream.finish(cut)
        assert sent + rest == (content or "")
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]
