"""Cross-process locks on files under ``<cache>/locks`` (``fcntl.flock``).

flock locks belong to an open file description, so two opens in one process exclude each other
too, and the kernel drops the lock when its holder dies (SIGKILL included): no stale lock files
to clean up. Waiting polls with a non-blocking attempt so an asyncio caller stays cancellable and
no thread is left blocked in the kernel.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path

from cache.errors import CacheError


class FileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self, shared: bool = False) -> bool:
        if self._fd is not None:
            raise CacheError(f"{self.path} is already held by this FileLock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def acquire(self, timeout: float | None = None, shared: bool = False, poll: float = 0.05) -> None:
        """Blocking wait (for threads and the CLI)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.try_acquire(shared):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {self.path}")
            time.sleep(poll)
            poll = min(poll * 2, 0.5)

    async def acquire_async(self, shared: bool = False, poll: float = 0.02) -> None:
        while not self.try_acquire(shared):
            await asyncio.sleep(poll)
            poll = min(poll * 2, 0.25)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> "FileLock":
        await self.acquire_async()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
