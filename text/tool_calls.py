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
HERMES_RESPONSE = "<tool_response>"
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

    @property
    def markers(self) -> tuple[str, ...]:
        """What starts our framing in the output: a call, and (hermes) a tool's answer, which
        tools' results are shown to the model in and which it may go on to imitate."""
        return {"hermes": (HERMES_OPEN, HERMES_RESPONSE), "llama3": ("{",), "mistral": (MISTRAL_MARK,)}[self.name]

    def parse(self, text: str, known: set[str], cut: bool = False) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output; ``cut``: it ended at the length limit, so its
        last call may be unfinished: that call is returned with the arguments written so far.

        Content is the text before the first call (trailing whitespace dropped); what the model
        writes between and after its calls, and from a ``<tool_response>`` of its own on, is not.
        A complete call to a tool not in ``known``, or one that does not parse, stays content with
        what follows it; no calls gives the text as it is (less, when cut, a tail that is the
        beginning of our framing). A cut call whose tool is not yet decided (its name is written
        in part, or not at all, and more than one offered tool fits) is dropped."""
        if self.name == "hermes":
            return self._parse_hermes(text, known, cut)
        if self.name == "mistral":
            return self._parse_mistral(text, known, cut)
        stripped = text.strip()  # llama3: the whole message is one JSON call
        try:
            item = json.loads(stripped)
        except ValueError:
            if cut and stripped.startswith("{"):
                got = self._partial(stripped, known, framed=False)
                if isinstance(got, ParsedCall):
                    return None, [got]
            return text, []
        calls = self._calls([item], known)
        return (None, calls) if calls else (text, [])

    def _parse_hermes(self, text: str, known: set[str], cut: bool) -> tuple[str | None, list[ParsedCall]]:
        first = _first_marker(text, self.markers, 0)
        if first < 0:
            return _cut_tail(text, self.markers) if cut else text, []
        before = text[:first].rstrip()
        calls: list[ParsedCall] = []
        left = ""  # from a block that is not a call on: stays content
        pos = first
        while pos >= 0 and text.startswith(HERMES_OPEN, pos):
            body_at = pos + len(HERMES_OPEN)
            end = text.find(HERMES_CLOSE, body_at)
            if end < 0:
                got = self._partial(text[body_at:], known, framed=True) if cut else None
                if isinstance(got, ParsedCall):
                    calls.append(got)
                elif got != "drop":
                    left = text[pos:]
                break
            try:
                found = self._calls([json.loads(text[body_at:end])], known)
            except ValueError:
                found = []
            if not found:
                left = text[pos:]
                break
            calls.extend(found)
            pos = _first_marker(text, self.markers, end + len(HERMES_CLOSE))
        if left and not calls:
            return text, []
        return (before + left) or None, calls

    def _parse_mistral(self, text: str, known: set[str], cut: bool) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(MISTRAL_MARK)
        body = text[at + len(MISTRAL_MARK):] if at >= 0 else text.strip()
        before = text[:at].rstrip() if at > 0 else ""
        try:
            items = json.loads(body)
        except ValueError:
            if not cut:
                return text, []
            if at < 0 and not body.startswith("["):
                return _cut_tail(text, self.markers), []
            if not body.strip():
                return before or None, []
            complete, rest = _array_prefix(body)
            if complete is None:
                return text, []
            calls = self._calls(complete, known)
            if len(calls) != len(complete):
                return text, []
            got = self._partial(rest, known, framed=True) if rest is not None else None
            if isinstance(got, ParsedCall):
                calls.append(got)
            elif got is not None and got != "drop":
                return (text, []) if not calls else (before or None, calls)
            return before or None, calls
        calls = self._calls(items if isinstance(items, list) else [items], known)
        if not calls:
            return text, []
        return before or None, calls

    def _partial(self, body: str, known: set[str], framed: bool) -> ParsedCall | str:
        """The unfinished call ``body`` (JSON cut short) as a call with the arguments written so
        far; ``"drop"`` when its tool is not decided yet and ``framed`` (it sits in our framing,
        which never reaches content); ``"text"`` when it is not a call."""
        fields = _object_prefix(body)
        if fields is None:
            return "text"
        name = fields.get("name")
        if name is None:
            if not framed:
                return "text"
            fits = sorted(known)
        elif name[1]:
            try:
                fits = [n for n in [json.loads(name[0])] if n in known]
            except ValueError:
                return "text"
        else:
            prefix = _string_prefix(name[0])
            fits = [] if prefix is None else sorted(n for n in known if n.startswith(prefix))
        if len(fits) != 1:
            return "drop" if framed and (len(fits) > 1 or name is None) else "text"
        args = fields.get(self.args_key) or fields.get("arguments") or fields.get("parameters")
        text = ""
        if args is not None:
            text = args[0]
            if args[1]:
                try:
                    value = json.loads(text)
                    value = json.loads(value) if isinstance(value, str) else value
                except ValueError:
                    return "text"
                if not isinstance(value, dict):
                    return "text"
                text = _args_text(value)
        return ParsedCall(fits[0], text, call_id())

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


def _first_marker(text: str, markers: tuple[str, ...], pos: int) -> int:
    found = [at for m in markers if (at := text.find(m, pos)) >= 0]
    return min(found, default=-1)


def _marker_tail(text: str, markers: tuple[str, ...], start: int = 0) -> int:
    """The length of the longest tail of ``text[start:]`` that is a proper beginning of a marker."""
    longest = max(len(m) for m in markers) - 1
    return next((k for k in range(min(longest, len(text) - start), 0, -1)
                 if any(m.startswith(text[-k:]) for m in markers)), 0)


def _cut_tail(text: str, markers: tuple[str, ...]) -> str | None:
    """``text`` cut at the length limit, less a tail that is the beginning of our framing (None
    when that was all of it)."""
    k = _marker_tail(text, markers)
    return text[:len(text) - k] or None if k else text


def _value_end(s: str, i: int) -> int | None:
    """Where the JSON value that starts at ``s[i]`` ends; None when ``s`` ends first."""
    n = len(s)
    if s[i] in "{[":
        depth, j = 0, i
        while j < n:
            c = s[j]
            if c == '"':
                end = _value_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if s[i] == '"':
        j = i + 1
        while j < n:
            if s[j] == "\\":
                j += 2
            elif s[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    j = i
    while j < n and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < n else None


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _object_prefix(s: str) -> dict[str, tuple[str, bool]] | None:
    """The members of a JSON object cut short, key -> (value's text, complete); None when ``s``
    is not the beginning of an object. A key cut short, or without its value yet, is left out."""
    i = _skip_ws(s, 0)
    if i == len(s):
        return {}
    if s[i] != "{":
        return None
    fields: dict[str, tuple[str, bool]] = {}
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i == len(s) or s[i] == "}":
            return fields
        if s[i] == "," and fields:
            i += 1
            continue
        if s[i] != '"':
            return None
        key_end = _value_end(s, i)
        if key_end is None:
            return fields
        try:
            key = json.loads(s[i:key_end])
        except ValueError:
            return None
        i = _skip_ws(s, key_end)
        if i == len(s):
            return fields
        if s[i] != ":":
            return None
        i = _skip_ws(s, i + 1)
        if i == len(s):
            return fields
        end = _value_end(s, i)
        if end is None:
            fields[key] = (s[i:], False)
            return fields
        fields[key] = (s[i:end], True)
        i = end


def _array_prefix(s: str) -> tuple[list[Any] | None, str | None]:
    """(the complete items, the text of the one cut short or None) of a JSON array cut short;
    ``(None, None)`` when ``s`` is not the beginning of an array."""
    i = _skip_ws(s, 0)
    if i == len(s) or s[i] != "[":
        return None, None
    items: list[Any] = []
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i == len(s):
            return items, None
        if s[i] == "," and items:
            i += 1
            continue
        end = _value_end(s, i)
        if end is None:
            return items, s[i:]
        try:
            items.append(json.loads(s[i:end]))
        except ValueError:
            return None, None
        i = end


def _string_prefix(raw: str) -> str | None:
    """The characters of a JSON string cut short (``"get_we`` -> ``get_we``)."""
    if not raw.startswith('"'):
        return None
    body = raw[1:]
    for cut in (body, body[:-1], body[:-2], body[:-3], body[:-4], body[:-5]):  # a cut escape
        try:
            return json.loads('"' + cut + '"')
        except ValueError:
            continue
    return None


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
            out.append({"role": "user", "content": f"{HERMES_RESPONSE}\n{m.get('content') or ''}\n</tool_response>"})
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
    call may be starting (one of the format's markers, or a beginning of one at the tail, or —
    llama3, mistral — a message that opens with ``{`` / ``[``); from there on it is held, and
    :meth:`finish` says what of it is content and what calls, as :meth:`ToolFormat.parse` reads
    the whole text: streamed and whole answers are the same. Trailing whitespace is held too
    (content before a call drops it)."""

    def __init__(self, fmt: ToolFormat, known: set[str]) -> None:
        self.fmt, self.known = fmt, known
        self._text = ""  # everything so far
        self._sent = 0  # how much of it went out as content
        self._held = False  # a (possible) call started: nothing more goes out before the end

    def feed(self, piece: str) -> str:
        """The content that may go out now."""
        self._text += piece
        if self._held:
            return ""
        if self.fmt.name in ("llama3", "mistral") and self._sent == 0:
            head = self._text.lstrip()
            if not head:
                return ""
            if head[0] == ("{" if self.fmt.name == "llama3" else "["):
                self._held = True
                return ""
            if self.fmt.name == "llama3":
                return self._emit(len(self._text))
        at = _first_marker(self._text, self.fmt.markers, self._sent)
        if at >= 0:
            self._held = True
            return self._emit(len(self._text[:at].rstrip()))
        keep = _marker_tail(self._text, self.fmt.markers, self._sent)
        return self._emit(len(self._text[:len(self._text) - keep].rstrip()))

    def _emit(self, upto: int) -> str:
        out, self._sent = self._text[self._sent:upto], max(self._sent, upto)
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[ParsedCall]]:
        """(content not yet sent, calls) once the choice has ended (``cut``: at the length limit)."""
        content, calls = self.fmt.parse(self._text, self.known, cut)
        content = content or ""
        sent = self._text[:self._sent]
        assert content.startswith(sent), "streamed content is always the beginning of the answer's"
        return content[len(sent):], calls
