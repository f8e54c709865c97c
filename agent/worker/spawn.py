"""Starting one engine worker process: wait (bounded) for a previous agent's worker to be gone,
exec ``python -m engine.worker`` with one end of a socketpair, name it in the runtime dir's pid file.

Blocking and standard-library only, so that the serve command can start the first worker before
it builds an event loop or imports the rest of the agent (logging, aiohttp, the API, the
manager): the worker's own start (``import torch``, the CUDA context: seconds) then overlaps
all of it. :class:`agent.worker.client.WorkerClient` adopts that first worker and starts later
ones with the same function in a thread.
"""

from __future__ import annotations

import contextlib

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PID_FILE = "worker.pid"  # in the runtime dir: the worker's pid, for the next agent to wait on
PREVIOUS_WORKER_WAIT_S = 30.0  # a previous worker's exit (freeing the GPU) is waited for this long at most


@dataclass
class Spawned:
    """A started worker: the process, the agent's end of its socket, and when (monotonic) its
    exec was asked for and done; ``notes``: what happened on the way (for the caller's log)."""

    proc: subprocess.Popen
    sock: socket.socket
    spawn_at: float
    spawned_at: float
    notes: list[tuple[str, dict[str, Any]]]


def spawn_worker(options: dict[str, Any], engine: str, env: dict[str, str] | None) -> Spawned:
    notes: list[tuple[str, dict[str, Any]]] = []
    pid_file = _pid_file(options)
    if pid_file is not None:
        notes += _wait_for_previous_worker(pid_file)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    spawn_at = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.worker", "--fd", str(child.fileno()),
             "--options", json.dumps(options), "--engine", engine],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    spawned_at = time.monotonic()
    if pid_file is not None:
        notes += _write_pid(pid_file, proc.pid)
    return Spawned(proc, parent, spawn_at, spawned_at, notes)


def forget_worker(options: dict[str, Any], pid: int) -> None:
    """The worker ``pid`` has exited for good (the agent stopped it): its pid file goes, if it
    still names it (a later agent's worker may have written its own)."""
    path = _pid_file(options)
    if path is not None and _read_pid(path) == pid:
        with contextlib.suppress(OSError):
            path.unlink()


def _pid_file(options: dict[str, Any]) -> Path | None:
    run = (options.get("sandbox_options") or {}).get("runtime_dir")
    return Path(run) / PID_FILE if run else None


def _read_pid(path: Path) -> int | None:
    """The pid in a worker pid file (None: none, or not a plain positive number)."""
    try:
        text = path.read_text()[:32].strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 1 << 22 else None


def _is_worker_of(pid: int, runtime_dir: str) -> bool:
    """Whether ``pid`` is alive and an engine worker started for ``runtime_dir`` (not a reused pid)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    cmd = raw.replace(b"\0", b" ").decode(errors="replace")
    return state != "Z" and "engine.worker" in cmd and runtime_dir in cmd


def _wait_for_previous_worker(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A worker of an earlier agent still alive (its pid in the runtime dir, its command line an
    engine worker's for the same runtime dir) holds the GPU until it is gone: wait for it, at
    most ``PREVIOUS_WORKER_WAIT_S`` (the first load would otherwise fail for memory it is about
    to free)."""
    pid = _read_pid(path)
    run = str(path.parent)
    if pid is None or pid == os.getpid() or not _is_worker_of(pid, run):
        return []
    t0 = time.monotonic()
    deadline = t0 + PREVIOUS_WORKER_WAIT_S
    while time.monotonic() < deadline and _is_worker_of(pid, run):
        time.sleep(0.02)
    if _is_worker_of(pid, run):
        return [("previous_worker_still_alive", {"pid": pid, "waited_s": round(time.monotonic() - t0, 3)})]
    return [("previous_worker_waited", {"pid": pid, "waited_s": round(time.monotonic() - t0, 3)})]


def _write_pid(path: Path, pid: int) -> list[tuple[str, dict[str, Any]]]:
    try:
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        tmp = path.with_name(f".{PID_FILE}.{os.getpid()}")
        tmp.write_text(f"{pid}\n")
        os.replace(tmp, path)
    except OSError as e:  # no runtime dir yet, read-only: only the next start's wait is lost
        return [("worker_pid_not_written", {"error": str(e)})]
    return []
