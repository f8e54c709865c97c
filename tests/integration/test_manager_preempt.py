"""The manager's side of preemption for room, against a fake worker whose ``preempt`` pauses the
model's requests as ``Generation`` does (each waits in ``ModelManager.wait_back``): no
preemption once shutdown has begun (a drain lets the requests finish; a comeback never comes);
a model just back whose requests are all still paused is never drained before they resume; and
a model that comes back on other files (a pull meanwhile) does not resume them on those.
Through a real worker and daemon: test_manager_room.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent.manager.entries import ModelNotReady, State
from agent.worker.client import WorkerError
from tests.integration.test_manager_locks import FakeSource, FakeWorker, _manager


class PausingWorker(FakeWorker):
    """Every admitted request in the engine and resumable; a preemption pauses them all, each
    model's once (a model preempted once drains after, as the real rule has it)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.mgr: Any = None
        self.preempted: list[str] = []
        self.waits: list[asyncio.Task[None]] = []

    def preemptible(self, name: str, min_tokens_left: int = 0) -> int:
        e = self.mgr.get(name)
        return 0 if e.preempted or name in self.preempted else e.in_flight

    def preempt(self, name: str) -> int:
        self.preempted.append(name)
        n = self.mgr.get(name).in_flight
        self.waits.append(asyncio.ensure_future(self.mgr.wait_back(name, n)))
        return n


def _pausing(monkeypatch, tmp_path, names: list[str], cached: list[str], load_s: float = 0.02):
    monkeypatch.setenv("INFIRE_SERVER__PREEMPT_FOR_ROOM", "true")  # off by default
    w = PausingWorker(capacity=2, load_s=load_s)
    models = ", ".join(f'{{"name": "{n}"' + (', "pin": true}' if n == "p" else "}") for n in names)
    w.mgr = _manager(monkeypatch, tmp_path, w, f"[{models}]", cached)
    return w, w.mgr


async def _until(cond, seconds: float = 3.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def test_a_load_under_way_at_shutdown_drains_a_busy_model_instead_of_preempting_it(monkeypatch, tmp_path):
    w, mgr = _pausing(monkeypatch, tmp_path, ["p", "x", "a"], ["p", "x"])  # a: pulled first (0.3 s)
    for n in ("p", "x"):
        await mgr.load(n)
    held = mgr.admit("x")
    held.__enter__()  # x serving a request
    loading = mgr.load("a")  # an autoload under way when shutdown begins
    await asyncio.sleep(0.05)
    mgr.end_comebacks()
    await _until(lambda: mgr.get("x").state is not State.READY)  # the load needs x's room
    assert w.preempted == [] and mgr.get("x").state is State.DRAINING  # its request may finish
    held.__exit__(None, None, None)
    await asyncio.wait_for(loading, 3)
    assert mgr.get("a").state is State.READY and mgr.get("x").state is State.CACHED
    await mgr.close()


async def test_a_model_back_for_its_paused_requests_is_not_drained_before_they_resume(monkeypatch, tmp_path):
    """Between a comeback's READY and the paused requests' wake-up (a loop turn), another load's
    room search runs (its refusal read in the same batch of frames): the model is READY with
    requests in flight, all of them paused. Drained then, they would wait for a second comeback."""
    w, mgr = _pausing(monkeypatch, tmp_path, ["p", "x", "a", "b"], ["p", "x", "a", "b"], load_s=0.05)
    for n in ("p", "x"):
        await mgr.load(n)
    held = mgr.admit("x")
    held.__enter__()
    x = mgr.get("x")
    seen: list[tuple[list[str], int, int]] = []
    observe = x.observer

    def observer(e, prev) -> None:
        observe(e, prev)
        if e.state is State.READY and prev is State.LOADING and not seen:
            def room_search() -> None:  # queued ahead of the paused requests' wake-up
                seen.append(([v.name for v in mgr._planner.to_drain(6, exclude="b", tokens_to_go={})],
                             x.in_flight, x.preempted))
            asyncio.get_running_loop().call_soon(room_search)
    x.observer = observer
    await mgr.load("a")  # preempts x; x's comeback evicts a (idle) and loads x
    await asyncio.wait_for(w.waits[0], 3)  # resumed: no error
    assert w.preempted == ["x"] and seen == [([], 1, 1)]  # busy, all paused: not a drain candidate
    assert x.state is State.READY and sorted(w.loaded) == ["p", "x"]  # back, and staying
    held.__exit__(None, None, None)
    await mgr.close()


class VersionedSource(FakeSource):
    """A store that holds a new version of every model from its first pull on."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.pulled: set[str] = set()

    def version(self, name: str) -> str | None:
        return None if name not in self.cached else ("v2" if name in self.pulled else "v1")

    async def pull(self, name: str, verify: bool = False):
        path = await super().pull(name, verify)
        self.pulled.add(name)
        return path


async def _x_preempted_for_a(w: PausingWorker, mgr) -> tuple[Any, asyncio.Task[None]]:
    """p (pinned) and x loaded, x serving a request (its admission, held), a's load under way and
    x preempted for its room: (the admission, a's load)."""
    for n in ("p", "x"):
        await mgr.load(n)
    held = mgr.admit("x")
    held.__enter__()
    loading = mgr.load("a")
    await _until(lambda: w.preempted == ["x"])
    return held, loading


async def test_requests_paused_on_one_version_are_not_resumed_on_another(monkeypatch, tmp_path):
    w, mgr = _pausing(monkeypatch, tmp_path, ["p", "x", "a"], ["p", "x", "a"], load_s=0.05)
    mgr.source = VersionedSource(tmp_path, ["p", "x", "a"], pull_s=0.05)
    held, loading = await _x_preempted_for_a(w, mgr)
    assert mgr.pull("x") is None and mgr.get("x").needs_pull  # asked while x leaves: its comeback pulls
    await loading
    with pytest.raises(ModelNotReady, match="other files"):
        await asyncio.wait_for(w.waits[0], 5)
    assert mgr.get("x").state is State.READY and mgr.source.version("x") == "v2"  # the new version serves
    assert mgr.get("x").preempted == 0
    held.__exit__(None, None, None)
    await mgr.close()


async def test_paused_requests_end_with_shutting_down_when_shutdown_begins(monkeypatch, tmp_path):
    w, mgr = _pausing(monkeypatch, tmp_path, ["p", "x", "a"], ["p", "x", "a"], load_s=0.3)
    held, loading = await _x_preempted_for_a(w, mgr)
    mgr.end_comebacks()
    with pytest.raises(WorkerError) as ex:
        await asyncio.wait_for(w.waits[0], 3)
    assert ex.value.code == "shutting_down" and mgr.get("x").preempted == 0
    held.__exit__(None, None, None)
    await asyncio.wait_for(loading, 3)
    await mgr.close()
