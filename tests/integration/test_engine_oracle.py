"""The engine against transformers on the same random weights (CPU, float32).

Tolerances (float32 on both sides; logits of the tiny models are O(0.1-1)):
- logits: max |engine - transformers| <= LOGITS_ATOL = 1e-5 at every prefill position and at
  every decode step (seen: <= 3e-7; the differences are summation order only);
- greedy tokens: identical.

The generated weights (std 0.02) give near-uniform attention, where a position bug moves the
logits by only ~1e-5. So every check also runs on a "sharp" copy of each model: q/k
projections scaled by 20 and the other projections by 4, which makes attention peaked and
position-dependent (Llama and Mistral, which differ only in rope, then disagree by ~0.7).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.sampling import SamplingParams
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput
from tests.sharp import sharpen

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
LOGITS_ATOL = 1e-5
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 55)), [400], list(range(100, 140, 3))]


@pytest.fixture(scope="session")
def oracle_model(make_tiny_model, tmp_path_factory):
    """``oracle_model(arch, sharp)`` → model folder (the sharp copy is made once per session)."""
    made: dict[str, Path] = {}

    def get(arch: str, sharp: bool) -> Path:
        src = make_tiny_model(arch)
        if not sharp:
            return src
        if arch not in made:
            made[arch] = sharpen(src, tmp_path_factory.mktemp("sharp") / arch, 20.0, 4.0)
        return made[arch]

    return get


def hf_model(model_dir):
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return m.eval()


def engine(model_dir, **kw) -> EngineCore:
    core = EngineCore(device="cpu", max_num_batched_tokens=kw.pop("budget", 256), block_size=kw.pop("block_size", 4),
                      max_prefill_chunk=kw.pop("chunk", None))
    core.load_model("m", model_dir, max_model_len=kw.pop("max_model_len", 128), max_num_seqs=8, **kw)
    return core


@pytest.mark.parametrize("sharp", [False, True], ids=["plain", "sharp"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_at_every_position_match(arch, sharp, oracle_model):
    d = oracle_model(arch, sharp)
    hf = hf_model(d)
    core = engine(d)
    slot = core.slot("m")
    prompts = PROMPTS[:3]
    # Allocate pages for a hand-made prefill step of three sequences and run the model on it.
    out = SchedulerOutput()
    for i, p in enumerate(prompts):
        slot.scheduler.blocks.ensure_capacity(i, len(p))
        out.seqs.append(ScheduledSeq(i, f"r{i}", p, 0, slot.scheduler.blocks.block_table(i), True, 0,
                                     SamplingParams(temperature=0)))
    step = slot.runner.prepare(out)
    with torch.inference_mode():
        hidden = slot.model(step.input_ids, step.positions, slot.kv, step.meta)
        logits = slot.model.compute_logits(hidden)
        start = 0
        for p in prompts:
            want = hf(torch.tensor([p])).logits[0].float()
            got = logits[start:start + len(p)]
            start += len(p)
            assert (got - want).abs().max().item() <= LOGITS_ATOL


@pytest.mark.parametrize("sharp", [False, True], ids=["plain", "sharp"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_logits_at_every_step_and_greedy_tokens_match(arch, sharp, oracle_model):
    d = oracle_model(arch, sharp)
    hf = hf_model(d)
    core = engine(d)
    runner = core.slot("m").runner
    captured: list[tuple[list[str], torch.Tensor]] = []
    orig = runner.forward_logits

    def spy(step):
        logits = orig(step)
        captured.append((list(step.sample_entries), logits.clone()))
        return logits

    runner.forward_logits = spy
    n_new = 8
    for i, p in enumerate(PROMPTS):  # a batch of prompts of different lengths
        core.add_request(f"r{i}", "m", p, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    per_req_logits: dict[str, list[torch.Tensor]] = {k: [] for k in tokens}
    while core.has_unfinished_requests():
        n_before = len(captured)
        outs = core.step()
        if len(captured) > n_before:
            entries, logits = captured[-1]
            sampled = [o for o in outs if o.new_token_ids]
            for row, o in enumerate(sampled):
                per_req_logits[o.req_id].append(logits[row])
        for o in outs:
            tokens[o.req_id] += o.new_token_ids
    for i, p in enumerate(PROMPTS):
        got = tokens[f"r{i}"]
        assert len(got) == n_new
        full = torch.tensor([p + got])
        with torch.inference_mode():
            want_logits = hf(full).logits[0, len(p) - 1: len(p) - 1 + n_new].float()
        eng_logits = torch.stack(per_req_logits[f"r{i}"])
        assert (eng_logits - want_logits).abs().max().item() <= LOGITS_ATOL, f"prompt {i}"
        # Greedy tokens: identical to transformers.generate on its own.
        gen = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        assert gen[0, len(p):].tolist() == got, f"prompt {i}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_stops_on_eos_like_transformers(arch, oracle_model):
    """A stop token ends the request where generate's eos ends it, with finish reason stop."""
    d = oracle_model(arch, True)
    hf = hf_model(d)
    core = engine(d)
    assert core.models()["m"].eos_token_ids  # read from config.json / generation_config.json
    # Random weights rarely pick eos; the 4th greedy token, given to generate as its eos and to
    # the engine as a stop token id, makes both stop at the same place.
    p = PROMPTS[0]
    core.add_request("free", "m", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    toks = []
    while core.has_unfinished_requests():
        for o in core.step():
            toks += o.new_token_ids
    stop_at = toks[3]
    core.add_request("stop", "m", p, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at]))
    got, reason = [], None
    while core.has_unfinished_requests():
        for o in core.step():
            got += o.new_token_ids
            reason = o.finish_reason or reason
    gen = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=6,
                      do_sample=False, eos_token_id=[stop_at], pad_token_id=0)
    assert got == gen[0, len(p):].tolist() == toks[: toks.index(stop_at) + 1]
    assert reason == "stop"
