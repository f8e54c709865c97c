"""Probes: ``/livez``, ``/readyz``, ``/readyz/{model}``, and the canary that keeps readiness honest.

Ready means more than "process up": the worker's heartbeat is fresh, the engine is making
progress, and each preload model (or the named model) is ready *and has decoded a token
recently*. Traffic refreshes that on its own; when a model is idle the :class:`Canary` sends it
a one-token greedy request every ``CANARY_INTERVAL_S`` so an engine that can no longer decode
shows up as not ready within a minute rather than on the next user request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from agent.context import AgentContext
from agent.log import get_logger
from agent.manager.entries import ModelEntry, State
from agent.worker.client import WorkerError

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
        for m in ctx.settings.models:
            if m.preload:
                good, why = self.model_ready(ctx.manager.models[m.name], now)
                ok &= good
                reasons.append(why)
        return ok, reasons or ["worker up"]

    async def livez(self, request: web.Request) -> web.Response:
        alive = self.ctx.worker.alive
        return web.json_response({"status": "ok" if alive else "worker down", "worker_pid": self.ctx.worker.pid},
                                 status=200 if alive else 503)

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
        sampling: dict[str, Any] = {"temperature": 0.0, "max_tokens": 1, "ignore_eos": True}
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
                if out.finish_reason is not None:
                    return bool(out.new_token_ids) or e.name in self.ctx.worker.last_decode
        except asyncio.TimeoutError:
            self._log.error("canary_timeout", model=e.name, timeout_s=CANARY_TIMEOUT_S)
            self.ctx.worker.abort(req_id)
            return False
