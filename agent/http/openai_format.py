"""OpenAI's answer objects, for completions and chat, whole and streamed: the ``model`` object, a
finished answer (``text_completion`` / ``chat.completion``), and the SSE events of a streamed one
(``chat.completion.chunk`` / ``text_completion`` chunks, the usage chunk), with tool calls read
back from the text when tools are offered (text/tool_calls.py) and logprobs in either endpoint's
shape (agent/http/logprobs.py)."""

from __future__ import annotations

import json
import time
from typing import Any

from agent.http.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from agent.http.sse import encode as sse_encode
from agent.worker.generation import Choice, Delta
from text.tokenizer import Tokenizer
from text.tool_calls import ParsedCall, ToolFormat, ToolStream


def model_object(name: str, created: int, max_model_len: int | None, state: str) -> dict[str, Any]:
    """A model as ``GET /v1/models`` lists it; ``state`` (an extension, as ``max_model_len``):
    ready, or where it is on its way (a request for a model that is not ready loads it)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "infire", "max_model_len": max_model_len,
            "state": state}


def _call_view(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_finish(reason: str | None, calls: list[ParsedCall]) -> str | None:
    """OpenAI's finish_reason for an answer that called tools."""
    return "tool_calls" if calls and reason == "stop" else reason


def _compact(o: object) -> bytes:
    return json.dumps(o, separators=(",", ":")).encode()


class OpenAIFormatter:
    """OpenAI response and chunk shapes for one request."""

    def __init__(self, base_id: str, model: str, chat: bool, tokenizer: Tokenizer | None,
                 tools: tuple[ToolFormat, set[str]] | None = None) -> None:
        """``tokenizer``: shows logprobs' tokens (None: the answer has none); ``tools``: (the
        model's call format, the offered tool names) when the request offers tools: answers are
        read for calls (text/tool_calls.py)."""
        self.id, self.model, self.chat, self.tok = base_id, model, chat, tokenizer
        self.tools = tools
        self._tool_streams: dict[int, ToolStream] = {}  # a streamed answer's choices, by index
        self._text_offsets: dict[int, int] = {}  # streamed completions: each choice's text so far, by index
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        # A streamed chunk without logprobs, as bytes around its varying parts (index, text,
        # finish_reason): what ``sse([chunk(d)])`` encodes, byte for byte, without building and
        # encoding the dict for every token (a fifth of the agent's CPU at c200 went to SSE
        # encoding and JSON).
        head = _compact({"id": self.id, "object": self.object, "created": self.created, "model": self.model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'

    sse = staticmethod(sse_encode)

    def event(self, d: Delta, include_usage: bool) -> bytes:
        """The SSE events of one delta of a streamed answer."""
        return self.tool_events(d, include_usage) if self.tools is not None else self.chunk_event(d, include_usage)

    def chunk_event(self, d: Delta, include_usage: bool) -> bytes:
        """``sse([chunk(d, include_usage)])``."""
        if d.logprobs or d.echo is not None:
            return self.sse([self.chunk(d, include_usage)])
        finish = b"null" if d.finish_reason is None else _compact(d.finish_reason)
        if self.chat:
            text = b'{"content":' + _compact(d.text) + b"}" if d.text else b"{}"
            body = b',"delta":' + text
        else:
            body = b',"text":' + _compact(d.text)
        end = b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n"
        tail = b',"logprobs":null,"finish_reason":' + finish + end
        return self._head + str(d.index).encode() + body + tail

    def _envelope(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                             "choices": choices}
        if include_usage:
            d["usage"] = None
        return d

    def role_chunks(self, n: int, include_usage: bool) -> list[dict[str, Any]]:
        """A streamed chat answer's first chunk for each of its ``n`` choices: the role."""
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], include_usage) for i in range(n)]

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        if d.echo is not None:  # a completion's first delta with echo: the prompt before its own text
            e = d.echo
            wanted = d.echo_logprobs is not None or bool(d.logprobs)
            d = Delta(d.index, e.text + d.text, e.ids + d.token_ids,
                      ((d.echo_logprobs or [None] * len(e.ids)) + (d.logprobs or [])) if wanted else None,
                      d.finish_reason, e.pieces + (d.pieces or []))
        lp = self._logprobs(d.token_ids, d.pieces or [], d.logprobs) if d.logprobs else None
        if lp is not None and not self.chat:  # text_offset counts from the answer's start, not the chunk's
            start = self._text_offsets.get(d.index, 0)
            lp["text_offset"] = [start + k for k in lp["text_offset"]]
            self._text_offsets[d.index] = start + sum(len(t) for t in lp["tokens"])
        if self.chat:
            delta = {"content": d.text} if d.text else {}
            choice = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        return self._envelope([choice], include_usage)

    def tool_events(self, d: Delta, include_usage: bool) -> bytes:
        """The chunks of one delta when tools are offered: content up to where a call may start
        (held back from there), and at the choice's end what was held, as content or as calls
        (each call as OpenAI streams it: id, type and name, then the arguments); a call cut by
        the length limit comes with the arguments written so far, as in :meth:`full`."""
        assert self.tools is not None  # only answers that offer tools are read for calls
        stream = self._tool_streams.setdefault(d.index, ToolStream(*self.tools))
        out = [stream.feed(d.text)]
        calls: list[ParsedCall] = []
        if d.finish_reason is not None:
            rest, calls = stream.finish(cut=d.finish_reason == "length")
            out.append(rest)
        chunks = [self._envelope([{"index": d.index, "delta": {"content": t}, "logprobs": None,
                                   "finish_reason": None}], include_usage) for t in out if t]
        for k, call in enumerate(calls):
            head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            body = {"index": k, "function": {"arguments": call.arguments}}
            chunks += [self._envelope([{"index": d.index, "delta": {"tool_calls": [part]}, "logprobs": None,
                                        "finish_reason": None}], include_usage) for part in (head, body)]
        if d.finish_reason is not None:
            chunks.append(self._envelope([{"index": d.index, "delta": {}, "logprobs": None,
                                           "finish_reason": _tool_finish(d.finish_reason, calls)}], include_usage))
        return self.sse(chunks) if chunks else b""

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        d = self._envelope([], False)
        d["usage"] = usage
        return d

    def full(self, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        """A finished answer with all its ``choices``."""
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.text)
            lp = self._logprobs(c.token_ids, c.pieces, c.logprobs, text) if c.logprobs else None
            if self.chat and self.tools is not None:
                content, calls = self.tools[0].parse(text, self.tools[1], cut=c.finish_reason == "length")
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = [_call_view(k) for k in calls]
                out.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": _tool_finish(c.finish_reason, calls)})
            elif self.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
                if c.echo is not None:  # the prompt first, in the text and in the logprobs
                    choice["text"] = c.echo.text + text
                    if c.prompt_logprobs is not None or c.logprobs:
                        choice["logprobs"] = self._logprobs(
                            c.echo.ids + c.token_ids, c.echo.pieces + c.pieces,
                            (c.prompt_logprobs or [None] * len(c.echo.ids)) + c.logprobs, choice["text"])
                elif c.prompt_logprobs is not None:
                    assert self.tok is not None
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, c.prompt_logprobs)
                out.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": usage}

    def _logprobs(self, token_ids: list[int], pieces: list[str], entries: list[Any],
                  text: str | None = None) -> dict[str, Any]:
        assert self.tok is not None  # a request with logprobs is formatted with its tokenizer
        if self.chat:  # the tokens with text in the answer: a stop string cuts the pieces (generation.Choice)
            return chat_logprobs(self.tok, token_ids[:len(pieces)], entries[:len(pieces)])
        return completion_logprobs(self.tok, token_ids, pieces, entries, text)
