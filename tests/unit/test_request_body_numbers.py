"""Numbers JSON does not have (``NaN``, ``Infinity``, ``-Infinity``, ``1e400``: Python's parser takes
them all) are refused at the body, naming where they were, wherever they were: a fourth attacker
pass saw a ``NaN`` temperature told "must be <= 2", a ``-Infinity`` in an ignored field served, and
``1e400`` in a tool's schema reach the prompt as ``Infinity``."""

from __future__ import annotations

import pytest

from agent.http.api_error import ApiError
from agent.http.request_body import parse_json


@pytest.mark.parametrize("raw, param", [
    (b'{"temperature": NaN}', "temperature"),
    (b'{"temperature": Infinity}', "temperature"),
    (b'{"messages": [{"annotations": [{"v": -Infinity}]}]}', "messages.0.annotations.0.v"),
    (b'{"tools": [{"function": {"parameters": {"maximum": 1e400}}}]}', "tools.0.function.parameters.maximum"),
    (b'{"logit_bias": {"5": -1e400}}', "logit_bias.5"),
])
def test_a_number_json_does_not_have_is_refused_where_it_is(raw: bytes, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_value")
    assert e.value.message.startswith(f"{param}: must be a finite number")


def test_finite_numbers_and_long_id_lists_pass() -> None:
    body = parse_json(b'{"t": 1.5, "big": 1e308, "small": -1e-320, "prompt": [' + b",".join([b"7"] * 100_000) + b"]}")
    assert body["t"] == 1.5 and body["big"] == 1e308 and len(body["prompt"]) == 100_000


def test_the_param_of_a_long_key_is_bounded() -> None:
    with pytest.raises(ApiError) as e:
        parse_json(b'{"' + b"k" * 100_000 + b'": NaN}')
    assert e.value.param == "k" * 64 and len(e.value.message) < 200
