"""sd_notify: READY/STATUS/EXTEND_TIMEOUT/STOPPING/WATCHDOG over path and abstract sockets."""

from __future__ import annotations

import os
import socket

from agent.systemd import Notifier


def _listen(path: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    return s


def test_notifier_path_socket(tmp_path) -> None:
    sock = _listen(str(tmp_path / "n.sock"))
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "4000000"})
    assert n.enabled and n.watchdog_interval_s == 2.0
    assert n.ready("serving")
    assert sock.recv(100) == b"READY=1\nSTATUS=serving"
    n.extend_timeout(1.5)
    assert sock.recv(100) == b"EXTEND_TIMEOUT_USEC=1500000"
    n.stopping()
    assert sock.recv(100) == b"STOPPING=1\nSTATUS=draining"
    n.close()
    sock.close()


def test_notifier_abstract_socket_and_watchdog_pid() -> None:
    name = f"infire-test-{os.getpid()}"
    sock = _listen(b"\0" + name.encode())
    n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None  # the watchdog is someone else's (pid 1), not ours
    assert n.watchdog()
    assert sock.recv(100) == b"WATCHDOG=1"
    sock.close()


def test_notifier_off_without_socket_and_survives_missing_listener(tmp_path) -> None:
    assert not Notifier({}).enabled and Notifier({}).ready("x") is False
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).ready("x") is False
