"""Several models' steps on their own CUDA streams (engine/runner/streams.py) give the tokens they
give on one stream; the quiet model's steps take the high-priority stream. Skipped without CUDA.

float32 weights: the two runs batch differently (the fair-share pick reads step times), and
float32 keeps a batch-size-dependent rounding far below any gap between the top two logits.
"""

from __future__ import annotations

import pytest
import torch
from engine.load_spec import LoadSpec
from engine.options import EngineOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    from modelgen.make import make_model

    root = tmp_path_factory.mktemp("m")
    return make_model(root / "llama", "llama", "small", seed=0), make_model(root / "qwen3", "qwen3", "small", seed=1)


def _run(dirs, window_ms: str = "0", yielded: list | None = None, only: str | None = None):
    """The flood (24 requests at once) and the quiet model (3 requests arriving while it runs) in one
    engine; ``only``: that model alone, with the same requests at the same steps."""
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams

    core = EngineCore(EngineOptions(dtype="float32", max_num_batched_tokens=256, seed=0, decode_buckets=(1, 2, 4, 8, 16),
                                    quiet_window_ms=int(window_ms)), device="cuda")
    if only in (None, "flood"):
        core.load_model(LoadSpec("flood", dirs[0], max_model_len=256, max_num_seqs=16))
    if only in (None, "quiet"):
        core.load_model(LoadSpec("quiet", dirs[1], max_model_len=256, max_num_seqs=4))
    # urgent steps while serving (each load's warm-up runs one on each stream: PoolKeeper.warm_up)
    loaded = {n: s.runner.streams.urgent_steps for n, s in core.slots.items()}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=24, ignore_eos=True)
    if only in (None, "flood"):
        for i in range(24):
            core.add_request(f"f{i}", "flood", list(range(10 + i, 40 + 3 * i)), greedy if i % 2 else seeded)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests() or steps <= 20:
        if steps in (3, 9, 20) and only in (None, "quiet"):  # quiet requests arrive while the flood runs
            core.add_request(f"q{steps}", "quiet", list(range(100, 100 + 5 * steps)), greedy)
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        step = core.yielded()
        if step is not None and yielded is not None:
            yielded.append(steps)
            step.wait()  # as the worker's waiter does
        steps += 1
    urgent = {n: s.runner.streams.urgent_steps - loaded[n] for n, s in core.slots.items()}
    for n in core.slots.names():
        core.unload_model(n)
    return tokens, urgent


def test_models_on_their_own_streams_give_the_tokens_of_each_model_alone(two_models):
    # Each runner launches on streams of its own, the quiet model's steps on the urgent one; the
    # tokens are those each model gives when it is the only one loaded (one runner, one stream).
    both, urgent = _run(two_models)
    flood, flood_urgent = _run(two_models, only="flood")
    quiet, quiet_urgent = _run(two_models, only="quiet")
    assert len(both) == 27 and all(len(t) == 24 for t in both.values())
    assert both == {**flood, **quiet}
    assert urgent["quiet"] > 0 and urgent["flood"] == 0
    assert flood_urgent == {"flood": 0} and quiet_urgent == {"quiet": 0}  # alone, nothing is urgent


def test_a_stream_pool_lends_a_stream_again_once_its_borrower_is_gone():
    import gc

    from engine.runner.streams import StreamPool

    pool = StreamPool(torch.device("cuda"))

    class Borrower:
        pass

    a, b = Borrower(), Borrower()
    first = pool.take(a)
    assert pool.take(b) != first  # lent out: a second borrower gets another one
    del a
    gc.collect()
    c = Borrower()
    assert pool.take(c) == first  # given back when its borrower went
    urgent = pool.take(b, priority=-64)
    assert urgent.priority < first.priority  # priorities kept apart
    assert pool.created == 3


def test_a_busy_model_yields_its_step_to_a_quiet_one_and_the_tokens_stay_the_same(two_models):
    plain, _ = _run(two_models)
    yielded: list[int] = []
    yielding, urgent = _run(two_models, window_ms="60000", yielded=yielded)
    assert yielding == plain
    assert yielded and yielded[0] >= 3  # only once the quiet model had a request
    assert urgent["quiet"] > 0
