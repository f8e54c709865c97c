"""A busy model yields to a quiet one (StepPolicy.yields, EngineCore(quiet_window_s=)): while a model
with at most a quarter of its requests had one within the window, the busy model's next step is
launched only once its step in flight is collected, and step() returns instead of blocking on that
step while nothing else has work (EngineCore.yielded), so a request that arrives meanwhile goes out
at once, ahead of the busy model's next step. Tokens are those of the engine without the rule;
two equally busy models keep launching ahead."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec


@pytest.fixture(scope="module")
def dirs(make_tiny_model):
    return make_tiny_model("llama"), make_tiny_model("qwen3")


def _spy(runner, name: str, events: list) -> None:
    """Record the runner's launches and collects (the instance attributes shadow its methods)."""
    launch, collect = runner.launch, runner.collect

    def spy_launch(out, *rest):
        events.append((name, "launch"))
        return launch(out, *rest)

    def spy_collect(pending):
        events.append((name, "collect"))
        return collect(pending)

    runner.launch, runner.collect = spy_launch, spy_collect


def _run(dirs, window_s: float, quiet: bool = True):
    core = EngineCore(EngineOptions(max_num_batched_tokens=32, block_size=4, max_prefill_chunk=16, seed=5,
                                    async_steps=True, async_on_cpu=True, quiet_window_ms=round(window_s * 1000)),
                      device="cpu")
    core.load_model(LoadSpec("busy", dirs[0], max_model_len=64, max_num_seqs=8))
    core.load_model(LoadSpec("other", dirs[1], max_model_len=64, max_num_seqs=8))
    events: list[tuple[str, str]] = []  # (model, "launch" | "collect") in order
    for name, slot in core.slots.items():
        _spy(slot.runner, name, events)
    # The busy model's requests outlive the quiet one's: it has 4x its requests all along (QUIET_RATIO).
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=30, ignore_eos=True)
    for i in range(8):
        core.add_request(f"b{i}", "busy", list(range(20 + i, 30 + 2 * i)), greedy if i % 2 else seeded)
        if not quiet:  # the other model as busy as this one
            core.add_request(f"o{i}", "other", list(range(40 + i, 50 + 2 * i)), greedy if i % 2 else seeded)
    tokens: dict[str, list[int]] = {}
    arrived_at = None
    steps = 0
    while core.has_unfinished_requests():
        if quiet and steps == 6:
            core.add_request("q", "other", list(range(60, 75)), SamplingParams(temperature=0, max_tokens=10))
            arrived_at = len(events)
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 2000
    for slot in core.slots.values():
        del slot.runner.launch, slot.runner.collect  # a spy holds its runner (and the pool's views)
    for name in core.slots.names():
        core.unload_model(name)
    return tokens, events, arrived_at


def _launches_behind(events, model: str, start: int = 0, by: str | None = None) -> int:
    """Launches (of ``by``, or of any model) made from ``events[start]`` on while a launched step
    of ``model`` was not yet collected."""
    open_steps, behind = 0, 0
    for i, (name, kind) in enumerate(events):
        if kind == "launch" and i >= start and by in (None, name):
            behind += open_steps > 0
        if name == model:
            open_steps += 1 if kind == "launch" else -1
    return behind


def _first_launch(events, model: str, start: int) -> int:
    return next(i for i, (name, kind) in enumerate(events) if i >= start and name == model and kind == "launch")


def test_the_busy_model_stops_launching_ahead_while_a_quiet_model_is_active(dirs):
    plain, plain_events, plain_at = _run(dirs, 0)
    got, events, at = _run(dirs, 60)
    assert got == plain and len(got["q"]) == 10
    assert _launches_behind(plain_events, "busy", plain_at, by="busy") > 0  # without the rule: launched ahead
    # With it, the busy model's next step is launched only once its last one is collected ...
    assert _launches_behind(events, "busy", at, by="busy") == 0
    assert _launches_behind(events[:at], "busy", by="busy") > 0  # (before the quiet request: as usual)
    # ... and the quiet prompt goes out before that next step, beside the busy step in flight.
    assert _first_launch(events, "other", at) < _first_launch(events, "busy", at)


def test_two_equally_busy_models_keep_launching_ahead(dirs):
    _, events, _ = _run(dirs, 60, quiet=False)
    assert _launches_behind(events, "busy") > 0 and _launches_behind(events, "other") > 0
    assert _launches_behind(events, "busy", by="busy") > 0


def test_a_drained_model_steps_alone_even_beside_a_quiet_model(dirs):
    """An expedited model (drained for a load's room) does not yield: a quiet model's recent
    request would otherwise make it yield, and in each of its gaps a busy model's step went ahead
    of its next one (its drain at two models' step time a token)."""
    def run(expedite: bool) -> list[tuple[str, str]]:
        core = EngineCore(EngineOptions(max_num_batched_tokens=32, block_size=4, seed=5, async_steps=True,
                                        async_on_cpu=True, quiet_window_ms=60_000), device="cpu")
        for name, d in (("drain", dirs[0]), ("busy", dirs[1]), ("quiet", dirs[0])):
            core.load_model(LoadSpec(name, d, max_model_len=64, max_num_seqs=8))
        events: list[tuple[str, str]] = []
        for name, slot in core.slots.items():
            _spy(slot.runner, name, events)
        core.add_request("q", "quiet", [7, 8, 9], SamplingParams(temperature=0, max_tokens=1))
        while core.has_unfinished_requests():  # quiet: a request a moment ago, none now
            core.step()
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(4):
            core.add_request(f"d{i}", "drain", list(range(20 + i, 26 + i)), greedy)
        for i in range(8):
            core.add_request(f"b{i}", "busy", list(range(40 + i, 48 + i)), greedy)
        core.expedite("drain", on=expedite)
        start = len(events)
        while core.slots.get("drain").scheduler.has_unfinished():
            core.step()
        for slot in core.slots.values():
            del slot.runner.launch, slot.runner.collect
        for name in core.slots.names():
            core.unload_model(name)
        return [n for n, k in events[start:] if k == "launch"]

    assert "busy" in run(False)  # in turn, yielding: busy's steps go in drain's gaps
    drained = run(True)
    assert drained and set(drained) == {"drain"}  # expedited: its steps alone until its requests end


@pytest.mark.parametrize("bad", [-100, 61_000, True, "1000", 0.5])
def test_a_bad_window_argument_is_refused(bad):
    with pytest.raises(EngineError, match="quiet_window_ms"):
        EngineCore(EngineOptions(quiet_window_ms=bad), device="cpu")


def test_the_window_is_the_argument_alone(monkeypatch):
    monkeypatch.setenv("INFIRE_QUIET_WINDOW_MS", "250")  # no longer read
    assert EngineCore(device="cpu").policy.quiet_window_s == 1.0
    assert EngineCore(EngineOptions(quiet_window_ms=2000), device="cpu").policy.quiet_window_s == 2.0
