"""The OpenAI-compatible API: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions``.

A request is parsed (size, content coding and JSON depth bounded), validated (every field
bounded), tokenized (chat template in the tokenizer's sandboxed Jinja; a prompt that cannot fit
the context by its length alone is refused before that, and long texts tokenize in a thread
without the GIL), admitted under the model's queue limit and sent to the engine under request ids
of its own (a client's ``X-Request-Id`` names the request in logs and the answer only, so two
requests that reuse one never meet); outputs come back as token ids and are detokenized here.
Streaming answers are SSE; a client that goes away cancels the handler (aiohttp
``handler_cancellation``), and the ``finally`` aborts the request in the engine before the next step.

Bodies are decoded here, not by aiohttp (the server runs with ``auto_decompress=False``): gzip and
deflate up to the body limit, anything else a 415 in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import zlib
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11
from pydantic import ValidationError

from agent.worker.generation import Delta, Generation
from agent.context import AgentContext
from agent.log import bind_request_id, get_logger, new_request_id
from agent.manager.entries import ManagerError
from agent.http.openai_schema import (
    MAX_PROMPT_TOKENS, ChatCompletionRequest, CompletionRequest, first_error, json_depth_ok,
)
from agent.http.sse import EventStream, encode as sse_encode
from agent.http.structured import StructuredOutputError
from agent.worker.client import WorkerDied, WorkerError
from engine.sampling import SamplingParams, SamplingParamsError
from text.tokenizer import TokenLimitExceeded
from text.tool_calls import ToolFormat, ToolStream, default_tool_prompt, history_view, tool_format

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 417: "invalid_request_error", 503: "server_error", 500: "server_error"}
TOKENIZE_INLINE_CHARS = 16_384  # longer texts tokenize in a thread so the loop keeps serving
DECODE_INLINE_BYTES = 65_536  # longer compressed bodies inflate in a thread (zlib drops the GIL)
DEFAULT_COMPLETION_TOKENS = 16
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
BODY_TIMEOUT_S = 30.0  # a client trickling its body holds a connection, not the server
# Content codings a body may come in, with zlib's window bits for each (gzip header / zlib header).
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def _stream_error(e: WorkerError) -> ApiError:
    """A failure after the request was sent: refused by the engine (400), engine gone or
    shutting down (503), anything else (500)."""
    if e.code in ("EngineError", "RequestError", "SamplingParamsError"):
        return ApiError(400, str(e), code="invalid_request")
    if e.code == "GrammarError":  # the format passed the agent's check but not this model's vocabulary
        return ApiError(400, str(e), param="response_format", code="invalid_value")
    unavailable = isinstance(e, WorkerDied) or e.code in ("shutting_down", "aborted")
    return ApiError(503 if unavailable else 500, str(e), code=e.code)


def _from_manager(e: ManagerError) -> ApiError:
    return ApiError(e.status, str(e), param="model", code=e.code, retry_after=e.retry_after)


def _inflate(raw: bytes, coding: str, limit: int) -> bytes:
    """``raw`` decoded from ``coding``; ApiError past ``limit`` bytes or when it is not that coding."""
    wbits = _CODINGS[coding]
    try:
        d = zlib.decompressobj(wbits)
        out = d.decompress(raw, limit + 1)
    except zlib.error:
        if coding != "deflate":
            raise ApiError(400, f"the body is not valid {coding} data", code="invalid_encoding") from None
        try:  # "deflate" is sent both with and without the zlib header
            d = zlib.decompressobj(-zlib.MAX_WBITS)
            out = d.decompress(raw, limit + 1)
        except zlib.error:
            raise ApiError(400, "the body is not valid deflate data", code="invalid_encoding") from None
    if len(out) > limit or d.unconsumed_tail:
        raise ApiError(413, f"the decoded body is larger than {limit} bytes", code="body_too_large")
    if not d.eof:
        raise ApiError(400, f"the {coding} body is truncated", code="invalid_encoding")
    return out


async def _decode_body(request: web.Request, raw: bytes) -> bytes:
    coding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if coding in ("", "identity"):
        return raw
    if coding not in _CODINGS:
        raise ApiError(415, f"Content-Encoding {coding[:40]!r} is not supported; send identity, gzip or deflate",
                       param="Content-Encoding", code="unsupported_content_encoding")
    limit = request.app._client_max_size
    if len(raw) <= DECODE_INLINE_BYTES:
        return _inflate(raw, coding, limit)
    return await asyncio.to_thread(_inflate, raw, coding, limit)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, with the size (client_max_size, before and after decoding), the content
    coding and the nesting depth bounded."""
    # asyncio.timeout, not wait_for: wait_for reads in a task of its own, and a refused body's
    # exception then sits in a cycle (task -> exception -> traceback -> frames -> task) that
    # keeps the partial body alive until the cyclic GC runs: ~20 MB per refused 100 MB upload.
    err: ApiError | None = None
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        err = ApiError(413, f"the body is larger than {request.app._client_max_size} bytes", code="body_too_large")
    except TimeoutError:
        err = ApiError(408, f"the body did not arrive within {BODY_TIMEOUT_S:g}s", code="body_timeout")
    if err is not None:  # raised outside the handler: no link back to the frames that held the body
        raise err
    raw = await _decode_body(request, raw)
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the JSON body nests too deeply", code="invalid_json") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not json_depth_ok(obj):
        raise ApiError(400, "the JSON body nests too deeply", code="invalid_json")
    if not isinstance(obj, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return obj


class OpenAIApi:
    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self._keys = [k.get_secret_value().encode() for k in ctx.settings.server.api_keys if k.get_secret_value()]
        self._log = get_logger("openai")

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.list_models),
            web.get("/v1/models/{model}", self.get_model),
            web.post("/v1/completions", self.completions, expect_handler=self.expect),
            web.post("/v1/chat/completions", self.chat_completions, expect_handler=self.expect),
        ]

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: a refusal the headers already decide (no key, a body over the
        limit) is answered now, so the client never sends the body; else 100 Continue."""
        expect = request.headers.get("Expect", "").lower()
        if expect != "100-continue":
            err = ApiError(417, f"Expect: {expect[:40]!r} is not understood (only 100-continue)",
                           param="Expect", code="expectation_failed")
        elif request.content_length is not None and request.content_length > request.app._client_max_size:
            err = ApiError(413, f"the body is larger than {request.app._client_max_size} bytes", code="body_too_large")
        else:
            try:
                self._check_key(request)
            except ApiError as e:
                err = e
            else:
                if request.version == HttpVersion11:
                    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    request.writer.output_size = 0  # the answer proper has not started
                return None
        resp = err.response()
        resp.force_close()  # the body will not come: the connection cannot carry another request
        return resp

    def _check_key(self, request: web.Request) -> None:
        if not self._keys:
            return
        auth = request.headers.get("Authorization", "")
        # Header bytes that are not UTF-8 arrive as surrogate escapes: encode them back to bytes.
        given = auth[7:].strip().encode("utf-8", "surrogateescape") if auth[:7].lower() == "bearer " else b""
        # Compare against every key so the time taken says nothing about which one was close.
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(given, k)
        if not ok:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key")

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            self._check_key(request)
        except ApiError as e:
            return e.response()
        return web.json_response({"object": "list", "data": [self._model_view(e) for e in self.ctx.manager.ready_models()]})

    async def get_model(self, request: web.Request) -> web.Response:
        """One model, as the list shows it (the SDK's ``models.retrieve``); 404 when not listed."""
        try:
            self._check_key(request)
            name = request.match_info["model"]
            entry = next((e for e in self.ctx.manager.ready_models() if e.name == name), None)
            if entry is None:
                raise ApiError(404, f"the model {name[:128]!r} does not exist or is not loaded", param="model",
                               code="model_not_found")
        except ApiError as e:
            return e.response()
        return web.json_response(self._model_view(entry))

    def _model_view(self, e: Any) -> dict[str, Any]:
        return {"id": e.name, "object": "model", "created": int(self.ctx.started_wall), "owned_by": "infire",
                "max_model_len": e.info.max_model_len}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    # --- the request path -------------------------------------------------------------------

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        given = request.headers.get("X-Request-Id", "")
        rid = bind_request_id(given if _REQUEST_ID_RE.fullmatch(given) else new_request_id())
        # The engine's ids are ours alone: a client reusing an X-Request-Id (a retry, a bug) must
        # never reach, abort or be refused for another request. Without the header the two agree.
        uid = rid if rid != given else new_request_id()
        model_label = ""  # only known models become label values: clients cannot grow the series
        status = 500
        try:
            self._check_key(request)
            if self.ctx.draining:
                raise ApiError(503, "the server is shutting down", code="shutting_down", retry_after=5)
            body = await read_json(request)
            try:
                req: ChatCompletionRequest | CompletionRequest = (
                    ChatCompletionRequest.model_validate(body) if chat else CompletionRequest.model_validate(body))
            except ValidationError as e:
                param, msg = first_error(e)
                raise ApiError(400, msg, param=param, code="invalid_value") from None
            if req.model in self.ctx.manager.models:
                model_label = req.model
            try:
                admission = await self.ctx.manager.admit_wait(req.model)  # autoload waits, bounded
            except ManagerError as e:
                raise _from_manager(e) from None
            with admission as entry:
                resp = await self._run(request, req, entry, chat, rid, uid)
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            if status >= 500:  # ours, not the client's: worth a line (the request id is bound)
                self._log.warning("request_failed", status=status, code=e.code, error=e.message)
            resp = e.response()
            resp.headers["X-Request-Id"] = rid
            return resp
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            self.ctx.metrics.requests.labels(model=model_label, status=str(status)).inc()

    async def _prompt_ids(self, req: Any, entry: Any, chat: bool, ctx_len: int,
                          tool_fmt: ToolFormat | None = None) -> list[int]:
        """The prompt's ids; a prompt of ``ctx_len`` tokens or more is refused, by its length alone
        when that already tells (before any tokenizing), else before its ids are built.
        ``tool_fmt``: how the model writes tool calls (chat), for tools and a history with calls."""
        tok = entry.tokenizer
        limit = min(ctx_len, MAX_PROMPT_TOKENS + 1)
        if chat:
            messages = [m.template_view() for m in req.messages]
            variables: dict[str, Any] = {}
            if tool_fmt is not None and (req.uses_tools or any("tool_calls" in m or m["role"] == "tool"
                                                               for m in messages)):
                messages = history_view(messages, tool_fmt)
                if req.uses_tools:
                    tools = [t.model_dump(exclude_none=True) for t in req.tools]
                    if tool_fmt.native:
                        variables["tools"] = tools
                    else:
                        messages = _with_system(messages, default_tool_prompt([t["function"] for t in tools]))
            size = sum(len(m.get("content") or "") for m in messages)
            work = lambda: tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,  # noqa: E731
                                                              **variables),
                                      add_special_tokens=False, limit=limit)
        elif isinstance(req.prompt, str):
            size = len(req.prompt)
            if (at_least := tok.min_tokens(req.prompt)) >= limit:  # O(1): no thread, no tokenizing
                raise self._too_long(at_least, ctx_len, chat, exact=False)
            work = lambda: tok.encode(req.prompt, limit=limit)  # noqa: E731
        else:
            vocab = entry.info.vocab_size
            bad = next((t for t in req.prompt if t >= vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary (size {vocab})", param="prompt")
            return list(req.prompt)
        try:
            ids = work() if size < TOKENIZE_INLINE_CHARS else await asyncio.to_thread(work)
        except TokenLimitExceeded as e:
            raise self._too_long(e.tokens, ctx_len, chat, exact=e.exact) from None
        except Exception as e:  # template errors, template output bounds
            raise ApiError(400, f"{'messages' if chat else 'prompt'}: {e}", param="messages" if chat else "prompt") from None
        return list(ids)

    @staticmethod
    def _too_long(n: int, ctx_len: int, chat: bool, *, exact: bool) -> ApiError:
        return ApiError(400, f"the prompt has {'' if exact else 'at least '}{n} tokens; this model's context is {ctx_len}",
                        param="messages" if chat else "prompt", code="context_length_exceeded")

    def _samplings(self, req: Any, max_tokens: int, chat: bool) -> list[SamplingParams]:
        logprobs = req.logprobs_count() if chat else req.logprobs
        out = []
        for i in range(req.n):
            # With a seed and n > 1 each choice gets its own seed, else the n answers are equal.
            seed = None if req.seed is None else (req.seed + i) % (1 << 63)
            try:
                out.append(SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                                          min_p=req.min_p, seed=seed, max_tokens=max_tokens,
                                          ignore_eos=req.ignore_eos, logprobs=logprobs))
            except SamplingParamsError as e:
                raise ApiError(400, str(e), param=e.field, code="invalid_value") from None
        return out

    async def _run(self, request: web.Request, req: Any, entry: Any, chat: bool, rid: str,
                   uid: str) -> web.StreamResponse:
        ctx_len = entry.info.max_model_len
        tool_fmt = tool_format(getattr(entry.tokenizer, "chat_template", None)) if chat else None
        prompt_ids = await self._prompt_ids(req, entry, chat, ctx_len, tool_fmt)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
        if len(prompt_ids) >= ctx_len or len(prompt_ids) > MAX_PROMPT_TOKENS:
            raise self._too_long(len(prompt_ids), ctx_len, chat, exact=True)
        limit = req.output_limit() if chat else req.max_tokens
        if limit is None:  # OpenAI's defaults: the rest of the context for chat, 16 for completions
            limit = ctx_len - len(prompt_ids) if chat else min(DEFAULT_COMPLETION_TOKENS, ctx_len - len(prompt_ids))
        max_tokens = limit
        if len(prompt_ids) + max_tokens > ctx_len:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds this "
                                f"model's context of {ctx_len} tokens",
                           param="max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens",
                           code="context_length_exceeded")
        samplings = self._samplings(req, max_tokens, chat)
        try:
            if chat and req.forces_call:
                named = req.tool_choice.function.name if req.tool_choice != "required" else None
                offered = [t.function.model_dump(exclude_none=True) for t in req.tools
                           if named is None or t.function.name == named]
                grammar = await self.ctx.grammars.tool_grammar(tool_fmt, offered, req.parallel_tool_calls and not named,
                                                               strict=any(t.get("strict") for t in offered))
            else:
                grammar = await self.ctx.grammars.grammar(req.response_format)
        except StructuredOutputError as e:
            raise ApiError(400, e.message, param=e.param, code="invalid_value") from None
        if grammar:
            self.ctx.metrics.constrained_requests.labels(model=entry.name).inc()
        from text.detokenizer import IncrementalDetokenizer, StopMatcher

        base_id = ("chatcmpl-" if chat else "cmpl-") + uid
        gen = Generation(self.ctx.worker, self.ctx.metrics, entry.name, base_id, entry.tokenizer,
                         req.stop_list(), IncrementalDetokenizer, StopMatcher)
        try:
            try:
                gen.start(prompt_ids, samplings, grammar)
            except WorkerDied as e:
                raise ApiError(503, str(e), code="engine_unavailable", retry_after=2) from None
            except WorkerError as e:
                raise ApiError(400, str(e), code=e.code) from None
            tools = (tool_fmt, {t.function.name for t in req.tools}) if chat and req.uses_tools else None
            fmt = _Formatter(base_id, entry.name, chat, entry.tokenizer, tools)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return await self._stream(request, gen, fmt, include_usage, rid)
            resp = await self._collect(gen, fmt, len(prompt_ids))
            resp.headers["X-Request-Id"] = rid
            return resp
        finally:
            gen.close()

    async def _collect(self, gen: Generation, fmt: _Formatter, n_prompt: int) -> web.Response:
        try:
            await gen.finish()
        except WorkerError as e:
            raise _stream_error(e) from None
        usage = gen.usage()
        usage["prompt_tokens"] = usage["prompt_tokens"] or n_prompt
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response(fmt.full(list(gen.choices.values()), usage))

    async def _stream(self, request: web.Request, gen: Generation, fmt: _Formatter, include_usage: bool,
                      rid: str) -> web.StreamResponse:
        """SSE: the events are written by ``EventStream.push`` as the generation makes them (from
        before the first await: nothing made meanwhile is missed); this task writes what that
        held back (the first events, a slow reader's backlog) and the end."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no", "X-Request-Id": rid})
        chunked = request.version == HttpVersion11
        if chunked:
            resp.enable_chunked_encoding()
        first = fmt.sse(fmt.role_chunks(len(gen.choices), include_usage)) if fmt.chat else b""
        stream = EventStream(request, resp, gen.notify, chunked, first)
        if fmt.tools is not None:
            streams: dict[int, ToolStream] = {}
            gen.on_delta = lambda d: stream.push(fmt.tool_events(streams, d, include_usage))
        else:
            gen.on_delta = lambda d: stream.push(fmt.chunk_event(d, include_usage))
        try:
            await resp.prepare(request)
            while True:
                await stream.flush()
                if stream.gone:
                    return resp  # the client left; close() aborts in the engine
                if gen.over:
                    break
                if not stream.pending:
                    await gen.wait()
            if gen.failure is not None:
                raise gen.failure
            tail = fmt.sse([fmt.usage_chunk(gen.usage())]) if include_usage else b""
            await stream.write(tail + b"data: [DONE]\n\n")
        except WorkerError as e:
            err = _stream_error(e)
            self._log.warning("stream_failed", status=err.status, code=err.code, error=err.message)
            await stream.write(fmt.sse([err.body()]))
        except (ConnectionResetError, ConnectionError):
            return resp  # the client left; close() aborts in the engine

        await resp.write_eof()
        return resp


def _call_view(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_finish(reason: str | None, calls: list[Any]) -> str | None:
    """OpenAI's finish_reason for an answer that called tools."""
    return "tool_calls" if calls and reason == "stop" else reason


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` at the end of the system message, or as one in front."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}".lstrip()}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _compact(o: Any) -> bytes:
    return json.dumps(o, separators=(",", ":")).encode()


class _Formatter:
    """OpenAI response and chunk shapes for one request."""

    def __init__(self, base_id: str, model: str, chat: bool, tokenizer: Any,
                 tools: tuple[ToolFormat, set[str]] | None = None) -> None:
        """``tools``: (the model's call format, the offered tool names) when the request offers
        tools: answers are read for calls (text/tool_calls.py)."""
        self.id, self.model, self.chat, self.tok = base_id, model, chat, tokenizer
        self.tools = tools
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"
        # A streamed chunk without logprobs, as bytes around its varying parts (index, text,
        # finish_reason): what ``sse([chunk(d)])`` encodes, byte for byte, without building and
        # encoding the dict for every token (a fifth of the agent's CPU at c200 went to SSE
        # encoding and JSON).
        head = _compact({"id": self.id, "object": self.object, "created": self.created, "model": self.model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'

    def chunk_event(self, d: Delta, include_usage: bool) -> bytes:
        """``sse([chunk(d, include_usage)])``."""
        if d.logprobs:
            return self.sse([self.chunk(d, include_usage)])
        finish = b"null" if d.finish_reason is None else _compact(d.finish_reason)
        if self.chat:
            text = b'{"content":' + _compact(d.text) + b"}" if d.text else b"{}"
            body = b',"delta":' + text
        else:
            body = b',"text":' + _compact(d.text)
        tail = b',"logprobs":null,"finish_reason":' + finish + (b'}],"usage":null}\n\n' if include_usage else b"}]}\n\n")
        return self._head + str(d.index).encode() + body + tail

    sse = staticmethod(sse_encode)

    def _envelope(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                             "choices": choices}
        if include_usage:
            d["usage"] = None
        return d

    def role_chunks(self, n: int, include_usage: bool) -> list[dict[str, Any]]:
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], include_usage) for i in range(n)]

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        lp = self._logprobs(d.token_ids, d.pieces or [], d.logprobs) if d.logprobs else None
        if self.chat:
            delta = {"content": d.text} if d.text else {}
            choice = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        return self._envelope([choice], include_usage)

    def tool_events(self, streams: dict[int, ToolStream], d: Delta, include_usage: bool) -> bytes:
        """The chunks of one delta when tools are offered: content up to where a call may start
        (held back from there), and at the choice's end what was held, as content or as calls
        (each call as OpenAI streams it: id, type and name, then the arguments)."""
        stream = streams.setdefault(d.index, ToolStream(*self.tools))
        out = [stream.feed(d.text)]
        calls: list[Any] = []
        if d.finish_reason is not None:
            rest, calls = stream.finish()
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

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        d = self._envelope([], False)
        d["usage"] = usage
        return d

    def full(self, choices: list[Any], usage: dict[str, int]) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            text = "".join(c.text)
            lp = self._logprobs(c.token_ids, c.pieces, c.logprobs, text) if c.logprobs else None
            if self.chat and self.tools is not None:
                content, calls = self.tools[0].parse(text, self.tools[1])
                message: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    message["tool_calls"] = [_call_view(k) for k in calls]
                out.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": _tool_finish(c.finish_reason, calls)})
            elif self.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out, "usage": usage}

    def _logprobs(self, token_ids: list[int], pieces: list[str], entries: list[Any],
                  text: str | None = None) -> dict[str, Any]:
        from agent.http.logprobs import chat_logprobs, completion_logprobs

        if self.chat:
            return chat_logprobs(self.tok, token_ids, entries)
        return completion_logprobs(self.tok, token_ids, pieces, entries, text)
