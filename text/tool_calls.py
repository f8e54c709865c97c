"""Tool calls in a model's own words: which format a model writes them in, how a chat history
with calls and results is shown to its template, and how calls are read back from its output.

Formats (chosen from the chat template's text, :func:`tool_format`):
- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block a call
  (Qwen2.5, Qwen3, Hermes; also the default for templates that know no tools, which are then
  told about the tools in a system message, :func:`default_tool_prompt`);
- ``llama3``: a bare ``{"name": ..., "parameters": {...}}`` (Llama 3.1's JSON calls);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

Pure text and JSON: the grammar that enforces a call (``tool_choice`` required or named) is
built from :meth:`ToolFormat.lark` by the agent (agent/http/structured.py).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _args_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class ToolFormat:
    name: str  # hermes | llama3 | mistral
    native: bool  # the template renders tools itself (else the default system prompt does)

    @property
    def args_key(self) -> str:
        return "parameters" if self.name == "llama3" else "arguments"

    @property
    def marker(self) -> str:
        """What starts a call in the output (streaming holds text back from it)."""
        return {"hermes": HERMES_OPEN, "llama3": "{", "mistral": MISTRAL_MARK}[self.name]

    def lark(self, call_schema: dict[str, Any], parallel: bool) -> str:
        """An llguidance lark grammar of one call (``parallel``: one or more) whose JSON matches
        ``call_schema`` (an object with ``name`` and this format's arguments key)."""
        one = "%json " + json.dumps(call_schema, separators=(",", ":"))
        if self.name == "hermes":
            call = '"' + HERMES_OPEN + '\\n" ' + one + ' "\\n' + HERMES_CLOSE + '"'
            more = ' ("\\n" call)*' if parallel else ""
            return "start: call" + more + "\ncall: " + call + "\n"
        if self.name == "mistral":
            items = {"type": "array", "items": call_schema, "minItems": 1, **({} if parallel else {"maxItems": 1})}
            return f'start: "{MISTRAL_MARK}" %json {json.dumps(items, separators=(",", ":"))}\n'
        return f"start: {one}\n"

    def parse(self, text: str, known: set[str]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output. Calls to tools not in ``known`` and text that
        is not a well-formed call stay content; no calls gives ``(text, [])``."""
        if self.name == "hermes":
            return self._parse_hermes(text, known)
        if self.name == "mistral":
            at = text.find(MISTRAL_MARK)
            body = text[at + len(MISTRAL_MARK):] if at >= 0 else text.strip()
            try:
                items = json.loads(body)
            except ValueError:
                return text, []
            calls = self._calls(items if isinstance(items, list) else [items], known)
            if not calls:
                return text, []
            before = text[:at].strip() if at > 0 else ""
            return before or None, calls
        stripped = text.strip()  # llama3: the whole message is one JSON call
        try:
            item = json.loads(stripped)
        except ValueError:
            return text, []
        calls = self._calls([item], known)
        return (None, calls) if calls else (text, [])

    def _parse_hermes(self, text: str, known: set[str]) -> tuple[str | None, list[ParsedCall]]:
        parts, calls, pos = [], [], 0
        while (start := text.find(HERMES_OPEN, pos)) >= 0:
            end = text.find(HERMES_CLOSE, start)
            if end < 0:
                break
            body = text[start + len(HERMES_OPEN):end]
            try:
                found = self._calls([json.loads(body)], known)
            except ValueError:
                found = []
            if not found:
                break
            parts.append(text[pos:start])
            calls.extend(found)
            pos = end + len(HERMES_CLOSE)
        if not calls:
            return text, []
        parts.append(text[pos:])
        content = "".join(parts).strip()
        return content or None, calls

    def _calls(self, items: list[Any], known: set[str]) -> list[ParsedCall]:
        out = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in known:
                return []
            args = item.get(self.args_key, item.get("arguments", item.get("parameters", {})))
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return []
            if not isinstance(args, dict):
                return []
            out.append(ParsedCall(item["name"], _args_text(args), call_id()))
        return out


def tool_format(template_source: str | None) -> ToolFormat:
    """The format a chat template's model writes calls in, and whether it renders tools."""
    src = template_source or ""
    native = "tools" in src
    if MISTRAL_MARK in src:
        return ToolFormat("mistral", native)
    if HERMES_OPEN in src:
        return ToolFormat("hermes", native)
    if "<|python_tag|>" in src or ("ipython" in src and native):
        return ToolFormat("llama3", native)
    return ToolFormat("hermes", False)


def default_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that tells a model whose template knows no tools what it may call."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to answer. The functions, as JSON schemas:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with a JSON object of its name and arguments inside tags:\n"
            f'{HERMES_OPEN}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{HERMES_CLOSE}')


def history_view(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """The messages as the template sees them. Native templates get OpenAI's shape with each
    call's arguments as an object (what Hugging Face templates expect); others get calls written
    out in the hermes format and tool results as user turns in ``<tool_response>`` tags."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if fmt.native:
            if calls:
                m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                             "arguments": _loads_or_text(c["function"]["arguments"])}}
                                         for c in calls]}
            out.append(m)
            continue
        if calls:
            written = "\n".join(_hermes_block(c["function"]["name"], _loads_or_text(c["function"]["arguments"]))
                                for c in calls)
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{text}\n{written}" if text else written})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return out


def _hermes_block(name: str, arguments: Any) -> str:
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{HERMES_CLOSE}"


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ToolStream:
    """One streamed choice's text with tools offered: content flows out as it comes until a
    call may be starting (the format's marker, or a prefix of it at the tail, or — llama3 — a
    message that opens with ``{``); from there on it is held, and :meth:`finish` says whether it
    was calls or more content."""

    def __init__(self, fmt: ToolFormat, known: set[str]) -> None:
        self.fmt, self.known = fmt, known
        self._text = ""  # everything so far
        self._sent = 0  # how much of it went out as content
        self._held_from: int | None = None  # where a (possible) call starts

    def feed(self, piece: str) -> str:
        """The content that may go out now."""
        self._text += piece
        if self._held_from is not None:
            return ""
        if self.fmt.name == "llama3":
            head = self._text.lstrip()
            if not head:
                return ""
            if head.startswith("{"):
                self._held_from = 0
                return ""
            return self._emit(len(self._text))
        marker = self.fmt.marker
        at = self._text.find(marker, self._sent)
        if at >= 0:
            self._held_from = at
            return self._emit(at)
        # hold a tail that could be the marker's beginning
        keep = next((k for k in range(min(len(marker) - 1, len(self._text) - self._sent), 0, -1)
                     if marker.startswith(self._text[-k:])), 0)
        return self._emit(len(self._text) - keep)

    def _emit(self, upto: int) -> str:
        out, self._sent = self._text[self._sent:upto], max(self._sent, upto)
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not yet sent, calls) once the choice has ended."""
        if self._held_from is not None:
            content, calls = self.fmt.parse(self._text, self.known)
            if calls:
                before = self._text[self._sent:self._held_from]
                return before, calls
        return self._emit(len(self._text)), []
