"""Asynchronous steps (EngineCore.step with async_steps): step N+1 is scheduled and launched
before step N's tokens reach the host; a decode scheduled ahead reads its input token from the
previous launch on the device. The specification: exactly the tokens, finish reasons and
logprobs of synchronous steps, whatever the batching, preemption, stops, aborts or unloads —
and every page back at the end."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec

PROMPTS = [list(range(40, 40 + n)) for n in (1, 5, 19, 33, 8, 3)]


def _core(model_dir, async_steps: bool, **kw) -> EngineCore:
    core = EngineCore(EngineOptions(max_num_batched_tokens=kw.pop("budget", 64), block_size=kw.pop("block_size", 4),
                                    max_prefill_chunk=kw.pop("chunk", 16), seed=99, async_steps=async_steps,
                                    async_on_cpu=True), device="cpu")
    core.load_model(LoadSpec("m", model_dir, max_model_len=kw.pop("max_model_len", 64), max_num_seqs=kw.pop("max_num_seqs", 8),
                             num_kv_pages=kw.pop("num_kv_pages", None), prefix_caching=kw.pop("prefix_caching", True)))
    assert not kw
    return core


def _run(core, prompts, params, model="m", abort_at: dict[str, int] | None = None):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(f"r{i}", model, p, sp)
    toks = {f"r{i}": [] for i in range(len(prompts))}
    reasons, lps = {}, {}
    steps = placeholders = 0
    runner = core.slots.get(model).runner
    launch = runner.launch

    def spy(out, *rest):
        nonlocal placeholders
        placeholders += out.num_placeholders
        return launch(out, *rest)

    runner.launch = spy
    while core.has_unfinished_requests():
        for o in core.step():
            toks[o.req_id] += o.new_token_ids
            if o.logprobs:
                lps.setdefault(o.req_id, []).extend(lp["logprob"] for lp in o.logprobs)
            if o.finish_reason:
                reasons[o.req_id] = o.finish_reason
        steps += 1
        for rid, at in (abort_at or {}).items():
            if steps == at:
                core.abort_request(rid)
        assert steps < 5000
    assert core.stats()[model].kv_pages_used == 0
    return toks, reasons, lps, placeholders


def _params(eos_at=None):
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=30, seed=3, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, stop_token_ids=[eos_at] if eos_at else []),
            SamplingParams(temperature=1.0, top_p=0.8, seed=11, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
            SamplingParams(temperature=0.7, min_p=0.1, seed=5, max_tokens=13, ignore_eos=True)]


@pytest.fixture(scope="module")
def model_dir(make_tiny_model):
    return make_tiny_model("llama")


@pytest.mark.parametrize("shape", [dict(), dict(budget=8, chunk=4), dict(block_size=1, budget=256, chunk=None),
                                   dict(num_kv_pages=20, max_model_len=48)])  # the last forces preemption
def test_async_steps_give_the_tokens_of_sync_steps(model_dir, shape):
    sync = _run(_core(model_dir, False, **dict(shape)), PROMPTS, _params())
    got = _run(_core(model_dir, True, **dict(shape)), PROMPTS, _params())
    assert got[:2] == sync[:2]
    assert [len(t) for t in got[0].values()] == [12, 9, 15, 7, 1, 13]
    assert got[3] > 0 and sync[3] == 0  # decodes really were scheduled ahead of their input token


def test_a_stop_token_met_in_flight_wastes_one_row_and_nothing_else(model_dir):
    first = _run(_core(model_dir, False), PROMPTS, _params())[0]["r2"]
    stop = first[4]  # greedy: the request stops at its 5th token (or earlier, at the same id)
    sync = _run(_core(model_dir, False), PROMPTS, _params(stop))
    got = _run(_core(model_dir, True), PROMPTS, _params(stop))
    assert got[:2] == sync[:2]
    assert got[1]["r2"] == "stop" and got[0]["r2"][-1] == stop and len(got[0]["r2"]) <= 5


def test_logprobs_and_aborts_under_async_steps(model_dir):
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2 if i % 2 else None)
              for i in range(len(PROMPTS))]
    sync = _run(_core(model_dir, False), PROMPTS, params)
    got = _run(_core(model_dir, True), PROMPTS, params)
    assert got[0] == sync[0] and got[2].keys() == sync[2].keys()
    for rid in got[2]:
        assert got[2][rid] == pytest.approx(sync[2][rid], abs=1e-6)
    # an abort while the request's step is in flight: it ends as aborted, its pages come back
    toks, reasons, _, _ = _run(_core(model_dir, True), PROMPTS, _params(), abort_at={"r0": 6, "r3": 2})
    assert reasons["r0"] == "abort" and reasons["r3"] == "abort" and len(toks["r0"]) < 12


def test_unload_and_load_settle_the_step_in_flight(model_dir, make_tiny_model):
    core = _core(model_dir, True)
    before = core.memory()
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", "m", p, _params()[i])
    outs = []
    for _ in range(4):
        outs += core.step()
    assert core.in_flight() is not None
    core.load_model(LoadSpec("q", make_tiny_model("qwen3"), max_model_len=64, max_num_seqs=4))  # settles first
    assert core.in_flight() is None
    core.unload_model("m")
    while core.has_unfinished_requests():
        outs += core.step()
    ended = {o.req_id: o.finish_reason for o in outs if o.finish_reason}
    assert set(ended) == {f"r{i}" for i in range(len(PROMPTS))}
    assert set(ended.values()) <= {"abort", "length"}
    core.unload_model("q")
    assert core.memory().vacant > 0  # kept for the next load of its kind (engine/core/vacancy.py)
    core.pools.grow_when_quiet(0)  # quiet: gone
    after = core.memory()
    assert after.used == 0 and after.vacant == 0 and after.kv_used == 0 and before.budget == after.budget


SYSTEM = list(range(200, 219))  # 19 tokens: four full pages of 4
SHARED = [SYSTEM + [1, 2], SYSTEM + [3], SYSTEM[:10] + [4, 5, 6], SYSTEM + [1, 2], [7, 8, 9], SYSTEM + [1, 2, 3, 4, 5]]


@pytest.mark.parametrize("shape", [dict(), dict(budget=8, chunk=4), dict(num_kv_pages=24, max_model_len=48)])
def test_prefix_cache_hits_under_async_steps_give_the_tokens_of_no_cache(model_dir, shape):
    """Prompts sharing a system prompt, sent twice (the second wave is all hits): asynchronous
    steps with the cache give the tokens (seeded sampling included) of synchronous steps without
    it; a page is indexed only once the step writing it is launched and its tokens are known."""
    base = _core(model_dir, False, prefix_caching=False, **dict(shape))
    want = [_run(base, SHARED, _params())[:2] for _ in range(2)]
    core = _core(model_dir, True, **dict(shape))
    got = [_run(core, SHARED, _params())[:2] for _ in range(2)]
    assert got == want
    stats = core.stats()["m"]
    assert stats.prefix_caching and stats.prefix_hit_tokens >= 5 * 16
    assert not base.stats()["m"].prefix_caching and base.stats()["m"].prefix_hit_tokens == 0


def test_a_step_left_in_flight_that_must_be_collected_is_collected_before_the_next_launch(model_dir):
    """A failure while collecting the step before can leave a just-launched step that wants
    logprobs in flight: the next step collects it before launching anything (a launch behind it
    would overwrite the logits its logprobs are read from)."""
    from engine.errors import EngineError

    core = _core(model_dir, async_steps=True)
    core.add_request("a", "m", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    core.step()
    core.step()  # "a" decodes, a step in flight
    core.add_request("lp", "m", PROMPTS[4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))
    real, failed = core._complete, []

    def fails_once(f):
        if not failed:
            failed.append(f)
            raise EngineError("collect failed")
        return real(f)

    core._complete = fails_once
    with pytest.raises(EngineError, match="collect failed"):
        core.step()  # launched "lp"'s prefill (it samples, with logprobs), then failed collecting the step before
    assert core._inflight is not None and core._inflight.collect_now
    runner, order = core.slots.get("m").runner, []
    launch, collect = runner.launch, runner.collect
    runner.launch = lambda *a: (order.append("launch"), launch(*a))[1]
    runner.collect = lambda p: (order.append("collect"), collect(p))[1]
    core.step()
    assert order[:2] == ["collect", "launch"], order


def test_pages_a_model_frees_while_its_step_is_in_flight_reach_another_model_only_after_it(model_dir):
    # Two models in one pool, steps launched ahead: a sequence of "m" that ends (length, stop,
    # abort) while m's next step is in flight frees pages that step still writes. They stay m's
    # (held) until m has no step in flight; the other model never gets one meanwhile, and every
    # page comes back at the end with the tokens of a lone model.
    lone = _run(_core(model_dir, True), PROMPTS, _params(stop := 7))[0]
    core = _core(model_dir, True)
    core.load_model(LoadSpec("o", model_dir, max_model_len=64, max_num_seqs=8))
    m, o = core.slots.get("m"), core.slots.get("o")
    for i, (p, sp) in enumerate(zip(PROMPTS, _params(stop))):
        core.add_request(f"r{i}", "m", p, sp)
    taken = o.pages.allocate  # o's block manager allocates through its page source
    held_seen = beside = 0

    def spy():
        nonlocal beside
        page = taken()
        assert page not in set(core.pools.pool._slot("m").held), page
        beside += m.pages.num_held > 0
        return page

    o.pages.allocate = spy
    toks = {f"r{i}": [] for i in range(len(PROMPTS))}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            if out.req_id in toks:
                toks[out.req_id] += out.new_token_ids
        f = core._inflight
        m_in_flight = f is not None and f.slot is m
        assert m.pages.num_held == 0 or m_in_flight, steps  # held only behind a step of m's in flight
        held_seen += m.pages.num_held
        steps += 1
        if steps == 5:
            core.abort_request("r3")
        if steps % 2 == 0 and steps < 80:  # o's short requests arrive while m runs step behind step
            core.add_request(f"o{steps}", "o", PROMPTS[steps % 6], SamplingParams(temperature=0, max_tokens=2))
        assert steps < 5000
    assert held_seen > 0 and beside > 0  # the case happened, with o allocating meanwhile
    assert {r: t for r, t in toks.items() if r != "r3"} == {r: t for r, t in lone.items() if r != "r3"}
    assert core.stats()["m"].kv_pages_used == core.stats()["o"].kv_pages_used == 0


class _StandInEvent:
    """A step's ``written`` event on CPU, fired by the test (the device's work "done")."""

    fired = False

    def query(self):
        return self.fired

    def synchronize(self):
        self.fired = True


def _two_models_with_events(model_dir):
    """Models "m" and "o" in one pool; each empty step of m's carries a stand-in event: (core, m,
    the events in launch order)."""
    core = _core(model_dir, True, budget=8, chunk=4)
    core.load_model(LoadSpec("o", model_dir, max_model_len=64, max_num_seqs=8))
    m = core.slots.get("m")
    events = []
    launch = m.runner.launch

    def spy(out, *rest):
        pending = launch(out, *rest)
        if pending.num_sampled == 0:
            pending.written = _StandInEvent()
            events.append(pending.written)
        return pending

    m.runner.launch = spy
    return core, m, events


def test_an_empty_step_still_running_keeps_the_pages_freed_behind_it_until_it_has_run(model_dir):
    # A prefill chunk that samples nothing is collected without waiting (no ids to copy), but it
    # writes K/V: it counts as done with the page pool only once its event has fired (a stand-in
    # event here, on CPU), and a settle (before a load or an unload) waits for it.
    core, m, events = _two_models_with_events(model_dir)
    core.add_request("long", "m", list(range(10, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert events and m.behind  # chunks collected while "still running"
    pool = core.pools.pool._slot("m")
    assert pool.launched - pool.done >= len(m.behind)
    # the other model keeps the engine busy meanwhile (an engine going idle waits: below)
    core.add_request("busy", "o", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    core.abort_request("long")  # its pages: held behind the chunks
    assert m.pages.num_held > 0
    events[0].fired = True
    core.step()  # the first chunk has run: counted done; the others still run
    assert m.pages.num_held > 0 and m.behind
    core._settle()  # waits for all of them
    assert not m.behind and m.pages.num_held == 0 and pool.launched == pool.done
    assert core.stats()["m"].kv_pages_used == 0


def test_an_engine_going_idle_waits_for_the_empty_steps_behind_it(model_dir):
    # Nothing would call the catch-up again until the next request: the pages an aborted
    # prompt's chunks hold would stay held, counted as used (memory stats, the idle trim), while
    # the device had long run them. The step that leaves the engine idle waits for them instead.
    core, m, _ = _two_models_with_events(model_dir)
    core.add_request("long", "m", list(range(10, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    core.step()
    core.step()
    assert m.behind
    core.abort_request("long")
    while core.has_unfinished_requests():
        core.step()
    assert not m.behind and m.pages.num_held == 0 and core.stats()["m"].kv_pages_used == 0


def test_synchronous_steps_wait_for_a_step_that_samples_nothing(model_dir, monkeypatch):
    # Without launch-ahead no page is held (no step is counted on the device): a step that
    # samples nothing, whose collect returns at once, is waited for by execute itself, or its
    # model's pages freed next would reach another model while it still writes them.
    waited = []

    class Event:
        def synchronize(self):
            waited.append(self)

    core = _core(model_dir, False, budget=8, chunk=4)
    runner = core.slots.get("m").runner
    launch = runner.launch

    def spy(out, *rest):
        pending = launch(out, *rest)
        if pending.num_sampled == 0:
            pending.written = Event()
        return pending

    monkeypatch.setattr(runner, "launch", spy)
    core.add_request("long", "m", list(range(10, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    assert len(waited) >= 3  # 30 prompt tokens in chunks of 4: the first chunks sample nothing
