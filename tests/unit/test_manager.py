"""ModelManager bookkeeping that needs no worker process: states, admission, a model's admin view."""

from __future__ import annotations

import pytest

from agent.config import load_settings
from agent.http.admin_view import model_view
from agent.manager.entries import ManagerError, ModelNotReady, QueueFull, State, UnknownModel
from agent.manager.manager import ModelManager
from agent.metrics import Metrics
from agent.worker.client import WorkerClient


@pytest.fixture
def mgr(monkeypatch) -> ModelManager:
    monkeypatch.setenv("INFIRE_MODELS", '[{"name": "m", "max_num_seqs": 2, "preload": true}]')
    settings = load_settings()
    return ModelManager(settings, WorkerClient({}, engine="none"), None, Metrics(), lambda p: None)


def test_configured_models_start_absent(mgr: ModelManager) -> None:
    e = mgr.get("m")
    assert e.state is State.ABSENT and e.queue_limit == 4
    with pytest.raises(UnknownModel):
        mgr.get("other")
    assert not mgr.preload_ready()


def test_illegal_transitions_are_refused(mgr: ModelManager) -> None:
    e = mgr.get("m")
    with pytest.raises(ManagerError, match="cannot go from absent to ready"):
        e.move(State.READY)
    e.move(State.PULLING)
    e.move(State.CACHED)
    with pytest.raises(ManagerError):
        e.move(State.DRAINING)
    assert b'infire_model_state{model="m",state="cached"} 1.0' in mgr.metrics.render()


def test_admission_bounds(mgr: ModelManager) -> None:
    e = mgr.get("m")
    with pytest.raises(ModelNotReady) as ex:
        mgr.admit("m")
    assert ex.value.status == 503
    with pytest.raises(UnknownModel):
        mgr.admit("nope")
    e.state = State.READY
    slots = [mgr.admit("m") for _ in range(e.queue_limit)]
    for s in slots:
        s.__enter__()
    assert e.in_flight == 4 and e.last_used is not None
    with pytest.raises(QueueFull) as ex:
        mgr.admit("m")
    assert ex.value.retry_after and ex.value.status == 503
    slots[0].__exit__(None, None, None)
    with mgr.admit("m"):
        assert e.in_flight == 4
    assert e.in_flight == 3


def test_without_a_store_pulls_and_unknown_loads_are_refused(mgr: ModelManager) -> None:
    with pytest.raises(ManagerError, match="no model store"):
        mgr.pull("m")
    with pytest.raises(UnknownModel):
        mgr.load("not-configured")
    d = model_view(mgr, mgr.get("m"))
    assert {"name", "state", "device_bytes", "kv_pages", "in_flight", "last_used"} <= set(d)


async def test_a_model_the_engine_says_cannot_run_is_unloaded_for_a_fresh_load(mgr: ModelManager, tmp_path) -> None:
    """A ready model whose runner could not be rebuilt (``ModelStats.broken``) would only abort
    its requests: it is unloaded with the reason, to be loaded afresh at the next request; a
    row of a model loaded since that status (stale) is not believed."""
    from tests.records import model_stats

    e = mgr.get("m")
    e.snapshot = tmp_path  # its files are cached: an unload leaves it cached
    e.move(State.PULLING)
    e.move(State.CACHED)
    e.move(State.LOADING)
    e.move(State.READY)
    why = "its runner could not be rebuilt after a KV pool resize: OutOfMemoryError"
    mgr.worker.state.models = {"m": model_stats(broken=why)}
    mgr.worker.state.stale_models = {"m"}
    mgr.unload_broken()
    assert e.state is State.READY and not e.busy  # loaded since: that row is the load before
    mgr.worker.state.stale_models = set()
    mgr.unload_broken()
    await e.task
    assert e.state is State.CACHED and why in e.reason  # the next request loads it afresh
    mgr.worker.state.models = {"m": model_stats()}
    mgr.unload_broken()  # nothing more to do
    assert e.state is State.CACHED


def test_a_recall_belongs_to_the_drain_under_way(mgr: ModelManager) -> None:
    """A drain called off is marked on the entry; any move out of draining (the worker died and
    cut the drain short) forgets the mark, so a later unload of the model is not called off."""
    e = mgr.get("m")
    e.state = State.READY
    e.move(State.DRAINING, "drained to make room for n")
    e.recalled = True
    e.move(State.DRAINING, "still draining")
    assert e.recalled
    e.move(State.UNLOADING, "the engine worker exited")
    assert not e.recalled


def test_a_load_never_fits_when_it_needs_more_than_the_budget_less_the_pinned_models(monkeypatch) -> None:
    """``RoomPlanner.never_fits``: a pinned model in the engine (ready, or loading past its engine
    load: its info is set) never leaves for a load, so what it holds is out of any load's reach;
    an unpinned one, a pinned one not in the engine, or the load's own entry are not counted."""
    from types import SimpleNamespace

    from agent.manager.room import RoomPlanner

    monkeypatch.setenv("INFIRE_MODELS", '[{"name": "p", "pin": true}, {"name": "q"}, {"name": "x"}]')
    mgr = ModelManager(load_settings(), WorkerClient({}, engine="none"), None, Metrics(), lambda p: None)
    p, q = mgr.get("p"), mgr.get("q")
    for e in (p, q):
        e.state, e.info = State.READY, SimpleNamespace(device_bytes=40)
    planner = RoomPlanner(mgr.models)
    refusal = {"needed": 61, "free": 0, "evictable": 0, "budget": 100, "short": 61}
    assert planner.never_fits(refusal, exclude="x")  # 61 > 100 - 40 (p), whatever q frees
    assert not planner.never_fits({**refusal, "needed": 60}, exclude="x")
    p.state = State.LOADING  # its engine load done, the canary to come: still in the engine
    assert planner.never_fits(refusal, exclude="x")
    p.info = None  # loading before its engine load: nothing held yet
    assert not planner.never_fits(refusal, exclude="x")
    assert planner.never_fits({**refusal, "needed": 101}, exclude="x")  # past the budget itself
    assert not planner.never_fits({"needed": None, "budget": 100}, exclude="x")  # no figures: no proof


def test_a_load_waits_for_a_model_loading_past_its_engine_load(monkeypatch) -> None:
    """``RoomPlanner.may_free``: an unpinned model whose engine load is done (its info set; the
    tokenizer and canary to come) holds room it will give up once ready and idle, so a load short
    of room waits for it; before, the second of two loads racing for the last room was refused at
    once while the first was in its canary. A load still waiting for room itself (no info yet) or
    a pinned one is not waited for (two such loads would wait on each other)."""
    from types import SimpleNamespace

    from agent.manager.room import RoomPlanner

    monkeypatch.setenv("INFIRE_MODELS", '[{"name": "a"}, {"name": "b"}, {"name": "p", "pin": true}]')
    mgr = ModelManager(load_settings(), WorkerClient({}, engine="none"), None, Metrics(), lambda p: None)
    a, p = mgr.get("a"), mgr.get("p")
    planner = RoomPlanner(mgr.models)
    a.state = p.state = State.LOADING
    assert planner.may_free(exclude="b") == []  # neither holds room yet
    a.info = p.info = SimpleNamespace(device_bytes=40)
    assert [e.name for e in planner.may_free(exclude="b")] == ["a"]  # a pinned one never leaves
