"""Spare room (``server.spare_room``): while loads keep finding their room short, the least wanted
idle model is evicted ahead of the next load, so that load finds its room at once instead of
waiting for a busy model's drain. Against a fake worker whose status reports the room its loads
leave (each model 10 bytes, the budget ``capacity`` of them); through a real worker and daemon:
the last test."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from agent.manager import manager as manager_module
from agent.manager.entries import State
from agent.worker.client import WorkerClient
from tests.integration.agent_harness import Daemon, publish_tiny
from tests.integration.manager_helpers import CTX, SEQS, budget_for_two, complete, model, wait_state
from tests.integration.test_manager_locks import FakeWorker, _manager, _waiting


class RoomWorker(FakeWorker):
    """A fake worker whose last status tells the room left: free = (capacity - loaded) x 10 bytes."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.state.memory = self._memory()

    def _memory(self) -> SimpleNamespace:
        return SimpleNamespace(free=10 * (self.capacity - len(self.loaded)), vacant=0)

    async def load(self, spec, evictable=None):
        out = await super().load(spec, evictable)
        self.state.memory = self._memory()
        return out

    async def unload(self, name: str) -> None:
        await super().unload(name)
        self.state.memory = self._memory()

    room = WorkerClient.room  # the real reading of the status this one keeps


def _spare(monkeypatch, tmp_path, names: str = "xyz", on: bool = True):
    if on:
        monkeypatch.setenv("INFIRE_SERVER__SPARE_ROOM", "true")  # off by default
    w = RoomWorker(capacity=2, load_s=0.01)
    models = ", ".join(f'{{"name": "{n}"}}' for n in names)
    return w, _manager(monkeypatch, tmp_path, w, f"[{models}]", list(names))


async def _short_for_z(mgr) -> None:
    """x and y loaded (the budget holds two), then z, whose room is short: x (the least recently
    used) is evicted for it."""
    for n in "xyz":
        await mgr.load(n)
    assert [mgr.get(n).state for n in "xyz"] == [State.CACHED, State.READY, State.READY]


def _used(mgr, name: str, requests: int) -> None:
    for _ in range(requests):
        with mgr.admit(name):
            pass


async def test_after_a_load_found_its_room_short_the_least_wanted_idle_model_leaves_ahead_of_the_next(
        monkeypatch, tmp_path) -> None:
    w, mgr = _spare(monkeypatch, tmp_path)
    await _short_for_z(mgr)
    assert mgr.get("y").state is State.READY  # z's load took x's room only
    v = mgr.keep_spare_room()
    assert v is not None and v.name == "y"  # idle, and used before z
    await v.task
    assert mgr.get("y").state is State.CACHED and w.state.memory.free == 10
    assert mgr.keep_spare_room() is None  # the room is there: nothing more leaves
    offers = len(w.offers)
    await mgr.load("x")  # the next load: in at once, nobody evicted for it
    assert len(w.offers) == offers + 1 and mgr.get("z").state is State.READY
    await mgr.close()


async def test_it_is_off_by_default_and_ends_with_the_pressure(monkeypatch, tmp_path) -> None:
    w, mgr = _spare(monkeypatch, tmp_path, on=False)
    await _short_for_z(mgr)
    assert mgr.keep_spare_room() is None and mgr.get("y").state is State.READY
    await mgr.close()
    monkeypatch.setenv("INFIRE_SERVER__SPARE_ROOM", "true")
    w, mgr = _spare(monkeypatch, tmp_path / "on")
    await _short_for_z(mgr)
    mgr._short_at -= manager_module.SPARE_PRESSURE_S + 1  # no load ran short for longer than the window
    assert mgr.keep_spare_room() is None and mgr.get("y").state is State.READY
    await mgr.close()


async def test_a_busy_model_or_one_more_wanted_than_the_loads_that_ran_short_stays(monkeypatch, tmp_path) -> None:
    w, mgr = _spare(monkeypatch, tmp_path)
    for n in "xy":
        await mgr.load(n)
    _waiting(mgr.get("z"), 2)  # two requests wait for z's load: it asks room for 2
    await mgr.load("z")
    assert mgr._short_claim == 2
    _waiting(mgr.get("z"), 0)  # admitted now (as admit_wait does once the load is ready)
    held = mgr.admit("y")
    held.__enter__()  # y serving: never evicted for spare room (a drain would stop its admissions)
    _used(mgr, "z", 6)  # z idle, but wanted more (6 requests) than about as much as the load that ran short
    assert mgr.keep_spare_room() is None
    held.__exit__(None, None, None)
    assert mgr.keep_spare_room() is mgr.get("y")  # idle now, and wanted less (1): it goes, z stays
    await mgr.get("y").task
    assert mgr.get("z").state is State.READY and mgr.get("y").state is State.CACHED
    await mgr.close()


async def test_one_at_a_time_and_only_on_a_status_that_saw_every_change(monkeypatch, tmp_path) -> None:
    w, mgr = _spare(monkeypatch, tmp_path)
    await _short_for_z(mgr)
    w.state.stale_models = {"z"}  # z's load is newer than the last status: its figures may be before it
    assert mgr.keep_spare_room() is None
    w.state.stale_models = set()
    w.capacity = 3  # ... and the room for one more opened (x, y, z of 30 bytes: 10 free)
    w.state.memory = w._memory()
    assert mgr.keep_spare_room() is None
    w.capacity = 2
    w.state.memory = w._memory()
    first = mgr.keep_spare_room()
    assert first is not None and mgr.keep_spare_room() is None  # the first still leaving
    await first.task
    await mgr.close()


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("manager-spare")
    src = make_tiny_model("llama")
    publish_tiny(make_tiny_model, tmp / "store", ("s-a", "s-b", "s-c"))
    models = [{"name": n, "max_model_len": CTX, "max_num_seqs": SEQS, "keep_alive": -1} for n in ("s-a", "s-b", "s-c")]
    d = Daemon(tmp, models=models, env={"INFIRE_GPU__CPU_MEMORY_BUDGET": str(budget_for_two(src)),
                                        "INFIRE_SERVER__SPARE_ROOM": "true"})
    d.start(timeout=120)
    yield d
    d.stop()


def test_through_the_daemon_the_next_load_finds_its_room_made(daemon) -> None:
    """Two tiny models fit the budget: the third's load evicts the least recently used; then the
    least wanted idle one leaves by itself, and the next model loads beside the third at once."""
    for n in ("s-a", "s-b"):
        assert complete(daemon, n)[0] == 200  # autoload: both fit
    assert complete(daemon, "s-c")[0] == 200  # its room short: s-a (idle, used first) evicted for it
    assert "evicted to make room for s-c" in model(daemon, "s-a")["reason"]
    b = wait_state(daemon, "s-b", {"cached"}, timeout=10)  # within a few keep-alive ticks
    assert b["reason"] == "evicted to keep room for the next load", b
    assert complete(daemon, "s-a")[0] == 200
    assert model(daemon, "s-c")["state"] == "ready"  # s-a loaded into the room kept for it
    logs = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    assert not [r for r in logs if r.get("event") == "evict_for_load" and r.get("model") == "s-a"]
