"""A real ``infire-agent serve`` process on loopback, for the agent's integration tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish_tiny(make_tiny_model: Any, store_dir: Path, name: str | tuple[str, ...] = "tiny", arch: str = "llama") -> str:
    """Publish a generated tiny model into a file store, under one name or several; returns the
    store URL."""
    from cache.publish import publish_model
    from cache.store import open_store

    url = store_dir.as_uri()
    store = open_store(url)
    try:
        for n in (name,) if isinstance(name, str) else name:
            publish_model(store, make_tiny_model(arch), n)
    finally:
        store.close()
    return url


class Daemon:
    def __init__(self, tmp: Path, *, store_url: str | None = None, models: list[dict[str, Any]] | None = None,
                 engine: str = "core", env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.runtime = tmp / "run"
        self.socket = self.runtime / "admin.sock"
        self.log_path = tmp / "agent.log"
        self.engine = engine
        self.env = {
            **os.environ,
            "INFIRE_SERVER__PORT": str(self.port),
            "INFIRE_SERVER__RUNTIME_DIR": str(self.runtime),
            "INFIRE_SERVER__ADMIN_TOKEN": "test-admin-token",
            "INFIRE_SERVER__DRAIN_TIMEOUT": "20",
            "INFIRE_CACHE__DIR": str(tmp / "cache"),
            "INFIRE_CACHE__MAX_BYTES": "1GiB",
            "INFIRE_STORE__URL": store_url or (tmp / "store").as_uri(),
            "INFIRE_GPU__DEVICE": "cpu",
            "INFIRE_GPU__CPU_MEMORY_BUDGET": "256MiB",
            "INFIRE_ENGINE__SANDBOX": "false",
            "INFIRE_MODELS": json.dumps(models or []),
            "INFIRE_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": "1",
            # The repo first; a caller's own entries (a machine's extra site folder) after it.
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready: bool = True, timeout: float = 90.0) -> "Daemon":
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "agent.cli", "serve", "--engine", self.engine]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_for("/readyz" if ready else "/livez", 200, timeout)
        return self

    def get(self, path: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, Any]:
        req = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, _body(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _body(e.read())

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None,
             timeout: float = 30.0) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, _body(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _body(e.read())

    def wait_for(self, path: str, status: int, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                code, body = self.get(path, timeout=2)
                last = (code, body)
                if code == status:
                    return body
            except OSError as e:
                last = e
            time.sleep(0.1)
        raise TimeoutError(f"{path} did not answer {status} in {timeout}s (last: {last})\n{self.logs()[-4000:]}")

    def status(self) -> dict[str, Any]:
        code, body = self.get("/admin/v1/status", {"Authorization": "Bearer test-admin-token"})
        if code != 200:
            raise RuntimeError(f"status: {code} {body}")
        return body

    def engine_stats(self, model: str) -> dict[str, Any]:
        """The model's admin view, read over the admin unix socket (no token)."""
        from agent.admin_client import AdminClient

        c = AdminClient(self.socket, "127.0.0.1", self.port)
        return next(m for m in c.models() if m["name"] == model)

    def engine_status(self) -> dict[str, Any]:
        """The status JSON over the admin unix socket (no token)."""
        from agent.admin_client import AdminClient

        return AdminClient(self.socket, "127.0.0.1", self.port).status()

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
