"""Logit rules and prompt logprobs on the GPU, with decode and mixed-step graphs on (the ruled rows
are sampled after the step before, as grammar rows; a prompt-logprobs chunk runs eagerly beside
graph steps). Skipped without CUDA.

Tolerance of the prompt logprobs (bf16): max |engine - hf_fp32| <= 3 * max |hf_bf16 - hf_fp32| +
2e-3 over the prompt's positions, the engine held to transformers' own bf16 error, as
tests/gpu/test_engine_gpu.py holds its last-position logprobs.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from tests.engine_run import run_outputs
from tests.sharp import sharpen

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = list(range(30, 75))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from modelgen.make import make_model

    root = tmp_path_factory.mktemp("rules-gpu")
    return sharpen(make_model(root / "plain", "llama", "small", seed=0), root / "sharp", 8.0)


def _core(model_dir, chunk: int | None = None):
    from engine.core.engine_core import EngineCore

    core = EngineCore(EngineOptions(dtype="bfloat16", max_num_batched_tokens=512, block_size=16, seed=0,
                                    decode_buckets=(1, 2, 4, 8, 16), max_prefill_chunk=chunk), device="cuda")
    core.load_model(LoadSpec("m", model_dir, max_model_len=256, max_num_seqs=16))
    return core


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunks-of-16"])
def test_prompt_logprobs_match_transformers_within_bf16(model_dir, chunk):
    transformers = pytest.importorskip("transformers")
    core = _core(model_dir, chunk)
    outs = run_outputs(core, {"a": (PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)),
                       "b": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))})
    got = torch.tensor([e["logprob"] for e in outs["a"][0].prompt_logprobs], dtype=torch.float64)
    ids = torch.tensor(PROMPT)
    ref = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids[None].cuda()).logits[0].float(), dim=-1).cpu()
        ref[dtype] = lp[torch.arange(len(PROMPT) - 1), ids[1:]].double()
        del hf
    own = (ref[torch.bfloat16] - ref[torch.float32]).abs().max().item()
    assert (got - ref[torch.float32]).abs().max().item() <= 3 * own + 2e-3
    assert core.slots.get("m").runner.prompt_logprobs == {}


def test_rules_under_graphs_force_hold_back_and_repeat(model_dir):
    core = _core(model_dir)
    eos = core.slots.get("m").config.eos_token_ids[0]
    forced = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=[(123, 100.0)])
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias=[(eos, 100.0)], min_tokens=6)
    pen = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True, frequency_penalty=1.0,
                         presence_penalty=0.5, repetition_penalty=1.2)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = run_outputs(core, {"f": (PROMPT, forced), "h": (PROMPT, held), "p": (PROMPT[:9], pen), "x": ([5, 6], plain)})
    assert [t for o in first["f"] for t in o.new_token_ids] == [123] * 16
    held_toks = [t for o in first["h"] for t in o.new_token_ids]
    assert first["h"][-1].finish_reason == "stop" and eos not in held_toks[:6] and len(held_toks) in (6, 7)
    again = run_outputs(core, {"p": (PROMPT[:9], pen)})
    assert [t for o in again["p"] for t in o.new_token_ids] == [t for o in first["p"] for t in o.new_token_ids]
    graphs = core.slots.get("m").runner.graphs
    assert graphs is not None and core.slots.get("m").runner.graph_steps > 0


def test_the_rules_never_wait_for_the_forward_in_flight():
    """The rules are applied while the step's forward pass runs (the host prepares the next step
    meanwhile): queued behind ~0.5 s of device work, they return in a fraction of it, every
    rule on, and their effect is the same as on a quiet device."""
    from engine.runner.logit_rules import apply_logit_rules
    from engine.sched.scheduler import ScheduledSeq

    vocab, hist = 4096, list(range(100, 400)) * 3
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                       logit_bias=[(7, 5.0)], min_tokens=2000, max_tokens=2048)
    rows = []
    for k in range(8):
        e = ScheduledSeq(k, f"r{k}", [hist[-1]], len(hist) - 1, [], True, 600, p)
        e.history, e.num_prompt = hist, 300
        rows.append((k, e))
    logits = torch.randn((16, vocab), device="cuda")
    quiet = logits.clone()
    apply_logit_rules(quiet, rows, eos_ids=[2])
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of a busy stream
    t = time.perf_counter()
    apply_logit_rules(logits, rows, eos_ids=[2])
    host_s = time.perf_counter() - t
    torch.cuda.synchronize()
    busy_s = time.perf_counter() - t
    assert host_s < busy_s / 4, (host_s, busy_s)
    assert torch.equal(logits, quiet)
