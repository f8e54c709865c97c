"""Readiness logic and the canary, in process, against the real engine-less worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import uvloop

from agent.http import health
from agent.app import CTX, build_app
from agent.config import load_settings
from agent.manager.entries import State
from agent.manager.manager import ModelManager
from agent.systemd import Notifier


def test_readiness_needs_a_fresh_worker_and_a_recent_decode(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("INFIRE_MODELS", '[{"name": "m", "preload": true}]')
    monkeypatch.setenv("INFIRE_SERVER__RUNTIME_DIR", str(tmp_path / "run"))
    settings = load_settings()

    async def main() -> None:
        app = build_app(settings, engine="none", notifier=Notifier({}))
        ctx = app[CTX]
        ctx.manager = ModelManager(settings, ctx.worker, None, ctx.metrics, lambda p: None,
                                   verify=health.Canary(ctx).probe)
        await ctx.worker.start()
        try:
            h = health.Health(ctx)
            ok, why = h.ready()
            assert not ok and why == ["m: absent"]
            e = ctx.manager.get("m")
            e.state = State.READY  # as if loaded: readiness now hinges on a recent decode
            assert h.ready() == (False, [f"m: no decode in the last {health.DECODE_FRESH_S:.0f}s"])
            ctx.worker.last_decode["m"] = time.monotonic()
            assert h.ready() == (True, ["m: ready"])
            ctx.worker.last_decode["m"] = time.monotonic() - health.DECODE_FRESH_S - 1
            assert not h.ready()[0]
            # The canary reports an engine that cannot decode (here: there is no engine).
            assert await health.Canary(ctx).probe(e) is False
            assert "m" not in ctx.worker.last_decode or time.monotonic() - ctx.worker.last_decode["m"] > 1
            ctx.worker.last_decode["m"] = time.monotonic()
            ctx.draining = True
            assert h.ready() == (False, ["shutting down"])
            ctx.draining = False
            pid = ctx.worker.state.pid
            os.kill(pid, signal.SIGSTOP)  # the heartbeat goes stale
            try:
                deadline = time.monotonic() + 10
                while ctx.worker.heartbeat_fresh() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert h.ready() == (False, ["engine worker down or not responding"])
            finally:
                os.kill(pid, signal.SIGCONT)
        finally:
            await ctx.worker.stop(timeout=5)

    uvloop.run(main())
