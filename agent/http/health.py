"""Probes: ``/livez``, ``/readyz``, ``/readyz/{model}``, and the canary that keeps readiness honest.

Live: the agent itself answers (its event loop runs); never the worker's state or a model's, so
a liveness probe does not restart the agent while it recovers a worker. Ready (the node may take
traffic): the worker's heartbeat is fresh, the engine is making progress, and every *pinned*
model (one loaded at start or since: a pin alone loads nothing) is ready *and has decoded a
token recently*. Preload means "load at start": a preload model counts until it has been ready
once, and not after (the policy may evict it for an autoloaded one). ``/readyz/{model}`` answers the same for one model. Traffic refreshes the
decode on its own; when a model is idle the :class:`Canary` sends it a one-token greedy request
every ``CANARY_INTERVAL_S`` so an engine that can no longer decode, or decodes non-finite
logits, shows up as not ready within a minute rather than on the next user request.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from aiohttp import web

from agent.context import AgentContext
from agent.log import get_logger
from agent.manager.entries import ModelEntry, State
from agent.worker.client import WorkerError
from engine.sampling import SamplingParams

CANARY_INTERVAL_S = 10.0
DECODE_FRESH_S = 45.0
CANARY_TIMEOUT_S = 30.0


class Health:
    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/livez", self.livez), web.get("/readyz", self.readyz), web.get("/readyz/{model}", self.readyz_model)]

    def model_ready(self, e: ModelEntry, now: float | None = None) -> tuple[bool, str]:
        now = time.monotonic() if now is None else now
        if e.state is not State.READY:
            return False, f"{e.name}: {e.state.value}" + (f" ({e.reason})" if e.reason else "")
        last = self.ctx.worker.last_decode.get(e.name)
        if last is None or now - last > DECODE_FRESH_S:
            return False, f"{e.name}: no decode in the last {DECODE_FRESH_S:.0f}s"
        return True, f"{e.name}: ready"

    @staticmethod
    def required(e: ModelEntry) -> bool:
        """A model the node's readiness waits for: a preload model until it has been ready once
        (start-up), and a pinned one that was loaded (at start, or since: its pin keeps it)."""
        started = e.been_ready or e.settings.preload
        return (e.settings.preload and not e.been_ready) or (e.pin and started)

    def ready(self) -> tuple[bool, list[str]]:
        ctx = self.ctx
        now = time.monotonic()
        if ctx.draining:
            return False, ["shutting down"]
        if not ctx.worker.heartbeat_fresh(now):
            return False, ["engine worker down or not responding"]
        if not ctx.worker.progressing(now):
            return False, ["engine worker stalled"]
        reasons, ok = [], True
        for e in sorted(ctx.manager.models.values(), key=lambda e: e.name):
            if self.required(e):
                good, why = self.model_ready(e, now)
                ok &= good
                reasons.append(why)
        return ok, reasons or ["worker up"]

    async def livez(self, request: web.Request) -> web.Response:
        """200 whenever the agent answers: the worker's restarts and the models' states are
        readiness, not liveness (the worker's state is reported, never failed on)."""
        return web.json_response({"status": "ok", "worker_alive": self.ctx.worker.alive,
                                  "worker_pid": self.ctx.worker.pid})

    async def readyz(self, request: web.Request) -> web.Response:
        ok, reasons = self.ready()
        self.ctx.metrics.ready.set(1 if ok else 0)
        return web.json_response({"ready": ok, "checks": reasons}, status=200 if ok else 503)

    async def readyz_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        e = self.ctx.manager.models.get(name)
        if e is None:
            return web.json_response({"ready": False, "checks": [f"{name}: unknown model"]}, status=404)
        if not self.ctx.worker.heartbeat_fresh():
            return web.json_response({"ready": False, "checks": ["engine worker down"]}, status=503)
        ok, why = self.model_ready(e)
        return web.json_response({"ready": ok, "checks": [why]}, status=200 if ok else 503)


class Canary:
    """Background task: a one-token decode for every ready model that has been idle a while."""

    def __init__(self, ctx: AgentContext, interval_s: float = CANARY_INTERVAL_S) -> None:
        self.ctx = ctx
        self.interval_s = interval_s
        self._log = get_logger("canary")
        self._n = 0

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            for e in self.ctx.manager.ready_models():
                last = self.ctx.worker.last_decode.get(e.name)
                if (last is None or now - last >= self.interval_s) and self.ctx.worker.alive:
                    await self.probe(e)
            await asyncio.sleep(min(1.0, self.interval_s / 4))

    async def probe(self, e: ModelEntry) -> bool:
        """One greedy token from the BOS (or token 0); True when a token came back."""
        self._n += 1
        req_id = f"canary-{e.name}-{self._n}"
        tok = e.tokenizer
        first = getattr(tok, "bos_token_id", None)
        prompt = [first if isinstance(first, int) else 0]
        # logprobs 0: the chosen token's logprob, which is NaN when the logits are not finite.
        sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0)
        try:
            req = self.ctx.worker.add(req_id, e.name, prompt, sampling)
        except WorkerError as ex:
            self._log.warning("canary_not_sent", model=e.name, error=str(ex))
            return False
        try:
            while True:
                out = await asyncio.wait_for(req.queue.get(), CANARY_TIMEOUT_S)
                if isinstance(out, Exception):
                    self._log.warning("canary_failed", model=e.name, error=str(out))
                    return False
                bad = [lp.get("logprob") for lp in out.logprobs or () if isinstance(lp, dict)
                       and not (isinstance(lp.get("logprob"), (int, float)) and math.isfinite(lp["logprob"]))]
                if bad:
                    self._log.error("canary_non_finite", model=e.name, logprob=str(bad[0]))
                    self.ctx.worker.abort(req_id)
                    self.ctx.worker.last_decode.pop(e.name, None)  # that token proves nothing: not ready
                    return False
                if out.finish_reason is not None:
                    return bool(out.new_token_ids) or e.name in self.ctx.worker.last_decode
        except asyncio.TimeoutError:
            self._log.error("canary_timeout", model=e.name, timeout_s=CANARY_TIMEOUT_S)
            self.ctx.worker.abort(req_id)
            return False
