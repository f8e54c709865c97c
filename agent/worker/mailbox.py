"""Mailbox: where an engine request's outputs wait for a task that awaits them.

The default sink of ``WorkerClient.add`` (the readiness canary, tests of the worker client);
the API's requests hand their outputs to their ``Generation`` instead, which handles each where
it is read. One consumer, producers on the same loop (the worker client's reader), never bounded:
the engine has already made the tokens. ``asyncio.Queue`` does much more (maxsize, many getters
and putters, a loop check on each call; 17 % of the agent's CPU at concurrency 200 on the H200
when every request had one). This is a deque and at most one waiting future.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> T:
        """The oldest item, waiting for one if there is none (one caller at a time)."""
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("a Mailbox has one consumer")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def take_all(self) -> list[T]:
        """Every item waiting now, oldest first (none: an empty list)."""
        items = list(self._items)
        self._items.clear()
        return items

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
