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
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput
from engine.load_spec import LoadSpec
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
    core = EngineCore(EngineOptions(max_num_batched_tokens=kw.pop("budget", 256), block_size=kw.pop("block_size", 4),
                                    max_prefill_chunk=kw.pop("chunk", None)), device="cpu")
    core.load_model(LoadSpec("m", model_dir, max_model_len=kw.pop("max_model_len", 128), max_num_seqs=8, **kw))
    return core


@pytest.mark.parametrize("sharp", [False, True], ids=["plain", "sharp"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_at_every_position_match(arch, sharp, oracle_model):
    d = oracle_model(arch, sharp)
    hf = hf_model(d)
    core = engine(d)
    slot = core.slots.get("m")
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
    runner = core.slots.get("m").runner
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


def _run_all(core: EngineCore, reqs: dict[str, list[int]], n_new: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    tokens: dict[str, list[int]] = {r: [] for r in reqs}
    cached: dict[str, int] = {}
    for r, p in reqs.items():
        core.add_request(r, "m", p, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    while core.has_unfinished_requests():
        for o in core.step():
            tokens[o.req_id] += o.new_token_ids
            cached[o.req_id] = o.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("pages", [None, 40], ids=["roomy", "tight"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hits_give_transformers_greedy_tokens(arch, pages, oracle_model):
    """Prompts that share a system prompt, a prompt sent again, and a chat turn that resends
    the previous answer: with the prefix cache the hits are counted and every greedy token is
    transformers'; with it off, the same tokens and no hit. ``tight``: 40 pages of 4 tokens for
    six ~30-token requests, so sequences are preempted and cached-free pages handed out again."""
    d = oracle_model(arch, True)  # sharp: a K/V at the wrong position changes tokens
    hf = hf_model(d)
    n_new = 6
    system = list(range(40, 61))  # 21 tokens: five full pages of 4
    first = {"a": system + [7, 8]}
    kw = {"num_kv_pages": pages} if pages else {}
    core = engine(d, budget=32, chunk=12, **kw)
    got1, _ = _run_all(core, first, n_new)
    wave = {"b": system + [9], "c": system + [7, 8], "d": system + [7, 8] + got1["a"] + [3],
            "e": system[:9] + [1, 2, 3], "f": [300, 301, 302, 303, 304],
            "g": list(system)}  # 20 of its 21 tokens cached: a one-token prefill after a cached prefix
    got2, cached = _run_all(core, wave, n_new)
    assert cached["b"] == 20 and cached["c"] == 20 and cached["e"] == 8 and cached["f"] == 0 and cached["g"] == 20
    assert cached["d"] >= 20  # the system prompt, and the first answer's full pages where they survived
    off = engine(d, budget=32, chunk=12, prefix_caching=False, **kw)
    got_off1, _ = _run_all(off, first, n_new)
    got_off2, cached_off = _run_all(off, wave, n_new)
    assert set(cached_off.values()) == {0}
    assert got_off1 == got1 and got_off2 == got2
    for r, p in {**first, **wave}.items():
        gen = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        assert gen[0, len(p):].tolist() == {**got1, **got2}[r], r


def test_an_unloaded_models_prefix_cache_goes_with_it(oracle_model):
    d = oracle_model("llama", False)
    core = engine(d)
    prompt = list(range(60, 90))
    _, cached = _run_all(core, {"a": prompt}, 2)
    _, cached = _run_all(core, {"b": prompt}, 2)
    assert cached["b"] == 28
    core.unload_model("m")
    core.load_model(LoadSpec("m", d, max_model_len=128, max_num_seqs=8))
    _, cached = _run_all(core, {"c": prompt}, 2)
    assert cached["c"] == 0 and core.stats()["m"].prefix_hit_tokens == 0
