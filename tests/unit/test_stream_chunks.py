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

