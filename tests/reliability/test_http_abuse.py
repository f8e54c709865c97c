"""Abuse at the HTTP layer, on raw sockets: oversized headers and bodies, slowloris, path and
Host tricks against admin auth, hostile model names on the admin API."""

from __future__ import annotations

import socket
import threading
import time

from tests.reliability.rel_helpers import ADMIN, MODEL, healthy, raw_request, rss_bytes, status_of

ADMIN_PATHS = [
    "/admin/v1/status", "//admin/v1/status", "///admin/v1/status", "/admin//v1/status",
    "/v1/../admin/v1/status", "/v1/%2e%2e/admin/v1/status", "/%2e%2e/admin/v1/status",
    "/v1/..%2Fadmin/v1/status", "/admin%2Fv1%2Fstatus", "/%61dmin/v1/status", "/./admin/v1/status",
    "/admin/v1/../v1/models", "/admin/./v1/status", "/admin/v1/status/", "/ADMIN/v1/status",
    "/admin/v1/status?x=/v1/models", "/admin/v1/status#/v1", "http://127.0.0.1/admin/v1/status",
    "/admin/v1/models/tiny/..%2F..%2Fstatus", "/v1/models/../../admin/v1/status", "/admin\\v1\\status",
    "/%2Fadmin/v1/status", "/admin%00/v1/status", "/admin/v1/models/%2e%2e/load",
]
HOSTS = ["127.0.0.1", "localhost", "", "admin", "unix", "evil.example:80", "127.0.0.1:1@x"]


def _get(port: int, path: str, host: str = "127.0.0.1", extra: str = "", method: str = "GET") -> int:
    req = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
    return status_of(raw_request(port, req.encode()))


def test_path_and_host_tricks_never_bypass_admin_auth(daemon, tally) -> None:
    for path in ADMIN_PATHS:
        for host in HOSTS:
            for method in ("GET", "POST"):
                code = _get(daemon.port, path, host, method=method)
                # Without the token: refused, not found, not allowed or malformed; never served.
                assert code in (400, 401, 404, 405), (method, path, host, code)
                tally["requests"] += 1
                tally["bad_inputs"] += 1
        code = _get(daemon.port, path, extra="Authorization: Bearer wrong\r\nX-Forwarded-For: 127.0.0.1\r\n")
        assert code in (400, 401, 404, 405), (path, code)
        code = _get(daemon.port, path, extra="Authorization: bearer  \r\n")
        assert code in (400, 401, 404, 405), (path, code)
        tally["requests"] += 2
    assert _get(daemon.port, "/admin/v1/status", extra=f"Authorization: {ADMIN['Authorization']}\r\n") == 200
    healthy(daemon)


def test_admin_load_with_hostile_names(daemon, tally) -> None:
    names = ["..", "../x", "..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "%2e%2e", "tiny%00", "%00",
             "a%00b", "x" * 300, "Tiny", ".hidden", "-x", "a%2Fb", "%5C..%5Cx", "%0d%0aSet-Cookie:x"]
    for name in names:
        for op in ("load", "pull", "unload"):
            code, body = daemon.post(f"/admin/v1/models/{name}/{op}", headers=ADMIN)
            assert code in (400, 404), (name, op, code, body)
            tally["requests"] += 1
            tally["bad_inputs"] += 1
        code, _ = daemon.get(f"/admin/v1/models/{name}", headers=ADMIN)
        assert code in (400, 404), (name, code)
    status = daemon.status()
    assert [m["name"] for m in status["models"]] == [MODEL]  # no entry was created for any of them
    cache = daemon.tmp / "cache"
    assert not any(p.name.startswith((".", "-")) for p in cache.rglob("*") if p.parent.name == "models")
    healthy(daemon)


def test_headers_over_64k_and_1000_headers(daemon, tally) -> None:
    big = "X-Big: " + "a" * (64 * 1024 + 10) + "\r\n"
    many = "".join(f"X-H{i}: v\r\n" for i in range(1200))
    long_line = "/v1/models?" + "q" * (70 * 1024)
    for extra, path in [(big, "/v1/models"), (many, "/v1/models"), ("", long_line),
                        ("Cookie: " + "c=1; " * 20000 + "\r\n", "/livez")]:
        t0 = time.monotonic()
        code = _get(daemon.port, path, extra=extra)
        assert code in (400, 413, 414, 431), code
        assert time.monotonic() - t0 < 2.0
        tally["requests"] += 1
        tally["bad_inputs"] += 1
    healthy(daemon)


def _send_big_body(port: int, chunked: bool, total: int = 100 << 20, answer_after: int = 16 << 20) -> tuple[int, int]:
    """POST ``total`` bytes of body; (status the server answered, bytes sent when it answered).

    After ``answer_after`` bytes the answer must already be there: the refusal comes before the
    upload ends, not after the server has swallowed 100 MB."""
    chunk = b"a" * (1 << 20)
    frame = (b"100000\r\n" + chunk + b"\r\n") if chunked else chunk
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{length}\r\n\r\n".encode())
        sent = 0
        try:
            while sent < answer_after:
                s.sendall(frame)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(2.0)
        try:
            answer = s.recv(4096)
        except (ConnectionResetError, socket.timeout):
            answer = b""
        try:
            while sent < total:
                s.sendall(frame)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
    return status_of(answer.split(b"\r\n", 1)[0]), sent


def test_100mb_body_refused_early_without_rss_growth(daemon, tally) -> None:
    pid = daemon.proc.pid
    for chunked in (False, True):  # one round each first: the allocator's high-water mark settles
        assert _send_big_body(daemon.port, chunked)[0] == 413
    settled = rss_bytes(pid)
    for _ in range(6):
        for chunked in (False, True):
            code, _ = _send_big_body(daemon.port, chunked)
            assert code == 413
            tally["requests"] += 1
            tally["bad_inputs"] += 1
    grown = rss_bytes(pid) - settled
    # Each refusal reads up to the 8 MiB body limit; what the allocator keeps of those reads
    # moves RSS by 0-17 MiB once, whatever the count (measured here, 2-core box). A body kept
    # per request — even a third of the limit each — would pass 32 MiB over these twelve.
    assert grown < 32 << 20, f"RSS grew by {grown >> 20} MiB over twelve 100 MB bodies"
    healthy(daemon)


def test_slowloris_while_livez_answers(daemon, tally) -> None:
    """Hundreds of connections trickle header bytes; /livez and a completion stay fast."""
    n, stop = 300, threading.Event()
    socks: list[socket.socket] = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)

    def trickle() -> None:
        i = 0
        while not stop.is_set():
            for s in socks:
                try:
                    s.sendall(f"X-{i}: a\r\n".encode())
                except OSError:
                    pass
            i += 1
            stop.wait(0.2)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        worst = 0.0
        for _ in range(20):
            worst = max(worst, healthy(daemon))
            time.sleep(0.1)
        assert worst < 1.0, f"/livez took {worst:.2f}s under slowloris"
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()
    tally["faults"] += 1
    tally["requests"] += n + 40
    healthy(daemon)
