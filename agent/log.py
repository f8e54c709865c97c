"""Structured logging: JSON lines in production, readable console on a TTY.

Request ids travel in a contextvar (``bind_request_id``) so every line logged while a request is
handled carries it, across awaits, without threading it through every call.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import uuid
from typing import Any, Literal

import structlog

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def bind_request_id(request_id: str | None = None) -> str:
    """Set the request id for the current context (task); returns it."""
    rid = request_id or new_request_id()
    _request_id.set(rid)
    return rid


def _add_request_id(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    rid = _request_id.get()
    if rid is not None and "request_id" not in event:
        event["request_id"] = rid
    return event


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at write time, not at configure time.

    structlog's configuration is process-wide; binding it to the stream object of the moment
    breaks when that stream is later replaced and closed (test capture, daemonizing)."""

    def write(self, text: str) -> int:
        # One log line is one write to the file, newline included: another process writing to
        # the same stderr (the worker; Triton's nanobind leak report at its exit) cannot land
        # in the middle of a line or glue itself to its end.
        stream = sys.stderr
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            return stream.write(text)
        stream.flush()
        data = text.encode("utf-8", "backslashreplace")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure_logging(
    fmt: Literal["auto", "json", "console"] = "auto", level: str = "info", stream: Any = None
) -> None:
    """Configure structlog (and stdlib logging, for libraries) once at process start."""
    stream = stream or _CurrentStderr()
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared = [
        structlog.contextvars.merge_contextvars,
        _add_request_id,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        renderer: Any = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=getattr(stream, "isatty", lambda: False)())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.WriteLoggerFactory(file=stream),  # message + newline in one write
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def get_logger(name: str | None = None, **bound: Any) -> Any:
    log = structlog.get_logger(name)
    return log.bind(**bound) if bound else log
