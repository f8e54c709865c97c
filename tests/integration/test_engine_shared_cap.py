"""``EngineCore(shared_step_tokens=N)``: while several models are loaded no step takes more than
N tokens (a quiet model's request waits for at most one short step of a flooded one); alone, a
model gets its whole step budget back. Tokens are those of the uncapped engine."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.errors import EngineError
from engine.sampling import SamplingParams

PROMPTS = [list(range(30, 30 + n)) for n in (33, 5, 19)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(core: EngineCore, model: str, sizes: list[int]) -> dict[str, list[int]]:
    slot = core._slots[model]
    schedule = slot.scheduler.schedule

    def spy(max_tokens=None):
        out = schedule(max_tokens)
        sizes.append(out.num_batched_tokens)
        return out

    slot.scheduler.schedule = spy
    for i, p in enumerate(PROMPTS):
        core.add_request(f"{model}{i}", model, p, PARAMS)
    toks = {f"{model}{i}": [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for o in core.step():
            toks[o.req_id] += o.new_token_ids
    slot.scheduler.schedule = schedule
    return toks


def test_steps_are_capped_while_models_share_the_device(make_tiny_model):
    a, b = make_tiny_model("llama"), make_tiny_model("qwen3")
    alone = EngineCore(device="cpu", max_num_batched_tokens=64, seed=1)
    alone.load_model("a", a, max_model_len=64, max_num_seqs=4)
    sizes_alone: list[int] = []
    want = _run(alone, "a", sizes_alone)
    assert max(sizes_alone) > 8

    core = EngineCore(device="cpu", max_num_batched_tokens=64, seed=1, shared_step_tokens=8)
    core.load_model("a", a, max_model_len=64, max_num_seqs=4)
    core.load_model("b", b, max_model_len=64, max_num_seqs=4)
    sizes: list[int] = []
    assert _run(core, "a", sizes) == want
    assert max(sizes) == 8
    core.unload_model("b")  # alone again: the whole budget
    sizes.clear()
    assert _run(core, "a", sizes) == {k: v for k, v in want.items()}
    assert max(sizes) > 8


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_a_bad_cap_is_refused(bad):
    with pytest.raises(EngineError, match="shared_step_tokens"):
        EngineCore(device="cpu", shared_step_tokens=bad)
