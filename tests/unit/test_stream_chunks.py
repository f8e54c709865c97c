"""A streamed chunk's bytes (``OpenAIFormatter.chunk_event``) are exactly what encoding its OpenAI dict
gives (``sse([chunk(d)])``), for chat and completions, with and without the usage field, for any
text (quotes, escapes, non-ASCII, empty) and finish reason: the fast path is only a faster way to
write the same bytes."""

from __future__ import annotations

from hypothesis import given, strategies as st

from agent.http.openai_format import OpenAIFormatter
from agent.worker.generation import Delta

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["", '"', "\\", "\n\t", "\u2028", "é漢🙂", "</script>", "\x00\x1f"])


@given(text=texts, index=st.integers(0, 127), finish=st.sampled_from([None, "stop", "length", "abort"]),
       chat=st.booleans(), usage=st.booleans(), rid=st.sampled_from(["cmpl-abc", 'q"uote', "é"]),
       model=st.sampled_from(["m", "llama-3.1-8b", "mo\\del"]))
def test_chunk_bytes_equal_the_encoded_dict(text, index, finish, chat, usage, rid, model):
    fmt = OpenAIFormatter(rid, model, chat, tokenizer=None)
    d = Delta(index, text, [1, 2], None, finish)
    assert fmt.chunk_event(d, usage) == fmt.sse([fmt.chunk(d, usage)])



def test_streamed_completion_text_offset_continues_across_chunks():
    """Each chunk's ``text_offset`` counts from the start of its choice's text, as a whole answer's do."""
    fmt = OpenAIFormatter("cmpl-x", "m", False, tokenizer=object())  # no alternatives: the tokenizer is unused
    entry = {"token_id": 1, "logprob": -0.5, "top_logprobs": []}
    offsets = {0: [], 1: []}
    for index, pieces in [(0, ["ab", "c"]), (1, ["xyz"]), (0, ["", "de"]), (1, ["w"]), (0, ["f"])]:
        d = Delta(index, "".join(pieces), [1] * len(pieces), [entry] * len(pieces), None, pieces)
        offsets[index] += fmt.chunk(d, False)["choices"][0]["logprobs"]["text_offset"]
    assert offsets == {0: [0, 2, 3, 3, 5], 1: [0, 3]}


# --- with tools offered: the streamed answer assembles to the whole one (issue 36, item 6) ------------------
import json  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from agent.worker.generation import Choice  # noqa: E402
from text.tool_calls import ToolFormat  # noqa: E402

CALL = '<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>'


def _assemble(events: bytes) -> dict:
    """A streamed choice as a client puts it together: content, calls by index, finish_reason."""
    msg: dict = {"content": None, "tool_calls": {}, "finish_reason": None}
    for line in events.decode().split("\n\n"):
        if not line.startswith("data: "):
            continue
        ch = json.loads(line[6:])["choices"][0]
        delta = ch["delta"]
        if delta.get("content"):
            msg["content"] = (msg["content"] or "") + delta["content"]
        for tc in delta.get("tool_calls", []):
            got = msg["tool_calls"].setdefault(tc["index"], {"id": None, "type": None, "name": "", "arguments": ""})
            got["id"] = tc.get("id", got["id"])
            got["type"] = tc.get("type", got["type"])
            got["name"] += tc.get("function", {}).get("name", "")
            got["arguments"] += tc.get("function", {}).get("arguments", "")
        msg["finish_reason"] = ch["finish_reason"] or msg["finish_reason"]
    msg["tool_calls"] = [msg["tool_calls"][k] for k in sorted(msg["tool_calls"])]
    return msg


@pytest.mark.parametrize("text", [
    CALL[:40],  # a forced call cut in its arguments
    CALL + "\n" + CALL[:30],  # parallel calls, the second cut
    CALL + "\n<tool_ca",
    "<tool_c",
    "Sure.\n" + CALL,
    "Sure.\n" + CALL + "\n<tool_response>\n12:00\n</tool_response>",
    "just text",
])
@pytest.mark.parametrize("finish", ["length", "stop"])
def test_tool_answers_streamed_equal_whole_ones_field_by_field(text, finish) -> None:
    tools = (ToolFormat("hermes", False), {"get_time", "get_weather"})
    fmt = OpenAIFormatter("chatcmpl-x", "m", True, tokenizer=None, tools=tools)
    whole = fmt.full([Choice(0, "r", None, None, text=[text], finish_reason=finish)], {})["choices"][0]
    rng, events, i = random.Random(len(text)), b"", 0
    while i < len(text):
        n = rng.randint(1, 5)
        last = i + n >= len(text)
        events += fmt.event(Delta(0, text[i:i + n], [1], None, finish if last else None), False)
        i += n
    streamed = _assemble(events)
    message = whole["message"]
    assert streamed["content"] == message["content"]
    assert streamed["finish_reason"] == whole["finish_reason"]
    assert [(c["type"], c["name"], c["arguments"]) for c in streamed["tool_calls"]] == \
        [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert all(c["id"].startswith("call_") for c in streamed["tool_calls"])
    if finish == "length" or text.count("<tool_call>") == text.count("</tool_call>"):
        # (an unclosed call that ended otherwise, by a stop string or EOS, is not a call: it stays text)
        cut_tag = ("<tool_c",) if finish == "length" else ()
        for framing in ("<tool_call>", "</tool_call>", "<tool_response>", *cut_tag):
            assert framing not in (message["content"] or "")
    if finish == "length" and "<tool_call>" in text:
        assert message.get("tool_calls") and whole["finish_reason"] == "length"
