"""The connections the HTTP server holds: a deadline for a request's headers and a cap on how many
are open at once, so that no client can hold the agent's file descriptors.

aiohttp bounds a connection that trickles its headers only by ``keepalive_timeout`` (75 s), and
accepts connections until ``accept`` fails with EMFILE; by then the agent cannot open the worker's
socket on a respawn, a blob in the cache or a probe's connection. :class:`ConnectionGuard` wraps
the server's protocol factory (one wrapper per listening socket, each with its own cap):

- a connection over its socket's cap gets ``503`` and is closed at once: it holds its descriptor
  only for that write;
- a request's headers must all arrive within ``header_timeout`` of its first byte (of the
  connection's opening, for the first request); a connection that misses it gets ``408`` and is
  closed. The clock stops when the request reaches the handlers (the guard's middleware) and
  starts again at the first byte after the request's answer.

The default cap (:func:`default_max_connections`) is the descriptor limit less what the agent needs
beside its clients: the admin socket's own connections (:data:`ADMIN_CONNECTIONS`) and
:data:`FD_HEADROOM` for the worker's socket and pipes, the cache's files and pulls, the logs.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import web

ADMIN_CONNECTIONS = 64  # the admin unix socket's own cap: probes and the CLI, never starved by clients
FD_HEADROOM = 256  # worker socket and pipes, cache files and ranged pulls, logs, tokenizer files
MIN_CONNECTIONS = 16
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n")
_REFUSED_BODY = (b'{"error":{"message":"too many open connections; retry later","type":"server_error",'
                 b'"param":null,"code":"too_many_connections"}}')
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


def fd_limit() -> int:
    """The process's soft limit on open files."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(nofile: int) -> int:
    """The most client connections that leave the agent's own headroom under ``nofile`` descriptors."""
    return max(MIN_CONNECTIONS, nofile - FD_HEADROOM - ADMIN_CONNECTIONS)


def max_connections(setting: int | None, nofile: int) -> int:
    """``server.max_connections``, or the default; never above what leaves the headroom."""
    safe = default_max_connections(nofile)
    return safe if setting is None else min(setting, safe)


@dataclass
class SiteCounts:
    """One listening socket's connections: open now, refused over the cap, cut at the header deadline."""

    cap: int
    open: int = 0
    refused: int = 0
    timed_out: int = 0


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, made only once the connection is under the cap."""

    def __init__(self, guard: ConnectionGuard, site: SiteCounts, factory: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._site = site
        self._factory = factory
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False  # a request of this connection is with the handlers
        self._partial = False  # bytes arrived since the clock started

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        self._transport = transport
        if self._site.open >= self._site.cap:
            self._site.refused += 1
            transport.write(_REFUSED % len(_REFUSED_BODY) + _REFUSED_BODY)
            transport.close()
            return
        self._site.open += 1
        self._guard.track(transport, self)
        self._inner = self._factory()
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if not self._busy:
            self._partial = True
            if self._timer is None:
                self._arm()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        inner, self._inner = self._inner, None
        if inner is None:
            return
        self._site.open -= 1
        if self._transport is not None:
            self._guard.untrack(self._transport)
        inner.connection_lost(exc)

    # -- the header clock ----------------------------------------------------------------------

    def request_started(self) -> None:
        self._busy = True
        self._partial = False
        self._disarm()

    def request_ended(self) -> None:
        self._busy = False

    def _arm(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._guard.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        t = self._transport
        if self._busy or t is None or t.is_closing():
            return
        self._site.timed_out += 1
        if self._partial:
            t.write(_TIMED_OUT)
        t.close()


class ConnectionGuard:
    """The header deadline and the per-socket caps of one application's listening sockets."""

    def __init__(self, header_timeout: float) -> None:
        self.header_timeout = header_timeout
        self._live: dict[asyncio.BaseTransport, _Guarded] = {}
        self.sites: dict[str, SiteCounts] = {}

    def factory(self, name: str, server: Callable[[], asyncio.Protocol], cap: int) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for one listening socket (``name``): ``server`` (aiohttp's
        ``runner.server``) behind the cap and the deadline."""
        site = self.sites[name] = SiteCounts(cap)
        return lambda: _Guarded(self, site, server)

    def track(self, transport: asyncio.BaseTransport, conn: _Guarded) -> None:
        self._live[transport] = conn

    def untrack(self, transport: asyncio.BaseTransport) -> None:
        self._live.pop(transport, None)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Stops the connection's header clock while its request is with the handlers."""
        conn = self._live.get(request.transport) if request.transport is not None else None
        if conn is None:
            return await handler(request)
        conn.request_started()
        try:
            return await handler(request)
        finally:
            conn.request_ended()
