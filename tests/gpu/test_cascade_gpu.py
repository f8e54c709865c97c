"""Cascade attention on the GPU (engine/runner/cascade.py, the cascade kernel in
engine/kernels/attention_triton.py): compiled kernels at the 8B's shapes against the reference,
and an engine serving forks of one prompt through captured decode graphs.

Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.sharp import sharpen
from engine.load_spec import LoadSpec
from engine.options import EngineOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _forks(rows: int, groups: int, shared_pages: int, block: int, seed: int):
    """Block tables of ``rows`` one-token rows forking from ``groups`` prompts of ``shared_pages``
    pages, each with 1-4 pages of its own; every fourth row shares nothing."""
    g = torch.Generator().manual_seed(seed)
    trunks = [list(range(1 + k * shared_pages, 1 + (k + 1) * shared_pages)) for k in range(groups)]
    nxt = 1 + groups * shared_pages
    tables, lens = [], []
    for i in range(rows):
        own = 1 + int(torch.randint(0, 4, (1,), generator=g))
        pages = ([] if i % 4 == 3 else trunks[i % groups]) + list(range(nxt, nxt + own))
        nxt += own
        tables.append(pages)
        lens.append((len(pages) - 1) * block + 1 + int(torch.randint(0, block, (1,), generator=g)))
    width = max(map(len, tables))
    bt = torch.zeros(rows, width, dtype=torch.int32)
    for i, p in enumerate(tables):
        bt[i, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return bt, torch.tensor(lens, dtype=torch.int32), nxt


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows,splits,long_rows", [(48, None, 0), (200, None, 0), (24, 4, 0), (48, None, 3)])
def test_cascade_kernels_match_the_reference(kv_dtype, rows, splits, long_rows):
    """Forks of three prompts (and, with ``long_rows``, rows of 5,000 positions of their own,
    which the plan's spare tiles split) against the reference and the plain kernels."""
    from engine.kernels.attention import paged_attention_ref
    from engine.kernels.attention_triton import paged_attention_triton
    from engine.runner.cascade import max_tiles, plan_cascade, rows_per_tile

    hq, hkv, d, block = 32, 8, 128, 16
    bt, sl, pages = _forks(rows, 3, 64, block, rows)
    if long_rows:  # the last rows get long tables of fresh pages
        n = -(-5000 // block)
        wide = torch.zeros(rows, max(bt.shape[1], n), dtype=torch.int32)
        wide[:, :bt.shape[1]] = bt
        for i in range(rows - long_rows, rows):
            wide[i] = 0
            wide[i, :n] = torch.arange(pages, pages + n, dtype=torch.int32)
            sl[i] = 5000
            pages += n
        bt = wide
    per_tile = rows_per_tile(hq, hkv)
    plan = plan_cascade(bt.numpy(), sl.numpy(), torch.ones(rows).numpy(), block, per_tile,
                        max_tiles(rows, per_tile))
    tiles, kv_lo = plan.tiles, plan.kv_lo
    assert plan.shared >= (rows - long_rows) // 2 and plan.long == long_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(pages, block, hkv, d, device="cuda", generator=g).to(kv_dtype)
    vc = torch.randn(pages, block, hkv, d, device="cuda", generator=g).to(kv_dtype)
    q = torch.randn(rows, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    bt, sl = bt.cuda(), sl.cuda()
    cascade = (torch.from_numpy(tiles).cuda(), torch.from_numpy(kv_lo).cuda())
    out = paged_attention_triton(q, kc, vc, qsl, sl, bt, 0.088, 1, 4096, num_splits=splits, cascade=cascade)
    plain = paged_attention_triton(q, kc, vc, qsl, sl, bt, 0.088, 1, 4096, num_splits=splits)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), qsl, sl, bt, 0.088)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    err_plain = ((plain.float() - ref).norm() / ref.norm()).item()
    assert err <= 1.5 * err_plain + 1e-3, (err, err_plain)


def test_forks_of_one_prompt_run_through_cascade_graphs(tmp_path_factory):
    """20 requests forking from one 96-token prompt (served from the prefix cache): the decode
    graphs of buckets >= 16 launch the cascade kernel over the step's plan; replayed graphs give
    the tokens eager steps give (same plans, same kernels), and the plan was used in both."""
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions
    from engine.sampling import SamplingParams
    from modelgen.make import make_model

    root = tmp_path_factory.mktemp("casc")
    d = sharpen(make_model(root / "plain", "llama", "small", seed=0), root / "sharp", 8.0)
    shared = [(i * 37) % 400 + 5 for i in range(96)]
    prompts = [shared + [410 + i, 420 + i % 3] for i in range(20)]
    got, planned = {}, {}
    for graphs in (True, False):
        core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, block_size=16, seed=0,
                                        decode_buckets=(1, 8, 16, 24, 32), cuda_graphs=graphs, mixed_buckets=()),
                          device="cuda")
        core.load_model(LoadSpec("m", d, max_model_len=256, max_num_seqs=32))
        core.add_request("warm", "m", shared + [1], SamplingParams(temperature=0, max_tokens=1))
        while core.has_unfinished_requests():
            core.step()
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", "m", p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        toks = {i: [] for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for o in core.step():
                toks[int(o.req_id[1:])].extend(o.new_token_ids)
        runner = core.slots.get("m").runner
        assert (runner.graph_steps > 0) == graphs
        assert bool(graphs and runner.graphs.cascade_graphs) == graphs  # buckets 16-32: both variants
        # 15 decode steps (16 tokens, the first from the prefill), every one replayed: the first
        # with a plan captured its variant (kernels compiled at load) instead of running eagerly
        assert runner.graph_steps == (15 if graphs else 0)
        got[graphs], planned[graphs] = toks, runner.cascade_rows
        del core, runner
    assert planned[True] >= 20 * 10 and planned[False] >= 20 * 10
    assert got[True] == got[False]


def test_the_warm_up_compiles_every_kernel_a_cascade_variant_launches(tmp_path):
    """After a load, capturing the cascade variant of every decode bucket that can plan finds
    every kernel compiled (a variant is captured by a serving step: a compile there stalls it)."""
    from engine.core.engine_core import EngineCore
    from engine.kernels import attention_triton as at
    from modelgen.make import make_model

    d = make_model(tmp_path / "m", "llama", "small", seed=0)
    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, block_size=16, seed=0,
                                    decode_buckets=(1, 8, 16, 24, 32, 48, 64), mixed_buckets=()), device="cuda")
    core.load_model(LoadSpec("m", d, max_model_len=2048, max_num_seqs=64))
    runner = core.slots.get("m").runner
    runner.capture_deferred_graphs()
    graphs = runner.graphs
    planned = [b for b in sorted(graphs.graphs) if graphs.bufs.cascade_tiles_for(b) > 0]
    assert planned == [16, 24, 32, 48, 64]  # buckets of 16 rows and more plan
    launchers = (at._DECODE_LAUNCH, at._REDUCE_LAUNCH, at._CASCADE_LAUNCH)
    before = [x.misses for x in launchers]
    with torch.inference_mode():  # as every capture the runner makes (its buffers are inference tensors)
        for b in planned:
            graphs._capture_one(b, cascade=True)
    assert [x.misses for x in launchers] == before
    assert sorted(graphs.cascade_graphs) == planned
