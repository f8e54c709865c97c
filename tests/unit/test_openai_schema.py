"""Request schema helpers: JSON depth, the param a validation error names, prompt shapes, chat limits."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent.http.openai_schema import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest, first_error, json_depth_ok


def test_json_depth() -> None:
    nested: object = 0
    for _ in range(MAX_JSON_DEPTH):
        nested = {"a": nested}
    assert json_depth_ok(nested)
    assert not json_depth_ok([nested])
    assert json_depth_ok({"prompt": list(range(10000))})


def test_first_error_names_the_param() -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": 5}]})
    param, msg = first_error(e.value)
    assert param == "messages.0.content" and msg.startswith("messages.0.content:")
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 2})
    assert first_error(e.value) == ("best_of", "best_of: unknown or unsupported parameter")


def test_prompt_shapes() -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    for bad in ([], [True], [1, "a"], [-1], [["a"], ["b"]]):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})


def test_chat_output_limit_and_logprobs() -> None:
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_tokens": 5, "max_completion_tokens": 7,
        "logprobs": True})
    assert r.output_limit() == 7 and r.logprobs_count() == 0 and r.messages[0].text() == "ab"


def test_a_grammar_the_worker_cannot_compile_is_a_400_naming_response_format() -> None:
    from agent.http.api_error import stream_error
    from agent.worker.client import WorkerError

    e = stream_error(WorkerError("grammar does not compile: ...", "GrammarError"))
    assert (e.status, e.param) == (400, "response_format")
    assert stream_error(WorkerError("boom", "RuntimeError")).status == 500


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "text", "json_schema": {"name": "a", "schema": {}}}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"p": "x" * 70000}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
     "response_format.json_schema.extra"),
])
def test_response_format_bounds(fmt, param) -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "response_format": fmt})
    assert first_error(e.value)[0] == param
