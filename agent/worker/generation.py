"""One HTTP request's engine requests ("choices"): send, detokenize, match stop strings, abort.

A request with ``n`` choices becomes ``n`` engine requests sharing one output queue, so the
handler waits on a single queue whatever ``n`` is. Text stays here in the agent: the engine
sends token ids, :class:`Choice` turns them into text incrementally and holds back what could be
the start of a stop string; when a stop string completes, the choice aborts its engine request
at once and finishes with ``"stop"``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agent.metrics import Metrics
from agent.worker.client import EngineRequest, WorkerClient, WorkerError
from agent.worker.mailbox import Mailbox
from engine.worker import protocol as P


@dataclass
class Delta:
    """New output of one choice since the last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None
    finish_reason: str | None
    pieces: list[str] | None = None  # with logprobs: the text each token added (one per token id)


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

    def push(self, out: P.TokenOutput) -> Delta:
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
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
        pieces = [self.detok.push([i]) for i in ids] if out.logprobs else None
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
        emit, stopped = self.matcher.push(new_text) if self.matcher is not None else (new_text, False)
        if stopped:
            finish = "stop"
        elif finish is not None and self.matcher is not None:
            emit += self.matcher.flush()  # nothing more can complete a stop string
        self.finish_reason = finish
        self.text.append(emit)
        return Delta(self.index, emit, ids, out.logprobs or None, finish, pieces)


class Generation:
    """Drives the choices of one request through the worker; always abort with ``close()``."""

    def __init__(self, worker: WorkerClient, metrics: Metrics, model: str, base_id: str,
                 tokenizer: Any, stops: list[str], make_detok: Any, make_matcher: Any) -> None:
        self.worker = worker
        self.metrics = metrics
        self.model = model
        self.base_id = base_id
        self.tokenizer = tokenizer
        self.stops = stops
        self._make_detok = make_detok
        self._make_matcher = make_matcher
        self.queue: Mailbox[P.TokenOutput | Exception] = Mailbox()
        self.choices: dict[str, Choice] = {}
        self._requests: list[EngineRequest] = []
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        # Labelled children looked up once: observing them happens once per streamed step.
        self._ttft = metrics.ttft.labels(model=model)
        self._itl = metrics.itl.labels(model=model)

    def start(self, prompt_token_ids: list[int], samplings: list[dict[str, Any]], grammar: str = "") -> None:
        """Send one engine request per choice (each constrained by ``grammar`` when not empty).
        Raises WorkerError (the caller answers 503/400).

        ``base_id`` must be unique to this request (the handler makes it; a client's
        X-Request-Id is not): the engine knows requests by these ids alone. A choice is recorded
        only once its request was sent, so ``close()`` aborts only what this request started."""
        for i, sampling in enumerate(samplings):
            req_id = f"{self.base_id}-{i}"
            matcher = self._make_matcher(self.stops) if self.stops else None
            # The prompt's tail gives non-byte-level detokenizers their leading-space context.
            detok = self._make_detok(self.tokenizer, context_ids=prompt_token_ids[-8:])
            self._requests.append(self.worker.add(req_id, self.model, prompt_token_ids, sampling, queue=self.queue,
                                                  grammar=grammar))
            self.choices[req_id] = Choice(i, req_id, detok, matcher)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Yield the deltas available now (at least one), until every choice has finished.

        Outputs that queued up while the client was slow are coalesced into one yield, so a
        slow reader costs fewer writes rather than more. Raises WorkerError when the engine
        fails the request (or the worker dies).
        """
        while not self.done:
            items = [await self.queue.get()]
            items += self.queue.take_all()
            out: list[Delta] = []
            for item in items:
                if isinstance(item, Exception):
                    raise item if isinstance(item, WorkerError) else WorkerError(str(item))
                choice = self.choices.get(item.req_id)
                if choice is None or choice.finish_reason is not None:
                    continue
                delta = choice.push(item)
                if delta.finish_reason == "stop" and item.finish_reason is None:
                    self.worker.abort(choice.req_id)  # a stop string ended it: free the engine now
                self._observe(len(delta.token_ids))
                out.append(delta)
            if out:
                yield out

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
        """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens the
        engine did not compute (its prefix cache had them)."""
        prompt = max((c.num_prompt_tokens for c in self.choices.values()), default=0)
        cached = max((c.num_cached_tokens for c in self.choices.values()), default=0)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def close(self) -> None:
        """Abort whatever is still running in the engine and record token counts."""
        for c in self.choices.values():
            if c.finish_reason is None:
                self.worker.abort(c.req_id)
        u = self.usage()
        self.metrics.prompt_tokens.labels(model=self.model).inc(u["prompt_tokens"])
        self.metrics.generation_tokens.labels(model=self.model).inc(u["completion_tokens"])
        self.metrics.e2e.labels(model=self.model).observe(time.monotonic() - self.started)
