"""The KV pool on a GPU grows and shrinks in place (engine/kv/vmm.py, engine/kv/page_memory.py:
ElasticMemory): its addresses never move, so a resize keeps every view, runner and captured
graph, copies no page, and gives the memory it cuts back to the driver at once; a load takes the
pool's free tail while the other models serve.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from engine.load_spec import LoadSpec
from engine.options import EngineOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 1 << 20


def _driver_used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from modelgen.make import make_model

    return make_model(tmp_path_factory.mktemp("m") / "small", "llama", "small", seed=0)


def test_a_virtual_range_backs_zeroed_memory_and_gives_it_back_under_a_captured_graph():
    from engine.kv.vmm import VirtualRange, VmmError

    r = VirtualRange(torch.device("cuda"), 1 << 30, 64 * MiB)
    with pytest.raises(VmmError):
        r.tensor()  # nothing mapped: torch could not tell the address's device
    base = _driver_used()
    assert r.map_to(100 * MiB) == 128 * MiB  # whole chunks
    t = r.tensor()
    assert t.data_ptr() == r.base and t.numel() == r.reserved
    assert _driver_used() - base >= 120 * MiB
    assert int(t[:128 * MiB].count_nonzero()) == 0
    torch.cuda.empty_cache()  # the check's temporaries are not the range's
    base = _driver_used() - r.mapped
    t[:4096].fill_(3)
    t[64 * MiB:64 * MiB + 16].fill_(5)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g.capture_begin()
        t[:4096].add_(1)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    # The second chunk goes back to the driver; the graph on the first replays as before.
    r.map_to(64 * MiB)
    assert _driver_used() - base <= 72 * MiB
    g.replay()
    g.replay()
    assert int(t[0]) == 6 and int(t[4095]) == 6
    r.map_to(128 * MiB)
    assert int(t[64 * MiB]) == 0  # fresh memory, zeroed
    with pytest.raises(VmmError):
        r.map_to(2 << 30)  # past the reservation
    del g, t
    r.close()
    assert _driver_used() - base <= 8 * MiB


def test_the_pool_keeps_pages_views_and_generation_through_a_resize_and_hands_out_low_pages_first():
    from engine.kv.page_pool import PagePool

    pool = PagePool(64, 1 * MiB, device="cuda", capacity=1024)
    pool.register("m", num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    pages = pool.allocator_for("m")
    held = [pages.allocate() for _ in range(12)]
    assert held == list(range(12))
    for p in held[3:9]:
        pages.free(p)
    assert [pages.allocate() for _ in range(3)] == [3, 4, 5]  # the lowest free first, not the last freed
    k0 = pool.kv_views("m")[0][0]
    for p in (0, 5, 11):
        k0[p].fill_(p + 1)
    ptr, gen = k0.data_ptr(), pool.generation
    before = _driver_used()
    pool.resize(512)  # grow while pages are held: nothing moves
    assert _driver_used() - before >= (512 - 64) * MiB - 64 * MiB
    assert pool.kv_views("m")[0][0].data_ptr() == ptr and pool.generation == gen
    pool.resize(16)  # the tail is free: unmapped, memory back to the driver
    assert _driver_used() - before <= 64 * MiB
    k0 = pool.kv_views("m")[0][0]
    assert k0.data_ptr() == ptr and pool.generation == gen
    assert [float(k0[p].float().mean()) for p in (0, 5, 11)] == [1.0, 6.0, 12.0]


def _greedy(core, name: str, prompts: list[list[int]], n: int, load_beside: LoadSpec | None = None) -> list[list[int]]:
    """Greedy outputs of ``prompts`` on ``name``; with ``load_beside``, that load begun after a
    few steps and stepped through (its weights in the load thread) while they run."""
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"{name}-{i}", name, p, params)
    out: dict[str, list[int]] = {f"{name}-{i}": [] for i in range(len(prompts))}
    pending = None
    steps = 0
    while core.has_unfinished_requests() or pending is not None:
        for o in core.step():
            if o.req_id in out:
                out[o.req_id] += o.new_token_ids
        steps += 1
        if load_beside is not None and steps == 4:
            pending, load_beside = core.begin_load(load_beside), None
        if pending is not None and pending.done():
            core.finish_load(pending)
            pending = None
    return [out[f"{name}-{i}"] for i in range(len(prompts))]


def test_a_load_takes_the_pools_free_tail_while_another_model_serves_with_nothing_rebuilt(small_model):
    from engine.core.engine_core import EngineCore

    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, seed=0, decode_buckets=(1, 2, 4, 8)),
                      device="cuda", budget=3 << 30)
    prompts = [list(range(10 + i, 60 + i)) for i in range(6)]
    try:
        # a's pool grows into the budget (1,024 sequences of 4,096 tokens want more than it has)
        spec = dict(max_model_len=4096, max_num_seqs=1024)
        core.load_model(LoadSpec("a", small_model, **spec))
        pages_alone = core.memory().kv_pages
        reference = _greedy(core, "a", prompts, 24)
        runner, resizes = core.slots.get("a").runner, core.pools.resizes

        served = _greedy(core, "a", prompts, 24, load_beside=LoadSpec("b", small_model, **spec))
        assert served == reference  # a served through b's load, token for token
        assert "b" in core.models()
        assert core.pools.resizes > resizes and core.memory().kv_pages < pages_alone  # b took the tail
        assert core.slots.get("a").runner is runner  # nothing rebuilt, no graph captured again
        assert _greedy(core, "b", prompts[:2], 8) == [r[:8] for r in reference[:2]]  # same weights
    finally:
        for name in list(core.models()):
            core.unload_model(name)
