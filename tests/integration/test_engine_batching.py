"""Same tokens however requests are batched, chunked, paged or preempted; aborts free pages.

The reference is each prompt run alone with default settings; every variant must give
token-identical greedy output (the "sharp" copy is not needed here: these compare the engine
with itself, and any lost or misplaced K/V changes the tokens of the plain model too).
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.engine_core import EngineCore
from engine.options import EngineOptions
from engine.errors import EngineError, RequestError
from engine.sampling import SamplingParams
from engine.load_spec import LoadSpec
from engine.stats import ModelStats

PROMPTS = [list(range(40, 40 + n)) for n in (1, 5, 19, 33, 8)]
N_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


def make_core(model_dir, *, budget=256, block_size=16, chunk=None, num_kv_pages=None, max_model_len=64,
              max_num_seqs=8) -> EngineCore:
    core = EngineCore(EngineOptions(max_num_batched_tokens=budget, block_size=block_size, max_prefill_chunk=chunk,
                                    seed=1234), device="cpu")
    core.load_model(LoadSpec("m", model_dir, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             num_kv_pages=num_kv_pages))
    return core


def run(core: EngineCore, prompts, params, prefix="r") -> tuple[dict[str, list[int]], dict[str, str]]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        core.add_request(f"{prefix}{i}", "m", p, sp)
    toks: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
    reasons: dict[str, str] = {}
    steps = 0
    while core.has_unfinished_requests():
        for o in core.step():
            toks[o.req_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.req_id] = o.finish_reason
        steps += 1
        assert steps < 5000
    assert core.stats()["m"].kv_pages_used == 0
    return toks, reasons


@pytest.fixture(scope="module")
def model_dir(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    core = make_core(model_dir)
    out = []
    for p in PROMPTS:  # one at a time
        toks, reasons = run(core, [p], GREEDY)
        assert reasons == {"r0": "length"}
        out.append(toks["r0"])
    return out


@pytest.mark.parametrize(
    "variant",
    [
        dict(),  # all together
        dict(chunk=1),
        dict(chunk=3),
        dict(chunk=17),
        dict(block_size=1),
        dict(block_size=16, budget=7),  # a tight budget: prefill chunks share steps with decodes
        dict(block_size=4, num_kv_pages=12, max_model_len=48),  # one max-length sequence: forced preemption
        dict(block_size=1, num_kv_pages=64, chunk=3),
        dict(max_num_seqs=2),
    ],
    ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "together",
)
def test_variants_match_one_at_a_time(model_dir, reference, variant):
    core = make_core(model_dir, **variant)
    preempted = []
    sched = core.slots.get("m").scheduler
    orig = sched.schedule

    def spy():
        out = orig()
        preempted.extend(out.preempted_req_ids)
        return out

    sched.schedule = spy
    toks, reasons = run(core, PROMPTS, GREEDY)
    assert [toks[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert set(reasons.values()) == {"length"}
    if variant.get("num_kv_pages") == 12:
        assert preempted, "the page budget was meant to force preemption"


@pytest.mark.parametrize("when", ["mid_prefill", "mid_decode"])
def test_abort_frees_every_page_and_spares_the_others(model_dir, reference, when):
    core = make_core(model_dir, chunk=3, block_size=2)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", "m", p, GREEDY)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    victim = "r3"  # 33-token prompt: 11 steps of prefill at chunk 3
    n_steps = 4 if when == "mid_prefill" else 14
    for _ in range(n_steps):
        for o in core.step():
            got[o.req_id] += o.new_token_ids
    seq = core.slots.get("m").scheduler.get(victim)
    if when == "mid_prefill":
        assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    else:
        assert seq.num_output_tokens >= 1
    used = core.stats()["m"].kv_pages_used
    core.abort_request(victim)
    assert core.stats()["m"].kv_pages_used < used
    core.abort_request(victim)  # twice: no-op
    core.abort_request("never-seen")
    reasons = {}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.req_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.req_id] = o.finish_reason
    assert reasons[victim] == "abort"
    assert got[victim] == reference[3][: len(got[victim])]
    for i in (0, 1, 2, 4):
        assert got[f"r{i}"] == reference[i]
    assert core.stats()["m"].kv_pages_used == 0


def test_abort_everything_midway_frees_every_page(model_dir):
    core = make_core(model_dir, chunk=5, block_size=4)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", "m", p, GREEDY)
    for _ in range(5):
        core.step()
    assert core.stats()["m"].kv_pages_used > 0
    for i in range(len(PROMPTS)):
        core.abort_request(f"r{i}")
    assert core.stats()["m"].kv_pages_used == 0
    outs = core.step()
    assert sorted(o.req_id for o in outs) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(o.finish_reason == "abort" and o.new_token_ids == [] for o in outs)
    assert not core.has_unfinished_requests()


def test_seeded_sampling_is_independent_of_batch_mates(model_dir):
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=7, max_tokens=10, ignore_eos=True)
    alone, _ = run(make_core(model_dir), [PROMPTS[2]], sp)
    mates = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=1), SamplingParams(top_k=3, seed=99)]
    mates = [dataclasses.replace(m, max_tokens=7, ignore_eos=True) for m in mates]
    together, _ = run(make_core(model_dir, chunk=4, block_size=1), [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[1]],
                      [mates[0], sp, mates[1], mates[2]])
    assert together["r1"] == alone["r0"]
    other_seed, _ = run(make_core(model_dir), [PROMPTS[2]], dataclasses.replace(sp, seed=8))
    assert other_seed["r0"] != alone["r0"]  # the seed matters (10 draws at T=0.9)
    # The engine draws a seed for requests without one, so they still sample.
    a, _ = run(make_core(model_dir), [PROMPTS[2]] * 2, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
    assert a["r0"] != a["r1"]


def test_logprobs_are_returned_and_consistent(model_dir):
    core = make_core(model_dir)
    core.add_request("a", "m", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True))
    core.add_request("b", "m", PROMPTS[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    entries = {"a": [], "b": []}
    while core.has_unfinished_requests():
        for o in core.step():
            if o.logprobs is not None:
                entries[o.req_id] += o.logprobs
    assert entries["b"] == [] and len(entries["a"]) == 3
    for e in entries["a"]:
        tops = e["top_logprobs"]
        assert len(tops) == 5 and tops[0]["token_id"] == e["token_id"]  # greedy picks the top one
        assert tops[0]["logprob"] == pytest.approx(e["logprob"]) and e["logprob"] <= 0
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda c: c.add_request("x", "nope", [1], GREEDY), "not loaded"),
        (lambda c: c.add_request("x", "m", [], GREEDY), "non-empty"),
        (lambda c: c.add_request("x", "m", [1, 10**6], GREEDY), "not an id"),
        (lambda c: c.add_request("x", "m", [1, -1], GREEDY), "not an id"),
        (lambda c: c.add_request("x", "m", [True], GREEDY), "not an id"),
        (lambda c: c.add_request("x", "m", list(range(1, 65)), GREEDY), "max_model_len"),
        (lambda c: c.add_request("", "m", [1], GREEDY), "req_id"),
        (lambda c: c.add_request("x", "m", [1], {"temperature": 0}), "SamplingParams"),
        (lambda c: c.load_model(LoadSpec("m", "/nonexistent")), "already loaded"),
        (lambda c: c.unload_model("nope"), "not loaded"),
    ],
)
def test_bad_requests_are_refused_and_leave_no_trace(model_dir, call, match):
    core = make_core(model_dir)
    with pytest.raises(EngineError, match=match):
        call(core)
    assert not core.has_unfinished_requests()
    st = core.stats()["m"]
    assert dataclasses.replace(st, kv_pages_total=0, device_bytes=0) == ModelStats(
        running=0, waiting=0, kv_pages_used=0, kv_pages_total=0, device_bytes=0, yield_waits=0, yield_wait_s=0.0,
        prefix_caching=True, prefix_cached_pages=0, prefix_queried_tokens=0, prefix_hit_tokens=0,
        cascade=False, cascade_rows=0, cascade_steps=0, constrained=False, grammar_compiles=0, grammar_cache_hits=0,
        grammar_compile_s=0.0, grammar_mask_s=0.0, grammar_masked_rows=0, grammar_masked_steps=0)


@pytest.mark.parametrize("args,param", [
    (("x", "nope", [1], GREEDY), "model"),
    (("x", "m", [1, 10**6], GREEDY), "prompt_token_ids"),
    (("", "m", [1], GREEDY), "req_id"),
])
def test_refusals_name_the_param(model_dir, args, param):
    core = make_core(model_dir)
    with pytest.raises(RequestError) as e:
        core.add_request(*args)
    assert e.value.param == param


def test_duplicate_request_id_is_refused(model_dir):
    core = make_core(model_dir)
    core.add_request("x", "m", [1, 2], GREEDY)
    with pytest.raises(EngineError, match="already in flight"):
        core.add_request("x", "m", [3], GREEDY)


def test_context_length_ends_with_length(model_dir):
    core = make_core(model_dir, max_model_len=16)
    toks, reasons = run(core, [list(range(1, 11))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert len(toks["r0"]) == 6 and reasons["r0"] == "length"


def test_two_models_share_the_engine_and_unload_aborts(model_dir, make_tiny_model):
    core = make_core(model_dir)
    core.load_model(LoadSpec("q", make_tiny_model("qwen2"), max_model_len=64, max_num_seqs=4))
    core.add_request("a", "m", PROMPTS[1], GREEDY)
    core.add_request("b", "q", PROMPTS[1], GREEDY)
    seen = {"a": 0, "b": 0}
    for _ in range(6):
        for o in core.step():
            seen[o.req_id] += len(o.new_token_ids)
    assert seen["a"] > 0 and seen["b"] > 0  # neither model starves the other
    core.unload_model("q")
    outs = core.step()
    assert any(o.req_id == "b" and o.finish_reason == "abort" for o in outs)
    assert set(core.stats()) == {"m"}
    with pytest.raises(EngineError):
        core.add_request("c", "q", [1], GREEDY)


def test_a_failing_step_aborts_its_batch_and_keeps_the_books(model_dir):
    core = make_core(model_dir)
    core.add_request("a", "m", PROMPTS[1], GREEDY)
    core.add_request("b", "m", PROMPTS[2], GREEDY)
    runner = core.slots.get("m").runner

    def boom(out):
        raise RuntimeError("device fell over")

    runner.execute = boom
    with pytest.raises(EngineError, match="device fell over"):
        core.step()
    assert core.stats()["m"].kv_pages_used == 0
    outs = core.step()
    assert sorted((o.req_id, o.finish_reason) for o in outs) == [("a", "abort"), ("b", "abort")]
    assert not core.has_unfinished_requests()


def test_decode_steps_padded_to_graph_buckets_give_the_same_tokens(model_dir, reference):
    core = EngineCore(EngineOptions(max_num_batched_tokens=256, block_size=4, decode_buckets=(8, 3, 999)), device="cpu")
    core.load_model(LoadSpec("m", model_dir, max_model_len=64, max_num_seqs=8))
    runner = core.slots.get("m").runner
    assert runner.decode_buckets == (3, 8)  # sorted; a bucket above max_num_seqs is dropped
    shapes = []
    orig = runner.prepare

    def spy(out, pad_to=None, **kw):
        step = orig(out, pad_to, **kw)
        shapes.append((len(out.seqs), pad_to, step.input_ids.shape[0], tuple(step.meta.block_tables.shape)))
        return step

    runner.prepare = spy
    toks, _ = run(core, PROMPTS, GREEDY)
    assert [toks[f"r{i}"] for i in range(len(PROMPTS))] == reference
    padded = [s for s in shapes if s[1] is not None]
    assert padded and all(pad == (3 if real <= 3 else 8) for real, pad, _, _ in padded)
    assert all(n_tok == pad and width == runner.max_pages for _, pad, n_tok, (_, width) in padded)
    assert any(real < pad for real, pad, _, _ in padded)  # real padding rows ran
