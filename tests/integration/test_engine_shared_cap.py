"""``EngineCore(shared_step_tokens=N)``: while another model has requests (or had one within the
quiet window) no step takes more than N tokens (a quiet model's request waits for at most one
short step of a flooded one); alone, or beside idle models, a model gets its whole step budget.
Tokens are those of the uncapped engine."""

from __future__ import annotations

import pytest

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec

PROMPTS = [list(range(30, 30 + n)) for n in (33, 5, 19)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(core: EngineCore, model: str, sizes: list[int], beside: str | None = None) -> dict[str, list[int]]:
    """Serve PROMPTS on ``model``, recording its step sizes; ``beside``: a model kept busy
    (one long request) the whole time."""
    slot = core.slots.get(model)
    schedule = slot.scheduler.schedule

    def spy(token_cap=None):
        out = schedule(token_cap)
        sizes.append(out.num_batched_tokens)
        return out

    slot.scheduler.schedule = spy
    for i, p in enumerate(PROMPTS):
        core.add_request(f"{model}{i}", model, p, PARAMS)
    toks = {f"{model}{i}": [] for i in range(len(PROMPTS))}
    done: set[str] = set()
    longs = 0
    while len(done) < len(toks):
        # the other model busy until this one is done: a long request again whenever its last
        # ended (on a loaded 2-core box this model's first step ran while the other's 40-token
        # request went through all of its steps, and the cap rightly lifted)
        if beside is not None and not core.slots.get(beside).scheduler.has_unfinished():
            longs += 1
            core.add_request(f"long{longs}", beside, [7, 8, 9], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        for o in core.step():
            if o.req_id in toks:
                toks[o.req_id] += o.new_token_ids
                if o.finish_reason is not None:
                    done.add(o.req_id)
    while core.has_unfinished_requests():
        core.step()
    slot.scheduler.schedule = schedule
    return toks


def test_steps_are_capped_while_models_share_the_device(make_tiny_model):
    a, b = make_tiny_model("llama"), make_tiny_model("qwen3")
    alone = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=1), device="cpu")
    alone.load_model(LoadSpec("a", a, max_model_len=64, max_num_seqs=4))
    sizes_alone: list[int] = []
    want = _run(alone, "a", sizes_alone)
    assert max(sizes_alone) > 8

    core = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=1, shared_step_tokens=8, quiet_window_ms=0),
                      device="cpu")
    core.load_model(LoadSpec("a", a, max_model_len=64, max_num_seqs=4))
    core.load_model(LoadSpec("b", b, max_model_len=64, max_num_seqs=4))
    sizes: list[int] = []
    assert _run(core, "a", sizes, beside="b") == want
    assert 4 < max(sizes) <= 8  # the cap (a chunk counts its attention too: a token or two less)
    sizes.clear()
    assert _run(core, "a", sizes) == want  # b loaded but idle: the whole budget
    assert max(sizes) > 8
    core.unload_model("b")  # alone again: the whole budget
    sizes.clear()
    assert _run(core, "a", sizes) == want
    assert max(sizes) > 8


def test_the_cap_holds_through_the_quiet_window_after_the_other_model_went_idle(make_tiny_model):
    core = EngineCore(EngineOptions(max_num_batched_tokens=64, seed=1, shared_step_tokens=8, quiet_window_ms=60000),
                      device="cpu")
    core.load_model(LoadSpec("a", make_tiny_model("llama"), max_model_len=64, max_num_seqs=4))
    core.load_model(LoadSpec("b", make_tiny_model("qwen3"), max_model_len=64, max_num_seqs=4))
    core.add_request("b0", "b", [5, 6], SamplingParams(temperature=0, max_tokens=1))
    while core.has_unfinished_requests():
        core.step()
    sizes: list[int] = []
    _run(core, "a", sizes)  # b is idle, but had a request a moment ago: it may send another
    assert 4 < max(sizes) <= 8


@pytest.mark.parametrize("bad", [-3, True, 2.5, "8", None])
def test_a_bad_cap_is_refused(bad):
    with pytest.raises(EngineError, match="shared_step_tokens"):
        EngineCore(EngineOptions(shared_step_tokens=bad), device="cpu")


def test_the_defaults_are_the_daemons():
    core = EngineCore(device="cpu")
    assert core.policy.shared_step_tokens == 512 and core.policy.quiet_window_s == 1.0
    assert core.options.max_num_batched_tokens == 4096
