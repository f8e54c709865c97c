"""The mixture-of-experts path on the GPU in bf16 against transformers, through the engine's CUDA
graphs as served (Llama 4's small preset too: chunked and NoPE layers, the sigmoid router and the
shared expert in compiled kernels), and graphed against eager step for step. Skipped without CUDA.

Tolerance: the last prompt position's top-5 logprobs, max |engine - hf_fp32| <= 3 * max
|hf_bf16 - hf_fp32| + 2e-3, as tests/gpu/test_engine_gpu.py holds dense models."""

from __future__ import annotations

import pytest
import torch

from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = list(range(30, 75))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "llama4"])
def test_moe_logprobs_within_bf16_through_graphs(arch, tmp_path):
    transformers = pytest.importorskip("transformers")
    from engine.core.engine_core import EngineCore
    from modelgen.make import make_model

    d = make_model(tmp_path / arch, arch, "small", seed=0)
    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, block_size=16, seed=0),
                      device="cuda")
    core.load_model(LoadSpec("m", str(d), max_model_len=256, max_num_seqs=8))
    runner = core.slots.get("m").runner
    assert runner.graphs is not None and runner.mixed is not None  # experts capture graphs as dense models do
    core.add_request("r", "m", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    first = outs[0].logprobs[0]
    got = {t["token_id"]: t["logprob"] for t in first["top_logprobs"]}
    ref = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).cuda().eval()
        with torch.no_grad():
            ref[dtype] = torch.log_softmax(hf(torch.tensor([PROMPT]).cuda()).logits[0, -1].float(), -1).cpu()
        del hf
    own = (ref[torch.bfloat16] - ref[torch.float32]).abs().max().item()
    err = max(abs(v - ref[torch.float32][t].item()) for t, v in got.items())
    assert err <= 3 * own + 2e-3, (err, own)


def test_a_graphed_moe_forward_gives_the_eager_ones_tokens(tmp_path):
    """Why models with experts may capture graphs: the routing, the pairs' alignment and the
    grouped GEMMs have static shapes, so a runner capturing decode and mixed-step graphs over
    the same weights and KV picks the eager runner's tokens, step for step (top-1 logprobs
    within bf16's noise where a near-tie tips a pick)."""
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner
    from modelgen.make import make_model

    d = make_model(tmp_path / "qwen3_moe", "qwen3_moe", "small", seed=0)
    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=256, block_size=16, seed=0,
                                    cuda_graphs=False), device="cuda")
    core.load_model(LoadSpec("m", str(d), max_model_len=256, max_num_seqs=8))
    slot = core.slots.get("m")
    eager = slot.runner
    graphed = ModelRunner(slot.model, slot.kv, 256, 8, 256, decode_buckets=(1, 2, 4, 8), cuda_graphs=True,
                          mixed_buckets=(64, 128, 256), stream_pool=core.pools.streams)
    assert eager.graphs is None and graphed.graphs is not None and graphed.mixed is not None
    sched = slot.scheduler
    for i, n in enumerate((45, 7, 60)):
        sched.add(f"r{i}", [30 + (i * 11 + j) % 200 for j in range(n)],
                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1))
    while sched.has_unfinished():
        out = sched.schedule()
        a, b = eager.execute(out), graphed.execute(out)
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            assert ta == tb or abs(la["logprob"] - lb["logprob"]) < 0.05, (ta, tb, la, lb)
        sched.update(out, a.token_ids)
    assert graphed.graph_steps > 0 and graphed.mixed_graph_steps > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_experts_on_the_gpu_follow_the_bf16_model(arch, tmp_path):
    """quantization = "fp8" with experts: the compiled e4m3 grouped GEMM (weights widened to bf16,
    channel scales on the sums) serves through graphs, and its prefill logits stay within 0.99
    cosine of the bf16 model's at every position."""
    from engine.core.engine_core import EngineCore
    from modelgen.make import make_model
    from ops.bench.fp8_accuracy import prefill_logits

    d = make_model(tmp_path / arch, arch, "small", seed=0)
    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, block_size=16, seed=0),
                      device="cuda")
    core.load_model(LoadSpec("bf16", str(d), max_model_len=256, max_num_seqs=8))
    core.load_model(LoadSpec("fp8", str(d), max_model_len=256, max_num_seqs=8, quantization="fp8"))
    fp8 = core.slots.get("fp8")
    assert fp8.runner.graphs is not None
    assert any(layer.experts is not None and layer.experts.gate_up_w.dtype == torch.float8_e4m3fn
               for layer in fp8.model.layers)
    prompts = [PROMPT, list(range(100, 160))]
    a, b = prefill_logits(core, "bf16", prompts), prefill_logits(core, "fp8", prompts)
    cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    assert cos.min().item() >= 0.99, cos.min().item()
    core.add_request("r", "fp8", PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    out = []
    while core.has_unfinished_requests():
        out += core.step()
    assert sum(len(o.new_token_ids) for o in out) == 16


@pytest.mark.parametrize("n, e, k, scoring", [(1, 128, 8, "softmax"), (300, 128, 8, "softmax"), (7, 8, 2, "softmax"),
                                              (1, 16, 1, "sigmoid"), (300, 16, 1, "sigmoid")])
def test_the_compiled_routing_is_the_torch_formulations(n, e, k, scoring, monkeypatch):
    """engine/kernels/moe_route_triton.py compiled, on bfloat16 logits as served: the chosen
    experts' logits are the top k, and each row's weights, in order of size, those of softmax →
    top-k → renormalise within float32 rounding, a sigmoid router's the bfloat16 rounding of
    each sigmoid exactly (the interpreter's cast truncates; the GPU's rounds). bfloat16 logits
    of 128 experts tie often, and a tie may go either way (torch.topk leaves it unspecified), so
    rows are compared as sets of logits and sorted weights, not expert by expert."""
    from engine.kernels import _dispatch
    from engine.kernels.moe import Router, route

    logits = (torch.randn((n, e), device="cuda", generator=torch.Generator("cuda").manual_seed(n)) * 2).bfloat16()
    router = Router(k, renormalize=scoring == "softmax", scoring=scoring)
    monkeypatch.setattr(_dispatch, "_forced", "torch")
    want_w, want_e = route(logits, router)
    monkeypatch.setattr(_dispatch, "_forced", "")
    got_w, got_e = route(logits, router)
    assert got_e.dtype == torch.int64 and got_e.min() >= 0 and got_e.max() < e
    assert all(len(set(row)) == k for row in got_e.tolist())
    assert torch.equal(logits.gather(1, got_e).sort(dim=1).values, logits.gather(1, want_e).sort(dim=1).values)
    got_sorted, want_sorted = got_w.sort(dim=1).values, want_w.sort(dim=1).values
    if scoring == "sigmoid":
        assert torch.equal(got_sorted, want_sorted)
    else:
        torch.testing.assert_close(got_sorted, want_sorted, atol=1e-6, rtol=1e-5)
