"""On CUDA: a model decodes (graph replays) while another's weights are read in the load thread.

Skipped without a GPU. Checks what the CPU tests cannot: the copy streams wait for the step
stream before writing into freshly allocated weights, the step stream waits for the load
thread's event before using them, and a warm reload at the same shape skips the warm-up.
Run: ``python -m pytest -q tests/integration/test_load_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _core(**kw) -> EngineCore:
    return EngineCore(EngineOptions(max_num_batched_tokens=256, seed=0, decode_buckets=(1, 2, 4, 8), **kw),
                      device="cuda", budget=2 << 30)


def _run(core: EngineCore, reqs: dict[str, tuple[str, list[int]]]) -> dict[str, list[int]]:
    for rid, (model, prompt) in reqs.items():
        core.add_request(rid, model, prompt, GREEDY)
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.req_id] += o.new_token_ids
    return out


def test_decoding_beside_a_load_and_a_warm_reload(make_tiny_model):
    da, db = make_tiny_model("llama"), make_tiny_model("llama", seed=1)
    prompts = {f"r{i}": [3 + i, 7, 11 + i, 2] for i in range(6)}
    solo = _core()
    solo.load_model(LoadSpec("b", db, max_model_len=256, max_num_seqs=8))
    ref_b = _run(solo, {k: ("b", p) for k, p in prompts.items()})
    core = _core(warmup=True, warm_tier_bytes=1 << 30)
    core.load_model(LoadSpec("a", da, max_model_len=256, max_num_seqs=8))
    ref_a = _run(core, {k: ("a", p) for k, p in prompts.items()})
    for rid, p in prompts.items():
        core.add_request("x" + rid, "a", p, GREEDY)
    pending = core.begin_load(LoadSpec("b", db, max_model_len=256, max_num_seqs=8))
    got_a = {"x" + k: [] for k in prompts}
    while core.has_unfinished_requests() or not pending.done():
        for o in core.step():
            got_a[o.req_id] += o.new_token_ids
    core.finish_load(pending)
    assert got_a == {"x" + k: v for k, v in ref_a.items()}
    assert _run(core, {k: ("b", p) for k, p in prompts.items()}) == ref_b
    core.unload_model("b")
    core.load_model(LoadSpec("b", db, max_model_len=256, max_num_seqs=8))
    t = core.loader.last_load_timings
    assert t["warm"] == 1.0 and t["warmup_skipped"] == 1.0
    assert core.memory().models["b"].workspace > 0
    assert _run(core, {"y" + k: ("b", p) for k, p in prompts.items()}) == {"y" + k: v for k, v in ref_b.items()}
