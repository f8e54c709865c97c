"""Helpers of the reliability suite: raw sockets, process resources, health checks."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from tests.integration.agent_harness import Daemon

MODEL = "tiny"
CTX = 256
ADMIN = {"Authorization": "Bearer test-admin-token"}


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send bytes on a fresh connection; the status line of the answer (b"" if it closed first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused early and closed; its answer may still be readable
        buf = b""
        try:
            while b"\r\n" not in buf:
                chunk = s.recv(4096)
                if not chunk:
                    break
                buf += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return buf.split(b"\r\n", 1)[0]


def status_of(line: bytes) -> int:
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def healthy(d: Daemon, timeout: float = 2.0) -> float:
    """Seconds /livez took; raises unless it answered 200 and a one-token completion works."""
    t0 = time.monotonic()
    code, _ = d.get("/livez", timeout=timeout)
    took = time.monotonic() - t0
    if code != 200:
        raise AssertionError(f"/livez answered {code}")
    code, body = d.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1}, timeout=30)
    if code != 200:
        raise AssertionError(f"a plain completion answered {code}: {body}")
    return took


def idle(d: Daemon, timeout: float = 10.0) -> dict[str, Any]:
    """Wait until the model has nothing in flight, running, waiting or in KV pages; its admin view."""
    deadline = time.monotonic() + timeout
    m: dict[str, Any] = {}
    while time.monotonic() < deadline:
        m = d.engine_stats(MODEL)
        # The worker's stats come with its heartbeats: wait until they show nothing held.
        if m["in_flight"] == 0 and m["running"] == 0 and m["waiting"] == 0 and m["kv_pages"]["used"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"the model did not go idle: {m}")


def open_stream(d: Daemon, max_tokens: int, chat: bool = False,
                timeout: float = 60.0) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=timeout)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "go"}]
    else:
        body["prompt"] = "go"
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def sse_events(resp: http.client.HTTPResponse) -> list[str]:
    out = []
    try:
        for line in resp:
            if line.startswith(b"data: "):
                out.append(line[6:].decode().strip())
    except (http.client.IncompleteRead, ConnectionError, socket.timeout):
        pass
    return out


def ensure_loaded(d: Daemon, name: str = MODEL, timeout: float = 90.0) -> None:
    """Load ``name`` and wait until it is ready (retrying while another operation finishes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, body = d.post(f"/admin/v1/models/{name}/load?wait=true&timeout=30", headers=ADMIN, timeout=60)
        if code == 200 and body["model"]["state"] == "ready":
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} did not become ready: {code} {body}")
