"""Pull and publish progress: a thread-safe counter the agent can show and the CLI can draw.

Download threads call :meth:`Progress.add`; readers call :meth:`Progress.snapshot` from any
thread or the event loop. The rate is measured over a sliding window so the ETA follows the
current speed rather than the average since the start.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import TextIO

from cache.sizes import human_bytes


class Progress:
    def __init__(self, name: str = "", total_bytes: int = 0, window_s: float = 5.0) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._total = total_bytes
        self._downloaded = 0  # bytes that crossed the network in this run
        self._resumed = 0  # bytes already on disk (resumed parts, cached blobs)
        self._retries = 0
        self._file = ""
        self._state = "pending"
        self._started = time.monotonic()
        self._window_s = window_s
        self._samples: deque[tuple[float, int]] = deque([(self._started, 0)])

    def set_total(self, total_bytes: int) -> None:
        with self._lock:
            self._total = total_bytes

    def set_state(self, state: str, file: str | None = None) -> None:
        with self._lock:
            self._state = state
            if file is not None:
                self._file = file

    def add(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._downloaded += n
            if now - self._samples[-1][0] >= 0.1:
                self._samples.append((now, self._downloaded))
                while len(self._samples) > 2 and now - self._samples[0][0] > self._window_s:
                    self._samples.popleft()

    def add_resumed(self, n: int) -> None:
        with self._lock:
            self._resumed += n

    def add_retry(self) -> None:
        with self._lock:
            self._retries += 1

    @property
    def downloaded_bytes(self) -> int:
        with self._lock:
            return self._downloaded

    def snapshot(self) -> dict:
        """Plain data: bytes done and total, rate (bytes/s), ETA (s, None when unknown)."""
        now = time.monotonic()
        with self._lock:
            t0, b0 = self._samples[0]
            rate = (self._downloaded - b0) / (now - t0) if now - t0 > 0.05 else 0.0
            done = self._downloaded + self._resumed
            remaining = max(0, self._total - done)
            return {
                "name": self.name,
                "state": self._state,
                "file": self._file,
                "total_bytes": self._total,
                "done_bytes": done,
                "downloaded_bytes": self._downloaded,
                "resumed_bytes": self._resumed,
                "retries": self._retries,
                "rate_bytes_s": rate,
                "eta_s": (remaining / rate) if rate > 0 else (0.0 if remaining == 0 else None),
                "elapsed_s": now - self._started,
            }


def render_bar(snap: dict, width: int = 30) -> str:
    """One line: ``name [#####.....]  45% 1.2 GiB/2.7 GiB 350.0 MiB/s ETA 4s``; once done, the
    average rate (or that everything was there already); never a rate of ``0 B/s``."""
    total = snap["total_bytes"] or 1
    frac = min(1.0, snap["done_bytes"] / total)
    filled = int(frac * width)
    eta = snap["eta_s"]
    head = (f"{snap['name']} [{'#' * filled}{'.' * (width - filled)}] {frac * 100:3.0f}% "
            f"{human_bytes(snap['done_bytes'])}/{human_bytes(snap['total_bytes'])}")
    moved, elapsed = snap.get("downloaded_bytes", 0), snap.get("elapsed_s") or 0.0
    if snap["done_bytes"] >= snap["total_bytes"] and snap["total_bytes"]:  # done: the average, never "0 B/s"
        if not moved:
            return f"{head} (all already there)"
        return f"{head} {human_bytes(moved / elapsed)}/s" if elapsed > 0 else head
    rate = snap["rate_bytes_s"]
    speed = f"{human_bytes(rate)}/s" if rate >= 1 else "starting" if not moved else "stalled"
    return f"{head} {speed} ETA {'--' if eta is None else f'{eta:.0f}s'}"


class BarPrinter:
    """Draws a progress bar on a TTY (or a line every few seconds elsewhere) from its own thread."""

    def __init__(self, progress: Progress, stream: TextIO | None = None, interval: float | None = None) -> None:
        self.progress = progress
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.2 if self.tty else 5.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-bar", daemon=True)

    def _draw(self, final: bool = False) -> None:
        line = render_bar(self.progress.snapshot())
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def __enter__(self) -> "BarPrinter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._draw(final=True)
