"""A chat request as its model's template renders it, and the token ids that gives.

The messages come in the shape chat templates read (transformers' keys: ``role``, ``content``,
``name``, ``tool_call_id``, ``tool_calls``). When tools are offered, or the history holds calls or
tool results, the messages are put in the model's own tool-call format
(:func:`text.tool_calls.history_view`); offered tools go to a template that knows tools as its
``tools`` variable, and to one that does not as a system message
(:func:`text.tool_calls.default_tool_prompt`).

Building is cheap and pure; :meth:`ChatPrompt.token_ids` renders (sandboxed Jinja) and tokenizes,
which for a long conversation is worth a thread: :attr:`ChatPrompt.chars` says how long it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from text.tokenizer import Tokenizer
from text.tool_calls import ToolFormat, default_tool_prompt, history_view


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, Any]]  # as the template sees them
    variables: dict[str, Any] = field(default_factory=dict)  # template variables beside them (``tools``)

    @classmethod
    def build(cls, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
              fmt: ToolFormat) -> ChatPrompt:
        """``messages``: the conversation in the template's shape; ``tools``: the offered tools in
        OpenAI's shape (``{"type": "function", "function": {...}}``), None when none are offered;
        ``fmt``: how the model writes tool calls (:func:`text.tool_calls.tool_format`)."""
        msgs = [dict(m) for m in messages]
        variables: dict[str, Any] = {}
        if tools is not None or any("tool_calls" in m or m["role"] == "tool" for m in msgs):
            msgs = history_view(msgs, fmt)
            if tools is not None:
                offered = [dict(t) for t in tools]
                if fmt.native:
                    variables["tools"] = offered
                else:
                    msgs = _with_system(msgs, default_tool_prompt([t["function"] for t in offered]))
        return cls(msgs, variables)

    @property
    def chars(self) -> int:
        """The characters of the messages' contents: how much rendering and tokenizing there is."""
        return sum(len(m.get("content") or "") for m in self.messages)

    def token_ids(self, tokenizer: Tokenizer, limit: int | None = None) -> list[int]:
        """The prompt's ids, with the generation prompt; raises ``ChatTemplateError`` (a template
        or input past its bounds) and ``TokenLimitExceeded`` (``limit`` ids or more)."""
        rendered = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, **self.variables)
        # The template writes the special tokens (BOS) itself.
        return list(tokenizer.encode(rendered, add_special_tokens=False, limit=limit))


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` at the end of the system message, or as one in front."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}".lstrip()}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
