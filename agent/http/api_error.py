"""A refusal or failure in OpenAI's error shape (``{"error": {message, type, param, code}}``), and
how the agent's own failures (the worker's, the manager's) become one."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from agent.manager.entries import SHUTDOWN_RETRY_S, ManagerError
from agent.worker.client import WorkerDied, WorkerError

# OpenAI's error type for each status we answer with.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 417: "invalid_request_error", 503: "server_error", 500: "server_error"}


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


# Retry-After of a 503 the agent's own recovery causes: the worker restarts in ~2 s (a drained
# model is reloaded by the next request as soon); a shutting-down agent is gone longer
# (SHUTDOWN_RETRY_S, with the manager's ShuttingDown).
WORKER_RETRY_S = 2


def stream_error(e: WorkerError, grammar_param: str = "response_format") -> ApiError:
    """A failure after the request was sent: refused by the engine (400), engine gone or
    shutting down (503), anything else (500). ``grammar_param``: the field a grammar's failure
    names (``response_format``, or ``tools`` for a forced call)."""
    if e.code in ("EngineError", "RequestError", "SamplingParamsError"):
        return ApiError(400, str(e), code="invalid_request")
    if e.code == "GrammarError":  # passed the agent's check, not this model's vocabulary or the mask budget
        return ApiError(400, str(e), param=grammar_param, code="invalid_value")
    # The same transient conditions a request meets one step earlier as a 503 with Retry-After
    # (send_error, the manager's refusals).
    if e.code == "ModelNotLoaded":  # admitted, then unloaded before it reached the engine
        return ApiError(503, str(e), param="model", code="model_not_ready", retry_after=WORKER_RETRY_S)
    if isinstance(e, WorkerDied) or e.code == "aborted":
        return ApiError(503, str(e), code=e.code, retry_after=WORKER_RETRY_S)
    if e.code == "shutting_down":
        return ApiError(503, str(e), code=e.code, retry_after=SHUTDOWN_RETRY_S)
    return ApiError(500, str(e), code=e.code)


def send_error(e: WorkerError) -> ApiError:
    """A failure to send the request: the worker is gone (503, retry soon) or refused it (400)."""
    if isinstance(e, WorkerDied):
        return ApiError(503, str(e), code="engine_unavailable", retry_after=WORKER_RETRY_S)
    return ApiError(400, str(e), code=e.code)


def manager_error(e: ManagerError) -> ApiError:
    """The manager's refusal of a model (unknown, not ready, queue full, ...), about ``model``."""
    return ApiError(e.status, str(e), param="model", code=e.code, retry_after=e.retry_after)
