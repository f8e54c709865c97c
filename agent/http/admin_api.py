"""The admin API (``/admin/v1``): list, inspect, load, unload and pull models; agent status.

Served on the TCP listener behind a bearer token (``server.admin_token``, compared in constant
time; with no token configured, admin over TCP is refused) and on the admin unix socket without
one: the socket's file mode (0660) is the access control there. Load, unload and pull run in the
background: the answer is 202 with the model's state to poll, or, with ``?wait=true``, the final
state once the operation has finished. Asking again for what is under way joins it (a load
during a load or an autoload, an unload during a drain); a load during an unload, a pull or a
verify runs once that ends. A 409 is left for what contradicts the operation under way (an
unload during a load, a load with other options). The JSON shapes are agent/http/admin_view.py's.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import socket
from typing import Any

from aiohttp import web

from agent.config import MODEL_NAME_RE
from agent.context import AgentContext
from agent.http.admin_view import model_view, models_view, status_view
from agent.http.health import Health
from agent.manager.entries import ManagerError, State

MAX_WAIT_S = 3600.0


def _error(status: int, message: str, code: str, retry_after: float | None = None) -> web.Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status, headers=headers)


def is_unix_peer(request: web.Request) -> bool:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and getattr(sock, "family", None) == socket.AF_UNIX


def admin_authorized(request: web.Request, token: str) -> bool:
    if is_unix_peer(request):
        return True
    if not token:
        return False
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    # Header bytes that are not UTF-8 arrive as surrogate escapes: encode them back to bytes.
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


class AdminApi:
    def __init__(self, ctx: AgentContext, health: Health) -> None:
        self.ctx = ctx
        self.health = health
        self._token = ctx.settings.server.admin_token.get_secret_value()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/admin/v1/status", self.status),
            web.get("/admin/v1/models", self.list_models),
            web.get("/admin/v1/models/{name}", self.get_model),
            web.post("/admin/v1/models/{name}/load", self.load),
            web.post("/admin/v1/models/{name}/unload", self.unload),
            web.post("/admin/v1/models/{name}/pull", self.pull),
            web.post("/admin/v1/models/{name}/pin", self.pin),
            web.post("/admin/v1/models/{name}/unpin", self.unpin),
            web.post("/admin/v1/models/{name}/verify", self.verify),
            web.post("/admin/v1/models/{name}/drop-prefix-cache", self.drop_prefix_cache),
        ]

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Under /admin: the token first (whatever the route: no route is told to a stranger), then
        the model name, then the handler; the server's own refusals (no such route, wrong method)
        in the admin API's JSON error shape."""
        if not (request.path == "/admin" or request.path.startswith("/admin/")):
            return await handler(request)
        if not admin_authorized(request, self._token):
            why = ("a valid admin token is required (Authorization: Bearer ...)" if self._token
                   else "the admin API over TCP is off (no server.admin_token); use the admin unix socket")
            return _error(401, why, "unauthorized")
        name = request.match_info.get("name")
        if name is not None and not MODEL_NAME_RE.fullmatch(name):
            # Refused before anything (an entry, a lock file, a metrics label) is made for it.
            return _error(400, f"{name!r} is not a model name (^[a-z0-9][a-z0-9._-]{{0,127}}$)", "invalid_value")
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as e:
            allowed = ", ".join(sorted(e.allowed_methods))
            resp = _error(405, f"{request.method} is not allowed on {request.path[:200]}; Allow: {allowed}",
                          "method_not_allowed")
            resp.headers["Allow"] = e.headers.get("Allow", allowed)
            return resp
        except web.HTTPNotFound:
            return _error(404, f"no such admin endpoint: {request.method} {request.path[:200]}", "not_found")

    # --- views ------------------------------------------------------------------------------

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(status_view(self.ctx, self.health.ready()[0]))

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"models": models_view(self.ctx.manager)})

    async def get_model(self, request: web.Request) -> web.Response:
        try:
            e = self.ctx.manager.get(request.match_info["name"])
        except ManagerError as ex:
            return _error(ex.status, str(ex), ex.code)
        return web.json_response({"model": model_view(self.ctx.manager, e)})

    # --- operations -------------------------------------------------------------------------

    async def _operate(self, request: web.Request, op: str, goal: set[State]) -> web.Response:
        name = request.match_info["name"]
        mgr = self.ctx.manager
        if self.ctx.draining:
            return _error(503, "the agent is shutting down", "shutting_down")
        wait = op == "verify" or _flag(request, "wait")
        try:
            timeout = _seconds(request, "timeout", MAX_WAIT_S)
            drain = _seconds(request, "drain_timeout", None) if op == "unload" else None
            quantization = _fp8_choice(request, "quantization") if op == "load" else ...
            kv_cache_dtype = _fp8_choice(request, "kv_cache_dtype") if op == "load" else ...
        except ValueError as ex:
            return _error(400, str(ex), "invalid_value")
        try:
            if op == "unload":
                task = mgr.unload(name, drain_s=drain)
            elif op == "pull":
                task = mgr.pull(name, verify=_flag(request, "verify"))
            elif op == "verify":
                task = mgr.verify_files(name)
            elif op == "load":
                task = mgr.load(name, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
            else:
                task = getattr(mgr, op)(name)
        except ManagerError as ex:
            return _error(ex.status, str(ex), ex.code, ex.retry_after)
        e = mgr.models.get(name)
        if task is not None and wait:  # neither cancels it nor raises when it was (a queued load an unload called off)
            stopping = asyncio.ensure_future(self.ctx.stopping.wait())
            try:
                await asyncio.wait([task, stopping], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
            if self.ctx.draining and not task.done():
                # Answered now, while the server still writes answers: its shutdown calls the
                # operation off (a client waiting on a hung pull got its connection cut).
                return _error(503, f"the agent is shutting down; the {op} of {name!r} did not finish",
                              "shutting_down")
        if e is None or mgr.models.get(name) is not e:
            # Not in the store (nor configured or cached): forgotten, nothing left of it.
            why = (e.reason if e is not None else "") or f"the model {name!r} does not exist"
            return _error(404, why, "model_not_found")
        body: dict[str, Any] = {"model": model_view(mgr, e)}
        if op == "verify" and (e.state is not State.FAILED or (e.last_verify or {}).get("ok")):
            # 200: nothing wrong, or repaired; 409: wrong, but loaded (repaired by its next load).
            v = e.last_verify or {}
            return web.json_response({**body, "verify": v}, status=200 if v.get("ok") or v.get("repaired") else 409)
        if e.state is State.FAILED and e.refusal and (wait or task is None):
            # Refused for room: the client's budget problem, with the engine's numbers.
            return web.json_response({**body, "error": {"message": e.reason, "type": "invalid_request_error",
                                                        "param": None, "code": "no_room", "details": e.refusal}},
                                     status=507)
        if e.state is State.FAILED and (wait or task is None):
            # A typed failure (broken files, a busy cache lock) answers its own status; the rest is ours.
            status, code = (e.failure.status, e.failure.code) if e.failure is not None else (500, f"{op}_failed")
            retry = e.failure.retry_after if e.failure is not None else None
            return web.json_response({**body, "error": {"message": e.reason,
                                                        "type": "server_error" if status >= 500 else "invalid_request_error",
                                                        "param": None, "code": code}}, status=status,
                                     headers={"Retry-After": str(max(1, round(retry)))} if retry else None)
        done = e.state in goal
        return web.json_response(body, status=200 if done else 202)

    async def load(self, request: web.Request) -> web.Response:
        return await self._operate(request, "load", {State.READY})

    async def unload(self, request: web.Request) -> web.Response:
        return await self._operate(request, "unload", {State.CACHED, State.ABSENT})

    async def _pin(self, request: web.Request, pinned: bool) -> web.Response:
        try:
            e = self.ctx.manager.set_pin(request.match_info["name"], pinned)
        except ManagerError as ex:
            return _error(ex.status, str(ex), ex.code)
        return web.json_response({"model": model_view(self.ctx.manager, e)})

    async def pin(self, request: web.Request) -> web.Response:
        """Never evict this model for another's load, never unload it when idle."""
        return await self._pin(request, True)

    async def unpin(self, request: web.Request) -> web.Response:
        return await self._pin(request, False)

    async def drop_prefix_cache(self, request: web.Request) -> web.Response:
        """Forget a ready model's prefix cache: its free cached pages become plain free pages."""
        try:
            entries = await self.ctx.manager.drop_prefix_cache(request.match_info["name"])
        except ManagerError as ex:
            return _error(ex.status, str(ex), ex.code)
        return web.json_response({"model": request.match_info["name"], "entries_dropped": entries})

    async def pull(self, request: web.Request) -> web.Response:
        """``?verify=true`` reads every sha256 of a cached model (sizes are always checked)."""
        return await self._operate(request, "pull", {State.CACHED, State.LOADING, State.READY, State.DRAINING,
                                                     State.UNLOADING})

    async def verify(self, request: web.Request) -> web.Response:
        """Check every sha256 of a cached model and repair it (unless loaded); always waits."""
        return await self._operate(request, "verify", {State.CACHED, State.READY, State.ABSENT})


def _flag(request: web.Request, key: str) -> bool:
    return request.query.get(key, "").lower() in ("1", "true", "yes")


FP8_CHOICES = {"fp8": "fp8", "none": None}


def _fp8_choice(request: web.Request, key: str):
    """``?quantization=`` / ``?kv_cache_dtype=`` of a load: fp8 or none (``...``: absent, the
    model's settings decide)."""
    if key not in request.query:
        return ...
    v = request.query[key].lower()
    if v not in FP8_CHOICES:
        raise ValueError(f"{key} must be one of {', '.join(FP8_CHOICES)}, not {request.query[key][:32]!r}")
    return FP8_CHOICES[v]


def _seconds(request: web.Request, key: str, default: float | None) -> float | None:
    """A query parameter in seconds, finite and in [0, MAX_WAIT_S]; ValueError naming it."""
    if key not in request.query:
        return default
    try:
        v = float(request.query[key])
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and 0 <= v <= MAX_WAIT_S):
        raise ValueError(f"{key} must be seconds in [0, {MAX_WAIT_S:g}], not {request.query[key]!r}")
    return v
