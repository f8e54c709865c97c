"""agent.worker.mailbox.Mailbox: one request's outputs in order, a waiting get woken by a put,
take_all draining what is there, a cancelled or timed-out get leaving it usable, one consumer."""

from __future__ import annotations

import asyncio

import pytest

from agent.worker.mailbox import Mailbox


def test_order_wakeup_drain_and_cancel():
    async def main():
        box: Mailbox[int] = Mailbox()
        assert box.empty() and box.take_all() == []
        with pytest.raises(asyncio.QueueEmpty):
            box.get_nowait()
        getter = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        assert not getter.done()
        box.put_nowait(1)
        box.put_nowait(2)
        assert await getter == 1  # woken by the first put
        box.put_nowait(3)
        assert box.qsize() == 2 and box.take_all() == [2, 3] and box.empty()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(box.get(), 0.01)  # a timed-out get leaves no waiter behind
        box.put_nowait(4)
        assert await asyncio.wait_for(box.get(), 1) == 4
        first = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one consumer"):
            await box.get()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        box.put_nowait(5)
        assert box.get_nowait() == 5

    asyncio.run(main())
