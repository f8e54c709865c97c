"""The agent's aiohttp application and its lifecycle.

Start-up and tear-down are aiohttp cleanup contexts, declared once in :data:`LIFECYCLE` and torn
down in reverse: runtime dir → engine worker → model manager (+ preload) → background tasks
(canary, sd_notify/watchdog) → the heap frozen. :func:`serve` is the one shutdown path: on
SIGTERM it tells systemd STOPPING=1, refuses new work (503), lets in-flight requests finish up to
``server.drain_timeout``, fails the rest with a "shutting down" error that their clients see
(and aborts them in the engine), stops listening, then stops the worker.

Every answer under ``/v1`` is in OpenAI's error shape, the server's own ones too (no route, wrong
method: :func:`v1_errors`). A request aiohttp cannot parse is the client's fault: it is one info
line with the reason, rate-limited (:class:`ProtocolLog`), not an error with a traceback that any
client could flood the log with.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from agent.http.admin_api import AdminApi
from agent.config import Settings
from agent.admin_client import agent_listening
from agent.context import AgentContext
from agent.gateway_metrics import Admitted, gateway_view
from agent.http.health import Canary, Health
from agent.log import get_logger
from agent.manager.manager import ModelManager
from agent.metrics import CONTENT_TYPE, Metrics
from agent.http.api_error import ApiError
from agent.http.connections import ADMIN_CONNECTIONS, ConnectionGuard, fd_limit, max_connections
from agent.http.openai_api import OpenAIApi
from agent.http.openapi import routes as openapi_routes
from agent.systemd import Notifier
from agent.worker.client import WorkerClient
from agent.worker.options import worker_env, worker_options
from engine.core import heap

CTX: web.AppKey[AgentContext] = web.AppKey("ctx")
BACKGROUND: web.AppKey[Background] = web.AppKey("background")
GUARD: web.AppKey[ConnectionGuard] = web.AppKey("connections")
TICK_S = 1.0
SHUTDOWN_GRACE_S = 5.0  # after our own drain: time for handlers to write their last bytes
MALFORMED_LOG_INTERVAL_S = 1.0  # at most one malformed-request line per interval; the rest counted


class ProtocolLog:
    """The HTTP server's own logger (aiohttp's ``logger=``). A request that does not parse
    (aiohttp's ``HttpProcessingError``: bad headers, lengths, encodings) is logged as one info
    line with its reason, at most one per ``interval_s`` (the next line says how many were
    skipped); everything else goes to aiohttp's logger unchanged, tracebacks included."""

    def __init__(self, interval_s: float = MALFORMED_LOG_INTERVAL_S) -> None:
        self._log = get_logger("http")
        self._std = logging.getLogger("aiohttp.server")
        self._interval_s = interval_s
        self._next = 0.0
        self._skipped = 0

    def exception(self, msg: str, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if not isinstance(exc, HttpProcessingError):
            self._std.exception(msg, *args, exc_info=exc_info, **kw)
            return
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        self._next = now + self._interval_s
        reason = (exc.message or type(exc).__name__).strip().splitlines()[0][:200]
        remote = args[0] if args else None
        self._log.info("malformed_request", status=exc.code, reason=reason, remote=remote, skipped=self._skipped)
        self._skipped = 0

    def __getattr__(self, name: str) -> Any:  # debug, warning, ...: aiohttp's logger as it is
        return getattr(self._std, name)


@web.middleware
async def v1_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Under /v1, the server's own refusals (no such route, wrong method, ...) in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if not (request.path == "/v1" or request.path.startswith("/v1/")) or e.status < 400:
            raise
        if isinstance(e, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(e.allowed_methods))
            err = ApiError(405, f"{request.method} is not allowed on {request.path[:200]}; Allow: {allowed}",
                           code="method_not_allowed")
        elif e.status == 404:
            err = ApiError(404, f"no such endpoint: {request.method} {request.path[:200]}", code="not_found")
        else:
            err = ApiError(e.status, e.reason, code=None)
        resp = err.response()
        if isinstance(e, web.HTTPMethodNotAllowed):
            resp.headers["Allow"] = e.headers.get("Allow", "")
        return resp


@dataclass
class Background:
    """What the app runs beside the handlers: the canary and the background tasks."""

    canary: Canary  # one instance: its request ids never collide with each other
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


# --- lifecycle contexts, in start order ------------------------------------------------------


async def _runtime_ctx(app: web.Application) -> AsyncIterator[None]:
    ctx = app[CTX]
    ctx.settings.server.runtime_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    yield
    ctx.notifier.close()


async def _worker_ctx(app: web.Application) -> AsyncIterator[None]:
    ctx = app[CTX]
    await ctx.worker.start(wait=False)  # (if not started already) HTTP comes up at once; /readyz 503 until ready
    yield
    await ctx.worker.stop()


async def _manager_ctx(app: web.Application) -> AsyncIterator[None]:
    ctx, bg = app[CTX], app[BACKGROUND]
    source = None
    if ctx.engine != "none":
        from agent.manager.model_source import CacheSource

        source = CacheSource.from_settings(ctx.settings)
    ctx.manager = ModelManager(ctx.settings, ctx.worker, source, ctx.metrics, _load_tokenizer,
                               verify=bg.canary.probe)
    ctx.worker.on_up = ctx.manager.on_worker_up
    ctx.worker.on_down = ctx.manager.on_worker_down
    if source is not None:
        source.cache.on_shared_repair = ctx.manager.on_shared_repair  # a blob other snapshots linked too
    bg.tasks.append(asyncio.create_task(ctx.manager.preload(), name="preload"))
    ctx.manager.start()  # keep_alive: idle models unload after their time
    yield
    await ctx.manager.close()
    if source is not None:
        await source.close_builds()
        source.close()


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    ctx, bg = app[CTX], app[BACKGROUND]
    bg.tasks.append(asyncio.create_task(bg.canary.run(), name="canary"))
    bg.tasks.append(asyncio.create_task(_notify_loop(ctx), name="sd-notify"))
    yield
    for t in bg.tasks:
        t.cancel()
    await asyncio.gather(*bg.tasks, return_exceptions=True)
    bg.tasks.clear()


async def _grammar_ctx(app: web.Application) -> AsyncIterator[None]:
    """The grammar checks' child processes (agent/http/structured.py) end with the agent."""
    yield
    await app[CTX].grammars.aclose()


async def _frozen_heap_ctx(app: web.Application) -> AsyncIterator[None]:
    """What start-up made (modules, settings, the app) lives for good: out of the cycle
    collector's walks (engine/core/heap.py)."""
    heap.freeze()
    yield
    heap.thaw()


LIFECYCLE: tuple[Callable[[web.Application], AsyncIterator[None]], ...] = (
    _runtime_ctx, _grammar_ctx, _worker_ctx, _manager_ctx, _background_ctx, _frozen_heap_ctx,
)


def _load_tokenizer(model_dir: Path) -> Any:
    from text.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


async def _notify_loop(ctx: AgentContext) -> None:
    """READY=1 once preload models are ready (or have failed: READY with a degraded STATUS, so
    systemd does not restart-loop on a bad model), EXTEND_TIMEOUT_USEC while pulling or loading
    before that, STATUS= on changes, WATCHDOG=1 only while the engine makes progress."""
    n, log = ctx.notifier, get_logger("notify")
    ready_sent, last_status, last_ping = False, "", 0.0
    while True:
        mgr = ctx.manager
        if mgr is not None:
            ctx.metrics.worker_up.set(1 if ctx.worker.alive else 0)
            ctx.metrics.refresh_engine(ctx.worker.state.models, ctx.worker.state.stale_models)
            status = _status_line(ctx)
            preload = [mgr.models[m.name] for m in ctx.settings.models if m.preload]
            settled = ctx.worker.alive and all(e.state.value in ("ready", "failed") for e in preload)
            if not ready_sent and settled:
                n.ready(status)
                ready_sent, last_status = True, status
                log.info("sd_ready", status=status)
                record = ctx.startup_record(freeze=True)
                get_logger("startup").info("startup", ready_s=record["ready_s"], phases=record["phases"])
            elif not ready_sent and (mgr.busy() or not ctx.worker.alive):
                n.extend_timeout(TICK_S * 30)
            if status != last_status:
                n.status(status)
                last_status = status
            now = time.monotonic()
            if n.watchdog_interval_s and now - last_ping >= n.watchdog_interval_s and ctx.worker.progressing(now):
                n.watchdog()
                last_ping = now
        await asyncio.sleep(min(TICK_S, n.watchdog_interval_s or TICK_S))


def _status_line(ctx: AgentContext) -> str:
    if not ctx.worker.alive:
        return "engine worker starting" if not ctx.worker.state.restarts else "engine worker restarting"
    parts = []
    for e in sorted(ctx.manager.models.values(), key=lambda e: e.name):
        if e.state.value not in ("absent", "cached"):
            parts.append(f"{e.name} {e.state.value}")
    return "serving: " + (", ".join(parts) if parts else "no models loaded")


def build_app(settings: Settings, *, engine: str = "core", notifier: Notifier | None = None,
              worker: WorkerClient | None = None) -> web.Application:
    """The app; ``worker``: a client already started for ``settings`` (the serve command starts it
    before importing this module, so the worker's torch import overlaps the agent's), else a new one
    that the lifecycle starts."""
    metrics = Metrics()
    worker = worker or WorkerClient(worker_options(settings), engine=engine, env=worker_env(settings),
                                     hang_timeout_s=settings.server.worker_hang_timeout)
    worker.on_restart = metrics.worker_restarts.inc
    ctx = AgentContext(settings=settings, metrics=metrics, notifier=notifier or Notifier(), engine=engine,
                       worker=worker)
    health = Health(ctx)
    admin = AdminApi(ctx, health)
    guard = ConnectionGuard(settings.server.header_timeout)
    app = web.Application(client_max_size=settings.server.max_body_bytes,
                          middlewares=[guard.middleware, admin.middleware, v1_errors])
    app[CTX] = ctx
    app[GUARD] = guard
    app[BACKGROUND] = Background(canary=Canary(ctx))
    app.add_routes(OpenAIApi(ctx).routes())
    app.add_routes(admin.routes())
    app.add_routes(health.routes())
    app.add_routes(openapi_routes())

    async def metrics_handler(request: web.Request) -> web.Response:
        metrics.worker_up.set(1 if ctx.worker.alive else 0)
        metrics.refresh_engine(ctx.worker.state.models, ctx.worker.state.stale_models)
        metrics.refresh_warm_tier(ctx.worker.state.warm_tier)
        metrics.ready.set(1 if health.ready()[0] else 0)
        if ctx.manager is not None:
            admitted = {e.name: Admitted(e.in_flight, e.load_waiters, e.info.block_size if e.info is not None else None)
                        for e in ctx.manager.models.values()}
            metrics.gateway.update(gateway_view(ctx.worker.state.models, ctx.worker.state.memory, admitted))
        metrics.refresh_budget(ctx.budget())
        if ctx.manager is not None and ctx.manager.source is not None:
            c = ctx.manager.source.stats()
            metrics.cache_used.set(c["used_bytes"])
            metrics.cache_max.set(c["max_bytes"])
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/metrics", metrics_handler)

    async def on_shutdown(app: web.Application) -> None:
        ctx.draining = True  # before in-flight handlers are awaited: new requests get 503

    app.on_shutdown.append(on_shutdown)
    app.cleanup_ctx.extend(LIFECYCLE)
    return app


def _bind_admin_socket(path: Path) -> None:
    """Refuse to start over a live agent's socket; remove a stale one."""
    if agent_listening(path):
        raise RuntimeError(f"another agent is listening on {path}")
    path.unlink(missing_ok=True)


def _unlink_own_socket(path: Path, own: os.stat_result | None) -> None:
    """Remove the admin socket this agent bound, so no stale socket outlives it; never one that
    another agent bound (a refused start, or a path taken over since)."""
    try:
        st = path.stat()
    except OSError:
        return
    if own is not None and (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
        path.unlink(missing_ok=True)


async def _drain(ctx: AgentContext, timeout: float) -> None:
    """Let admitted requests finish until ``timeout``; then fail the rest with a clear error
    (their handlers still write it to the client) and abort them in the engine."""
    log = get_logger("serve")
    in_flight = lambda: sum(e.in_flight for e in ctx.manager.models.values()) if ctx.manager else 0  # noqa: E731
    log.info("draining", in_flight=in_flight(), deadline_s=timeout)
    if ctx.manager is not None:
        ctx.manager.end_comebacks()
    deadline = time.monotonic() + timeout
    while in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if in_flight():
        n = ctx.worker.abort_all("the server is shutting down; the request was aborted", "shutting_down")
        log.warning("drain_deadline_passed", aborted=n)


async def serve(settings: Settings, *, engine: str = "core", stop: asyncio.Event | None = None,
                worker: WorkerClient | None = None) -> None:
    """Run until SIGTERM/SIGINT (or ``stop``), then drain and shut down (``worker``: see :func:`build_app`)."""
    log = get_logger("serve")
    s = settings.server
    app = build_app(settings, engine=engine, worker=worker)
    ctx = app[CTX]
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
        keepalive_timeout=s.keepalive_timeout, max_line_size=s.max_header_bytes,
        max_field_size=s.max_header_bytes, max_headers=s.max_headers,
        # Bodies are decoded by the handlers (request_body.BodyReader): a coding they do not take is
        # a 415 in OpenAI's shape there, not a plain-text 400 from the parser.
        auto_decompress=False, logger=ProtocolLog(),
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()
    assert runner.server is not None
    guard = app[GUARD]
    nofile = fd_limit()
    cap = max_connections(s.max_connections, nofile)
    if s.max_connections is not None and cap < s.max_connections:
        log.warning("max_connections_lowered", setting=s.max_connections, max_connections=cap, nofile=nofile)
    sock_path = s.admin_socket_path()
    own_socket: os.stat_result | None = None  # the socket this agent bound, removed at exit
    servers: list[asyncio.AbstractServer] = []  # listening sockets, closed before the runner's cleanup
    try:
        # Our own listeners (not TCPSite/UnixSite): each connection goes through the guard's cap and
        # header deadline (agent/http/connections.py); aiohttp's server handles what passes.
        tcp = await loop.create_server(guard.factory("tcp", runner.server, cap), s.host, s.port, backlog=1024)
        servers.append(tcp)
        sock_path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        _bind_admin_socket(sock_path)
        servers.append(await loop.create_unix_server(guard.factory("admin", runner.server, ADMIN_CONNECTIONS),
                                                     str(sock_path)))
        own_socket = sock_path.stat()
        os.chmod(sock_path, 0o660)
        port = tcp.sockets[0].getsockname()[1] if tcp.sockets else s.port
        ctx.startup.mark("http_listening")
        log.info("listening", host=s.host, port=port, admin_socket=str(sock_path), pid=os.getpid(),
                 max_connections=cap, nofile=nofile)
        await stop.wait()
        ctx.draining = True
        ctx.notifier.stopping()
        ctx.notifier.extend_timeout(s.drain_timeout + 15)  # drain, then stop the worker
        await _drain(ctx, s.drain_timeout)
    finally:
        for server in servers:
            server.close()
        await runner.cleanup()
        _unlink_own_socket(sock_path, own_socket)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("stopped")
