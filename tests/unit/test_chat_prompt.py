"""text.chat_prompt.ChatPrompt: tools reach a template that knows them as its ``tools`` variable and
one that does not as a system message; a history with calls is put in the model's format."""

from __future__ import annotations

from text.chat_prompt import ChatPrompt
from text.tool_calls import ToolFormat

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def test_plain_chat_is_left_as_it_is() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    p = ChatPrompt.build(msgs, None, ToolFormat("hermes", False))
    assert p.messages == msgs and p.variables == {} and p.chars == len("be brief") + len("hi")


def test_native_template_gets_the_tools_variable() -> None:
    p = ChatPrompt.build([{"role": "user", "content": "hi"}], [TOOL], ToolFormat("hermes", True))
    assert p.variables == {"tools": [TOOL]} and p.messages == [{"role": "user", "content": "hi"}]


def test_other_templates_are_told_in_the_system_message() -> None:
    p = ChatPrompt.build([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], [TOOL],
                         ToolFormat("hermes", False))
    assert p.variables == {}
    assert p.messages[0]["role"] == "system" and p.messages[0]["content"].startswith("be brief\n\n")
    assert "get_weather" in p.messages[0]["content"] and len(p.messages) == 2
    p = ChatPrompt.build([{"role": "user", "content": "hi"}], [TOOL], ToolFormat("hermes", False))
    assert [m["role"] for m in p.messages] == ["system", "user"]


def test_a_history_with_calls_is_written_in_the_models_format_without_tools_offered() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    p = ChatPrompt.build(msgs, None, ToolFormat("hermes", False))
    assert [m["role"] for m in p.messages] == ["user", "assistant", "user"]
    assert "<tool_call>" in p.messages[1]["content"] and "<tool_response>" in p.messages[2]["content"]
