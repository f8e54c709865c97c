"""Server-sent events as the OpenAI streaming API frames them: ``data: <json>\\n\\n`` lines ended by
``data: [DONE]``. One encoder for the server, one line parser for the clients that read it
(the demo, the serving benchmark)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the clients that parse streams (demo, benchmark) need no aiohttp
    from aiohttp import web

DONE = object()  # parse_line's answer to ``data: [DONE]``


def encode(objs: list[dict[str, Any]]) -> bytes:
    """Frame JSON objects as SSE events, compactly."""
    return b"".join(b"data: " + json.dumps(o, separators=(",", ":")).encode() + b"\n\n" for o in objs)


def parse_line(line: bytes) -> dict[str, Any] | object | None:
    """One line of a stream: the event's JSON object, ``DONE`` at the end, or None for a line that
    carries no data (blank separators, comments)."""
    if not line.startswith(b"data: "):
        return None
    data = line[6:].strip()
    return DONE if data == b"[DONE]" else json.loads(data)


class EventStream:
    """A streamed answer's events written to the socket as they are made, off the handler's task.

    ``push`` runs where engine outputs are read (agent/worker/generation.py): once the response
    has started, an event goes straight to the transport as one HTTP chunk, so a token costs one
    write and no task switch. The handler's own writes (``flush``, ``write``) go through aiohttp,
    which sends the headers with the first of them and awaits the socket's drain: ``push`` holds
    events back (``pending``) until that first write is done, while the transport's buffer is over
    ``HIGH_WATER`` (a slow reader), and on HTTP/1.0 (no chunked framing); the handler writes what
    is held with ``flush``. Events are never dropped or reordered.
    """

    HIGH_WATER = 64 * 1024  # bytes queued in the transport beyond which the handler's drain takes over

    def __init__(self, request: web.BaseRequest, response: web.StreamResponse, wake: Callable[[], None],
                 chunked: bool, first: bytes = b"") -> None:
        """``response``: the ``web.StreamResponse`` to ``request``, with chunked encoding enabled
        when ``chunked`` (else ``push`` always holds back); ``wake()``: tells the handler that
        events are pending; ``first``: what the stream starts with, ahead of any event."""
        self._request = request
        self._response = response
        self._wake = wake
        self.chunked = chunked
        self._direct = False  # until the handler's first write has sent the headers
        self.pending: list[bytes] = [first] if first else []
        self.gone = False  # the client went away

    def push(self, data: bytes) -> None:
        if not data or self.gone:
            return
        transport = self._request.transport
        if transport is None or transport.is_closing():
            self.gone = True
            self._wake()
            return
        if self._direct and not self.pending and transport.get_write_buffer_size() < self.HIGH_WATER:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        self.pending.append(data)
        self._wake()

    async def write(self, data: bytes) -> None:
        """Write through aiohttp (waits for the socket to drain); what was pending goes first."""
        if self.pending:
            data, self.pending = b"".join(self.pending) + data, []
        if data:
            await self._response.write(data)
            self._direct = self.chunked

    async def flush(self) -> None:
        if self.pending:
            await self.write(b"")
