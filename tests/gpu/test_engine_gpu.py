"""The whole engine on the GPU in bf16 against transformers, and decode CUDA graphs against eager.

Skipped without CUDA. Models are the generated "small" presets of each architecture (4 layers,
hidden 256) with q/k projections x8, so attention is peaked and position-dependent (logits move
by ~1 against the unscaled model) while bf16 stays usable (transformers' own bf16 logits are
then within ~0.1 of float32; the x20/x4 copy of the CPU oracle puts them 0.3 off).

Tolerances (bf16 on both sides, so the engine is held to transformers' own bf16 error):
- logprobs at the last prompt position (top 5): max |engine - hf_fp32| <= 3 * max |hf_bf16 -
  hf_fp32| + 2e-3 — the engine may not be much worse than transformers in the same dtype;
- greedy tokens (24 per prompt, 8 prompts): where the engine's tokens part from transformers'
  bf16 ones, the engine's token must be a near-tie under the fp32 reference at that position
  (its logit within 3 x transformers' own bf16 error there + 0.02 of the best), and at least
  half of the prompts must agree on their first 4 tokens (bf16 near-ties make longer runs part);
- CUDA-graph decode against eager decode (same padded shapes, same kernels): identical tokens,
  greedy and seeded sampling.
"""

from __future__ import annotations

import pytest
import torch

from engine.runner.cuda_graphs import MixedGraphs
from engine.load_spec import LoadSpec
from tests.graph_stand_in import StandInGraphs
from tests.sharp import sharpen
from engine.options import EngineOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [300], list(range(100, 140, 3)),
           [7] * 17, list(range(200, 233)), [1, 490, 3, 480, 5, 470]]
GEN = 24


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    from modelgen.make import make_model

    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            made[arch] = sharpen(make_model(root / "plain", arch, "small", seed=0), root / "sharp", 8.0)
        return made[arch]

    return get


def _engine(model_dir, graphs: bool, monkeypatch, mixed: bool = False, quantization: str | None = None):
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions

    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, block_size=16, seed=0,
                                    decode_buckets=(1, 2, 4, 8, 16), cuda_graphs=graphs,
                                    mixed_buckets=None if mixed else ()), device="cuda")
    core.load_model(LoadSpec("m", model_dir, max_model_len=256, max_num_seqs=16, quantization=quantization))
    return core


def _run(core, prompts, params) -> tuple[dict[int, list[int]], dict[int, list]]:
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", "m", p, params)
    toks: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    lps: dict[int, list] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            i = int(o.req_id[1:])
            toks[i].extend(o.new_token_ids)
            if o.logprobs:
                lps.setdefault(i, []).extend(o.logprobs)
    return toks, lps


def _hf(model_dir, dtype):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_bf16_matches_transformers(arch, sharp_model, monkeypatch):
    from engine.sampling import SamplingParams

    d = sharp_model(arch)
    core = _engine(d, True, monkeypatch)
    runner = core.slots.get("m").runner
    assert runner.graphs is not None and runner.graphs.graphs
    toks, lps = _run(core, PROMPTS, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=5))
    assert runner.graph_steps > 0
    hf16, hf32 = _hf(d, torch.bfloat16), _hf(d, torch.float32)
    exact = 0
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            x = torch.tensor([p], device="cuda")
            ref32 = torch.log_softmax(hf32(x).logits[0, -1].float(), -1)
            ref16 = torch.log_softmax(hf16(x).logits[0, -1].float(), -1)
            top = lps[i][0]["top_logprobs"]
            ids = torch.tensor([t["token_id"] for t in top], device="cuda")
            ours = torch.tensor([t["logprob"] for t in top], device="cuda")
            err_ours = (ours - ref32[ids]).abs().max().item()
            err_hf = (ref16[ids] - ref32[ids]).abs().max().item()
            assert err_ours <= 3 * err_hf + 2e-3, (arch, i, err_ours, err_hf)
            gen16 = hf16.generate(x, max_new_tokens=GEN, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            n = min(len(gen16), GEN)  # transformers may stop at an eos; the engine ignores eos
            exact += toks[i][:4] == gen16[:4]
            if toks[i][:n] == gen16[:n]:
                continue
            j = next(k for k in range(n) if toks[i][k] != gen16[k])
            ctx = torch.tensor([p + toks[i][:j]], device="cuda")
            logits = hf32(ctx).logits[0, -1].float()
            err16 = (hf16(ctx).logits[0, -1].float() - logits).abs().max().item()
            gap = (logits.max() - logits[toks[i][j]]).item()
            assert gap <= 3 * err16 + 0.02, (arch, i, j, gap, err16)
    assert exact >= len(PROMPTS) // 2, (arch, exact)


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16", "fp8"])
def test_a_model_loaded_into_a_vacancy_replays_its_graphs_on_its_own_weights(quantization, sharp_model, tmp_path,
                                                                              monkeypatch):
    """a (graphs captured) unloaded, b (same architecture, other weights) loaded into its
    tensors and runner (engine/core/vacancy.py): b's decode and mixed graphs replay a's captures
    on b's weights (FP8: b quantized at load into a's e4m3 weights and scales); b's tokens are
    those of b in a fresh engine, greedy and seeded."""
    from engine.sampling import SamplingParams
    from modelgen.make import make_model

    a = sharp_model("llama")
    b = sharpen(make_model(tmp_path / "plain", "llama", "small", seed=1), tmp_path / "sharp", 8.0)
    for params in (SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=GEN, ignore_eos=True)):
        want, _ = _run(_engine(b, True, monkeypatch, mixed=True, quantization=quantization), PROMPTS, params)
        core = _engine(a, True, monkeypatch, mixed=True, quantization=quantization)
        runner = id(core.slots.get("m").runner)
        mine, _ = _run(core, PROMPTS, params)
        assert mine != want  # other weights: other tokens
        core.unload_model("m")
        core.load_model(LoadSpec("m", b, max_model_len=256, max_num_seqs=16, quantization=quantization))
        assert core.loader.last_load_timings["vacancy"] == 1.0 and id(core.slots.get("m").runner) == runner
        got, _ = _run(core, PROMPTS, params)
        assert core.slots.get("m").runner.graph_steps > 0
        assert got == want
        del core


def test_a_collection_never_runs_a_finalizer_inside_a_capture(sharp_model, monkeypatch):
    """Every captured forward leaves cyclic garbage whose finalizer synchronizes the device (as a
    warm tier's arena unregisters its pages, or a freed graph is destroyed), with collector
    thresholds that collect at every allocation: the load's captures all succeed (no_collection
    holds the collector off while one records), and the finalizers run after them. Without the
    hold, the collection inside a capture invalidated it ("operation failed due to a previous
    error during capture"): tests/gpu failed once so at 2d889af."""
    import gc

    from engine.runner.cuda_graphs import DecodeGraphs

    ran = []

    class Unsafe:
        def __del__(self) -> None:
            torch.cuda.synchronize()  # never allowed on a thread that is capturing
            ran.append(1)

    forward = DecodeGraphs._forward

    def forward_leaving_garbage(*args):
        a, b = Unsafe(), Unsafe()
        a.other, b.other = b, a
        return forward(*args)

    monkeypatch.setattr(DecodeGraphs, "_forward", staticmethod(forward_leaving_garbage))
    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1, 1, 1)
    try:
        core = _engine(sharp_model("llama"), True, monkeypatch)
        graphs = core.slots.get("m").runner.graphs
        assert not graphs.failed and sorted(graphs.graphs) == [1, 2, 4, 8, 16], graphs.failed
    finally:
        gc.set_threshold(*old)
    gc.collect()
    assert ran and len(ran) % 2 == 0  # every pair finalized, after the captures


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graph_decode_matches_eager(arch, sharp_model, monkeypatch):
    from engine.sampling import SamplingParams

    d = sharp_model(arch)
    for params in (SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=GEN, ignore_eos=True)):
        got = {}
        for graphs in (True, False):
            core = _engine(d, graphs, monkeypatch)
            got[graphs], _ = _run(core, PROMPTS, params)
            runner = core.slots.get("m").runner
            assert (runner.graph_steps > 0) == graphs
            del core
        assert got[True] == got[False]


def _backed(core, slot) -> torch.Tensor:
    """The part of the model's KV buffer with memory behind it: the buffer spans the pool's
    whole reserved range, of which only the pool's pages are backed (engine/kv/page_memory.py)."""
    return slot.kv.buffer[:core.pools.pool.num_pages * slot.kv.spec.elems_per_page]


def test_capture_is_fast_and_leaves_the_cache_untouched(sharp_model, monkeypatch):
    d = sharp_model("llama")
    core = _engine(d, True, monkeypatch)
    slot = core.slots.get("m")
    g = slot.runner.graphs
    assert sorted(g.graphs) == [1, 2, 4, 8, 16]
    assert g.capture_seconds < 1.0, g.capture_seconds
    # the load's warm-up step wrote K/V into pages it then freed: clear them, then replay every
    # graph on all-padding inputs — padding rows (slot -1) must write nothing
    backed = _backed(core, slot)
    backed.zero_()
    for b in sorted(g.graphs):
        g._fill_padding(slot.runner.bufs, b)
        g.replay(b)
    torch.cuda.synchronize()
    assert not backed.any().item()


def test_deferred_graphs_match_eager_and_launches_are_cached(sharp_model, monkeypatch):
    """Buckets above GRAPHS_AT_LOAD_MAX are captured at their first decode step and give
    the eager tokens; every Triton kernel the engine ran went through the cached launch path."""
    from engine.kernels import activation_triton, attention_triton, kv_write_triton, norm_triton, rope_triton
    from engine.sampling import SamplingParams

    d = sharp_model("llama")
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    monkeypatch.setattr("engine.runner.model_runner.GRAPHS_AT_LOAD_MAX", 1)
    core = _engine(d, True, monkeypatch)
    g = core.slots.get("m").runner.graphs
    assert sorted(g.graphs) == [1, 16] and g.deferred == {2, 4, 8}
    got, _ = _run(core, PROMPTS, params)
    assert 8 in g.graphs and 8 not in g.deferred and g.deferred_capture_seconds > 0
    del core
    want, _ = _run(_engine(d, False, monkeypatch), PROMPTS, params)
    assert got == want
    for lau in (norm_triton._RMS_NORM_LAUNCH, rope_triton._ROPE_LAUNCH, kv_write_triton._KV_WRITE_LAUNCH,
                activation_triton._SILU_MUL_LAUNCH, attention_triton._PREFILL_LAUNCH, attention_triton._DECODE_LAUNCH):
        assert lau.enabled and lau.hits > 0, (lau.fn, lau.enabled, lau.hits, lau.misses)


def test_idle_engine_captures_the_deferred_graphs_and_they_match_eager(sharp_model, monkeypatch):
    """An idle engine captures what its runners deferred, one graph a call, largest first; the
    busy steps after that capture nothing and give the eager tokens."""
    from engine.sampling import SamplingParams

    d = sharp_model("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=GEN, ignore_eos=True)
    monkeypatch.setattr("engine.runner.model_runner.GRAPHS_AT_LOAD_MAX", 1)
    core = _engine(d, True, monkeypatch)
    g = core.slots.get("m").runner.graphs
    assert g.deferred == {2, 4, 8}
    order, before = [], set(g.graphs)
    while core.capture_idle_graph():
        order.extend(sorted(set(g.graphs) - before))
        before = set(g.graphs)
    assert order == [8, 4, 2] and not g.deferred and sorted(g.graphs) == [1, 2, 4, 8, 16]
    spent = g.deferred_capture_seconds
    runner = core.slots.get("m").runner
    waited = runner.bufs.inputs.waits, runner.bufs.sampling.waits  # the load's warm-up may have
    got, _ = _run(core, PROMPTS, params)
    assert g.deferred_capture_seconds == spent and runner.graph_steps > 0
    # staging never waits for a copy: each step stages into the twin of two uploads ago
    assert (runner.bufs.inputs.waits, runner.bufs.sampling.waits) == waited
    del core
    want, _ = _run(_engine(d, False, monkeypatch), PROMPTS, params)
    assert got == want


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_step_graphs_match_their_eager_forward(arch, sharp_model, monkeypatch):
    """Every prefill and mixed step replays a mixed-step graph (token buckets, padding tokens,
    empty sequence slots) and gives exactly the tokens of the same padded forward run eagerly,
    and the tokens of the unpadded eager engine for greedy decoding up to bf16 ties."""
    from engine.sampling import SamplingParams

    d = sharp_model(arch)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=GEN, ignore_eos=True)
    core = _engine(d, True, monkeypatch, mixed=True)
    runner = core.slots.get("m").runner
    assert runner.mixed is not None and max(runner.mixed_buckets) in runner.mixed.graphs
    got, _ = _run(core, PROMPTS, params)
    assert runner.mixed_graph_steps > 0 and runner.graph_steps > 0
    del core, runner
    core = _engine(d, True, monkeypatch, mixed=True)
    runner = core.slots.get("m").runner
    runner.mixed = StandInGraphs(runner, MixedGraphs, runner.mixed_buckets)  # each graph's forward, eagerly
    want, _ = _run(core, PROMPTS, params)
    assert runner.mixed.replayed
    assert got == want
    del core, runner
    # replaying every captured bucket on all-padding inputs writes no K/V
    core = _engine(d, True, monkeypatch, mixed=True)
    slot = core.slots.get("m")
    backed = _backed(core, slot)
    backed.zero_()
    g = slot.runner.mixed
    for b in sorted(g.graphs):
        g._fill_padding(slot.runner.bufs, b)
        g.replay(b)
    torch.cuda.synchronize()
    assert not backed.any().item()


@pytest.mark.parametrize("quantization,kv_dtype", [(None, None), ("fp8", None), ("fp8", "fp8")])
def test_programmatic_dependent_launch_changes_no_token(quantization, kv_dtype, sharp_model, monkeypatch):
    """The engine's kernels launched with PDL (the default on sm_90) and plainly: same kernels,
    so the same tokens and log-probabilities, in decode graphs, mixed graphs and eager prefill
    (a kernel that read its predecessor's output before waiting would part them)."""
    from engine.core.engine_core import EngineCore
    from engine.kernels import _launch
    from engine.kernels.attention_triton import _DECODE_LAUNCH
    from engine.kernels.norm_triton import _RMS_NORM_LAUNCH
    from engine.sampling import SamplingParams

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90")
    d = sharp_model("llama")
    got = {}
    for pdl in (False, True):
        monkeypatch.setattr(_launch, "PDL_ON", pdl)
        core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, block_size=16, seed=0,
                                        decode_buckets=(1, 2, 4, 8, 16)), device="cuda")
        core.load_model(LoadSpec("m", d, max_model_len=256, max_num_seqs=16, quantization=quantization,
                                 kv_cache_dtype=kv_dtype))
        got[pdl] = _run(core, PROMPTS, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=GEN,
                                                      ignore_eos=True, logprobs=3))
        runner = core.slots.get("m").runner
        assert runner.graph_steps > 0
        # the launches really were (or were not) programmatic: the compiled launchers say so
        for lau in (_DECODE_LAUNCH, _RMS_NORM_LAUNCH):
            assert any(getattr(e[0], "launch_pdl", None) == pdl for e in lau._cache.values()), (lau.fn, pdl)
        del core
    assert got[True] == got[False]
