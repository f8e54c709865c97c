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
