"""EngineCore with several models on one budget: refusals with the numbers, eviction plans,
unloads that give back every page and byte, and fair stepping measured (docs/multi-model.md).

Tiny CPU models; the oracle for tokens is each model served alone.
"""

from __future__ import annotations

import statistics
import time

import pytest

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.core.ledger import LoadRefused
from engine.core.vacancy import VACANT_PREFIX
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec
from engine.kv.page_memory import ModelViews

MAX_LEN = 64
SEQS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(40, 40 + n)) for n in (3, 17, 9)]


@pytest.fixture(scope="module")
def dirs(make_tiny_model):
    return {"a": make_tiny_model("llama"), "b": make_tiny_model("qwen3"), "c": make_tiny_model("qwen2")}


def core_for(budget: int | None = None, **kw) -> EngineCore:
    return EngineCore(EngineOptions(max_num_batched_tokens=64, seed=3, **kw), device="cpu", budget=budget)


def load(core: EngineCore, name: str, d, evictable=(), **kw):
    return core.load_model(LoadSpec(name, d, max_model_len=MAX_LEN, max_num_seqs=SEQS, **kw), evictable)


def submit(core: EngineCore, *names: str) -> None:
    """Every prompt of PROMPTS to each model, greedy, as requests ``<model><i>``."""
    for name in names:
        for i, p in enumerate(PROMPTS):
            core.add_request(f"{name}{i}", name, p, GREEDY)


def drain(core: EngineCore, toks: dict[str, list[int]]) -> None:
    for _ in range(2000):
        if not core.has_unfinished_requests():
            return
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def needs(dirs):
    """Bytes each load needs, from the plan of an engine with room for everything."""
    core = core_for(1 << 30)
    return {n: core.check_load(LoadSpec(n, d, MAX_LEN, SEQS)).needed for n, d in dirs.items()}


@pytest.fixture(scope="module")
def solo(dirs):
    out = {}
    for name, d in dirs.items():
        core = core_for()
        load(core, name, d)
        submit(core, name)
        drain(core, out)
    return out


def test_third_load_over_budget_is_refused_with_the_numbers_and_the_plan_names_the_lru(dirs, needs, solo):
    budget = needs["a"] + needs["b"] + needs["c"] // 2
    assert needs["a"] >= needs["c"] // 2  # evicting one model is enough
    core = core_for(budget)
    start = core.pools.ledger.snapshot()
    load(core, "a", dirs["a"])
    load(core, "b", dirs["b"])
    with pytest.raises(LoadRefused) as e:
        load(core, "c", dirs["c"])
    assert isinstance(e.value, EngineError)
    assert (e.value.needed, e.value.free, e.value.budget) == (needs["c"], budget - needs["a"] - needs["b"], budget)
    assert e.value.short == needs["c"] - e.value.free and e.value.evict == ()
    assert str(needs["c"]) in str(e.value)  # exact bytes in the message
    # The caller offers its idle models, least recently used first: the plan evicts just the first.
    plan = core.check_load(LoadSpec("c", dirs["c"], MAX_LEN, SEQS), evictable=["a", "b"])
    assert plan.evict == ("a",) and plan.needed == needs["c"]
    with pytest.raises(LoadRefused) as e:
        load(core, "c", dirs["c"], evictable=["a", "b"])
    assert e.value.evict == ("a",) and e.value.evictable == needs["a"] + needs["b"]  # all offered
    assert "evicting a first makes room" in str(e.value)
    assert set(core.models()) == {"a", "b"}  # a refusal changed nothing
    core.unload_model("a")
    load(core, "c", dirs["c"])
    toks: dict[str, list[int]] = {}
    submit(core, "b", "c")
    drain(core, toks)
    assert toks == {k: v for k, v in solo.items() if k[0] in "bc"}
    core.pools.pool.audit()
    for name in ("b", "c"):
        core.unload_model(name)
    core.pools.grow_when_quiet(0)  # quiet: the vacancies go (engine/core/vacancy.py), the pool with them
    assert core.pools.ledger.snapshot() == start and core.memory().kv_pages == 0


@pytest.mark.parametrize("other_busy", [False, True], ids=["other_idle", "other_decoding"])
def test_unload_during_decode_frees_every_page_and_byte(dirs, solo, other_busy):
    core = core_for()
    start = core.pools.ledger.snapshot()
    load(core, "a", dirs["a"])
    after_a = core.pools.ledger.snapshot()
    load(core, "b", dirs["b"])
    if other_busy:
        submit(core, "a")
    submit(core, "b")
    toks: dict[str, list[int]] = {}
    while not all(len(toks.get(f"b{i}", ())) >= 2 for i in range(len(PROMPTS))):  # b is decoding
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert core.stats()["b"].kv_pages_used > 0
    resizes = core.memory().pool_resizes
    before, room = core.pools.ledger.snapshot(), core.pools.room()
    core.unload_model("b")
    assert "b" not in core.pools.pool.models() and "b" not in core.memory().models
    # Its tensors and runner stay for the next load of its kind (engine/core/vacancy.py): booked
    # as a vacancy (no KV minimum, no pages), the pool as it was (no resize, no runner rebuilt).
    assert core.memory().pool_resizes == resizes
    snap = core.pools.ledger.snapshot()
    assert "b" not in snap.weights and "b" not in snap.workspace and "b" not in snap.kv_min
    vacant = VACANT_PREFIX + "b"
    assert snap.weights[vacant] == before.weights["b"] and snap.kv_min[vacant] == 0
    # on the device still (used), but a load's to take (room)
    assert snap.used == before.used
    assert core.pools.room() == room + before.weights["b"] + before.workspace["b"] + before.kv_min["b"]
    core.pools.pool.audit()
    if not other_busy:  # quiet: the vacancy goes and the pool is trimmed, the books as before b
        core.pools.grow_when_quiet(0)
        assert core.pools.ledger.snapshot() == after_a and core.memory().pool_resizes == resizes + 1
    reasons = {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
            reasons[o.req_id] = o.finish_reason
    assert all(reasons[f"b{i}"] == "abort" for i in range(len(PROMPTS)))
    assert {k: v for k, v in toks.items() if k[0] == "a"} == ({k: v for k, v in solo.items() if k[0] == "a"}
                                                              if other_busy else {})
    mem = core.memory()
    assert mem.kv_used == 0 and mem.models["a"].kv_pages_used == 0
    core.unload_model("a")
    core.pools.grow_when_quiet(0)
    assert core.pools.ledger.snapshot() == start
    assert core.memory().used == 0 and core.memory().kv_pages == 0


def test_memory_snapshot_and_stats_add_up(dirs):
    core = core_for()
    load(core, "a", dirs["a"])
    load(core, "b", dirs["b"])
    core.add_request("x", "b", PROMPTS[1], GREEDY)
    core.step()
    mem = core.memory()
    assert mem.used == mem.weights + mem.workspace + mem.kv
    assert mem.kv == mem.kv_pages * mem.page_bytes and mem.free == mem.budget - mem.used
    b = mem.models["b"]
    assert b.kv_pages_used == core.stats()["b"].kv_pages_used > 0
    assert core.stats()["b"].device_bytes == b.weights + b.workspace + b.kv_used
    assert b.kv_min == -(-MAX_LEN // core.pools.pool.layout("b").tokens_per_page) * mem.page_bytes


def test_budget_arguments(dirs):
    with pytest.raises(EngineError, match="fraction"):
        EngineCore(device="cpu", budget=0.5)
    core = EngineCore(device="cpu", budget=1 << 30)
    assert core.budget == 1 << 30 and core.memory().budget == 1 << 30


def test_warm_up_at_load_leaves_no_trace(dirs, solo):
    core = core_for(warmup=True)
    load(core, "a", dirs["a"])
    assert core.stats()["a"].kv_pages_used == 0
    toks: dict[str, list[int]] = {}
    submit(core, "a")
    drain(core, toks)
    assert toks == {k: v for k, v in solo.items() if k[0] == "a"}


def _ttft(core: EngineCore, rid: str, model: str, flood_steps: list[float]) -> tuple[int, float]:
    """Steps and seconds from adding ``rid`` to its first token; the flood's step times go to
    ``flood_steps``."""
    core.add_request(rid, model, list(range(50, 60)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    t0 = time.perf_counter()
    steps = 0
    while True:
        t = time.perf_counter()
        outs = core.step()
        steps += 1
        if any(o.req_id == rid for o in outs):
            return steps, time.perf_counter() - t0
        flood_steps.append(time.perf_counter() - t)


def test_trickle_ttft_next_to_a_flood_stays_near_its_solo_ttft(dirs):
    core = EngineCore(EngineOptions(max_num_batched_tokens=128, seed=3), device="cpu")
    core.load_model(LoadSpec("flood", dirs["a"], max_model_len=MAX_LEN, max_num_seqs=8))
    core.load_model(LoadSpec("quiet", dirs["b"], max_model_len=MAX_LEN, max_num_seqs=8))
    solo_steps, solo_s, flood_steps = [], [], []
    for j in range(5):
        n, s = _ttft(core, f"solo{j}", "quiet", [])
        drain(core, {})
        solo_steps.append(n)
        solo_s.append(s)
    long = SamplingParams(temperature=0, max_tokens=MAX_LEN, ignore_eos=True)
    waves = 0
    got_steps, got_s = [], []
    charged = {"flood": 0.0, "quiet": 0.0}  # by the flood-only steps
    for j in range(5):
        while core.stats()["flood"].running + core.stats()["flood"].waiting < 8:  # keep it flooded
            core.add_request(f"f{waves}", "flood", list(range(10, 30)), long)
            waves += 1
        for _ in range(3):  # flood-only steps: what one step of the flood costs
            before = {m: core.picker.gpu_seconds(m) for m in charged}
            t = time.perf_counter()
            core.step()
            flood_steps.append(time.perf_counter() - t)
            for m in charged:
                charged[m] += core.picker.gpu_seconds(m) - before[m]
        n, s = _ttft(core, f"q{j}", "quiet", flood_steps)
        got_steps.append(n)
        got_s.append(s)
        while core.stats()["quiet"].running + core.stats()["quiet"].waiting:
            core.step()
    # Solo, the first token comes from the first step. Flooded: at most one flood step runs
    # before it (the quiet model wakes at the flood's virtual time and wins the tie).
    assert max(solo_steps) == 1 and max(got_steps) <= 2, got_steps
    bound = 2 * statistics.median(solo_s) + max(flood_steps)
    assert statistics.median(got_s) <= bound, (got_s, solo_s, max(flood_steps))
    # the flood's steps are charged to the flood alone (totals of both models are step times on a
    # shared CI box: comparing them was a coin toss once the quiet model's solo phase counts)
    assert charged["flood"] > 0 and charged["quiet"] == 0, charged


def test_load_next_to_a_busy_model_shrinks_the_pool_by_preempting_it(dirs, needs, solo):
    # A budget that holds a and b exactly: a's pool first takes everything beside a's weights,
    # so b's load must shrink it while a's sequences hold pages.
    need_a = core_for(1 << 30).check_load(LoadSpec("a", dirs["a"], MAX_LEN, 64)).needed
    budget = need_a + needs["b"]
    core = core_for(budget)
    core.load_model(LoadSpec("a", dirs["a"], max_model_len=MAX_LEN, max_num_seqs=64))
    before = core.memory()
    assert before.free < before.page_bytes  # a's pool took the rest of the budget
    submit(core, "a")
    toks: dict[str, list[int]] = {}
    for _ in range(4):
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert core.stats()["a"].kv_pages_used > 0
    generation = core.pools.pool.generation
    load(core, "b", dirs["b"])
    assert core.pools.pool.generation == generation + 1 and core.memory().kv < before.kv
    assert core.memory().used <= budget
    submit(core, "b")
    drain(core, toks)
    assert toks == {k: v for k, v in solo.items() if k[0] in "ab"}  # the preempted ones recomputed
    core.pools.pool.audit()


class InPlaceMemory(ModelViews):
    """A GPU pool's memory contract (engine/kv/page_memory.py, ElasticMemory) on the CPU: views
    over ``capacity`` pages that never move, a resize that only changes how many may be used.
    Pages cut off are filled with 0xFF (NaN in bf16 and fp32) so a read past the pool's end
    would change tokens."""

    moves = False

    def __init__(self, num_pages, page_bytes, device, capacity):
        import torch

        self.page_bytes, self.capacity, self._pages = page_bytes, capacity, 0
        self.tensor = torch.full((capacity, page_bytes), 0xFF, dtype=torch.uint8)
        self._views = {}
        self.resize(num_pages, [])

    @property
    def num_pages(self):
        return self._pages

    def _require(self):
        return self.tensor

    def resize(self, num_pages, live):
        assert num_pages <= self.capacity and all(p < num_pages for p in live)
        if num_pages > self._pages:
            self.tensor[self._pages:num_pages].zero_()
        else:
            self.tensor[num_pages:self._pages].fill_(0xFF)
        self._pages = num_pages


def test_load_next_to_a_busy_model_takes_the_tail_of_a_pool_that_stays_in_place(dirs, needs, solo, monkeypatch):
    """As on a GPU: the pool shrinks without moving, so the busy model's runner is not rebuilt and
    only the sequences in the way are preempted: those holding the cut-off tail, then, newest
    first, enough of the busy model's beyond its minimum for b's minimum to fit below the cut
    (the busy model's pages sit low, where the room is)."""
    monkeypatch.setattr("engine.kv.page_memory.pool_memory",
                        lambda n, pb, device, capacity: InPlaceMemory(n, pb, device, capacity))
    need_a = core_for(1 << 30).check_load(LoadSpec("a", dirs["a"], MAX_LEN, 64)).needed
    budget = need_a + needs["b"]
    core = core_for(budget)
    core.load_model(LoadSpec("a", dirs["a"], max_model_len=MAX_LEN, max_num_seqs=64))
    before = core.memory()
    longer = [list(range(50, 50 + n)) for n in (45, 41, 38)]  # 3 pages each: a goes past its minimum

    def submit_longer(c: EngineCore) -> None:
        for i, p in enumerate(longer):
            c.add_request(f"a-long{i}", "a", p, GREEDY)

    want = dict(solo)
    alone = core_for()
    load(alone, "a", dirs["a"])
    submit_longer(alone)
    drain(alone, want)
    submit(core, "a")
    submit_longer(core)
    toks: dict[str, list[int]] = {}
    for _ in range(4):
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    a_slot = core.slots.get("a")
    used, runner = core.stats()["a"].kv_pages_used, a_slot.runner
    assert used > a_slot.needs.min_pages  # beyond its minimum: b's minimum needs some of them
    generation = core.pools.pool.generation
    load(core, "b", dirs["b"])
    assert core.pools.pool.generation == generation and core.memory().kv < before.kv
    assert core.slots.get("a").runner is runner  # nothing rebuilt
    assert core.memory().used <= budget
    submit(core, "b")
    drain(core, toks)
    assert toks == {k: v for k, v in want.items() if k[0] in "ab"}  # the preempted ones recomputed
    core.pools.pool.audit()


def test_a_load_that_fails_after_booking_leaves_the_books_as_they_were(dirs, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(dirs["b"], broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not safetensors")
    core = core_for()
    start = core.pools.ledger.snapshot()
    with pytest.raises(EngineError):
        load(core, "x", broken)
    assert core.pools.ledger.snapshot() == start and core.memory().kv_pages == 0
    load(core, "a", dirs["a"])
    after_a = core.pools.ledger.snapshot()
    with pytest.raises(EngineError):
        load(core, "x", broken)
    assert core.pools.ledger.snapshot() == after_a and core.pools.pool.models() == ["a"]
    core.pools.pool.audit()


def test_padded_pages_and_a_block_size_that_does_not_fit(dirs, solo):
    core = core_for(page_bytes=8192 + 256)  # neither model fills a page exactly: per-layer views
    load(core, "a", dirs["a"])
    load(core, "b", dirs["b"])
    assert core.pools.pool.layout("a").tokens_per_page == 16 and core.pools.pool.layout("b").tokens_per_page == 8
    toks: dict[str, list[int]] = {}
    submit(core, "a", "b")
    drain(core, toks)
    assert toks == {k: v for k, v in solo.items() if k[0] in "ab"}
    with pytest.raises(EngineError, match="do not fit a page"):
        load(core, "c", dirs["c"], block_size=1000)
    assert set(core.models()) == {"a", "b"}


def test_weights_split_measured_step_time(dirs):
    core = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=3), device="cpu")
    core.load_model(LoadSpec("heavy", dirs["a"], max_model_len=MAX_LEN, max_num_seqs=4, weight=3.0))
    core.load_model(LoadSpec("light", dirs["b"], max_model_len=MAX_LEN, max_num_seqs=4, weight=1.0))
    long = SamplingParams(temperature=0, max_tokens=MAX_LEN - 4, ignore_eos=True)
    for name in ("heavy", "light"):
        for i in range(12):  # far more work than the steps below get through
            core.add_request(f"{name}{i}", name, [5, 6, 7], long)
    longest = 0.0
    for _ in range(80):
        t = time.perf_counter()
        core.step()
        longest = max(longest, time.perf_counter() - t)
    # both still have work (between two waves of max_num_seqs a model may have none running)
    st = core.stats()
    assert all(st[n].running + st[n].waiting for n in ("heavy", "light")), st
    # Fair share keeps the weighted clocks within one step of each other...
    assert abs(core.picker.virtual_time("heavy") - core.picker.virtual_time("light")) <= longest
    # ...so measured time splits about 3:1.
    ratio = core.picker.gpu_seconds("heavy") / core.picker.gpu_seconds("light")
    assert 2.0 <= ratio <= 4.5, ratio


@pytest.mark.parametrize("graphs", [False, True])
def test_every_runner_is_built_with_the_cores_cuda_graphs(dirs, monkeypatch, graphs):
    """``cuda_graphs`` reaches every runner the core builds: at load and when a resize of the
    pool rebuilds the runners of the models already loaded."""
    import engine.core.pool_keeper as pool_keeper

    seen: list[bool] = []
    real = pool_keeper.ModelRunner

    def spy(*args, **kw):
        seen.append(kw["cuda_graphs"])
        return real(*args, **kw)

    monkeypatch.setattr(pool_keeper, "ModelRunner", spy)
    core = core_for(cuda_graphs=graphs)
    load(core, "a", dirs["a"])
    load(core, "b", dirs["b"])  # the pool grows: a's runner is rebuilt on the new memory
    assert len(seen) >= 3 and set(seen) == {graphs}
    assert core.pools.decode_buckets == ()  # no graph buckets on CPU either way


def test_an_unload_never_grows_the_pool_a_quiet_idle_engine_does(dirs, monkeypatch):
    """A swap: b's load shrinks the pool (its weights need the room), b's unload leaves that room
    to the next load instead of growing the pool into it (which that load would shrink again, every
    runner rebuilt each time); once loads and unloads have been quiet and no request is in the
    engine, the pool grows back, and a serves as before."""
    import engine.core.engine_core as engine_core

    roomy = core_for(1 << 30)
    plans = {n: roomy.check_load(LoadSpec(n, dirs[n], MAX_LEN, SEQS)) for n in "ab"}
    load(roomy, "a", dirs["a"])
    full, pb = roomy.pools.pool.num_pages, roomy.pools.pool.page_bytes  # a's pool: its wants
    fixed = sum(p.weight_bytes + p.workspace_bytes for p in plans.values())
    core = core_for(fixed + (full - 4) * pb)  # beside both models' weights: 4 pages short of a's wants
    load(core, "a", dirs["a"])
    assert core.pools.pool.num_pages == full
    load(core, "b", dirs["b"])
    shrunk = core.pools.pool.num_pages
    assert shrunk < full
    resizes = core.memory().pool_resizes
    core.unload_model("b")
    assert core.pools.pool.num_pages == shrunk and core.memory().pool_resizes == resizes  # no grow
    assert not core.grow_idle_pool()  # not quiet yet
    monkeypatch.setattr(engine_core, "POOL_GROW_QUIET_S", 0.0)
    submit(core, "a")
    assert not core.grow_idle_pool()  # quiet, but requests are in the engine
    toks: dict[str, list[int]] = {}
    drain(core, toks)
    assert core.grow_idle_pool() and core.pools.pool.num_pages == full
    assert core.memory().pool_resizes == resizes + 1
    core.pools.pool.audit()
    submit(core, "a")
    again: dict[str, list[int]] = {}
    drain(core, again)
    assert again == toks  # served on the grown pool, the same tokens


def test_an_expedited_model_is_stepped_ahead_of_the_others_until_its_work_is_done(dirs, solo):
    """A model drained for a load's room (the agent admits nothing more to it) finishes its
    requests before any other model takes a step, then the others go on as before; the flag ends
    with its work (a later request of that model competes as usual), and tokens are unchanged."""
    core = core_for()
    for n in "abc":
        load(core, n, dirs[n])
    assert not core.expedite("nobody")
    submit(core, "a", "b", "c")
    for _ in range(3):  # every model under way
        core.step()
    assert core.expedite("b")
    order: list[str] = []
    toks: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                order.append(o.req_id)
    b_done = max(i for i, r in enumerate(order) if r.startswith("b"))
    assert b_done == 2 and all(r.startswith("b") for r in order[:3]), order  # b's three end first
    assert not core._expedited  # ended with its work
    assert all(solo[r][-len(t):] == t for r, t in toks.items()), toks  # the tokens after the flag: as alone
    # a later request of b is one among the others again: the picker chooses among all of them
    offered: list[list[str]] = []
    pick = core.picker.pick
    core.picker.pick = lambda names: offered.append(sorted(names)) or pick(names)

    def first_pick_after_submitting(*names: str) -> list[str]:
        offered.clear()
        submit(core, *names)
        core.step()
        return offered[0]

    assert first_pick_after_submitting("a", "b") == ["a", "b"]
    drain(core, toks)
    # flagged, then called off (its drain no longer needed): in turn with the others at once
    submit(core, "a")
    core.expedite("a")
    assert core.expedite("a", on=False) and not core._expedited
    assert first_pick_after_submitting("b", "c") == ["a", "b", "c"]
    drain(core, toks)
    # unloaded while expedited (a drain past its deadline): the others step on
    submit(core, "a", "c")
    core.expedite("a")
    core.step()
    core.unload_model("a")
    drain(core, toks)
    assert not core._expedited and all(toks[f"c{i}"] for i in range(3))
    # flagged with no step after (its last request just ended), then unloaded and loaded again:
    # the new load competes as any other
    core.expedite("b")
    core.unload_model("b")
    load(core, "b", dirs["b"])
    assert first_pick_after_submitting("b", "c") == ["b", "c"]  # not b alone
    drain(core, toks)


def test_a_workspace_measured_before_is_booked_in_place_of_the_estimate(dirs, tmp_path):
    """A load books the workspace a load of the same computation measured at the same shape (the
    load notes here; a vacancy or the warm tier's note likewise), not the estimate for any model:
    the estimate floored it once and booked an 8B 2.4x what it holds."""
    import json

    notes = tmp_path / "notes.json"
    spec = LoadSpec("a", dirs["a"], max_model_len=MAX_LEN, max_num_seqs=SEQS)
    first = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=3, warmup=True, load_notes_path=str(notes)),
                       device="cpu", budget=1 << 30)
    estimate = first.check_load(spec)
    first.load_model(spec)  # off CUDA nothing is measured: the note keeps the estimate
    doc = json.loads(notes.read_text())
    assert list(doc["notes"].values()) == [[estimate.workspace_bytes, 0]]
    doc["notes"] = {k: [4096, 1024] for k in doc["notes"]}  # as if a GPU had measured 4 KiB held, 1 KiB a step
    notes.write_text(json.dumps(doc))
    second = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=3, warmup=True, load_notes_path=str(notes)),
                        device="cpu", budget=1 << 30)
    plan = second.check_load(spec)
    assert (plan.workspace_bytes, plan.step_bytes) == (4096, 1024)
    assert plan.needed == estimate.needed - estimate.workspace_bytes + 4096 + 2 * 1024  # two steps in flight
    second.load_model(spec)
    assert second.memory().models["a"].workspace == 4096 and second.memory().step == 2 * 1024
    # another shape has no note: the estimate again
    assert second.check_load(LoadSpec("b", dirs["a"], max_model_len=MAX_LEN, max_num_seqs=SEQS + 1)).workspace_bytes \
        > 4096


@pytest.mark.parametrize("in_place", [True, False])
def test_a_busy_model_short_of_pages_grows_a_pool_that_stays_in_place(dirs, needs, solo, monkeypatch, in_place):
    """A pool left small by churn (b loaded beside a, then unloaded: its room kept as a vacancy)
    grows while a is busy once a's admissions wait for pages and loads have been quiet — where
    the pool grows in place (a GPU's: nothing moves, nothing is rebuilt). Where it would be
    re-created it waits for an idle engine, as before."""
    if in_place:
        monkeypatch.setattr("engine.kv.page_memory.pool_memory",
                            lambda n, pb, device, capacity: InPlaceMemory(n, pb, device, capacity))
    monkeypatch.setattr("engine.core.engine_core.POOL_GROW_QUIET_S", 0.0)
    monkeypatch.setattr("engine.core.engine_core.POOL_PRESSURE_CHECK_S", 0.0)
    longer = [list(range(50, 50 + n)) for n in (45, 41, 38, 44, 40)]
    want = dict(solo)
    alone = core_for()
    load(alone, "a", dirs["a"])
    for i, p in enumerate(longer):
        alone.add_request(f"a-long{i}", "a", p, GREEDY)
    drain(alone, want)

    need_a = core_for(1 << 30).check_load(LoadSpec("a", dirs["a"], MAX_LEN, 64)).needed
    core = core_for(need_a + needs["b"])  # b's load leaves the pool the two minimums
    core.load_model(LoadSpec("a", dirs["a"], max_model_len=MAX_LEN, max_num_seqs=64))
    load(core, "b", dirs["b"])
    core.unload_model("b")
    small = core.memory()
    assert small.vacant > 0  # b's room kept for the next load of its kind
    submit(core, "a")
    for i, p in enumerate(longer):
        core.add_request(f"a-long{i}", "a", p, GREEDY)
    toks: dict[str, list[int]] = {}
    grew_while_busy = False
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
        grew_while_busy |= core.has_unfinished_requests() and core.memory().kv_pages > small.kv_pages
    assert core.slots.get("a").scheduler.page_waits > 0  # a was short of pages
    assert toks == {k: v for k, v in want.items() if k.startswith("a")}
    assert grew_while_busy == in_place
    if in_place:
        assert core.memory().vacant == 0  # the vacancy's room went to the pool
    core.pools.pool.audit()


def test_a_load_takes_back_the_pages_another_model_took_above_its_minimum(dirs):
    # c leaves while b serves: b may then take c's pages (its cap is what the others' minimums
    # leave). The pool is already the size the books give it, so c's load resizes nothing; it
    # must still get its minimum, from b's pages above b's (b's sequences preempted, recomputed
    # token for token), not fail with "cannot guarantee" (found by a churn run through the daemon).
    def serve_b(core):
        for i in range(16):
            core.add_request(f"b{i}", "b", [7, 8, 9], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))

    alone = core_for(4 << 20)
    alone.load_model(LoadSpec("b", dirs["b"], max_model_len=512, max_num_seqs=16))
    serve_b(alone)
    want: dict[str, list[int]] = {}
    drain(alone, want)

    core = core_for(4 << 20)
    for n in ("a", "b", "c"):
        core.load_model(LoadSpec(n, dirs[n], max_model_len=512, max_num_seqs=16))
    pool = core.pools.pool
    serve_b(core)
    toks: dict[str, list[int]] = {}
    for o in core.step():
        toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    core.unload_model("c")
    c_min = 32
    for _ in range(2000):  # until b holds what c's minimum would need
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
        if pool.num_free - pool.num_reserved < c_min:
            break
    pages = pool.num_pages
    assert pool.num_free - pool.num_reserved < c_min and pool.num_used("b") > 64  # the case
    core.load_model(LoadSpec("c", dirs["c"], max_model_len=512, max_num_seqs=16))
    assert pool.num_pages == pages and pool._slot("c").min_pages == c_min
    drain(core, toks)
    assert toks == want
    pool.audit()
