"""SamplingParams: every bound refused with an error naming the field; dict round trip."""

from __future__ import annotations

import math

import pytest

from engine.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError


def test_defaults_are_valid_and_round_trip():
    p = SamplingParams().validate()
    assert p.temperature == 1.0 and p.top_k == 0 and p.seed is None and not p.greedy
    q = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.1, seed=7, max_tokens=3,
                       stop_token_ids=[1, 2], ignore_eos=True, logprobs=MAX_LOGPROBS)
    d = q.to_dict()
    assert d["stop_token_ids"] == [1, 2]
    assert SamplingParams.from_dict(d) == q and SamplingParams.from_dict(d).greedy


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
    p = SamplingParams(**{field: value})
    with pytest.raises(SamplingParamsError) as e:
        p.validate()
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}:")
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict({**SamplingParams().to_dict(), field: value})


@pytest.mark.parametrize(
    "field,value",
    [("temperature", 0), ("temperature", 100), ("top_p", 1), ("top_p", 1e-6), ("top_k", 0), ("min_p", 1.0),
     ("seed", 0), ("seed", (1 << 63) - 1), ("max_tokens", 1), ("logprobs", 0), ("logprobs", None)],
)
def test_edges_are_accepted(field, value):
    SamplingParams(**{field: value}).validate()


def test_from_dict_refuses_unknown_keys_and_non_mappings():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 3})
    assert e.value.field == "best_of"
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]
