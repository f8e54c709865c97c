"""agent.http.sse.EventStream: a streamed answer's events reach the socket in order, each exactly
once, whichever way they go — straight to the transport from ``push`` (once the handler's first
write has sent the headers), or held back and written by the handler (before that, while the
transport's buffer is over its high-water mark, on HTTP/1.0). The wire is one log of what the
transport and the response wrote, decoded as the client would read it."""

from __future__ import annotations

import asyncio
import random

import pytest

from agent.http.sse import EventStream


class Wire:
    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []  # ("raw", bytes the handler's framing wraps) / ("chunk", framed)


class Transport:
    def __init__(self, wire: Wire) -> None:
        self.wire, self.buffered, self.closing = wire, 0, False

    def write(self, data: bytes) -> None:
        self.wire.log.append(("chunk", data))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing


class Request:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport


class Response:
    def __init__(self, wire: Wire) -> None:
        self.wire, self.writes = wire, 0

    async def write(self, data: bytes) -> None:
        assert data, "an empty write would end a chunked body"
        self.writes += 1
        self.wire.log.append(("raw", data))


def body(wire: Wire, chunked: bool) -> bytes:
    """The bytes the client reads, chunk framing removed (the handler's writes are framed by aiohttp)."""
    out = b""
    for kind, data in wire.log:
        if kind == "chunk":
            assert chunked, "no direct chunks on HTTP/1.0"
            size, rest = data.split(b"\r\n", 1)
            assert rest.endswith(b"\r\n") and int(size, 16) == len(rest) - 2
            data = rest[:-2]
        out += data
    return out


def make(chunked: bool = True, first: bytes = b""):
    wire = Wire()
    t = Transport(wire)
    r = Response(wire)
    wakes = []
    s = EventStream(Request(t), r, lambda: wakes.append(1), chunked, first)
    return wire, t, r, s, wakes


def ev(i: int) -> bytes:
    return b"data: {\"i\":%d}\n\n" % i


def test_events_before_the_first_write_wait_for_it_then_go_straight_to_the_transport() -> None:
    wire, t, r, s, wakes = make(first=b"data: role\n\n")
    s.push(ev(0))
    s.push(ev(1))
    assert wire.log == [] and len(wakes) == 2  # headers not sent yet: held, the handler told
    asyncio.run(s.flush())
    assert r.writes == 1 and s.pending == []
    s.push(ev(2))
    assert wire.log[-1][0] == "chunk" and len(wakes) == 2  # no wake: written where it was made
    assert body(wire, True) == b"data: role\n\n" + ev(0) + ev(1) + ev(2)


def test_a_full_transport_buffer_hands_over_to_the_handler_without_reordering() -> None:
    wire, t, r, s, wakes = make()
    rng = random.Random(0)
    sent = []
    for i in range(400):
        t.buffered = rng.choice([0, 0, 0, EventStream.HIGH_WATER + 1])
        s.push(ev(i))
        sent.append(ev(i))
        if s.pending and rng.random() < 0.3:
            asyncio.run(s.flush())  # the handler, woken, drains and writes what was held
    asyncio.run(s.write(b"data: [DONE]\n\n"))
    assert body(wire, True) == b"".join(sent) + b"data: [DONE]\n\n"
    assert any(k == "chunk" for k, _ in wire.log) and r.writes > 1


def test_nothing_goes_direct_while_events_are_held() -> None:
    wire, t, r, s, wakes = make()
    asyncio.run(s.write(ev(0)))
    t.buffered = EventStream.HIGH_WATER
    s.push(ev(1))
    t.buffered = 0
    s.push(ev(2))  # would fit now, but ev(1) is still held: it queues behind it
    assert s.pending == [ev(1), ev(2)]
    asyncio.run(s.flush())
    assert body(wire, True) == ev(0) + ev(1) + ev(2)


def test_http_1_0_has_no_chunk_framing_so_the_handler_writes_everything() -> None:
    wire, t, r, s, wakes = make(chunked=False)
    for i in range(3):
        asyncio.run(s.write(ev(10 + i)))
        s.push(ev(i))
    asyncio.run(s.flush())
    assert all(k == "raw" for k, _ in wire.log)
    assert body(wire, False) == ev(10) + ev(0) + ev(11) + ev(1) + ev(12) + ev(2)


@pytest.mark.parametrize("started", [False, True])
def test_a_closed_connection_marks_the_stream_gone_and_wakes_the_handler(started) -> None:
    wire, t, r, s, wakes = make()
    if started:
        asyncio.run(s.write(ev(0)))
    t.closing = True
    s.push(ev(1))
    assert s.gone and wakes and s.pending == []
    s.push(ev(2))
    assert body(wire, True) == (ev(0) if started else b"")


def big(i: int) -> bytes:
    return b"data: {\"i\":%d,\"pad\":\"%b\"}\n\n" % (i, b"x" * 100)


def test_over_a_real_socket_a_lagging_reader_gets_every_event_and_the_writes_hand_over_both_ways() -> None:
    # aiohttp on loopback with a 4 KiB send buffer: events pushed from loop callbacks (as the
    # worker reader does) while the client does not read pile up past the high-water mark; the
    # handler's drain takes over, and once the client reads, pushes go straight out again.
    import socket
    import threading

    from aiohttp import web

    n = 3000
    seen = {"held_after_direct": 0, "direct": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.enable_chunked_encoding()
        woken = asyncio.Event()
        stream = EventStream(request, resp, woken.set, True, first=b"data: start\n\n")
        produced = asyncio.Event()

        def produce(i: int) -> None:
            before = len(stream.pending)
            stream.push(big(i))
            if stream._direct and len(stream.pending) > before:
                seen["held_after_direct"] += 1
            elif len(stream.pending) == before:
                seen["direct"] += 1
            if i + 1 < n:
                asyncio.get_running_loop().call_later(0.0002 if i % 20 == 0 else 0, produce, i + 1)
            else:
                produced.set()
                woken.set()

        await resp.prepare(request)
        asyncio.get_running_loop().call_soon(produce, 0)
        while True:
            await stream.flush()
            if produced.is_set() and not stream.pending:
                break
            if not stream.pending:
                woken.clear()
                await woken.wait()
        await stream.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def serve(ready: threading.Event, stop: threading.Event, port: list[int]) -> None:
        app = web.Application()
        app.router.add_get("/s", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port.append(site._server.sockets[0].getsockname()[1])
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await runner.cleanup()

    ready, stop, port = threading.Event(), threading.Event(), []
    th = threading.Thread(target=lambda: asyncio.run(serve(ready, stop, port)), daemon=True)
    th.start()
    assert ready.wait(10)
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(30)
        s.connect(("127.0.0.1", port[0]))
        s.sendall(b"GET /s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        import time
        raw = b""
        for _ in range(4):  # read a little, lag, read a little: both hand-overs happen
            time.sleep(0.3)
            raw += s.recv(1 << 14)
        while chunk := s.recv(1 << 16):
            raw += chunk
        s.close()
    finally:
        stop.set()
        th.join(10)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] + b" "
    out = b""
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if int(size, 16) == 0:
            break
        out, rest = out + rest[:int(size, 16)], rest[int(size, 16) + 2:]
    assert out == b"data: start\n\n" + b"".join(big(i) for i in range(n)) + b"data: [DONE]\n\n"
    assert seen["held_after_direct"] > 0 and seen["direct"] > 0, seen
