"""SamplingParams: every bound refused at construction with an error naming the field; frozen; a
record of the worker protocol (Add.sampling), decoded strictly."""

from __future__ import annotations

import math

import dataclasses

import pytest

from engine.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from engine.worker import protocol as P


def _add(sampling: object) -> bytes:
    return P.encode(P.Add(req_id="r", model="m", prompt_token_ids=[1], sampling=sampling))[4:]  # type: ignore[arg-type]


def test_defaults_are_valid_and_cross_the_protocol():
    p = SamplingParams()
    assert p.temperature == 1.0 and p.top_k == 0 and p.seed is None and not p.greedy
    ids = [1, 2]
    q = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.1, seed=7, max_tokens=3,
                       stop_token_ids=ids, ignore_eos=True, logprobs=MAX_LOGPROBS)
    ids.append(3)  # the record holds a list of its own
    assert q.stop_token_ids == [1, 2] and q.greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.top_k = 6  # type: ignore[misc]
    back = P.decode(_add(q))
    assert isinstance(back, P.Add) and back.sampling == q and isinstance(back.sampling, SamplingParams)
    assert SamplingParams(stop_token_ids=(4, 5)).stop_token_ids == [4, 5]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", 101),
        ("temperature", "1"), ("temperature", True),
        ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan), ("top_p", None),
        ("top_k", -1), ("top_k", 1.5), ("top_k", True), ("top_k", 1 << 21),
        ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.inf),
        ("seed", -1), ("seed", 1 << 63), ("seed", 1.0), ("seed", "3"),
        ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0), ("max_tokens", None), ("max_tokens", 1 << 21),
        ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", 3), ("stop_token_ids", list(range(1025))),
        ("ignore_eos", 1), ("ignore_eos", "yes"),
        ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0), ("logprobs", True),
    ],
)
def test_out_of_bounds_is_refused_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}:")
    with pytest.raises(SamplingParamsError):
        dataclasses.replace(SamplingParams(), **{field: value})


@pytest.mark.parametrize(
    "field,value",
    [("temperature", 0), ("temperature", 100), ("top_p", 1), ("top_p", 1e-6), ("top_k", 0), ("min_p", 1.0),
     ("seed", 0), ("seed", (1 << 63) - 1), ("max_tokens", 1), ("logprobs", 0), ("logprobs", None)],
)
def test_edges_are_accepted(field, value):
    SamplingParams(**{field: value})


@pytest.mark.parametrize("sampling, why", [
    ({"top_k": -1}, "add.sampling: top_k: must be an integer"),  # the record's own bounds
    ({"max_tokens": True}, "add.sampling.max_tokens: unexpected type bool"),
    ({"stop_token_ids": 3}, "add.sampling.stop_token_ids: unexpected type int"),
    ([("temperature", 1.0)], "add.sampling: expected a map"),
])
def test_a_bad_sampling_on_the_wire_is_a_protocol_error(sampling, why):
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(_add(sampling))
