"""ModelManager concurrency against a scripted worker (in-process, no engine): pulls and loads
of different models overlap while engine loads plan one at a time; one model's operations never
interleave; eviction offers only idle unpinned models and retries once; keep_alive."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.config import load_settings
from agent.http.admin_view import model_view
from agent.manager.entries import ManagerError, ModelNotReady, State
from agent.manager.manager import ModelManager
from agent.metrics import Metrics
from agent.worker.client import WorkerError
from engine.load_spec import LoadSpec
from engine.model_info import ModelInfo
from ops.bench.room_sim import SimSource
from tests.records import model_stats


class FakeWorker:
    """Loads take ``load_s``; a load is refused for room while ``capacity`` models are loaded."""

    def __init__(self, capacity: int = 99, load_s: float = 0.05) -> None:
        self.alive = True
        self.state = SimpleNamespace(engine_error="", models={}, stale_models=set())
        self.capacity, self.load_s = capacity, load_s
        self.loaded: list[str] = []
        self.offers: list[list[str]] = []
        self.expedited: list[str] = []
        self.active = self.max_active = 0

    async def load(self, spec: LoadSpec, evictable: list[str] | None = None) -> Any:
        self.offers.append(list(evictable or []))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.load_s)
            self._refuse_if_full(evictable)
            self.loaded.append(spec.name)
            return SimpleNamespace(info=ModelInfo(spec.name, 8, spec.max_model_len, [2], 6, 0, 16), timings={"total_s": 0.01})
        finally:
            self.active -= 1

    def _refuse_if_full(self, evictable: list[str] | None) -> None:
        if len(self.loaded) >= self.capacity:
            short = len(self.loaded) - self.capacity + 1
            evict = list(evictable or [])[:short] if len(evictable or []) >= short else []
            raise WorkerError("no room", "no_room", {"needed": 10, "free": 4, "budget": 20, "short": 6,
                                                     "evictable": 6 * len(evictable or []), "evict": evict})

    async def unload(self, name: str) -> None:
        await asyncio.sleep(0.01)
        self.loaded.remove(name)

    def expedite(self, name: str, on: bool = True) -> None:
        self.expedited.append(name if on else f"-{name}")

    def tokens_to_go(self) -> dict[str, int]:
        return {n: m.tokens_to_go for n, m in self.state.models.items()}

    def preemptible(self, name: str, min_tokens_left: int = 0) -> int:
        return 0  # admissions here never reach an engine: a busy model is drained (preemption:
        # test_manager_room.py, through a real worker)

    def preempt(self, name: str) -> int:
        return 0

    def broken_models(self) -> dict[str, str]:
        return {}


class FakeSource(SimSource):
    """The simulator's source with a pull that takes 0.3 s by default."""

    def __init__(self, root: Path, cached: list[str], pull_s: float = 0.3) -> None:
        super().__init__(root, cached, pull_s)


def _waiting(e: Any, requests: int) -> None:
    """``requests`` requests (one prompt each) waiting for ``e``'s load, as ``admit_wait`` counts them."""
    e.load_waiters = e.load_requests = requests


def _manager(monkeypatch, tmp_path: Path, worker: FakeWorker, models: str, cached: list[str]) -> ModelManager:
    monkeypatch.setenv("INFIRE_MODELS", models)
    return ModelManager(load_settings(), worker, FakeSource(tmp_path, cached), Metrics(), lambda p: object())


async def test_pull_and_load_of_other_models_overlap_engine_loads_do_not(monkeypatch, tmp_path) -> None:
    w = FakeWorker(load_s=0.1)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "x"}, {"name": "y"}, {"name": "z"}]', ["y", "z"])
    t0 = time.monotonic()
    pulling = mgr.load("x")  # pull (0.3 s) then load
    ly, lz = mgr.load("y"), mgr.load("z")
    await asyncio.gather(ly, lz)
    assert time.monotonic() - t0 < 0.3 and mgr.get("x").state is State.PULLING
    await pulling
    assert {mgr.get(n).state for n in "xyz"} == {State.READY}
    assert w.max_active == 1  # the room lock: one plan-and-load at a time


async def test_one_models_operations_are_serialised(monkeypatch, tmp_path) -> None:
    w = FakeWorker(load_s=0.2)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "x"}]', ["x"])
    task = mgr.load("x")
    with pytest.raises(ManagerError) as ex:
        mgr.unload("x")
    assert ex.value.retry_after and "loading" in str(ex.value)
    assert mgr.load("x") is task  # already loading: asking again joins that load, no second one
    with pytest.raises(ManagerError, match="loading with quantization none"):
        mgr.load("x", quantization="fp8")  # but not with other options
    await task
    assert mgr.get("x").lock.locked() is False
    await mgr.unload("x")
    assert mgr.get("x").state is State.CACHED and w.loaded == []


async def test_asking_again_joins_an_operation_and_a_load_follows_an_unload(monkeypatch, tmp_path) -> None:
    """What an operator's automation meets (a second attacker's finding: every one was a 409):
    an unload during its drain joins it; a load during an unload (or a pull) runs once that ends;
    a load during an autoload joins it."""
    w = FakeWorker(load_s=0.2)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "x"}]', ["x"])
    await mgr.load("x")
    held = mgr.admit("x")
    held.__enter__()  # a request in flight: the unload drains
    out = mgr.unload("x", drain_s=5.0)
    assert mgr.get("x").state is State.DRAINING and mgr.unload("x") is out
    back = mgr.load("x")  # after the unload, loaded again
    assert back is not None and not back.done() and mgr.get("x").state is State.DRAINING
    held.__exit__(None, None, None)
    await out
    assert mgr.get("x").state in (State.CACHED, State.LOADING)
    await back
    assert mgr.get("x").state is State.READY and len(w.offers) == 2
    # a load while an operator's pull runs follows it; during a load's own pull, joins it
    await mgr.unload("x")
    pulling = mgr.pull("x")
    assert pulling is not None and mgr.get("x").state is State.PULLING
    follows = mgr.load("x")
    assert follows is not pulling
    await follows
    assert pulling.done() and mgr.get("x").state is State.READY and len(w.offers) == 3
    await mgr.unload("x")
    mgr.get("x").needs_repair = True
    own = mgr.load("x")
    assert mgr.get("x").state is State.PULLING and mgr.load("x") is own
    await own
    assert mgr.get("x").state is State.READY and len(w.offers) == 4
    # the later word wins: an unload called after a load queued behind a drain calls it off
    held = mgr.admit("x")
    held.__enter__()
    out = mgr.unload("x", drain_s=5.0)
    queued = mgr.load("x")
    assert mgr.load("x") is queued  # one queued load a model
    assert mgr.unload("x") is out
    held.__exit__(None, None, None)
    await out
    await asyncio.wait([queued])
    assert queued.cancelled() and mgr.get("x").state is State.CACHED and len(w.offers) == 4
    # the manager's close calls off what is queued; nothing starts after it
    await mgr.load("x")
    held = mgr.admit("x")
    held.__enter__()
    out = mgr.unload("x", drain_s=0.2)
    queued = mgr.load("x")
    await mgr.close()
    assert queued.cancelled() and len(w.offers) == 5


async def test_eviction_offers_idle_unpinned_lru_then_drains_the_lru_busy_one(monkeypatch, tmp_path) -> None:
    w = FakeWorker(capacity=3, load_s=0.01)
    models = '[{"name": "p", "pin": true}, {"name": "busy"}, {"name": "old"}, {"name": "new"}, {"name": "n"}]'
    mgr = _manager(monkeypatch, tmp_path, w, models, ["p", "busy", "old", "new", "n"])
    for n in ("p", "busy", "old"):
        await mgr.load(n)
    busy = mgr.admit("busy")
    busy.__enter__()  # a request in flight on "busy"
    mgr.get("old").last_used_mono -= 10  # least recently used
    await mgr.load("new")
    assert w.offers[-2] == ["old"] and w.offers[-1] == []  # never p (pinned) nor busy (in flight)
    assert mgr.get("old").state is State.CACHED and "make room for new" in mgr.get("old").reason
    # Nothing idle and unpinned left but "new": it goes for "n"; then nothing can go.
    await mgr.load("n")
    assert mgr.get("new").state is State.CACHED
    # Nothing idle and unpinned: the load drains the busy model nearest to idle (the engine's
    # tokens_to_go: "busy"'s request has 3 tokens to go, n's 100, though n is the least recently
    # used), enough to cover the shortfall (6 B, one model here); it admits nothing more, the
    # engine steps it first, and once its request ends it goes.
    n = mgr.get("n")
    n.in_flight += 1  # "n" busy too, as wanted as "busy" (one request each)
    n.note_request(time.monotonic())
    n.last_used_mono -= 20
    w.state.models = {"busy": model_stats(running=1, tokens_to_go=3), "n": model_stats(running=1, tokens_to_go=100)}
    loading = mgr.load("old")
    for _ in range(100):
        await asyncio.sleep(0.01)
        if mgr.get("busy").state is State.DRAINING:
            break
    assert mgr.get("busy").state is State.DRAINING and w.expedited == ["busy"]
    assert mgr.get("n").state is State.READY and mgr.get("old").state is State.LOADING
    with pytest.raises(ModelNotReady, match="draining"):
        mgr.admit("busy")
    busy.__exit__(None, None, None)  # its request ends
    await loading
    assert mgr.get("old").state is State.READY and set(w.loaded) == {"p", "n", "old"}
    b = mgr.get("busy")
    assert b.state is State.CACHED and "drained to make room for old" in b.reason
    # Nothing could ever make room (the rest pinned): refused at once, with the numbers.
    for n in ("n", "old"):
        mgr.set_pin(n, True)
    await mgr.load("busy")
    e = mgr.get("busy")
    assert e.state is State.FAILED and e.refusal["short"] == 6 and "short by" in e.reason
    assert w.offers[-1] == [] and set(w.loaded) == {"p", "n", "old"} and w.expedited == ["busy"]


async def test_the_least_wanted_model_goes_first_not_the_least_recently_used(monkeypatch, tmp_path) -> None:
    """Demand, not recency alone: a model asked for five times goes after one asked for once,
    though that one was used last; demand decays (DEMAND_TAU_S), so an old favourite fades."""
    from agent.manager.entries import DEMAND_TAU_S

    w = FakeWorker(capacity=2, load_s=0.01)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "hot"}, {"name": "cold"}, {"name": "new"}]',
                   ["hot", "cold", "new"])
    for n in ("hot", "cold"):
        await mgr.load(n)
    for _ in range(5):
        with mgr.admit("hot"):
            pass
    with mgr.admit("cold"):
        pass  # the most recent use
    await mgr.load("new")
    assert mgr.get("cold").state is State.CACHED and mgr.get("hot").state is State.READY
    hot, now = mgr.get("hot"), time.monotonic()
    assert 4.9 < hot.wanted(now) <= 5.0
    assert abs(hot.wanted(now + DEMAND_TAU_S) - hot.wanted(now) / 2.718281828) < 1e-3


async def test_two_loads_short_of_room_each_drain_their_own_model_at_once(monkeypatch, tmp_path) -> None:
    """Two loads on a full node of busy models: each drains a model of its own (promised to it),
    both drains run at once (the room lock is not held over a room wait), and each load takes
    the room its own drain made; no load waits for the other's drain."""
    w = FakeWorker(capacity=3, load_s=0.01)
    models = '[{"name": "p", "pin": true}, {"name": "x"}, {"name": "y"}, {"name": "a"}, {"name": "b"}]'
    mgr = _manager(monkeypatch, tmp_path, w, models, ["p", "x", "y", "a", "b"])
    for n in ("p", "x", "y"):
        await mgr.load(n)
    held = {n: mgr.admit(n) for n in ("x", "y")}
    for h in held.values():
        h.__enter__()
    w.state.models = {"x": model_stats(running=1, tokens_to_go=5), "y": model_stats(running=1, tokens_to_go=9)}
    _waiting(mgr.get("a"), 1)  # a request waits for a: once up, it is not b's to evict
    la = mgr.load("a")
    await asyncio.sleep(0.05)
    _waiting(mgr.get("b"), 1)  # as wanted as a: a's coming does not make b spare x or y
    lb = mgr.load("b")
    for _ in range(100):
        await asyncio.sleep(0.01)
        if mgr.get("y").state is State.DRAINING:
            break
    # x (nearest to idle) drains for a; b, finding x promised to a, drains y for itself
    assert mgr.get("x").state is State.DRAINING and mgr.get("y").state is State.DRAINING
    assert mgr._drains == {"x": "a", "y": "b"} and w.expedited == ["x", "y"]
    held["x"].__exit__(None, None, None)
    await la
    assert mgr.get("a").state is State.READY and mgr.get("b").state is State.LOADING
    held["y"].__exit__(None, None, None)
    await lb
    assert mgr.get("b").state is State.READY and set(w.loaded) == {"p", "a", "b"}
    assert "drained to make room for a" in mgr.get("x").reason and "for b" in mgr.get("y").reason
    assert mgr._drains == {} and w.max_active == 1  # promises end with their loads; one engine load at a time


class ByteWorker(FakeWorker):
    """Refuses for room by bytes as the engine does: ``evict`` is the shortest prefix of the
    offer that makes room, ``short`` what is missing beyond the whole offer."""

    def __init__(self, sizes: dict[str, int], budget: int) -> None:
        super().__init__()
        self.sizes, self.budget, self.held = sizes, budget, {}

    async def load(self, spec: LoadSpec, evictable: list[str] | None = None) -> Any:
        self.offers.append(list(evictable or []))
        await asyncio.sleep(0.01)
        need, free = self.sizes[spec.name], self.budget - sum(self.held.values())
        if need > free:
            offer = [m for m in (evictable or []) if m in self.held]
            room, evict = free, []
            for m in offer:
                if room >= need:
                    break
                evict.append(m)
                room += self.held[m]
            offered = sum(self.held[m] for m in offer)
            raise WorkerError("no room", "no_room", {"needed": need, "free": free, "budget": self.budget,
                                                     "evictable": offered, "short": max(0, need - free - offered),
                                                     "evict": evict if room >= need else []})
        self.held[spec.name] = need
        self.loaded.append(spec.name)
        return SimpleNamespace(info=ModelInfo(spec.name, 8, spec.max_model_len, [2], need, 0, 16), timings={})

    async def unload(self, name: str) -> None:
        await asyncio.sleep(0.01)
        self.held.pop(name)
        self.loaded.remove(name)


async def _serving(mgr: ModelManager, loads: str, busy: str, wanted: str) -> list[Any]:
    """Load ``loads`` in order, hold one request in flight on each of ``busy`` (their admissions,
    in order: ``__exit__`` ends each), and admit five more, ended, to ``wanted`` (the most wanted)."""
    for n in loads:
        await mgr.load(n)
    held = [mgr.admit(n) for n in busy]
    for h in held:
        h.__enter__()
    for _ in range(5):
        with mgr.admit(wanted):
            pass
    return held


async def test_a_drain_covers_what_the_idle_models_cannot_and_no_more(monkeypatch, tmp_path) -> None:
    """Budget 95; p (20, pinned), z (10, idle), x (25, busy, once), y (30, busy, the most wanted).
    Loading a (40): z alone cannot make room (short 20 beyond it), so x is drained (it covers the
    20), never y as well; once x is gone z is evicted and a loads, y serving throughout."""
    sizes = {"p": 20, "z": 10, "x": 25, "y": 30, "a": 40}
    w = ByteWorker(sizes, 95)
    models = json.dumps([{"name": "p", "pin": True}] + [{"name": n} for n in "zxya"])
    mgr = _manager(monkeypatch, tmp_path, w, models, list(sizes))
    hx, hy = await _serving(mgr, "pzxy", busy="xy", wanted="y")
    loading = mgr.load("a")
    await asyncio.sleep(0.1)
    assert mgr._drains == {"x": "a"} and mgr.get("y").state is State.READY
    hx.__exit__(None, None, None)
    await loading
    assert mgr.get("a").state is State.READY and mgr.get("y").state is State.READY
    assert mgr.get("z").state is State.CACHED and "evicted to make room for a" in mgr.get("z").reason
    assert set(w.held) == {"p", "y", "a"} and w.expedited == ["x"]
    hy.__exit__(None, None, None)


async def test_a_drain_its_load_no_longer_needs_is_called_off(monkeypatch, tmp_path) -> None:
    """Budget 60; p (20, pinned), x (20, busy, the least wanted), y (20, busy). Loading a (20)
    drains x. When y goes idle first, y is evicted, a loads into its room, and x's drain is called
    off: x never left the engine, serves again, and its expedite flag is taken back. A load
    refused past its deadline calls off its drain the same way: nothing unloaded for nobody."""
    monkeypatch.setenv("INFIRE_SERVER__AUTOLOAD_TIMEOUT", "1s")  # the refused load's deadline
    sizes = {"p": 20, "x": 20, "y": 20, "a": 20}
    w = ByteWorker(sizes, 60)
    models = json.dumps([{"name": "p", "pin": True}] + [{"name": n} for n in "xya"])
    mgr = _manager(monkeypatch, tmp_path, w, models, list(sizes))
    hx, hy = await _serving(mgr, "pxy", busy="xy", wanted="y")
    loading = mgr.load("a")
    await asyncio.sleep(0.1)
    assert mgr._drains == {"x": "a"} and mgr.get("x").state is State.DRAINING
    hy.__exit__(None, None, None)  # y idle: the load wakes, evicts it and loads
    await loading
    await asyncio.sleep(0.05)
    assert mgr.get("a").state is State.READY and mgr.get("y").state is State.CACHED
    x = mgr.get("x")
    assert x.state is State.READY and "drain called off" in x.reason and x.want_loaded and not x.busy
    assert mgr._drains == {} and w.expedited == ["x", "-x"] and "x" in w.held
    with mgr.admit("x"):  # it admits again
        assert x.in_flight == 2
    hx.__exit__(None, None, None)

    # x (wanted) and a (not yet) busy past y's deadline: a is drained for y, y is refused, a stays.
    ha, hx = await _serving(mgr, "", busy="ax", wanted="x")
    loading = mgr.load("y")
    await asyncio.sleep(0.1)
    assert mgr._drains == {"a": "y"} and mgr.get("a").state is State.DRAINING
    await loading
    y = mgr.get("y")
    assert y.state is State.FAILED and "short by" in y.reason, y.reason
    await asyncio.sleep(0.05)
    assert mgr.get("a").state is State.READY and "drain called off" in mgr.get("a").reason
    assert {"p", "x", "a"} == set(w.held) and mgr._drains == {} and w.expedited[-2:] == ["a", "-a"]
    ha.__exit__(None, None, None)
    hx.__exit__(None, None, None)


async def test_a_promise_ends_with_its_drain_and_never_calls_off_a_later_unload(monkeypatch, tmp_path) -> None:
    """x and y drained for a; x gone, loaded again and unloaded by an operator while a still
    waits on y: when a is refused at its deadline, y's drain is called off and the operator's
    unload of x goes on (x was promised to a for its first drain only)."""
    monkeypatch.setenv("INFIRE_SERVER__AUTOLOAD_TIMEOUT", "1s")
    sizes = {"p": 20, "x": 20, "y": 20, "a": 40}
    w = ByteWorker(sizes, 60)
    mgr = _manager(monkeypatch, tmp_path, w, json.dumps([{"name": "p", "pin": True}] + [{"name": n} for n in "xya"]),
                   list(sizes))
    hx, hy = await _serving(mgr, "pxy", busy="xy", wanted="y")
    loading = mgr.load("a")  # needs x's and y's room: both drained for it
    await asyncio.sleep(0.1)
    assert mgr._drains == {"x": "a", "y": "a"}
    hx.__exit__(None, None, None)  # x drains and goes: its promise ends with the drain
    await asyncio.sleep(0.1)
    assert mgr.get("x").state is State.CACHED and mgr._drains == {"y": "a"}
    await mgr.load("x")  # its 20 are free; a is still short
    h = mgr.admit("x")
    h.__enter__()
    unloading = mgr.unload("x")  # drains its request
    await loading  # a refused past its deadline
    await asyncio.sleep(0.05)
    assert mgr.get("a").state is State.FAILED
    x = mgr.get("x")
    assert x.state is State.DRAINING and "drain called off" not in x.reason, x.reason
    assert mgr.get("y").state is State.READY  # y's drain, still a's, is called off
    h.__exit__(None, None, None)
    await unloading
    assert x.state is State.CACHED
    hy.__exit__(None, None, None)


async def test_a_long_generation_is_drained_last_and_a_model_waited_for_never(monkeypatch, tmp_path) -> None:
    """A drain is stepped ahead of every other model, so a model with more than DRAIN_TOKENS_MAX
    tokens to go is the last choice whatever its demand; one that requests wait for (its
    load_waiters) is never drained."""
    from agent.manager.room import DRAIN_TOKENS_MAX

    w = FakeWorker(capacity=3, load_s=0.01)
    models = '[{"name": "p", "pin": true}, {"name": "long"}, {"name": "hot"}, {"name": "new"}]'
    mgr = _manager(monkeypatch, tmp_path, w, models, ["p", "long", "hot", "new"])
    for n in ("p", "long", "hot"):
        await mgr.load(n)
    held = [mgr.admit(n) for n in ("long", "hot", "hot", "hot")]
    for h in held:
        h.__enter__()
    w.state.models = {"long": model_stats(running=1, tokens_to_go=DRAIN_TOKENS_MAX + 1),
                      "hot": model_stats(running=3, tokens_to_go=40)}
    planner = mgr._planner
    assert [v.name for v in planner.to_drain(6, "new", w.tokens_to_go())] == ["hot"]
    mgr.get("hot").load_waiters = 1
    assert [v.name for v in planner.to_drain(6, "new", w.tokens_to_go())] == ["long"]
    for h in held:
        h.__exit__(None, None, None)


async def test_a_third_load_waits_for_the_two_ahead_before_draining(monkeypatch, tmp_path) -> None:
    """Two loads drain at once, not more (DRAINING_LOADS_MAX): a queue of loads must not drain
    every resident model together. The third waits (a model leaving for another load is waited
    on, never a reason to refuse), drains once one of the two is in, and every load ends ready."""
    from agent.manager.manager import DRAINING_LOADS_MAX

    assert DRAINING_LOADS_MAX == 2
    w = FakeWorker(capacity=4, load_s=0.01)
    names = ("p", "x", "y", "z", "a", "b", "c")
    mgr = _manager(monkeypatch, tmp_path, w, json.dumps([{"name": "p", "pin": True}] + [{"name": n} for n in names[1:]]),
                   list(names))
    for n in ("p", "x", "y", "z"):
        await mgr.load(n)
    held = {n: mgr.admit(n) for n in ("x", "y", "z")}
    for h in held.values():
        h.__enter__()
    loads = {}
    for n in ("a", "b", "c"):
        _waiting(mgr.get(n), 2)  # more wanted than the busy x, y, z (one request each)
        loads[n] = mgr.load(n)
        await asyncio.sleep(0.05)
    assert sorted(mgr._drains.values()) == ["a", "b"] and mgr.get("c").state is State.LOADING
    draining = {v for v in mgr._drains}
    assert len(draining) == 2 and all(mgr.get(v).state is State.DRAINING for v in draining)
    (rest,) = set(held) - draining
    assert mgr.get(rest).state is State.READY  # the third load drains nothing yet
    for n in ("a", "b"):
        _waiting(mgr.get(n), 1)  # requests wait for them: never evictable as they come up
    for v in sorted(draining):
        held[v].__exit__(None, None, None)
    await asyncio.gather(loads["a"], loads["b"])
    for n in ("a", "b"):  # ... and go in
        _waiting(mgr.get(n), 0)
        mgr.admit(n).__enter__()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if mgr.get(rest).state is State.DRAINING:
            break
    assert mgr._drains == {rest: "c"}
    held[rest].__exit__(None, None, None)
    await loads["c"]
    assert {mgr.get(n).state for n in "abc"} == {State.READY} and set(w.loaded) == {"p", "a", "b", "c"}


async def _request(mgr: ModelManager, name: str) -> Any:
    """One request as the API makes it: admitted (after its model's autoload) and in flight, no
    await between; the caller ends it with ``__exit__``."""
    h = await mgr.admit_wait(name)
    h.__enter__()
    return h


class PromptWorker(FakeWorker):
    """Refuses for room at once, as the engine does (its check comes before any allocation);
    a load that fits takes ``load_s``."""

    async def load(self, spec: LoadSpec, evictable: list[str] | None = None) -> Any:
        try:
            self._refuse_if_full(evictable)
        except WorkerError:
            self.offers.append(list(evictable or []))
            raise
        return await super().load(spec, evictable)


async def _spare_setup(monkeypatch, tmp_path) -> tuple[ModelManager, FakeWorker, Any]:
    """Room for three: p (pinned), h (six requests, one in flight: the most wanted) and o (idle,
    never asked for). A request for c evicts o and loads c."""
    w = PromptWorker(capacity=3, load_s=0.2)
    models = '[{"name": "p", "pin": true}, {"name": "h"}, {"name": "o"}, {"name": "c"}, {"name": "n"}]'
    mgr = _manager(monkeypatch, tmp_path, w, models, ["p", "h", "o", "c", "n"])
    for n in ("p", "h", "o"):
        await mgr.load(n)
    for _ in range(5):
        with mgr.admit("h"):
            pass
    hh = mgr.admit("h")
    hh.__enter__()
    return mgr, w, hh


async def test_a_load_spares_a_more_wanted_model_while_a_colder_one_is_on_its_way(monkeypatch, tmp_path) -> None:
    """A request for n comes while c, as cold as n, is in its engine load for its own request
    and h, the most wanted, is the only model ready: n does not drain h (its requests would wait
    for a whole reload). It waits for c, drains c once c's request is in, and loads into c's
    room; h serves throughout, never drained or slowed by an expedite."""
    from agent.manager.manager import ROOM_PATIENCE_S

    mgr, w, hh = await _spare_setup(monkeypatch, tmp_path)
    w.state.models = {"h": model_stats(running=1, tokens_to_go=5), "c": model_stats(running=1, tokens_to_go=50)}
    rc = asyncio.ensure_future(_request(mgr, "c"))
    await asyncio.sleep(0.1)  # refused for room at once, o evicted, c's load under way (0.2 s)
    assert mgr.get("c").in_worker and mgr.get("o").state is State.CACHED
    t0 = time.monotonic()
    rn = asyncio.ensure_future(_request(mgr, "n"))
    hc = await rc
    for _ in range(100):
        await asyncio.sleep(0.01)
        if mgr.get("c").state is State.DRAINING:
            break
    assert mgr.get("c").state is State.DRAINING and mgr._drains == {"c": "n"}
    assert mgr.get("h").state is State.READY and w.expedited == ["c"]
    hc.__exit__(None, None, None)
    hn = await rn
    assert time.monotonic() - t0 < ROOM_PATIENCE_S  # waited for c's turn, not for the patience
    assert set(w.loaded) == {"p", "h", "n"} and mgr.get("h").state is State.READY
    assert "drained to make room for n" in mgr.get("c").reason
    for h in (hh, hn):
        h.__exit__(None, None, None)


async def test_the_patience_for_a_colder_model_is_bounded(monkeypatch, tmp_path) -> None:
    """The colder model c has a long generation to go (a drain would hold every model), so n
    waits for it, but at most ROOM_PATIENCE_S: then the more wanted h, a few tokens from idle,
    is drained for n after all. A load with no colder model on its way never waits to spare."""
    import agent.manager.manager as manager_module
    from agent.manager.room import DRAIN_TOKENS_MAX

    monkeypatch.setattr(manager_module, "ROOM_PATIENCE_S", 0.6)
    mgr, w, hh = await _spare_setup(monkeypatch, tmp_path)
    w.state.models = {"h": model_stats(running=1, tokens_to_go=5),
                      "c": model_stats(running=1, tokens_to_go=DRAIN_TOKENS_MAX + 1)}
    hc = await _request(mgr, "c")
    t0 = time.monotonic()
    rn = asyncio.ensure_future(_request(mgr, "n"))
    await asyncio.sleep(0.4)
    assert mgr._drains == {} and mgr.get("h").state is State.READY  # sparing h, waiting on c
    for _ in range(100):
        await asyncio.sleep(0.01)
        if mgr.get("h").state is State.DRAINING:
            break
    assert mgr._drains == {"h": "n"} and time.monotonic() - t0 >= 0.6
    hh.__exit__(None, None, None)
    hn = await rn
    assert set(w.loaded) == {"p", "c", "n"} and mgr.get("c").state is State.READY
    # Nothing colder on its way (c is the only other model and more wanted than o): at once.
    hn.__exit__(None, None, None)
    for _ in range(3):
        with mgr.admit("c"):
            pass
    t0 = time.monotonic()
    ho = await _request(mgr, "o")
    assert time.monotonic() - t0 < 0.6 and mgr.get("n").state is State.CACHED
    for h in (hc, ho):
        h.__exit__(None, None, None)


async def _hot_and_cold(monkeypatch, tmp_path, w: FakeWorker, busy_h: bool) -> tuple[ModelManager, Any, Any]:
    """Room for three: p (pinned), h (six requests: the most wanted; one in flight if ``busy_h``)
    and c (one request in flight: as cold as a new model's first request)."""
    models = '[{"name": "p", "pin": true}, {"name": "h"}, {"name": "c"}, {"name": "n"}]'
    mgr = _manager(monkeypatch, tmp_path, w, models, ["p", "h", "c", "n"])
    for m in ("p", "h", "c"):
        await mgr.load(m)
    for _ in range(6):
        with mgr.admit("h"):
            pass
    hh = mgr.admit("h") if busy_h else None
    if hh is not None:
        hh.__enter__()
    hc = mgr.admit("c")
    hc.__enter__()
    return mgr, hh, hc


async def test_sparing_ends_in_time_for_a_short_deadline(monkeypatch, tmp_path) -> None:
    """With autoload_timeout (1 s) under ROOM_PATIENCE_S, sparing ends at half the deadline: the
    idle h is evicted for n then, instead of n being refused with h idle beside it."""
    monkeypatch.setenv("INFIRE_SERVER__AUTOLOAD_TIMEOUT", "1s")
    from agent.manager.room import DRAIN_TOKENS_MAX

    w = FakeWorker(capacity=3, load_s=0.05)
    mgr, _, hc = await _hot_and_cold(monkeypatch, tmp_path, w, busy_h=False)
    w.state.models = {"c": model_stats(running=1, tokens_to_go=DRAIN_TOKENS_MAX + 1)}  # no cheap drain
    hn = await _request(mgr, "n")
    assert mgr.get("n").state is State.READY and mgr.get("h").state is State.CACHED
    for h in (hn, hc):
        h.__exit__(None, None, None)


async def test_a_colder_model_going_idle_during_a_refused_load_is_seen_at_once(monkeypatch, tmp_path) -> None:
    """c's last request ends while n's Load (refused for room) is in the worker: n's wait was
    taken before that Load, so it wakes at once and evicts the now idle c, never waiting out the
    patience."""
    w = FakeWorker(capacity=3, load_s=0.2)
    mgr, hh, hc = await _hot_and_cold(monkeypatch, tmp_path, w, busy_h=True)
    w.state.models = {"h": model_stats(running=1, tokens_to_go=5), "c": model_stats(running=1, tokens_to_go=5)}
    t0 = time.monotonic()
    rn = asyncio.ensure_future(_request(mgr, "n"))
    await asyncio.sleep(0.1)  # n's first Load is in the worker
    hc.__exit__(None, None, None)
    hn = await rn
    assert time.monotonic() - t0 < 1.0 and mgr.get("h").state is State.READY and mgr.get("c").state is State.CACHED
    for h in (hn, hh):
        h.__exit__(None, None, None)


async def test_a_request_of_many_choices_claims_as_one_request(monkeypatch, tmp_path) -> None:
    """Demand counts HTTP requests (``wanted``): one request of eight choices waiting for n claims
    one, so h (six requests) is still spared for it."""
    w = FakeWorker(capacity=99, load_s=0.3)
    mgr, _, hc = await _hot_and_cold(monkeypatch, tmp_path, w, busy_h=False)
    rn = asyncio.ensure_future(mgr.admit_wait("n", choices=8))
    await asyncio.sleep(0.05)
    n = mgr.get("n")
    assert n.load_waiters == 8 and 0.99 < n.claim(time.monotonic()) <= 1.0
    assert "h" not in mgr._planner.evictable(exclude="n", most=n.claim(time.monotonic()))
    (await rn).__enter__().in_flight -= 8
    hc.__exit__(None, None, None)


async def test_a_load_cut_off_by_a_worker_death_is_not_a_colder_model_on_its_way(monkeypatch, tmp_path) -> None:
    w = FakeWorker(capacity=99, load_s=5.0)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "x"}, {"name": "n"}]', ["x", "n"])
    t = mgr.load("x")
    await asyncio.sleep(0.1)
    await mgr.on_worker_down()
    await asyncio.gather(t, return_exceptions=True)
    x, n = mgr.get("x"), mgr.get("n")
    assert x.state is State.LOADING and not x.busy  # waiting for the worker to come back
    _waiting(n, 1)
    assert mgr._planner.colder_coming(n, {}) == []


async def test_keep_alive_unloads_idle_unpinned_only(monkeypatch, tmp_path) -> None:
    w = FakeWorker()
    models = ('[{"name": "idle", "keep_alive": "0.2s"}, {"name": "pinned", "pin": true, "keep_alive": "0.2s"},'
              ' {"name": "used", "keep_alive": "0.2s"}, {"name": "never", "keep_alive": -1}]')
    mgr = _manager(monkeypatch, tmp_path, w, models, ["idle", "pinned", "used", "never"])
    for n in ("idle", "pinned", "used", "never"):
        await mgr.load(n)
    held = mgr.admit("used").__enter__()
    ka = asyncio.create_task(mgr.run_keep_alive(tick=0.05))
    try:
        await asyncio.sleep(0.6)
        assert mgr.get("idle").state is State.CACHED and mgr.get("idle").reason == "idle past keep_alive"
        assert {mgr.get(n).state for n in ("pinned", "used", "never")} == {State.READY}
        held.in_flight -= 1
        held.touch()
        await asyncio.sleep(0.5)
        assert mgr.get("used").state is State.CACHED
    finally:
        ka.cancel()


async def test_autoload_waits_for_the_load_and_times_out_with_retry_after(monkeypatch, tmp_path) -> None:
    w = FakeWorker(load_s=0.1)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "a"}, {"name": "b", "autoload": false}]', ["a", "b"])
    with pytest.raises(ModelNotReady):
        await mgr.admit_wait("b")  # autoload off for b
    with await mgr.admit_wait("a") as e:
        assert e.state is State.READY
    await mgr.unload("a")
    w.load_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(ModelNotReady) as ex:
        await mgr.admit_wait("a", timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 0.8 and ex.value.retry_after and ex.value.status == 503
    await mgr.get("a").task


async def test_max_queue_bounds_requests_in_flight(monkeypatch, tmp_path) -> None:
    from agent.manager.entries import QueueFull

    mgr = _manager(monkeypatch, tmp_path, FakeWorker(), '[{"name": "q", "max_num_seqs": 4, "max_queue": 3},'
                   ' {"name": "d", "max_num_seqs": 4}]', ["q", "d"])
    assert mgr.get("d").queue_limit == 8  # default: 2 x max_num_seqs
    await mgr.load("q")
    held = [mgr.admit("q").__enter__() for _ in range(3)]
    with pytest.raises(QueueFull) as ex:
        mgr.admit("q")
    assert ex.value.status == 503 and ex.value.retry_after
    assert len(held) == 3 and model_view(mgr, mgr.get("q"))["queue_limit"] == 3
    mgr.get("q").in_flight = 0  # the three leave
    # the limit counts engine requests (prompts × n), not HTTP requests
    wide = mgr.admit("q", choices=2)
    wide.__enter__()
    with pytest.raises(QueueFull):
        mgr.admit("q", choices=2)
    assert mgr.admit("q", choices=1) and mgr.get("q").in_flight == 2
    wide.__exit__(None, None, None)
    assert mgr.get("q").in_flight == 0
    with mgr.admit("q", choices=64) as e:  # nothing in flight: a request wider than the limit goes
        assert e.in_flight == 64


async def test_autoload_pulls_a_configured_model_that_is_only_in_the_store(monkeypatch, tmp_path) -> None:
    w = FakeWorker()
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "x"}]', [])  # autoload on by default
    assert mgr.get("x").state is State.ABSENT
    with await mgr.admit_wait("x") as e:  # pulled (0.3 s), loaded, then admitted
        assert e.state is State.READY and w.loaded == ["x"]
    mgr2 = _manager(monkeypatch, tmp_path / "b", FakeWorker(), '[{"name": "y"}]', [])
    mgr2.source.pull_s = 2.0
    with pytest.raises(ModelNotReady) as ex:  # past the bound: a 503 while the pull goes on
        await mgr2.admit_wait("y", timeout=0.2)
    assert ex.value.retry_after and mgr2.get("y").state is State.PULLING
    await mgr2.get("y").task
    assert mgr2.get("y").state is State.READY


class _HangingWorker(FakeWorker):
    """A worker whose loads of ``hang`` never answer (the worker dies meanwhile)."""

    def __init__(self, hang: str) -> None:
        super().__init__()
        self.hang, self.order = hang, []

    async def load(self, spec: LoadSpec, evictable: list[str] | None = None) -> Any:
        self.order.append(spec.name)
        if spec.name == self.hang:
            await asyncio.Event().wait()
        return await super().load(spec, evictable)


async def _restart(mgr: ModelManager, w: FakeWorker) -> None:
    await mgr.on_worker_down()
    await asyncio.sleep(0.01)  # the cancelled operations end (a restart's backoff is longer)
    w.loaded = []  # a new process holds nothing
    await mgr.on_worker_up()


async def test_after_a_restart_models_come_back_one_at_a_time_in_priority_order(monkeypatch, tmp_path) -> None:
    w = _HangingWorker(hang="")
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "old"}, {"name": "pre", "preload": true},'
                   ' {"name": "pinned", "pin": true}, {"name": "new"}]', ["old", "pre", "pinned", "new"])
    for n in ("pinned", "pre", "old", "new"):
        await mgr.load(n)
    mgr.get("old").touch()
    await asyncio.sleep(0.01)
    mgr.get("new").touch()
    w.order = []
    await _restart(mgr, w)
    assert {mgr.get(n).state for n in ("pinned", "pre", "old", "new")} == {State.LOADING}
    await mgr.get("old").task  # the last in line
    assert w.order == ["pinned", "pre", "new", "old"] and w.max_active == 1
    assert {mgr.get(n).state for n in ("pinned", "pre", "old", "new")} == {State.READY}


async def test_a_model_whose_load_took_the_worker_down_twice_is_failed_not_retried(monkeypatch, tmp_path) -> None:
    w = _HangingWorker(hang="bad")
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "good"}, {"name": "bad"}]', ["good", "bad"])
    await mgr.load("good")
    mgr.load("bad")
    await asyncio.sleep(0.1)  # in the worker's load when it dies
    await _restart(mgr, w)
    assert mgr.get("bad").state is State.LOADING and mgr.get("bad").crashed_loads == 1
    await asyncio.sleep(0.2)  # good back first (more recently used), then bad's load hangs again
    assert w.order[-2:] == ["good", "bad"] and mgr.get("good").state is State.READY
    await _restart(mgr, w)
    bad = mgr.get("bad")
    assert bad.state is State.FAILED and "died during 2 of its loads" in bad.reason
    await mgr.get("good").task
    assert mgr.get("good").state is State.READY and w.order.count("bad") == 2  # no third try
    with pytest.raises(ModelNotReady, match="died during 2"):
        await mgr.admit_wait("bad", timeout=1.0)  # a request does not retry it
    assert w.order.count("bad") == 2
    w.hang = ""
    await mgr.load("bad")  # an operator's load does
    assert mgr.get("bad").state is State.READY and mgr.get("bad").crashed_loads == 0


async def test_an_unload_drains_until_the_last_request_ends(monkeypatch, tmp_path) -> None:
    mgr = _manager(monkeypatch, tmp_path, FakeWorker(), '[{"name": "d"}]', ["d"])
    await mgr.load("d")
    admission = mgr.admit("d")
    admission.__enter__()
    unloading = mgr.unload("d", drain_s=30.0)
    await asyncio.sleep(0.1)
    assert mgr.get("d").state is State.DRAINING
    t0 = time.monotonic()
    admission.__exit__(None, None, None)  # the last one out wakes the drain
    await asyncio.wait_for(unloading, 5.0)
    assert mgr.get("d").state is State.CACHED and time.monotonic() - t0 < 5.0


async def test_an_fp8_load_reads_the_models_fp8_checkpoint_once_the_cache_holds_one(monkeypatch, tmp_path) -> None:
    """The first FP8 load of an unquantized model quantizes as it loads and asks for its FP8
    checkpoint to be built; once the cache holds it, loads read it instead (half the bytes)."""
    w = FakeWorker()
    specs = []
    real = w.load

    async def load(spec, evictable=None):
        specs.append(spec)
        return await real(spec, evictable)

    w.load = load
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "q", "quantization": "fp8"}, {"name": "p"}]', ["q", "p"])
    (tmp_path / "q" / "config.json").write_text('{"model_type": "llama"}')
    await mgr.load("q")
    assert specs[-1].model_dir == str(tmp_path / "q") and mgr.source.wanted == [("q", "fp8-channel")]
    await mgr.unload("q")
    (tmp_path / "q.fp8-channel").mkdir()  # the build finished
    await mgr.load("q")
    assert specs[-1].model_dir == str(tmp_path / "q.fp8-channel") and specs[-1].quantization == "fp8"
    assert mgr.source.wanted == [("q", "fp8-channel")]  # not asked again
    await mgr.load("p")  # not FP8: never derived
    assert specs[-1].model_dir == str(tmp_path / "p") and mgr.source.wanted == [("q", "fp8-channel")]
    (tmp_path / "p" / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    await mgr.unload("p")
    await mgr.load("p", quantization="fp8")  # already an FP8 checkpoint: nothing to derive
    assert specs[-1].model_dir == str(tmp_path / "p") and mgr.source.wanted == [("q", "fp8-channel")]


async def test_a_model_waiting_for_the_room_when_the_worker_dies_is_not_blamed(monkeypatch, tmp_path) -> None:
    """Only a model whose load was in the worker counts a crash; one queued behind it does not."""
    w = _HangingWorker(hang="bad")
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "bad"}, {"name": "queued"}]', ["bad", "queued"])
    mgr.load("bad")
    await asyncio.sleep(0.1)  # bad's load is in the worker, holding the room lock
    mgr.load("queued")
    await asyncio.sleep(0.1)  # queued waits for the room
    assert mgr.get("bad").in_worker and not mgr.get("queued").in_worker
    for _ in range(2):
        await _restart(mgr, w)
        await asyncio.sleep(0.2)
    assert mgr.get("bad").state is State.FAILED and mgr.get("queued").crashed_loads == 0
    assert mgr.get("queued").state in (State.LOADING, State.READY)


async def test_an_unreadable_fp8_checkpoint_is_dropped_not_the_snapshot_flagged(monkeypatch, tmp_path) -> None:
    w = FakeWorker()
    real = w.load

    async def load(spec, evictable=None):
        if spec.model_dir.endswith(".fp8-channel"):
            raise WorkerError("SafetensorError: invalid header", "SafetensorError")
        return await real(spec, evictable)

    w.load = load
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "q", "quantization": "fp8"}]', ["q"])
    (tmp_path / "q" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "q.fp8-channel").mkdir()
    await mgr.load("q")
    e = mgr.get("q")
    assert e.state is State.FAILED and not e.needs_repair and not (tmp_path / "q.fp8-channel").exists()
    await mgr.load("q")  # from the snapshot again (quantized as it loads), and asks for a new build
    assert e.state is State.READY and mgr.source.wanted == [("q", "fp8-channel")]


async def test_a_preempted_requests_wait_ends_at_shutdown_and_a_drain_does_not_wait_for_it(monkeypatch,
                                                                                             tmp_path) -> None:
    """Requests preempted for room wait (admitted) for their model's comeback: the unload that
    preempted them does not wait for them, and at shutdown (``end_comebacks``) each wait ends
    with ``shutting_down`` at once, not when the comeback's load or the drain's deadline ends."""
    w = FakeWorker(load_s=0.01)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "x"}]', ["x"])
    await mgr.load("x")
    held = mgr.admit("x")
    held.__enter__()  # x's request, preempted below: it waits for x, still admitted
    x = mgr.get("x")
    w.load_s = 5.0  # x's comeback is slow
    t = time.monotonic()
    unloading = mgr.unload("x")  # draining: it waits for requests in the engine only
    waiting = asyncio.ensure_future(mgr.wait_back("x", 1))  # as the preempted request's generation does
    await unloading
    assert time.monotonic() - t < 1.0, "the unload waited for a preempted request"
    await asyncio.sleep(0.3)
    assert x.preempted == 1 and not waiting.done() and x.state is State.LOADING  # its comeback
    t = time.monotonic()
    mgr.end_comebacks()
    with pytest.raises(WorkerError) as ex:
        await asyncio.wait_for(waiting, 2.0)
    assert ex.value.code == "shutting_down" and time.monotonic() - t < 1.0
    assert x.preempted == 0
    held.__exit__(None, None, None)
    await mgr.close()


@pytest.mark.parametrize("load_s", [0.9, 1.6])
async def test_a_preempted_requests_wait_lasts_as_long_as_its_comeback_load_may(monkeypatch, tmp_path, load_s) -> None:
    """The comeback's load waits for room up to ``comeback_s`` (1.2 s here) from its own start,
    which comes after the preempted model's unload (0.6 s); the paused request's wait counts from
    the same start, and past the room (the engine load under way) it waits for the load whatever
    the time: ready 1.5 s after the preemption (0.9 s after the load began), or 2.2 s (1.6 s
    after, past both deadlines, its room found at once)."""
    monkeypatch.setenv("INFIRE_SERVER__AUTOLOAD_TIMEOUT", "1s")
    monkeypatch.setenv("INFIRE_SERVER__DRAIN_TIMEOUT", "0.2s")

    class SlowUnload(FakeWorker):
        async def unload(self, name: str) -> None:
            await asyncio.sleep(0.6)
            await super().unload(name)

    w = SlowUnload(load_s=0.01)
    mgr = _manager(monkeypatch, tmp_path, w, '[{"name": "x"}]', ["x"])
    await mgr.load("x")
    assert mgr.comeback_s() == pytest.approx(1.2)
    w.load_s = load_s
    t = time.monotonic()
    mgr.unload("x")
    context = await mgr.wait_back("x", 1)  # as the preempted request's generation does
    assert mgr.get("x").state is State.READY and time.monotonic() - t >= 0.6 + load_s
    assert context == mgr.get("x").info.max_model_len
    await mgr.close()


async def test_a_model_another_pull_evicted_from_the_disk_cache_is_absent_and_pulled_again(monkeypatch, tmp_path) -> None:
    """The disk cache makes a pull's room by evicting idle unpinned models: the manager's view
    follows (status, /v1/models and ``infire_model_state`` said ``cached`` for a removed
    folder), and the evicted model's next load pulls it again."""
    from agent.manager.model_source import CacheSource
    from cache.disk_cache import DiskCache
    from cache.file_store import FileStore
    from cache.publish import publish_model
    from tests.s3_fault_proxy import fast_download, make_model

    store = FileStore(tmp_path / "store")
    one = max(publish_model(store, make_model(tmp_path / f"src-{n}", data_bytes=1 << 20, seed=i), n).total_size
              for i, n in enumerate("ab"))
    cache = DiskCache(tmp_path / "cache", int(one * 1.5), download=fast_download())
    monkeypatch.setenv("INFIRE_MODELS", '[{"name": "a"}, {"name": "b"}]')
    metrics = Metrics()
    mgr = ModelManager(load_settings(), FakeWorker(), CacheSource(cache, store), metrics, lambda p: object())
    await mgr.pull("a")
    assert mgr.get("a").state is State.CACHED
    await mgr.pull("b")  # room for b: a goes
    assert cache.snapshot_path("a") is None
    a = mgr.get("a")
    assert a.state is State.ABSENT and a.snapshot is None
    assert model_view(mgr, a)["state"] == "absent"
    assert 'infire_model_state{model="a",state="absent"} 1.0' in metrics.render().decode()
    await mgr.load("a")  # pulled again (b goes), then loaded
    assert mgr.get("a").state is State.READY and cache.snapshot_path("a") is not None
    assert mgr.get("b").state is State.ABSENT

    # A load's repair of broken files is a pull too: what it evicts is absent as well.
    await mgr.unload("a")
    await mgr.pull("b")  # b back on disk (a goes: the quota holds one)
    cache.max_bytes = int(one * 4)
    await mgr.pull("a")
    cache.max_bytes = int(one * 1.5)  # an operator lowers the quota: one model again
    snap = cache.snapshot_path("b")
    big = max((p for p in snap.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    big.chmod(0o644)
    with open(big, "r+b") as f:
        f.truncate(10)
    await mgr.load("b")  # finds its files broken, repairs them: a goes
    assert mgr.get("b").state is State.READY and cache.snapshot_path("a") is None
    assert mgr.get("a").state is State.ABSENT and mgr.get("a").snapshot is None
