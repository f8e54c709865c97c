"""The connections a client can hold, on a real daemon over sockets: a request's headers have a
deadline (``server.header_timeout``), open connections a cap (``server.max_connections``) that
keeps descriptors for the agent itself, and the admin socket answers ``/livez`` whatever the TCP
port holds."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from agent.http.connections import ADMIN_CONNECTIONS, FD_HEADROOM, default_max_connections, max_connections
from tests.integration.agent_harness import Daemon
from tests.reliability.rel_helpers import open_fds, raw_request, status_of

HEADER_TIMEOUT_S = 2.0
CAP = 40


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("conn-agent"), engine="none",
               env={"INFIRE_SERVER__HEADER_TIMEOUT": f"{HEADER_TIMEOUT_S}s",
                    "INFIRE_SERVER__MAX_CONNECTIONS": str(CAP)})
    d.start(ready=False, timeout=60)
    yield d
    d.stop()


def _livez_tcp(port: int) -> int:
    return status_of(raw_request(port, b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=5))


def _livez_admin(d: Daemon) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(d.socket))
        s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return status_of(s.recv(4096).split(b"\r\n", 1)[0])


def _closed_after(s: socket.socket, every_s: float, limit_s: float) -> tuple[float, bytes]:
    """Trickle one header line every ``every_s``; (seconds until the server closed, what it sent)."""
    t0 = time.monotonic()
    s.settimeout(every_s)
    got = b""
    i = 0
    while time.monotonic() - t0 < limit_s:
        try:
            s.sendall(f"X-Slow-{i}: a\r\n".encode())
        except OSError:
            return time.monotonic() - t0, got
        i += 1
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0, got
        got += chunk
        if not chunk:
            return time.monotonic() - t0, got
    return time.monotonic() - t0, got


def test_trickled_headers_are_cut_at_the_deadline(daemon) -> None:
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as s:
        s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
        took, got = _closed_after(s, every_s=0.5, limit_s=HEADER_TIMEOUT_S + 20)
    assert took < HEADER_TIMEOUT_S + 2.0, f"a trickling client held its connection {took:.1f}s"
    assert got.startswith(b"HTTP/1.1 408"), got[:80]
    # A connection that opens and sends nothing is closed too.
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=HEADER_TIMEOUT_S + 5) as s:
        t0 = time.monotonic()
        assert s.recv(4096) == b""
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 2.0


def test_the_deadline_is_per_request_not_per_connection(daemon) -> None:
    """A kept-alive connection serves requests for longer than the deadline, and a slow but timely
    client (headers over half the deadline) is served."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as s:
        t0 = time.monotonic()
        while time.monotonic() - t0 < HEADER_TIMEOUT_S * 2:
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
            time.sleep(HEADER_TIMEOUT_S / 2)
            s.sendall(b"\r\n")
            answer = s.recv(4096)
            assert status_of(answer.split(b"\r\n", 1)[0]) == 200, answer[:80]
            time.sleep(HEADER_TIMEOUT_S / 2)  # idle between requests: keep-alive's clock, not this one


def test_connections_over_the_cap_are_refused_and_livez_answers_on_the_admin_socket(daemon) -> None:
    pid = daemon.proc.pid
    before = open_fds(pid)
    socks: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(CAP * 5):
            s = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            socks.append(s)
        time.sleep(0.3)
        held = open_fds(pid) - before
        assert held <= CAP + 8, f"the agent holds {held} descriptors for {len(socks)} clients (cap {CAP})"
        assert _livez_tcp(daemon.port) == 503  # the port is full: a clear refusal, not a hang
        assert _livez_admin(daemon) == 200
        for s in socks:
            s.settimeout(0.05)
            try:
                if s.recv(4096).startswith(b"HTTP/1.1 503"):
                    refused += 1
            except (socket.timeout, OSError):
                pass
        assert refused >= CAP * 4 - 8, refused
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 5
    while _livez_tcp(daemon.port) != 200:
        assert time.monotonic() < deadline, "the port did not come back after the clients left"
        time.sleep(0.1)


def test_the_default_cap_keeps_headroom_under_the_descriptor_limit() -> None:
    assert default_max_connections(1024) == 1024 - FD_HEADROOM - ADMIN_CONNECTIONS
    assert max_connections(None, 65536) == 65536 - FD_HEADROOM - ADMIN_CONNECTIONS
    assert max_connections(100_000, 1024) == default_max_connections(1024)  # never past the headroom
    assert max_connections(50, 1024) == 50
