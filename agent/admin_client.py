"""A small synchronous client of the admin API for the CLI.

It talks over the admin unix socket when it can (no token needed; the socket's mode is the
access control) and falls back to TCP with ``server.admin_token``. Only the standard library:
the CLI must start fast and work on a box where the daemon is down.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from agent.config import Settings


class AgentDown(Exception):
    """No agent answered on the admin socket or the TCP port."""


class AdminError(Exception):
    """The agent answered with an error; ``status`` and ``body`` are its answer."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else str(body)
        super().__init__(f"HTTP {status}: {msg}")
        self.status, self.body = status, body


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


class AdminClient:
    def __init__(self, socket_path: Path | None, host: str, port: int, token: str = "", timeout: float = 10.0) -> None:
        self.socket_path, self.host, self.port, self.token, self.timeout = socket_path, host, port, token, timeout

    @classmethod
    def from_settings(cls, settings: Settings, timeout: float = 10.0) -> "AdminClient":
        s = settings.server
        host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
        return cls(s.admin_socket_path(), host, s.port, s.admin_token.get_secret_value(), timeout)

    def _connections(self, timeout: float) -> list[tuple[http.client.HTTPConnection, dict[str, str]]]:
        conns: list[tuple[http.client.HTTPConnection, dict[str, str]]] = []
        if self.socket_path is not None and self.socket_path.exists():
            conns.append((_UnixConnection(str(self.socket_path), timeout), {}))
        if self.token:
            conns.append((http.client.HTTPConnection(self.host, self.port, timeout=timeout),
                          {"Authorization": f"Bearer {self.token}"}))
        return conns

    def request(self, method: str, path: str, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """(status, JSON body). Raises AgentDown when nothing answers."""
        timeout = self.timeout if timeout is None else timeout
        errors = []
        for conn, headers in self._connections(timeout):
            try:
                conn.request(method, path, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            finally:
                conn.close()
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {"error": {"message": raw[:200].decode(errors="replace")}}
            return resp.status, body
        where = str(self.socket_path) + (f" or {self.host}:{self.port}" if self.token else "")
        raise AgentDown(f"no agent answered on {where}" + (f" ({'; '.join(errors)})" if errors else ""))

    def call(self, method: str, path: str, timeout: float | None = None, ok: tuple[int, ...] = (200, 202)) -> dict[str, Any]:
        status, body = self.request(method, path, timeout)
        if status not in ok:
            raise AdminError(status, body)
        return body

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/admin/v1/status")

    def models(self) -> list[dict[str, Any]]:
        return self.call("GET", "/admin/v1/models")["models"]

    def operate(self, name: str, op: str, wait: bool = True, timeout: float = 3600.0) -> tuple[int, dict[str, Any]]:
        q = f"?wait=true&timeout={timeout:g}" if wait else ""
        return self.request("POST", f"/admin/v1/models/{urllib.parse.quote(name, safe='')}/{op}{q}", timeout=timeout + 10 if wait else None)
