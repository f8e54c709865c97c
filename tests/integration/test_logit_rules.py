"""Logit rules (penalties, logit bias, min_tokens): the batched device code against a plain
per-token reference, the engine's greedy tokens against transformers' forward with those rules
applied step by step (repetition also through transformers' own processor), and the promises
around them: rows without rules untouched, seeded sampling reproducible, bounds refused."""

from __future__ import annotations

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.errors import RequestError
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.runner.logit_rules import apply_logit_rules
from engine.sampling import SamplingParams, SamplingParamsError
from engine.sched.scheduler import ScheduledSeq
from engine.worker import protocol as P
from tests.sharp import sharpen

PROMPT = [5, 9, 2, 7, 11, 3, 9, 9]


def reference(row: torch.Tensor, history: list[int], n_prompt: int, p: SamplingParams, eos: list[int]) -> torch.Tensor:
    """One row by the rules' definitions, token by token."""
    row = row.clone()
    out = history[n_prompt:]
    if p.repetition_penalty != 1.0:
        for t in set(history):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in p.logit_bias:
        row[t] += b
    if len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            row[t] = float("-inf")
    return row


def _entry(history: list[int], n_prompt: int, p: SamplingParams) -> ScheduledSeq:
    e = ScheduledSeq(0, "r", [history[-1]], len(history) - 1, [], True, len(history) - n_prompt, p)
    e.history, e.num_prompt = history, n_prompt
    return e


def test_the_batched_rules_match_the_definitions_and_leave_other_rows_alone():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn((6, vocab), generator=g) * 3
    before = logits.clone()
    hist = [[1, 2, 3, 4, 4, 7, 7, 7], [9, 9, 8, 1, 1], [3, 3, 3, 3], [5, 6, 7], [10, 11, 12, 13, 13]]
    params = [SamplingParams(repetition_penalty=1.7),
              SamplingParams(frequency_penalty=0.5, presence_penalty=-0.75),
              SamplingParams(logit_bias=[(3, -100.0), (49, 2.5)], repetition_penalty=0.5),
              SamplingParams(min_tokens=4, stop_token_ids=[6], max_tokens=8),
              SamplingParams(min_tokens=4, ignore_eos=True, max_tokens=8, frequency_penalty=2.0)]
    rows = [0, 1, 3, 4, 5]  # row 2 has no rules
    entries = [(k, _entry(h, 2, p)) for k, h, p in zip(rows, hist, params)]
    apply_logit_rules(logits, entries, eos_ids=[0, 1])
    for k, h, p in zip(rows, hist, params):
        want = reference(before[k], h, 2, p, [0, 1])
        assert torch.allclose(logits[k], want, atol=1e-5, equal_nan=True), (k, p)
    assert torch.equal(logits[2], before[2])
    assert logits[4, 0] == logits[4, 1] == logits[4, 6] == float("-inf")  # eos and stop banned early
    assert torch.isfinite(logits[5, :2]).all()  # ignore_eos: eos not banned


def _engine(model_dir, **opts) -> EngineCore:
    core = EngineCore(EngineOptions(max_num_batched_tokens=256, block_size=4, seed=0, **opts), device="cpu")
    core.load_model(LoadSpec("m", str(model_dir), max_model_len=128, max_num_seqs=8))
    return core


def _run(core: EngineCore, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    for rid, (prompt, p) in reqs.items():
        core.add_request(rid, "m", prompt, p)
    toks: dict[str, list[int]] = {r: [] for r in reqs}
    fin: dict[str, str] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            toks[o.req_id] += o.new_token_ids
            if o.finish_reason:
                fin[o.req_id] = o.finish_reason
    return {r: (toks[r], fin[r]) for r in reqs}


@pytest.fixture(scope="module")
def sharp_llama(make_tiny_model, tmp_path_factory):
    # peaked attention and larger logits: greedy repeats itself, so the penalties change the tokens
    return sharpen(make_tiny_model("llama"), tmp_path_factory.mktemp("sharp-rules") / "llama", 20.0, 4.0)


def _hf_greedy(model_dir, prompt: list[int], n: int, p: SamplingParams, eos: list[int], processor=None) -> list[int]:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            row = hf(torch.tensor([ids])).logits[0, -1].float()
            if processor is not None:
                row = processor(torch.tensor([ids]), row[None])[0]
            else:
                row = reference(row, ids, len(prompt), p, eos)
            ids.append(int(row.argmax()))
    return ids[len(prompt):]


# This model's plain greedy answer repeats no token, so the rules are chosen to change it: a
# repetition "penalty" below 1 and a negative presence penalty pull seen tokens up, a frequency
# penalty then pushes a repeated one back down after a few.
@pytest.mark.parametrize("rules", [
    {"repetition_penalty": 0.3},
    {"frequency_penalty": 0.7, "presence_penalty": -2.0},
    {"presence_penalty": -1.0},
    {"logit_bias": [(7, 3.0), (9, -100.0)]},
], ids=["repetition", "frequency+presence", "negative-presence", "bias"])
def test_greedy_with_rules_matches_transformers_step_by_step(sharp_llama, rules):
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **rules)
    core = _engine(sharp_llama)
    eos = list(core.slots.get("m").config.eos_token_ids)
    got, _ = _run(core, {"r": (PROMPT, p)})["r"]
    assert got == _hf_greedy(sharp_llama, PROMPT, 16, p, eos)
    plain, _ = _run(core, {"plain": (PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))})["plain"]
    assert got != plain  # the rule changed the answer (else this test proves nothing)


def test_repetition_penalty_is_transformers_own(sharp_llama):
    transformers = pytest.importorskip("transformers")
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=0.3)
    got, _ = _run(_engine(sharp_llama), {"r": (PROMPT, p)})["r"]
    proc = transformers.RepetitionPenaltyLogitsProcessor(0.3)
    assert got == _hf_greedy(sharp_llama, PROMPT, 16, p, [], processor=proc)


def test_min_tokens_holds_the_end_back_then_lets_it_come(sharp_llama):
    core = _engine(sharp_llama)
    eos = core.slots.get("m").config.eos_token_ids[0]
    ends = SamplingParams(temperature=0, max_tokens=20, logit_bias=[(eos, 100.0)])
    toks, fin = _run(core, {"a": (PROMPT, ends)})["a"]
    assert fin == "stop" and len(toks) <= 1  # the bias ends it at once
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias=[(eos, 100.0)], min_tokens=5)
    toks, fin = _run(core, {"b": (PROMPT, held)})["b"]
    assert fin == "stop" and eos not in toks[:5] and len(toks) in (5, 6), toks


def test_rows_without_rules_are_untouched_and_seeded_sampling_repeats(sharp_llama):
    core = _engine(sharp_llama)
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    alone = _run(core, {"p": (PROMPT, plain)})["p"]
    ruled = SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True, frequency_penalty=1.2,
                           logit_bias=[(3, 2.0)])
    mixed = _run(core, {"p": (PROMPT, plain), "q": (PROMPT[:5], ruled), "p2": ([4, 4, 4], plain)})
    assert mixed["p"] == alone  # batched beside a ruled row, sampled as if alone
    again = _run(core, {"q": (PROMPT[:5], ruled)})
    assert again["q"] == mixed["q"]  # the rules are deterministic: the seed still decides


def test_bounds_are_refused_with_the_field():
    for kw, field in (({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")},
                      "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
                      ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"logit_bias": [(1, 101.0)]}, "logit_bias"),
                      ({"logit_bias": [(-1, 1.0)]}, "logit_bias"), ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
                      ({"logit_bias": [(1, 1.0, 3)]}, "logit_bias"), ({"logit_bias": "x"}, "logit_bias")):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**kw)
        assert e.value.field == field, kw
    assert not SamplingParams().has_logit_rules and SamplingParams(min_tokens=1).has_logit_rules


def test_a_bias_beyond_the_vocabulary_is_refused_at_admission(make_tiny_model):
    core = _engine(make_tiny_model("llama"))
    vocab = core.slots.get("m").config.vocab_size
    with pytest.raises(RequestError) as e:
        core.add_request("r", "m", PROMPT, SamplingParams(logit_bias=[(vocab, 1.0)]))
    assert e.value.param == "logit_bias"


def test_the_rules_cross_the_worker_protocol():
    p = SamplingParams(temperature=0.5, seed=1, presence_penalty=0.5, frequency_penalty=-0.25,
                       repetition_penalty=1.1, logit_bias=[(3, -100.0), (8, 0.5)], min_tokens=2)
    msg = P.Add(req_id="r", model="m", prompt_token_ids=[1, 2], sampling=p)
    back = P.decode(P.encode(msg)[P.HEADER_BYTES:])
    assert back.sampling == p and back.sampling.has_logit_rules
