"""Worker process supervision, with the real worker process running without an engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from agent import worker_client as wc


@pytest.fixture(scope="module")
def event_loop_policy():
    import uvloop

    return uvloop.EventLoopPolicy()  # what the daemon runs on


async def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def client(monkeypatch):
    monkeypatch.setattr(wc, "BACKOFF_MIN_S", 0.05)
    ups: list[int] = []
    downs: list[int] = []

    async def on_up() -> None:
        ups.append(c.state.pid or -1)

    async def on_down() -> None:
        downs.append(1)

    c = wc.WorkerClient({}, engine="none", on_up=on_up, on_down=on_down)
    c.ups, c.downs = ups, downs  # type: ignore[attr-defined]
    await asyncio.wait_for(c.start(), 30)
    yield c
    await c.stop(timeout=5)


async def test_hello_heartbeat_and_refusals(client) -> None:
    assert client.alive and client.state.device == "none"
    await _wait_for(lambda: client.state.phase == "idle" and client.state.last_frame > client.state.started_at, 5)
    # A heartbeat arrives at least every HEARTBEAT_INTERVAL_S; status frames too.
    t = client.state.last_frame
    await _wait_for(lambda: client.state.last_frame > t, 3)
    assert client.heartbeat_fresh() and client.progressing()
    with pytest.raises(wc.WorkerError, match="without an engine") as ei:
        await client.load("m", "/nonexistent", max_model_len=64, max_num_seqs=1)
    assert ei.value.code == "no_engine"
    req = client.add("r1", "m", [1, 2], {"max_tokens": 2})
    err = await asyncio.wait_for(req.queue.get(), 5)
    assert isinstance(err, wc.WorkerError) and err.code == "no_engine"
    assert client.in_flight() == 0


async def test_sigkill_fails_in_flight_and_restarts(client) -> None:
    first_pid = client.state.pid
    # A request the (engine-less) worker never answers before it dies: register one by hand.
    req = wc.EngineRequest("r-inflight", "m")
    client._streams[req.req_id] = req
    os.kill(first_pid, signal.SIGKILL)
    got = await asyncio.wait_for(req.queue.get(), 5)
    assert isinstance(got, wc.WorkerDied) and "signal 9" in str(got)
    assert client.downs == [1]
    with pytest.raises(wc.WorkerDied):
        client.add("r2", "m", [1], {})
    await _wait_for(lambda: client.alive and client.state.pid != first_pid, 30)
    assert client.state.restarts == 1 and len(client.ups) == 2
    assert client.heartbeat_fresh()


async def test_wedged_worker_is_neither_fresh_nor_progressing(client) -> None:
    pid = client.state.pid
    client._proc.send_signal(signal.SIGSTOP)  # a wedged worker: heartbeats stop
    try:
        await _wait_for(lambda: not client.heartbeat_fresh(), 10)
        assert not client.progressing()
    finally:
        client._proc.send_signal(signal.SIGCONT)
    await _wait_for(client.heartbeat_fresh, 5)
    assert client.state.pid == pid


async def test_stop_is_clean(monkeypatch) -> None:
    c = wc.WorkerClient({}, engine="none")
    await asyncio.wait_for(c.start(), 30)
    proc = c._proc
    t0 = time.monotonic()
    await c.stop(timeout=5)
    assert proc.returncode == 0 and time.monotonic() - t0 < 3
    assert c.state.restarts == 0
