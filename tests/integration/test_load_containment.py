"""A failure is one model's: a failed step, a failed load or a runner that cannot be rebuilt after a
KV pool resize leaves every other model serving, token-identical to serving alone, and the worker
process up (issue 35, containment). Tiny CPU models; the oracle is each model served alone."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.errors import EngineError
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.worker import protocol as P
from engine.worker.main import MAX_FAILED_STEPS, Worker

MAX_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(40, 40 + n)) for n in (3, 11)]


@pytest.fixture(scope="module")
def dirs(make_tiny_model):
    return {"a": make_tiny_model("llama"), "b": make_tiny_model("qwen3")}


def new_core() -> EngineCore:
    return EngineCore(EngineOptions(max_num_batched_tokens=64, seed=3), device="cpu")


def spec(name: str, d) -> LoadSpec:
    return LoadSpec(name, d, max_model_len=MAX_LEN, max_num_seqs=4)


def submit(core: EngineCore, name: str) -> None:
    for i, p in enumerate(PROMPTS):
        core.add_request(f"{name}{i}", name, p, GREEDY)


def drain(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, str]]:
    toks: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(500):
        if not core.has_unfinished_requests():
            return toks, finish
        for o in core.step():
            toks.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.req_id] = o.finish_reason
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def solo(dirs):
    out = {}
    for name, d in dirs.items():
        core = new_core()
        core.load_model(spec(name, d))
        submit(core, name)
        out.update(drain(core)[0])
    return out


def test_a_load_that_fails_building_its_runner_leaves_the_others_serving(dirs, solo, monkeypatch):
    core = new_core()
    core.load_model(spec("a", dirs["a"]))
    submit(core, "a")
    first = {o.req_id: list(o.new_token_ids) for o in core.step()}  # a is mid-generation
    real = core.pools.attach_runner

    def oom_for_b(slot):
        if slot.name == "b":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        real(slot)

    monkeypatch.setattr(core.pools, "attach_runner", oom_for_b)
    with pytest.raises(RuntimeError, match="injected"):
        core.load_model(spec("b", dirs["b"]))
    assert core.slots.names() == ["a"] and "b" not in core.pools.ledger
    toks, finish = drain(core)
    assert {r: first.get(r, []) + toks[r] for r in ("a0", "a1")} == {r: solo[r] for r in ("a0", "a1")}
    monkeypatch.setattr(core.pools, "attach_runner", real)
    core.load_model(spec("b", dirs["b"]))  # the next load works
    submit(core, "b")
    assert drain(core)[0] == {r: solo[r] for r in ("b0", "b1")}


def test_a_runner_that_cannot_be_rebuilt_runs_eagerly_else_its_model_alone_is_stopped(dirs, solo, monkeypatch):
    core = new_core()
    core.load_model(spec("a", dirs["a"]))
    core.load_model(spec("b", dirs["b"]))
    real = core.pools.new_runner
    fails = {"graphs": True, "eager": False}

    def flaky(name, cfg, model, max_num_seqs, max_model_len, cuda_graphs=None):
        if name == "a" and (fails["graphs"] if cuda_graphs is None else fails["eager"]):
            raise RuntimeError("CUDA out of memory (injected)")
        return real(name, cfg, model, max_num_seqs, max_model_len, cuda_graphs=cuda_graphs)

    monkeypatch.setattr(core.pools, "new_runner", flaky)
    a = core.slots.get("a")
    core.pools.reattach_runner(a)  # the graphs' capture fails: an eager runner serves
    assert a.runner is not None and not a.broken and not a.runner.graphs
    submit(core, "a")
    assert drain(core)[0] == {r: solo[r] for r in ("a0", "a1")}

    fails["eager"] = True
    core.pools.reattach_runner(a)  # nothing can be built: a is stopped, b is not
    assert a.runner is None and "could not be rebuilt" in a.broken
    assert core.stats()["a"].broken == a.broken and core.stats()["b"].broken == ""  # the agent unloads it
    with pytest.raises(EngineError, match="cannot run"):
        core.add_request("late", "a", [1, 2, 3], GREEDY)
    core._req_model["stuck"] = "a"  # a request a held when its runner went (as after a resize)
    a.scheduler.add("stuck", [1, 2, 3], GREEDY, None)
    submit(core, "b")
    toks, finish = drain(core)
    assert finish["stuck"] == "abort" and toks.get("stuck", []) == []
    assert {r: toks[r] for r in ("b0", "b1")} == {r: solo[r] for r in ("b0", "b1")}
    monkeypatch.setattr(core.pools, "new_runner", real)
    core.pools.reattach_runner(a)  # the next rebuild (the next resize) brings it back
    submit(core, "a")
    assert not a.broken and drain(core)[0] == {r: solo[r] for r in ("a0", "a1")}


class _Conn:
    def __init__(self) -> None:
        self.sent: list[P.Message] = []

    def send(self, msg: P.Message) -> None:
        self.sent.append(msg)


def test_a_failed_step_ends_its_batch_and_the_worker_goes_on(dirs, solo, monkeypatch):
    core = new_core()
    core.load_model(spec("a", dirs["a"]))
    core.load_model(spec("b", dirs["b"]))
    worker = Worker(_Conn(), core)
    runner = core.slots.get("a").runner
    real = runner.execute
    calls = {"n": 0}

    def fail_once(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("an injected kernel failure")
        return real(out)

    monkeypatch.setattr(runner, "execute", fail_once)
    submit(core, "a")
    submit(core, "b")
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        worker._step()  # raises only when the device is gone or steps keep failing
    outs = [o for m in worker.conn.sent if isinstance(m, P.Tokens) for o in P.unpack_outputs(m)]
    finish = {o.req_id: o.finish_reason for o in outs if o.finish_reason}
    toks: dict[str, list[int]] = {}
    for o in outs:
        toks.setdefault(o.req_id, []).extend(o.new_token_ids)
    failed = [r for r in ("a0", "a1", "b0", "b1") if finish[r] == "abort"]
    assert failed and all(r.startswith("a") for r in failed)  # only a's batch ended
    assert {r: toks[r] for r in ("b0", "b1")} == {r: solo[r] for r in ("b0", "b1")}
    submit(core, "a")  # a serves again after its failed step
    while core.has_unfinished_requests():
        worker._step()
    assert worker._failed_steps == 0

    def always(out):
        raise RuntimeError("a kernel that always fails")

    monkeypatch.setattr(runner, "execute", always)
    with pytest.raises(EngineError):  # steps that keep failing end the process (a restart cures it)
        for i in range(MAX_FAILED_STEPS * 4):
            if not core.has_unfinished_requests():
                core.add_request(f"x{i}", "a", [1, 2, 3], GREEDY)
            worker._step()
    assert worker._failed_steps == MAX_FAILED_STEPS


def test_a_request_ended_for_its_mask_budget_gets_an_error_not_an_abort(dirs):
    """The worker reports a request the engine ended for its grammar's mask budget as that
    request's error (the client's 400), and every other output as usual."""
    core = new_core()
    core.load_model(spec("a", dirs["a"]))
    worker = Worker(_Conn(), core)
    submit(core, "a")
    worker._step()
    core.grammar_errors["a0"] = "response_format: the grammar took 52 ms of masks (budget 2 ms a step)"
    core.abort_request("a0")  # as the engine ends it
    while core.has_unfinished_requests():
        worker._step()
    errors = [m for m in worker.conn.sent if isinstance(m, P.Error)]
    outs = [o for m in worker.conn.sent if isinstance(m, P.Tokens) for o in P.unpack_outputs(m)]
    assert [(e.op, e.code, e.req_id) for e in errors] == [("add", "GrammarError", "a0")]
    assert "mask" in errors[0].message and not core.grammar_errors
    assert not [o for o in outs if o.req_id == "a0" and o.finish_reason == "abort"]
    assert [o.finish_reason for o in outs if o.req_id == "a1" and o.finish_reason] == ["length"]
