"""The OpenAI-compatible API: ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions``.

The handler wires the pieces of a request's path: the body read and checked
(agent/http/request_body.py, keys in api_keys.py), validated (every field bounded,
openai_schema.py), its prompt as token ids (prompt_ids.py, chat prompts built in
text/chat_prompt.py), its decoding planned (decoding.py: token limit, sampling, the grammar's
constraint, built by structured.py), admitted under the model's queue limit and sent to the engine
under request ids of its own (a client's ``X-Request-Id`` names the request in logs and the answer
only, so two requests that reuse one never meet); outputs come back as token ids, are detokenized
by the generation (agent/worker/generation.py) and shaped by openai_format.py. Streaming answers
are SSE (sse.py); a client that goes away cancels the handler (aiohttp ``handler_cancellation``),
and the ``finally`` aborts the request in the engine before the next step. Every refusal is an
:class:`~agent.http.api_error.ApiError` in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web
from aiohttp.http import HttpVersion11
from pydantic import ValidationError

from agent.context import AgentContext
from agent.http.api_error import ApiError, manager_error, send_error, stream_error
from agent.http.api_keys import ApiKeys
from agent.http.decoding import plan_decoding
from agent.http.openai_format import OpenAIFormatter, model_object
from agent.http.openai_schema import ChatCompletionRequest, CompletionRequest, first_error
from agent.http.prompt_ids import prompt_logprob_entries, prompt_ids, prompts_ids
from agent.http.request_body import BODY_BYTES, BodyReader, off_loop
from agent.http.sse import EventStream
from agent.http.structured import StructuredOutputError
from agent.log import bind_request_id, get_logger, new_request_id
from agent.manager.entries import SHUTDOWN_RETRY_S, ManagerError, ModelEntry
from agent.worker.client import WorkerError
from agent.worker.generation import Generation
from text.detokenizer import IncrementalDetokenizer, StopMatcher
from text.tool_calls import tool_format

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _context_len(entry: ModelEntry) -> int | None:
    """The model's context: what the engine loaded it with, else what its settings ask (None: its
    own context, known once loaded)."""
    return entry.info.max_model_len if entry.info is not None else entry.settings.max_model_len


class OpenAIApi:
    def __init__(self, ctx: AgentContext) -> None:
        server = ctx.settings.server
        self.ctx = ctx
        self._keys = ApiKeys(k.get_secret_value() for k in server.api_keys)
        # The same limit the application gives aiohttp (client_max_size), kept here from the settings.
        self._bodies = BodyReader(int(server.max_body_bytes), self._keys)
        self._log = get_logger("openai")

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.list_models),
            web.get("/v1/models/{model}", self.get_model),
            web.post("/v1/completions", self.completions, expect_handler=self._bodies.expect),
            web.post("/v1/chat/completions", self.chat_completions, expect_handler=self._bodies.expect),
        ]

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            self._keys.check(request)
        except ApiError as e:
            return e.response()
        models = [self._model_object(e) for e in self.ctx.manager.reachable_models()]
        return web.json_response({"object": "list", "data": models})

    async def get_model(self, request: web.Request) -> web.Response:
        """One model, as the list shows it (the SDK's ``models.retrieve``); 404 when not listed."""
        try:
            self._keys.check(request)
            name = request.match_info["model"]
            entry = next((e for e in self.ctx.manager.reachable_models() if e.name == name), None)
            if entry is None:
                raise ApiError(404, f"the model {name[:128]!r} does not exist or is not loaded", param="model",
                               code="model_not_found")
        except ApiError as e:
            return e.response()
        return web.json_response(self._model_object(entry))

    def _model_object(self, e: ModelEntry) -> dict[str, object]:
        return model_object(e.name, int(self.ctx.started_wall), _context_len(e), e.state.value)

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
            self._keys.check(request)
            if self.ctx.draining:
                raise ApiError(503, "the server is shutting down", code="shutting_down", retry_after=SHUTDOWN_RETRY_S)
            body = await self._bodies.read_json(request)
            size = request.get(BODY_BYTES, 0)
            try:
                req: ChatCompletionRequest | CompletionRequest = await off_loop(
                    size, ChatCompletionRequest.model_validate if chat else CompletionRequest.model_validate, body)
            except ValidationError as e:
                param, msg = first_error(e)
                raise ApiError(400, msg, param=param, code="invalid_value") from None
            if req.model in self.ctx.manager.models:
                model_label = req.model
            try:
                # the queue limit counts engine requests: prompts × n
                choices = req.n * (len(req.prompts()) if isinstance(req, CompletionRequest) else 1)
                admission = await self.ctx.manager.admit_wait(req.model, choices=choices)  # autoload waits, bounded
            except ManagerError as e:
                raise manager_error(e) from None
            with admission as entry:
                resp = await self._run(request, req, entry, rid, uid)
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

    async def _run(self, request: web.Request, req: ChatCompletionRequest | CompletionRequest, entry: ModelEntry,
                   rid: str, uid: str) -> web.StreamResponse:
        chat = isinstance(req, ChatCompletionRequest)
        tok = entry.tokenizer
        ctx_len = entry.info.max_model_len  # admitted: loaded, so the engine has said
        tool_fmt = tool_format(tok.chat_template) if chat else None
        vocab_size = entry.info.vocab_size
        past = [t for t, _ in req.logit_bias_pairs() if t >= vocab_size]
        if past:  # before the prompt and a grammar cost anything (the engine would refuse it too)
            raise ApiError(400, f"logit_bias: token {past[0]} is past the model's vocabulary ({vocab_size} tokens)",
                           param="logit_bias", code="invalid_value")
        if isinstance(req, ChatCompletionRequest):
            prompts = [await prompt_ids(req, tok, vocab_size, ctx_len, tool_fmt, request.get(BODY_BYTES, 0))]
        else:  # one prompt or a list: each with its n choices
            prompts = await prompts_ids(req, tok, vocab_size, ctx_len)
        plan = plan_decoding(req, max(len(ids) for ids in prompts), ctx_len, tool_fmt)
        try:
            grammar = await self.ctx.grammars.grammar(plan.constraint)
        except StructuredOutputError as e:
            raise ApiError(400, e.message, param=e.param, code="invalid_value") from None
        if grammar:
            self.ctx.metrics.constrained_requests.labels(model=entry.name).inc()

        base_id = ("chatcmpl-" if chat else "cmpl-") + uid
        manager = self.ctx.manager
        gen = Generation(self.ctx.worker, self.ctx.metrics, entry.name, base_id, tok,
                         req.stop_list(), IncrementalDetokenizer, StopMatcher,
                         comeback=lambda choices: manager.wait_back(entry.name, choices))
        try:
            try:
                echo = isinstance(req, CompletionRequest) and req.echo
                gen.start_batch(prompts, plan.samplings, grammar, echo=echo, echo_only=plan.echo_only)
            except WorkerError as e:
                raise send_error(e) from None
            tools = None
            if isinstance(req, ChatCompletionRequest) and req.uses_tools and req.tools and tool_fmt is not None:
                tools = (tool_fmt, {t.function.name for t in req.tools})
            fmt = OpenAIFormatter(base_id, entry.name, chat, tok, tools)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                return await self._stream(request, gen, fmt, include_usage, rid, plan.grammar_param)
            n_prompt = sum(len(ids) for ids in prompts)
            # an answer with prompt logprobs is built and serialized in a body thread (~30 bytes
            # an entry: megabytes of JSON would hold the loop, and /livez with it, for seconds)
            weight = 32 * prompt_logprob_entries(req, n_prompt) if isinstance(req, CompletionRequest) else 0
            resp = await self._collect(gen, fmt, n_prompt, weight, plan.grammar_param)
            resp.headers["X-Request-Id"] = rid
            return resp
        finally:
            gen.close()

    async def _collect(self, gen: Generation, fmt: OpenAIFormatter, n_prompt: int, weight: int,
                       grammar_param: str) -> web.Response:
        """The whole answer once the generation ends; ``weight``: its size as
        request_body.off_loop weighs work (bytes), which puts a heavy one in a thread."""
        try:
            await gen.finish()
        except WorkerError as e:
            raise stream_error(e, grammar_param) from None
        usage = gen.usage()
        usage["prompt_tokens"] = usage["prompt_tokens"] or n_prompt
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        choices = list(gen.choices.values())
        return web.json_response(text=await off_loop(weight, lambda: json.dumps(fmt.full(choices, usage))))

    async def _stream(self, request: web.Request, gen: Generation, fmt: OpenAIFormatter, include_usage: bool,
                      rid: str, grammar_param: str) -> web.StreamResponse:
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
        gen.on_delta = lambda d: stream.push(fmt.event(d, include_usage))
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
            err = stream_error(e, grammar_param)
            self._log.warning("stream_failed", status=err.status, code=err.code, error=err.message)
            await stream.write(fmt.sse([err.body()]))
        except (ConnectionResetError, ConnectionError):
            return resp  # the client left; close() aborts in the engine

        await resp.write_eof()
        return resp
