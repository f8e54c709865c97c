"""sd_notify over ``$NOTIFY_SOCKET``, without libsystemd.

The protocol is one datagram of newline-separated ``KEY=VALUE`` lines to a unix datagram socket
(a path, or an abstract name written with a leading ``@``). Without ``NOTIFY_SOCKET`` every call
is a no-op, so the daemon runs the same outside systemd.
"""

from __future__ import annotations

import os
import socket
from typing import Any


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if addr.startswith("@"):
            self._addr = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._addr = addr
        self._sock: socket.socket | None = None
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            # Ping at half the timeout: one missed tick is not yet a kill.
            self.watchdog_interval_s = int(usec) / 1e6 / 2

    @property
    def enabled(self) -> bool:
        return self._addr is not None

    def notify(self, **fields: Any) -> bool:
        """Send ``KEY=VALUE`` lines (``notify(READY=1, STATUS="...")``); False when not sent."""
        if self._addr is None:
            return False
        text = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(text.encode(), self._addr)
        except OSError:
            return False  # systemd gone or socket full: never let notify break serving
        return True

    def ready(self, status: str) -> bool:
        return self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.notify(STATUS=status)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def stopping(self, status: str = "draining") -> bool:
        return self.notify(STOPPING=1, STATUS=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
