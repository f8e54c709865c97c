"""A small synchronous client of the admin API for the CLI.

It talks over the admin unix socket when it can (no token needed; the socket's mode is the
access control) and falls back to TCP with ``server.admin_token``. Only the standard library:
the CLI must start fast and work on a box where the daemon is down.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import urllib.parse
from pathlib import Path
from typing import Any

from agent.config import Settings


def agent_listening(path: Path) -> bool:
    """Whether an agent answers on the admin unix socket ``path`` (a connect succeeds); a stale
    socket file, or none, is False."""
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class AgentDown(Exception):
    """No agent answered on the admin socket or the TCP port; the message says where the client
    looked, why each place did not answer, and how to point it elsewhere."""


# How to point the CLI at an agent that runs elsewhere: appended to every AgentDown message.
WHERE_HINT = ("start one with `infire-agent demo` or `infire-agent serve`, or point at a running one with "
              "--config FILE (or INFIRE_CONFIG) naming its config, or INFIRE_SERVER__RUNTIME_DIR / "
              "INFIRE_SERVER__ADMIN_SOCKET")


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

    def _connections(self, timeout: float) -> tuple[list[tuple[http.client.HTTPConnection, dict[str, str]]], list[str]]:
        """The places to try, and why each place left out is (socket absent)."""
        conns: list[tuple[http.client.HTTPConnection, dict[str, str]]] = []
        skipped: list[str] = []
        if self.socket_path is not None and self.socket_path.exists():
            conns.append((_UnixConnection(str(self.socket_path), timeout), {}))
        elif self.socket_path is not None:
            skipped.append("no such socket")
        if self.token:
            conns.append((http.client.HTTPConnection(self.host, self.port, timeout=timeout),
                          {"Authorization": f"Bearer {self.token}"}))
        return conns, skipped

    def _why(self, unix: bool, e: Exception) -> str:
        """One place's failure in words (a stale socket is not a connection error to the user)."""
        if isinstance(e, ConnectionRefusedError):
            what = ("a stale socket: nothing listens on it (left by an agent that did not exit cleanly; "
                    "the next `serve` replaces it)" if unix else "connection refused")
        elif isinstance(e, TimeoutError):
            what = f"no answer within {self.timeout:g}s"
        elif isinstance(e, PermissionError):
            what = "permission denied (run as the agent's user or a member of its group)"
        else:
            what = f"{type(e).__name__}: {e}"
        return what if unix else f"{self.host}:{self.port}: {what}"

    def request(self, method: str, path: str, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """(status, JSON body). Raises AgentDown when nothing answers."""
        timeout = self.timeout if timeout is None else timeout
        conns, errors = self._connections(timeout)
        for conn, headers in conns:
            try:
                conn.request(method, path, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                errors.append(self._why(isinstance(conn, _UnixConnection), e))
                continue
            finally:
                conn.close()
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = {"error": {"message": raw[:200].decode(errors="replace")}}
            return resp.status, body
        where = str(self.socket_path) + (f" or {self.host}:{self.port}" if self.token else "")
        raise AgentDown(f"no agent answered on {where} ({'; '.join(errors)}); {WHERE_HINT}")

    def socket_peer_pid(self) -> int:
        """The pid of the process listening on the admin socket (SO_PEERCRED: the kernel's word,
        not the agent's). Raises AgentDown when nothing listens there."""
        if self.socket_path is None or not self.socket_path.exists():
            raise AgentDown(f"no agent answered on {self.socket_path} (no such socket); {WHERE_HINT}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(str(self.socket_path))
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError as e:
            raise AgentDown(f"no agent answered on {self.socket_path} ({self._why(True, e)}); {WHERE_HINT}") from None
        finally:
            s.close()
        return struct.unpack("3i", creds)[0]

    def call(self, method: str, path: str, timeout: float | None = None, ok: tuple[int, ...] = (200, 202)) -> dict[str, Any]:
        status, body = self.request(method, path, timeout)
        if status not in ok:
            raise AdminError(status, body)
        return body

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/admin/v1/status")

    def models(self) -> list[dict[str, Any]]:
        return self.call("GET", "/admin/v1/models")["models"]

    def operate(self, name: str, op: str, wait: bool = True, timeout: float = 3600.0,
                verify: bool = False, quantization: str | None = None,
                kv_cache_dtype: str | None = None) -> tuple[int, dict[str, Any]]:
        """POST the model operation ``op``; ``verify``: a pull reads every sha256 of a cached model;
        ``quantization``, ``kv_cache_dtype`` ("fp8" or "none"): a load's, instead of the model's settings."""
        params = (([f"wait=true&timeout={timeout:g}"] if wait else []) + (["verify=true"] if verify else [])
                  + [f"{k}={urllib.parse.quote(v, safe='')}" for k, v in (("quantization", quantization),
                                                                         ("kv_cache_dtype", kv_cache_dtype)) if v])
        q = "?" + "&".join(params) if params else ""
        return self.request("POST", f"/admin/v1/models/{urllib.parse.quote(name, safe='')}/{op}{q}", timeout=timeout + 10 if wait else None)
