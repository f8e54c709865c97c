"""Worker process supervision, with the real worker process running without an engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from agent.worker import client as wc
from agent.worker import spawn as ws
from engine.load_spec import LoadSpec
from engine.model_info import ModelInfo
from engine.sampling import SamplingParams
from engine.worker import protocol as P
from tests.records import model_stats


async def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def _with_client(body: Callable[[wc.WorkerClient, list[int], list[int]], Awaitable[None]]) -> None:
    """Run ``body(client, ups, downs)`` on uvloop (what the daemon runs on) with a started client."""

    async def main() -> None:
        ups: list[int] = []
        downs: list[int] = []

        async def on_up() -> None:
            ups.append(c.state.pid or -1)

        async def on_down() -> None:
            downs.append(1)

        c = wc.WorkerClient({}, engine="none", on_up=on_up, on_down=on_down)
        await asyncio.wait_for(c.start(), 30)
        try:
            await body(c, ups, downs)
        finally:
            await c.stop(timeout=5)

    uvloop.run(main())


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch) -> None:
    monkeypatch.setattr(wc, "BACKOFF_MIN_S", 0.05)


def test_hello_heartbeat_and_refusals() -> None:
    async def body(client: wc.WorkerClient, ups: list[int], downs: list[int]) -> None:
        assert client.alive and client.state.device == "none" and ups == [client.state.pid]
        t = client.state.last_frame
        await _wait_for(lambda: client.state.last_frame > t, 3)  # heartbeats keep coming
        assert client.heartbeat_fresh() and client.progressing()
        with pytest.raises(wc.WorkerError, match="without an engine") as ei:
            await client.load(LoadSpec("m", "/nonexistent", max_model_len=64, max_num_seqs=2))
        assert ei.value.code == "no_engine"
        req = client.add("r1", "m", [1, 2], SamplingParams(max_tokens=2))
        err = await asyncio.wait_for(req.queue.get(), 5)
        assert isinstance(err, wc.WorkerError) and err.code == "no_engine"
        assert client.in_flight() == 0

    _with_client(body)


def test_sigkill_fails_in_flight_and_restarts() -> None:
    async def body(client: wc.WorkerClient, ups: list[int], downs: list[int]) -> None:
        first_pid = client.state.pid
        # A request the (engine-less) worker never answers before it dies: registered by hand.
        req = wc.EngineRequest("r-inflight", "m")
        client._streams[req.req_id] = req
        os.kill(first_pid, signal.SIGKILL)
        got = await asyncio.wait_for(req.queue.get(), 5)
        assert isinstance(got, wc.WorkerDied) and "signal 9" in str(got)
        assert downs == [1]
        with pytest.raises(wc.WorkerDied):
            client.add("r2", "m", [1], SamplingParams())
        await _wait_for(lambda: client.alive and client.state.pid != first_pid, 30)
        assert client.state.restarts == 1 and len(ups) == 2
        assert client.heartbeat_fresh()

    _with_client(body)


def test_wedged_worker_is_neither_fresh_nor_progressing() -> None:
    async def body(client: wc.WorkerClient, ups: list[int], downs: list[int]) -> None:
        pid = client.state.pid
        os.kill(pid, signal.SIGSTOP)  # a wedged worker: heartbeats stop
        try:
            await _wait_for(lambda: not client.heartbeat_fresh(), 10)
            assert not client.progressing()
        finally:
            os.kill(pid, signal.SIGCONT)
        await _wait_for(client.heartbeat_fresh, 5)
        assert client.state.pid == pid and downs == []

    _with_client(body)


def test_abort_all_fails_streams_with_the_reason() -> None:
    async def body(client: wc.WorkerClient, ups: list[int], downs: list[int]) -> None:
        reqs = [wc.EngineRequest(f"r{i}", "m") for i in range(3)]
        for r in reqs:
            client._streams[r.req_id] = r
        assert client.abort_all("shutting down", "shutting_down") == 3
        for r in reqs:
            err = r.queue.get_nowait()
            assert isinstance(err, wc.WorkerError) and err.code == "shutting_down"
        assert client.in_flight() == 0 and client.alive

    _with_client(body)


def test_stop_is_clean() -> None:
    async def main() -> None:
        c = wc.WorkerClient({}, engine="none")
        await asyncio.wait_for(c.start(), 30)
        proc = c._proc
        t0 = time.monotonic()
        await c.stop(timeout=5)
        assert proc.returncode == 0 and time.monotonic() - t0 < 3
        assert c.state.restarts == 0

    uvloop.run(main())


def test_a_previous_worker_still_alive_is_waited_for_before_ours_starts(tmp_path, monkeypatch) -> None:
    """The runtime dir's worker.pid names the last worker; a new agent whose predecessor's worker
    is still exiting (it holds the GPU) starts its own only once that one is gone, at most
    ws.PREVIOUS_WORKER_WAIT_S; a pid file naming anything else (garbage, a reused pid) is no reason
    to wait."""
    import subprocess
    import sys
    import threading

    run = tmp_path / "run"
    run.mkdir()
    options = {"sandbox_options": {"runtime_dir": str(run)}}
    # Stands in for the previous worker: an "engine.worker" for this runtime dir, exiting in 1.5 s.
    old = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(float(sys.argv[1]))", "1.5",
                            "engine.worker", str(run)])
    (run / ws.PID_FILE).write_text(f"{old.pid}\n")

    async def first() -> float:
        c = wc.WorkerClient(options, engine="none")
        await asyncio.wait_for(c.start(), 30)
        try:
            assert old.poll() is not None  # gone (reaped below by its parent, this test)
            assert (run / ws.PID_FILE).read_text().strip() == str(c.state.pid)  # ours is named now
            return c.state.spawn_at
        finally:
            await c.stop(timeout=5)

    t0 = time.monotonic()
    reaper = threading.Thread(target=old.wait, daemon=True)
    reaper.start()
    spawned = uvloop.run(first())
    assert spawned - t0 >= 1.0  # it waited for the old one's exit
    assert not (run / ws.PID_FILE).exists()  # stopped by its agent: nothing left to wait on
    # Garbage, or a live process that is not a worker of this runtime dir: no wait at all.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for content in ("not a pid", "-4", "9" * 40, str(other.pid)):
            (run / ws.PID_FILE).write_text(content)
            t0 = time.monotonic()
            assert uvloop.run(_spawn_at(options)) - t0 < 1.0, content
        # One that never exits is waited for only up to the bound.
        monkeypatch.setattr(ws, "PREVIOUS_WORKER_WAIT_S", 0.5)
        stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "engine.worker", str(run)])
        try:
            (run / ws.PID_FILE).write_text(str(stuck.pid))
            t0 = time.monotonic()
            assert 0.4 <= uvloop.run(_spawn_at(options)) - t0 < 5.0
        finally:
            stuck.kill()
            stuck.wait()
    finally:
        other.kill()
        other.wait()


async def _spawn_at(options: dict) -> float:
    c = wc.WorkerClient(options, engine="none")
    await asyncio.wait_for(c.start(), 30)
    try:
        return c.state.spawn_at
    finally:
        await c.stop(timeout=5)


def test_a_worker_spawned_before_the_loop_is_the_one_supervised() -> None:
    """The serve command starts the first worker before it has an event loop (its torch import
    then overlaps the agent's own imports); the client adopts exactly that process, and a
    client stopped before it ever ran still takes it down."""
    first = ws.spawn_worker({}, "none", None)

    async def adopt() -> None:
        c = wc.WorkerClient({}, engine="none", first=first)
        await asyncio.wait_for(c.start(), 30)
        try:
            assert c.state.pid == first.proc.pid and c.alive
            assert c.state.spawn_at == first.spawn_at <= first.spawned_at == c.state.spawned_at
        finally:
            await c.stop(timeout=5)
        assert first.proc.returncode == 0  # asked to shut down, not killed

    uvloop.run(adopt())
    never_run = ws.spawn_worker({}, "none", None)

    async def stop_at_once() -> None:
        await wc.WorkerClient({}, engine="none", first=never_run).stop(timeout=5)

    uvloop.run(stop_at_once())
    assert never_run.proc.returncode is not None and never_run.sock.fileno() == -1


def test_damaged_kernels_are_swept_before_the_workers_first_load(tmp_path, monkeypatch) -> None:
    """The agent sweeps the worker's Triton cache (cache/triton_cache.py) while the worker
    starts, and holds the first load until the sweep is done: a kernel whose metadata was cut
    short is gone by the time the worker reads the Load; a sound one stays."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    triton = tmp_path / "cache" / "triton"
    for key, meta in (("a" * 32, '{"name": "k"}'), ("b" * 32, '{"name": "k", "num_wa')):
        d = triton / key
        d.mkdir(parents=True)
        (d / "k.json").write_text(meta)
        (d / "k.cubin").write_bytes(b"\x7fELF")
        (d / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.json": str(d / "k.json"),
                                                                     "k.cubin": str(d / "k.cubin")}}))
    released = threading.Event()
    real_sweep = wc.sweep_triton_cache

    def slow_sweep(path: str) -> list[str]:
        assert path == str(triton)
        released.wait(10)
        return real_sweep(path)

    monkeypatch.setattr(wc, "sweep_triton_cache", slow_sweep)
    options = {"sandbox_options": {"cache_dir": str(tmp_path / "cache")}}

    async def main() -> None:
        c = wc.WorkerClient(options, engine="none")
        await asyncio.wait_for(c.start(), 30)
        try:
            load = asyncio.ensure_future(c.load(LoadSpec("m", str(tmp_path), max_model_len=64, max_num_seqs=2),
                                                timeout=10))
            await asyncio.sleep(0.3)
            assert not load.done() and not c._pending  # not sent: the sweep still runs
            released.set()
            with pytest.raises(wc.WorkerError):  # (an engine-less worker refuses every load)
                await load
            assert not (triton / ("b" * 32)).exists() and (triton / ("a" * 32) / "k.cubin").exists()
        finally:
            await c.stop(timeout=5)

    uvloop.run(main())


def test_a_load_or_unload_marks_the_models_last_status_stale() -> None:
    """The Status before a Loaded or an Unloaded describes the model's previous load: the client
    marks that model's row stale (a model's view reads its Loaded info instead) until the next
    Status; the rows themselves stay as the worker sent them, consistent with its memory split."""
    c = wc.WorkerClient({}, engine="none")
    old = model_stats(device_bytes=9_000)
    c._dispatch(P.Status(steps=1, busy=False, models={"m": old, "other": model_stats(device_bytes=5)}))
    c._dispatch(P.Loaded(model="m", info=ModelInfo("m", 8, 64, [2], 4_000, 10, 16), seconds=0.1))
    assert c.state.stale_models == {"m"} and c.state.models["m"] is old
    c._dispatch(P.Status(steps=2, busy=False, models={"m": model_stats(device_bytes=4_000),
                                                      "other": model_stats(device_bytes=5)}))
    assert not c.state.stale_models and c.state.models["m"].device_bytes == 4_000
    c._dispatch(P.Unloaded(model="m"))
    assert c.state.stale_models == {"m"}
    # what a drain is picked by leaves a stale row out too
    c._dispatch(P.Status(steps=3, busy=True, models={"m": model_stats(tokens_to_go=7),
                                                     "other": model_stats(tokens_to_go=3)}))
    assert c.tokens_to_go() == {"m": 7, "other": 3}
    c._dispatch(P.Unloaded(model="m"))
    assert c.tokens_to_go() == {"other": 3}
