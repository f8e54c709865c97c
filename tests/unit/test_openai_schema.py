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
    assert first_error(e.value)[1].startswith("best_of: only best_of = n (1) is served")
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 2, "n": 2}).n == 2


def test_an_object_of_a_kind_not_served_is_refused_for_its_type() -> None:
    """A fourth attacker pass: an image part was told its ``text`` was required, a custom tool
    its ``function``; the ``type`` is what is wrong."""
    user = {"role": "user", "content": "hi"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert _error(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}) == (
        "messages.0.content.0.type", "messages.0.content.0.type: must be 'text'")
    assert _error(ChatCompletionRequest, {"messages": [user], "tools": [{"type": "custom", "custom": {}}]})[0] == \
        "tools.0.type"
    assert _error(ChatCompletionRequest, {"messages": [user], "tools": tools,
                                          "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}})[0] == \
        "tool_choice.type"
    # a part of the served kind still names the field it lacks
    assert _error(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]})[0] == \
        "messages.0.content.0.text"


def test_streamed_logprobs_with_tools_are_refused_not_dropped() -> None:
    """Its chunks carried ``logprobs: null`` with no signal (a fourth attacker pass): a field whose
    effect is not served is a 400 naming it."""
    base = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    param, msg = _error(ChatCompletionRequest, {**base, "stream": True})
    assert param == "logprobs" and "not streamed when tools are offered" in msg
    for ok in ({**base}, {**base, "stream": True, "tool_choice": "none"}):
        ChatCompletionRequest.model_validate({"model": "m", **ok})


def test_prompt_shapes() -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    one = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]})
    assert not one.batched and one.prompts() == [[1, 2]]
    texts = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "n": 2})
    assert texts.batched and texts.prompts() == ["a", "b"]
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]]})
    assert ids.prompts() == [[1], [2, 3]]
    for bad in ([], [True], [1, "a"], [-1], [["a"], ["b"]], ["a", [1]], [[1], []], [[1], [True]], ["a"] * 65):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})
    with pytest.raises(ValidationError) as e:  # prompts x n is bounded
        CompletionRequest.model_validate({"model": "m", "prompt": ["a"] * 9, "n": 8})
    assert first_error(e.value)[0] == "n"


def _error(cls, body: dict) -> tuple[str, str]:
    with pytest.raises(ValidationError) as e:
        cls.model_validate({"model": "m", **body})
    return first_error(e.value)


def test_a_unions_error_is_the_one_of_the_branch_the_value_took() -> None:
    """A second attacker's findings: every one of these said "must be a string" or named
    pydantic's branch (``tool_choice.literal['none','auto','required']``)."""
    msg = "must be a string"
    assert _error(CompletionRequest, {"prompt": "x", "stop": [""]}) == ("stop.0", "stop.0: should have at least 1 character")
    assert _error(CompletionRequest, {"prompt": "x", "stop": ["\ud800"]})[1] == \
        "stop.0: must be valid Unicode text (no lone surrogates)"
    assert _error(CompletionRequest, {"prompt": "x", "stop": 5}) == ("stop", f"stop: {msg}")  # no branch took it
    chat = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert _error(ChatCompletionRequest, chat) == ("messages.0.content.0.text", "messages.0.content.0.text: required")
    hi = [{"role": "user", "content": "hi"}]
    assert _error(ChatCompletionRequest, {"messages": hi, "tool_choice": "foo"}) == \
        ("tool_choice", "tool_choice: must be 'none', 'auto' or 'required'")
    assert _error(ChatCompletionRequest, {"messages": hi, "tool_choice": {"type": "function"}})[0] == "tool_choice.function"
    # a client's own CamelCase key is named, not taken for a branch
    assert _error(CompletionRequest, {"prompt": "x", "Temperature": 1}) == \
        ("Temperature", "Temperature: unknown or unsupported parameter")


def test_errors_are_in_the_clients_words() -> None:
    param, msg = _error(CompletionRequest, {"prompt": "x", "logit_bias": {"fifty": 5}})
    assert param == "logit_bias" and "keys are token ids" in msg, msg
    param, msg = _error(CompletionRequest, {"prompt": "x", "logit_bias": {"50": 101}})
    assert param == "logit_bias" and "[-100, 100]" in msg, msg
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {"50": -100}}
                                            ).logit_bias_pairs() == [(50, -100.0)]
    for field, bad in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                       ("min_tokens", -1)):
        assert _error(CompletionRequest, {"prompt": "x", field: bad})[0] == field
    param, msg = _error(CompletionRequest, {"prompt": "x", "suffix": "s"})
    assert param == "suffix" and msg.startswith("suffix is not supported"), msg
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "logit_bias": {}, "suffix": ""})
    assert _error(CompletionRequest, {"prompt": "x", "max_tokens": "5"}) == ("max_tokens", "max_tokens: must be an integer")
    param, msg = _error(ChatCompletionRequest, {"messages": []})
    assert param == "messages" and "List" not in msg and "after validation" not in msg


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    ({"prompt": "x", "logprobs": False}, "logprobs"),
    ({"prompt": "x", "echo": 0}, "echo"),
    ({"prompt": "x", "stream": "true"}, "stream"),
    ({"prompt": "x", "temperature": "1"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "f", "strict": "false"}}]}, "tools.0.function.strict"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {}, "strict": 1}}}, "response_format.json_schema.strict"),
])
def test_types_are_strict(body, param) -> None:
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    assert _error(cls, body)[0] == param
    # A float field still takes an integer; top_logprobs with logprobs is fine.
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 1}).temperature == 1.0
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "logprobs": True, "top_logprobs": 2}).logprobs_count() == 2


def test_the_sdks_message_fields_and_harmless_fields() -> None:
    sdk_message = {"content": None, "refusal": "I can't", "role": "assistant", "annotations": [], "audio": None,
                   "function_call": {"name": "get", "arguments": "{}"}, "tool_calls": None}
    r = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}, sdk_message],
        "metadata": {"k": "v"}, "store": True, "service_tier": "default", "reasoning_effort": "high",
        "modalities": ["text"]})
    view = r.messages[1].template_view()
    assert view["content"] == "I can't"  # a refused turn reads as what the assistant said
    assert view["tool_calls"][0]["function"] == {"name": "get", "arguments": "{}"}
    for body, param in [
        ({"modalities": ["audio"]}, "modalities"),
        ({"service_tier": "fastest"}, "service_tier"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages.0.audio"),
        ({"messages": [{"role": "user", "content": "x", "function_call": {"name": "f", "arguments": ""}}]},
         "messages.0.function_call"),
        ({"messages": [{**sdk_message, "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": ""}}]}]}, "messages.0.function_call"),
    ]:
        assert _error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], **body})[0] == param


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


def test_a_request_cut_by_the_workers_death_or_a_drain_is_a_503_with_retry_after() -> None:
    """As when the same condition is met one step earlier (the send, the manager's refusal): a
    CPU churn pass found all 29 such answers without the header."""
    from agent.http.api_error import send_error, stream_error
    from agent.worker.client import WorkerDied, WorkerError

    for e in (WorkerDied("the engine worker exited"), WorkerError("drained", "aborted"),
              WorkerError("the agent is stopping", "shutting_down")):
        got = stream_error(e)
        assert got.status == 503 and got.retry_after and got.retry_after >= 1, (e, got)
    assert send_error(WorkerDied("gone")).retry_after == stream_error(WorkerDied("gone")).retry_after


def test_a_forced_calls_grammar_failure_names_tools() -> None:
    """A second attacker's finding: a forced call's grammar over its mask budget was refused
    naming ``response_format``, which the request did not have."""
    from agent.http.api_error import stream_error
    from agent.http.decoding import plan_decoding
    from agent.worker.client import WorkerError
    from text.tool_calls import ToolFormat

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    fmt = ToolFormat("hermes", False)
    forced = plan_decoding(ChatCompletionRequest.model_validate({**base, "tool_choice": "required"}), 4, 256, fmt)
    shaped = plan_decoding(ChatCompletionRequest.model_validate(
        {**base, "response_format": {"type": "json_object"}}), 4, 256, fmt)
    failed = WorkerError("the response format is too costly to enforce", "GrammarError")
    assert stream_error(failed, forced.grammar_param).param == "tools"
    assert stream_error(failed, shaped.grammar_param).param == "response_format"


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
