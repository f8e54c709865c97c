"""One HTTP request's engine requests ("choices"): send, detokenize, match stop strings, abort.

A request with ``n`` choices becomes ``n`` engine requests that all report to one
:class:`Generation`. Text stays here in the agent: the engine sends token ids, :class:`Choice`
turns them into text incrementally and holds back what could be the start of a stop string; when
a stop string completes, the choice aborts its engine request at once and finishes with ``"stop"``.

Outputs are handled where they are read: the worker client calls :meth:`Generation.put_nowait`
for each, on the loop, and the generation makes the delta and hands it to ``on_delta`` (the
streaming handler's writer) right there. The handler's task sleeps until the request ends (or
its writer has a backlog): no task wakes per request per engine step. With a mailbox per request
and a task switch per output, the wake-ups (the loop, ``async for`` over the deltas, the queue)
were a third of the agent's CPU at concurrency 200 on the H200 (py-spy over the c200 serve bench
at f23c06b: ~420 of 1,288 samples).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agent.metrics import Metrics
from agent.worker.client import EngineRequest, Preempted, WorkerClient, WorkerError
from engine.sampling import SamplingParams
from engine.worker import protocol as P


@dataclass
class Delta:
    """New output of one choice since the last delta. With logprobs, ``token_ids``,
    ``logprobs`` and ``pieces`` are the tokens whose text the text given so far holds (see
    ``Choice._release``), not the step's new tokens."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None
    finish_reason: str | None
    pieces: list[str] | None = None  # with logprobs: the text each token added (one per token id)
    # A streamed completion with echo, its first delta: the prompt (and the prompt's logprobs,
    # when asked), shown before this delta's own text and tokens
    echo: Echo | None = None
    echo_logprobs: list[Any] | None = None


@dataclass(frozen=True)
class Echo:
    """A completion's prompt shown before its answer (``echo``): its ids, the text each added
    (detokenized one by one, as generated tokens are for logprobs), and the whole text."""

    ids: list[int]
    pieces: list[str]
    text: str
    only: bool  # max_tokens 0: the prompt alone (the engine's one sampled token is not shown)

    @classmethod
    def of(cls, tokenizer: Any, ids: list[int], make_detok: Any, only: bool) -> Echo:
        detok = make_detok(tokenizer, context_ids=[])
        pieces = [detok.push([i]) for i in ids]
        tail = detok.flush()
        if pieces and tail:
            pieces[-1] += tail
        return cls(list(ids), pieces, "".join(pieces), only)


@dataclass
class Choice:
    index: int
    req_id: str
    detok: Any
    matcher: Any
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # with logprobs: the text each token added
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt's, served from the engine's prefix cache
    prompt: int = 0  # which of the request's prompts it answers (a completion's list of prompts)
    echo: Echo | None = None
    # The prompt's logprobs (the engine's entries, with the first token), None first: OpenAI has
    # none for the first prompt token.
    prompt_logprobs: list[Any] | None = None
    echo_sent: bool = False  # the prompt went out with a streamed delta
    # Stop strings are looked for in the text of a step that brings the answer past min_tokens
    # and later ones, as vLLM does (the engine holds back the end of text and stop ids as well)
    min_tokens: int = 0
    # With logprobs: the tokens given to deltas so far, the characters their pieces hold, and the
    # characters of text given (a token goes out once the text holds its piece: see push)
    sent: int = 0
    sent_chars: int = 0
    text_chars: int = 0
    # What sends it again after its model was preempted (Generation._resume): its prompt and
    # sampling, and how often it was preempted.
    prompt_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None
    preemptions: int = 0

    def push(self, out: P.TokenOutput) -> Delta:
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        if not self.preemptions or not self.token_ids:  # the first admission's hits, not a resumption's recompute
            self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *out.prompt_logprobs]
        shown = None if self.echo is None or self.echo_sent else self.echo  # the first delta shows the prompt
        self.echo_sent = True
        echo_lp = self.prompt_logprobs if shown is not None else None
        if self.echo is not None and self.echo.only and out.finish_reason != "abort":
            # max_tokens 0: the engine sampled one token (max_tokens 1) that the answer leaves out
            self.finish_reason = "length"
            return Delta(self.index, "", [], None, "length", None, shown, echo_lp)
        ids = list(out.new_token_ids)
        self.token_ids.extend(ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        finish = out.finish_reason
        if finish == "abort":
            # Not ours (ours are dropped before they arrive): the model was unloaded under it.
            raise WorkerError("the request was aborted in the engine (the model was unloaded)", "aborted")
        # With logprobs each token is detokenized alone, so each knows the text it added: a byte
        # that only starts a character adds "", the one completing it the whole character.
        # (a final output without tokens still releases what the stop matcher held: self.pieces)
        pieces = [self.detok.push([i]) for i in ids] if out.logprobs or self.pieces else None
        new_text = "".join(pieces) if pieces is not None else self.detok.push(ids) if ids else ""
        if finish is not None:
            tail = self.detok.flush()
            new_text += tail
            if tail and pieces:
                pieces[-1] += tail
            elif tail and self.pieces:
                self.pieces[-1] += tail
        if pieces is not None:
            self.pieces.extend(pieces)
        if self.matcher is None or len(self.token_ids) <= self.min_tokens:
            emit, stopped = new_text, False  # vLLM's min_tokens: stop strings wait for them too
        else:
            emit, stopped = self.matcher.push(new_text)
        if stopped:
            finish = "stop"
        elif finish is not None and self.matcher is not None:
            emit += self.matcher.flush()  # nothing more can complete a stop string
        self.finish_reason = finish
        self.text.append(emit)
        if pieces is None:
            return Delta(self.index, emit, ids, out.logprobs or None, finish, None, shown, echo_lp)
        sent_ids, sent_lps, sent_pieces = self._release(len(emit), stopped)
        return Delta(self.index, emit, sent_ids, sent_lps, finish, sent_pieces, shown, echo_lp)

    def _release(self, emitted: int, stopped: bool) -> tuple[list[int], list[Any] | None, list[str]]:
        """The tokens (ids, logprobs, pieces) a delta that gives ``emitted`` more characters of
        text carries: those whose pieces the text given so far holds. The stop matcher holds back
        text that may start a stop string; its tokens wait with it, so a streamed answer's
        ``"".join(tokens)`` is its text, as the whole answer's is. At a stop string the pieces
        are cut where the text ends (the token it lands in keeps what it kept, later ones are
        dropped, as agent/http/logprobs.completion_logprobs cuts a whole answer)."""
        self.text_chars += emitted
        if stopped:
            limit, offset = self.text_chars, 0
            for k, piece in enumerate(self.pieces):
                if offset + len(piece) > limit:
                    self.pieces[k:] = [piece[: max(0, limit - offset)]]
                    break
                offset += len(piece)
        end = self.sent
        while end < len(self.pieces) and (self.finish_reason is not None
                                          or self.sent_chars + len(self.pieces[end]) <= self.text_chars):
            self.sent_chars += len(self.pieces[end])
            end += 1
        part = slice(self.sent, end)
        self.sent = end
        return self.token_ids[part], self.logprobs[part] or None, self.pieces[part]


Comeback = Callable[[int], Awaitable[int]]  # (choices waiting) -> the context it came back with


class Generation:
    """Drives the choices of one request through the worker; always abort with ``close()``.

    ``comeback``: when given, a choice whose model is preempted for another's room
    (:class:`~agent.worker.client.Preempted`) is not a failure: the generation awaits
    ``comeback(choices)`` (the manager's :meth:`~agent.manager.manager.ModelManager.wait_back`:
    the model ready again, with its context length) and sends it again with the output it had,
    which the engine computes again and goes on from (seeded sampling, penalties and grammar
    included); the stream pauses. A choice whose prompt and output no longer leave room for a
    token in that context (a comeback given a smaller one, room short) ends there, as ``length``,
    as it would have at its context's end.
    A choice is preempted once at most (resumed, it is not resumable again: a model serving it
    is drained for room, so no request waits through one comeback after another), and one with
    prompt logprobs never (they come with its first prefill only)."""

    def __init__(self, worker: WorkerClient, metrics: Metrics, model: str, base_id: str,
                 tokenizer: Any, stops: list[str], make_detok: Any, make_matcher: Any,
                 comeback: Comeback | None = None) -> None:
        self.worker = worker
        self.metrics = metrics
        self.model = model
        self.base_id = base_id
        self.tokenizer = tokenizer
        self.stops = stops
        self._make_detok = make_detok
        self._make_matcher = make_matcher
        self.choices: dict[str, Choice] = {}
        # Each choice by its request id in the engine now: a resumed choice has a new one (the
        # abort of its old one may still be on its way back, and must not end the new)
        self._live: dict[str, Choice] = {}
        self._requests: list[EngineRequest] = []
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        # Each delta as it is made (on the loop, inside put_nowait); None: only collected.
        self.on_delta: Callable[[Delta], None] | None = None
        self.failure: WorkerError | None = None  # how the request failed (it then takes nothing more)
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._comeback = comeback
        self._grammar = ""
        self._preempted: list[Choice] = []  # waiting for their model to come back
        self._resuming: asyncio.Task[None] | None = None
        # Labelled children looked up once: observing them happens once per streamed step.
        self._ttft = metrics.ttft.labels(model=model)
        self._itl = metrics.itl.labels(model=model)

    def start(self, prompt_token_ids: list[int], samplings: list[SamplingParams], grammar: str = "") -> None:
        """Send one engine request per choice (each constrained by ``grammar`` when not empty).
        Raises WorkerError (the caller answers 503/400).

        ``base_id`` must be unique to this request (the handler makes it; a client's
        X-Request-Id is not): the engine knows requests by these ids alone. A choice is recorded
        only once its request was sent, so ``close()`` aborts only what this request started."""
        self.start_batch([prompt_token_ids], samplings, grammar)

    def start_batch(self, prompts: list[list[int]], samplings: list[SamplingParams], grammar: str = "",
                    echo: bool = False, echo_only: bool = False) -> None:
        """:meth:`start` for several prompts, each with the choices of ``samplings``: choice
        ``j`` of prompt ``i`` has index ``i * len(samplings) + j``, as OpenAI orders them.
        ``echo``: each choice shows its prompt first (``echo_only``: and nothing else)."""
        self._grammar = grammar
        for p, prompt_token_ids in enumerate(prompts):
            shown = Echo.of(self.tokenizer, prompt_token_ids, self._make_detok, echo_only) if echo else None
            for j, sampling in enumerate(samplings):
                i = p * len(samplings) + j
                req_id = f"{self.base_id}-{i}"
                matcher = self._make_matcher(self.stops) if self.stops else None
                # The prompt's tail gives non-byte-level detokenizers their leading-space context.
                detok = self._make_detok(self.tokenizer, context_ids=prompt_token_ids[-8:])
                resumable = self._comeback is not None and sampling.prompt_logprobs is None
                self._requests.append(self.worker.add(req_id, self.model, prompt_token_ids, sampling, queue=self,
                                                      grammar=grammar, resumable=resumable))
                self.choices[req_id] = self._live[req_id] = Choice(
                    i, req_id, detok, matcher, prompt=p, echo=shown, min_tokens=sampling.min_tokens,
                    prompt_ids=prompt_token_ids, sampling=sampling)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    @property
    def over(self) -> bool:
        """Every choice finished, or the request failed: nothing more will come."""
        return self.failure is not None or self.done

    def put_nowait(self, item: P.TokenOutput | Exception) -> None:
        """One engine output of a choice, or the exception that ends the request (the worker
        client's sink). Never raises: a failure is kept in ``failure`` and wakes the handler."""
        if self._closed or self.failure is not None:
            return
        try:
            if isinstance(item, Preempted):
                self._preempt(item.req_id)
                return
            if isinstance(item, Exception):
                raise item if isinstance(item, WorkerError) else WorkerError(str(item))
            choice = self._live.get(item.req_id)
            if choice is None or choice.finish_reason is not None:
                return
            made = len(choice.token_ids)
            delta = choice.push(item)
            if delta.finish_reason == "stop" and item.finish_reason is None:
                self.worker.abort(choice.req_id)  # a stop string ended it: free the engine now
            self._observe(len(choice.token_ids) - made)
            if self.on_delta is not None:
                self.on_delta(delta)
        except WorkerError as e:
            self.failure = e
        except Exception as e:  # a bug in making or writing the delta: fail this request, not the reader
            self.failure = WorkerError(f"{type(e).__name__}: {e}")
        if self.over:
            self.notify()

    def _preempt(self, req_id: str) -> None:
        """A choice's model was preempted: it waits for the model's comeback (one task for the
        choices preempted together), then resumes."""
        choice = self._live.pop(req_id, None)
        if choice is None or choice.finish_reason is not None or self._comeback is None:
            return
        choice.preemptions += 1
        self._preempted.append(choice)
        if self._resuming is None:
            self._resuming = asyncio.get_running_loop().create_task(self._resume(), name=f"resume-{self.base_id}")

    async def _resume(self) -> None:
        """Wait for the model (one wait for the choices preempted together), then send each
        choice again with its output so far; a model that does not come back fails the request
        (``model_not_ready``: 503 before its first byte, an error event in a stream)."""
        assert self._comeback is not None
        try:
            while self._preempted and not self._closed:
                waiting = len(self._preempted)
                context = await self._comeback(waiting)
                if self._closed:
                    return
                now, self._preempted = self._preempted[:waiting], self._preempted[waiting:]
                for c in now:
                    assert c.sampling is not None
                    c.req_id = f"{self.base_id}-{c.index}.r{c.preemptions}"
                    if len(c.prompt_ids) + len(c.token_ids) >= context:
                        self._live[c.req_id] = c
                        prompt = c.num_prompt_tokens or len(c.prompt_ids)  # 0 when nothing came before
                        self.put_nowait(P.TokenOutput(c.req_id, [], "length", None, prompt))
                        continue
                    # preempted once at most: its model is drained the next time (never starved)
                    self._requests.append(self.worker.add(
                        c.req_id, self.model, c.prompt_ids, c.sampling, queue=self, grammar=self._grammar,
                        output_token_ids=c.token_ids, resumable=False))
                    self._live[c.req_id] = c
        except WorkerError as e:
            self.failure = e
        except Exception as e:  # noqa: BLE001 - the manager's refusal (ModelNotReady ...): the request's end
            self.failure = WorkerError(f"the model {self.model!r} did not come back after it was preempted: {e}",
                                       "ModelNotLoaded")
        finally:
            self._resuming = None
            if self.failure is not None:
                self.notify()

    def notify(self) -> None:
        """Wake the handler waiting in :meth:`wait`."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Return at the next :meth:`notify`, or at once when the request is over (one caller at
        a time; a notify while nobody waits is not kept: look at what it announces first)."""
        if self.over:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def finish(self) -> None:
        """Wait until every choice has finished; raises the request's WorkerError if it failed."""
        while not self.over:
            await self.wait()
        if self.failure is not None:
            raise self.failure

    def _observe(self, n_tokens: int) -> None:
        if not n_tokens:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self._ttft.observe(now - self.started)
        elif self._last_token_at is not None:
            self._itl.observe(now - self._last_token_at)
        self._last_token_at = now

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object (a list of prompts: summed over them, each once whatever its
        ``n``); ``prompt_tokens_details.cached_tokens``: prompt tokens the engine did not compute
        (its prefix cache had them)."""
        prompts: dict[int, tuple[int, int]] = {}  # each prompt's tokens and cached tokens, counted once
        for c in self.choices.values():
            had = prompts.get(c.prompt, (0, 0))
            prompts[c.prompt] = (max(had[0], c.num_prompt_tokens), max(had[1], c.num_cached_tokens))
        prompt = sum(t for t, _ in prompts.values())
        cached = sum(k for _, k in prompts.values())
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def close(self) -> None:
        """Abort whatever is still running in the engine and record token counts."""
        self._closed, self.on_delta = True, None
        if self._resuming is not None:
            self._resuming.cancel()
        for c in self.choices.values():
            if c.finish_reason is None:
                self.worker.abort(c.req_id)
        u = self.usage()
        self.metrics.prompt_tokens.labels(model=self.model).inc(u["prompt_tokens"])
        self.metrics.generation_tokens.labels(model=self.model).inc(u["completion_tokens"])
        self.metrics.e2e.labels(model=self.model).observe(time.monotonic() - self.started)
