"""A request resumed after its model was preempted for another's room (``output_token_ids``):
the engine computes its prompt and the output it had again and goes on exactly where it was —
the seeded sampler's step, penalties, min_tokens and max_tokens count that output as its own,
a grammar accepts it first — and bad resumptions are refused with the field named."""

from __future__ import annotations

import pytest

from engine.errors import RequestError
from engine.sampling import SamplingParams
from engine.worker import protocol as P
from tests.engine_run import cpu_core
from tests.sharp import sharpen

PROMPT = [5, 9, 2, 7, 11, 3, 9, 9]


@pytest.fixture(scope="module")
def sharp_llama(make_tiny_model, tmp_path_factory):
    # peaked logits: seeded sampling at temperature 1 picks tokens that differ between steps
    return sharpen(make_tiny_model("llama"), tmp_path_factory.mktemp("sharp-resume") / "llama", 20.0, 4.0)


def _tokens(core, rid: str, prompt: list[int], p: SamplingParams, out: list[int] | None = None) -> list[int]:
    core.add_request(rid, "m", prompt, p, output_token_ids=out or [])
    got: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step():
            got.extend(o.new_token_ids)
    return got


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True, frequency_penalty=0.7,
                   presence_penalty=0.3, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=12, min_tokens=10, logit_bias=[(4, 1.5)]),
], ids=["seeded", "seeded-penalties", "greedy-min-tokens"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_resumed_request_goes_on_exactly_where_it_was(sharp_llama, params, cut):
    whole = _tokens(cpu_core(sharp_llama), "a", PROMPT, params)
    assert len(whole) == 12 or (params.min_tokens and len(whole) >= params.min_tokens)  # greedy may end after them
    if cut >= len(whole):
        pytest.skip("the answer ended before the cut")
    rest = _tokens(cpu_core(sharp_llama), "a", PROMPT, params, whole[:cut])
    assert whole[:cut] + rest == whole


def test_a_resumed_request_reports_its_own_prompt_and_only_new_tokens(sharp_llama):
    core = cpu_core(sharp_llama)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request("r", "m", PROMPT, p, output_token_ids=[4, 4, 4])
    outs = []
    while core.has_unfinished_requests():
        outs.extend(core.step())
    assert sum(len(o.new_token_ids) for o in outs) == 3  # max_tokens counts the output it had
    assert outs[-1].finish_reason == "length"
    assert {o.num_prompt_tokens for o in outs if o.num_prompt_tokens} == {len(PROMPT)}


def test_a_resumed_request_counts_only_its_prompt_as_cached(sharp_llama):
    """The prefix cache holds the K/V of an earlier answer's output too, so a resumption's
    prompt + output can be found cached past its prompt; cached_tokens (usage) stays a count of
    prompt tokens: a larger one broke the worker protocol's invariant and the agent killed the
    worker (a CPU churn pass, 404 preemptions, once)."""
    core = cpu_core(sharp_llama, prefix_caching=True)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole = _tokens(core, "a", PROMPT, p)
    core.add_request("b", "m", PROMPT, p, output_token_ids=whole[:12])
    outs = []
    while core.has_unfinished_requests():
        outs.extend(core.step())
    assert whole[:12] + [t for o in outs for t in o.new_token_ids] == whole
    assert all(0 < o.num_cached_tokens <= o.num_prompt_tokens == len(PROMPT) for o in outs)
    assert P.unpack_outputs(P.Tokens(0, [[o.req_id, o.new_token_ids, o.finish_reason, None, o.num_prompt_tokens,
                                            o.num_cached_tokens] for o in outs]))


def test_a_resumption_at_the_limits_is_taken(make_tiny_model):
    """One token left of max_tokens, and prompt + output one short of max_model_len (128): each
    gets exactly its last token."""
    core = cpu_core(make_tiny_model("llama"))
    assert len(_tokens(core, "a", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       [1, 2, 3])) == 1
    out = [1] * (127 - len(PROMPT))
    assert len(_tokens(core, "b", PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), out)) == 1


def test_bad_resumptions_are_refused_naming_the_field(make_tiny_model):
    core = cpu_core(make_tiny_model("llama"))
    p = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(RequestError) as e:
        core.add_request("a", "m", PROMPT, p, output_token_ids=[1, 2, 3, 4])  # nothing left of max_tokens
    assert e.value.param == "output_token_ids"
    with pytest.raises(RequestError) as e:
        core.add_request("b", "m", PROMPT, p, output_token_ids=[10 ** 6])
    assert e.value.param == "output_token_ids"
    with pytest.raises(RequestError) as e:  # the context (128) holds no more
        core.add_request("c", "m", PROMPT * 15, SamplingParams(max_tokens=100), output_token_ids=[1] * 10)
    assert e.value.param == "prompt_token_ids"
    with pytest.raises(RequestError) as e:
        core.add_request("d", "m", PROMPT, p, output_token_ids=[True])
    assert e.value.param == "output_token_ids"
    assert not core.has_unfinished_requests()


def test_the_output_to_resume_from_crosses_the_worker_protocol_and_an_old_peer_sends_none():
    msg = P.Add(req_id="r", model="m", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=4),
                output_token_ids=[3, 4])
    assert P.decode(P.encode(msg)[P.HEADER_BYTES:]) == msg
    old = P.Add(req_id="r", model="m", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=4))
    assert P.decode(P.encode(old)[P.HEADER_BYTES:]).output_token_ids == []
    # the container is checked here, the ids by the engine (test above), as a prompt's are
    bad = P.encode(P.Add(req_id="r", model="m", prompt_token_ids=[1], sampling=SamplingParams(),
                         output_token_ids=5))  # type: ignore[arg-type]
    with pytest.raises(P.ProtocolError):
        P.decode(bad[P.HEADER_BYTES:])

