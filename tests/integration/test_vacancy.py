"""Vacancies (engine/core/vacancy.py): an unloaded model's tensors and runner, taken by the next
load of the same computation at the same shape, dropped by any other; CPU, tiny models of one
architecture with different weights (seeds), tokens checked against a fresh engine's."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.core.ledger import LoadRefused
from engine.core.vacancy import VACANT_PREFIX
from engine.errors import WeightsError
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ([5, 9, 2, 7, 11, 3], [1, 2, 3, 4])


def _core(budget: int = 64 << 20, **kw) -> EngineCore:
    return EngineCore(EngineOptions(max_num_batched_tokens=64, seed=0, **kw), device="cpu", budget=budget)


def _spec(name: str, d, seqs: int = 4) -> LoadSpec:
    return LoadSpec(name, d, max_model_len=128, max_num_seqs=seqs)


def _generate(core: EngineCore, model: str) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        core.add_request(f"{model}-{i}", model, list(p), GREEDY)
    toks: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    return [toks[f"{model}-{i}"] for i in range(len(PROMPTS))]


def _alone(d, name: str = "x") -> list[list[int]]:
    core = _core()
    core.load_model(_spec(name, d))
    return _generate(core, name)


@pytest.fixture(scope="module")
def dirs(make_tiny_model):
    return {n: make_tiny_model("llama", seed=s) for n, s in (("a", 0), ("b", 1), ("c", 2))}


def test_a_load_of_the_same_kind_takes_the_unloaded_models_tensors_and_runner(dirs) -> None:
    """a unloaded, b (same architecture, other weights) loaded: b's weights go into a's tensors
    and a's runner serves b; b's tokens are those of b loaded into a fresh engine, and the books
    are those of a fresh load."""
    ref = _core()
    ref.load_model(_spec("b", dirs["b"]))
    fresh_books = ref.pools.ledger.snapshot()
    core = _core()
    core.load_model(_spec("a", dirs["a"]))
    model, runner = core.slots.get("a").model, core.slots.get("a").runner
    _generate(core, "a")
    core.unload_model("a")
    snap = core.pools.ledger.snapshot()
    assert list(snap.weights) == [VACANT_PREFIX + "a"] and snap.kv_min[VACANT_PREFIX + "a"] == 0
    assert core.pools.room() == core.pools.ledger.budget  # all of it a load's to take
    core.load_model(_spec("b", dirs["b"]))
    assert core.loader.last_load_timings["vacancy"] == 1.0
    assert core.slots.get("b").model is model and core.slots.get("b").runner is runner
    assert core.slots.get("b").runner.graph_steps == 0  # counters start over
    assert _generate(core, "b") == _alone(dirs["b"])
    assert core.pools.ledger.snapshot() == fresh_books
    assert core.pools.vacancies == [] and core.pools.vacancies_claimed == 1


def _one_model_bytes(d) -> int:
    probe = _core()
    probe.load_model(_spec("a", d))
    return probe.pools.ledger.snapshot().used


def test_other_vacancies_stay_while_a_load_fits_beside_them_and_go_when_it_needs_their_room(dirs) -> None:
    """Roomy: a load of another shape leaves the vacancies be (a later load of their kind takes
    one). Tight: a load that needs their room drops them all before it books."""
    core = _core()
    core.load_model(_spec("a", dirs["a"]))
    core.load_model(_spec("b", dirs["b"]))
    core.unload_model("a")
    core.unload_model("b")
    core.load_model(_spec("c", dirs["c"], seqs=2))  # another max_num_seqs: another shape
    assert core.loader.last_load_timings["vacancy"] == 0.0 and len(core.pools.vacancies) == 2
    ref = _core()
    ref.load_model(_spec("c", dirs["c"], seqs=2))
    assert _generate(core, "c") == _generate(ref, "c")
    core.load_model(_spec("a", dirs["a"]))  # one of them taken
    assert core.loader.last_load_timings["vacancy"] == 1.0 and len(core.pools.vacancies) == 1
    assert _generate(core, "a") == _alone(dirs["a"])

    one = _one_model_bytes(dirs["a"])
    tight = _core(budget=int(1.9 * one))  # two models, not two and their vacancies
    tight.load_model(_spec("a", dirs["a"]))
    tight.load_model(_spec("b", dirs["b"]))
    tight.unload_model("a")
    tight.unload_model("b")
    tight.load_model(_spec("c", dirs["c"], seqs=2))
    assert tight.pools.vacancies == []
    assert [n for n in tight.pools.ledger.snapshot().weights] == ["c"]
    assert _generate(tight, "c") == _generate(ref, "c")


def test_a_load_of_another_kind_beside_a_serving_model_takes_the_vacancys_room_not_the_pools(dirs) -> None:
    """The pool fills the budget (long contexts, many sequences): kept, a vacancy would make a
    load of another kind shrink the pool, preempting the serving model's sequences and
    rebuilding every runner; dropped first, its room is the load's and nothing else moves."""
    core = _core()
    core.load_model(LoadSpec("c", dirs["c"], max_model_len=2048, max_num_seqs=64))
    core.load_model(LoadSpec("a", dirs["a"], max_model_len=2048, max_num_seqs=64))
    assert core.pools.ledger.snapshot().free < core.pools.ledger.budget // 100  # the pool fills it
    core.add_request("r", "c", [1, 2, 3, 4, 5], GREEDY)
    core.step()
    core.step()
    resizes = core.memory().pool_resizes
    core.unload_model("a")
    core.load_model(LoadSpec("b", dirs["b"], max_model_len=2048, max_num_seqs=32))  # another shape
    assert core.pools.vacancies == [] and core.memory().pool_resizes == resizes
    assert len(core.slots.get("c").scheduler.running) == 1  # not preempted


def test_two_loads_each_take_their_own_vacancy_and_a_reload_of_the_same_name(dirs) -> None:
    core = _core()
    core.load_model(_spec("a", dirs["a"]))
    core.load_model(_spec("b", dirs["b"]))
    runners = {id(core.slots.get(n).runner) for n in "ab"}  # ids: a runner held here would pin the pool
    core.unload_model("a")
    core.unload_model("b")
    core.load_model(_spec("b", dirs["b"]))
    core.load_model(_spec("c", dirs["c"]))
    assert core.pools.vacancies == [] and core.pools.vacancies_claimed == 2
    assert {id(core.slots.get(n).runner) for n in "bc"} == runners
    assert _generate(core, "b") == _alone(dirs["b"]) and _generate(core, "c") == _alone(dirs["c"])
    core.unload_model("b")
    core.load_model(_spec("b", dirs["b"]))  # the same name again: its own vacancy
    assert core.loader.last_load_timings["vacancy"] == 1.0
    assert _generate(core, "b") == _alone(dirs["b"])


def test_a_pool_resize_leaves_the_runner_stale_and_the_weights_still_taken(dirs) -> None:
    core = _core()
    core.load_model(_spec("a", dirs["a"]))
    core.load_model(_spec("c", dirs["c"]))
    core.unload_model("a")
    (v,) = core.pools.vacancies
    model = v.model
    core.pools.fit(None, None)  # re-creates the pool (the vacancy's KV views must go first)
    assert v.runner is None and v.kv is None and v.model is model
    core.load_model(_spec("b", dirs["b"]))
    assert core.loader.last_load_timings["vacancy"] == 1.0 and core.slots.get("b").model is model
    assert _generate(core, "b") == _alone(dirs["b"])
    assert _generate(core, "c") == _alone(dirs["c"])


def test_a_load_that_fails_after_taking_a_vacancy_releases_everything(dirs, tmp_path, caplog) -> None:
    """Bad weights read into a vacancy's tensors, beside a model that serves on: the load fails
    alone, the vacancy's tensors, runner and KV views go with it (a pool resize after finds no
    view left), the books are as with c alone; the next load works."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(dirs["b"], bad)
    st = next(bad.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[:-64])  # truncated
    alone = _core()
    alone.load_model(_spec("c", dirs["c"]))
    core = _core()
    core.load_model(_spec("c", dirs["c"]))
    core.load_model(_spec("a", dirs["a"]))
    core.unload_model("a")
    with pytest.raises(WeightsError):
        core.load_model(_spec("b", bad))
    assert core.pools.vacancies == [] and list(core.pools.ledger.snapshot().weights) == ["c"]
    assert "still referenced" not in caplog.text
    core.pools.grow_when_quiet(0)  # a resize: would fail on a view left behind
    assert core.pools.ledger.snapshot() == alone.pools.ledger.snapshot()
    # and cancelled while its weights are read
    core.load_model(_spec("a", dirs["a"]))
    core.unload_model("a")
    pending = core.begin_load(_spec("b", dirs["b"]))
    core.cancel_load(pending)
    assert pending.vacancy is None and core.pools.vacancies == []
    core.load_model(_spec("b", dirs["b"]))
    assert _generate(core, "b") == _alone(dirs["b"]) and _generate(core, "c") == _alone(dirs["c"])
    assert "still referenced" not in caplog.text


def test_a_refused_load_that_took_a_vacancy_drops_it(dirs) -> None:
    """The vacancy is free to a load's plan, so a load too large even with it is refused with
    the vacancy's bytes counted as free, and the vacancy is gone after (its memory with it)."""
    one = _one_model_bytes(dirs["a"])
    core = _core(budget=one + one // 2)  # room for one model, not two
    core.load_model(_spec("a", dirs["a"]))
    core.unload_model("a")
    with pytest.raises(LoadRefused) as e:
        core.load_model(LoadSpec("b", dirs["b"], max_model_len=128, max_num_seqs=4, num_kv_pages=10_000))
    assert e.value.free >= one  # the vacancy counted as free
    assert core.pools.vacancies == [] and not core.pools.ledger.snapshot().weights
    core.load_model(_spec("b", dirs["b"]))
    assert _generate(core, "b") == _alone(dirs["b"])
