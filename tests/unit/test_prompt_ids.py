"""A completion's prompts as ids: the bounds a request meets before any engine work
(agent/http/prompt_ids.py), on token-id prompts, which need no tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from agent.http.api_error import ApiError
from agent.http.openai_schema import MAX_PROMPT_LOGPROB_ENTRIES, CompletionRequest
from agent.http.prompt_ids import prompt_logprob_entries, prompts_ids

CTX = 1 << 16


def _ids(body: dict) -> list[list[int]]:
    req = CompletionRequest.model_validate({"model": "m", **body})
    return asyncio.run(prompts_ids(req, None, 1000, CTX))  # type: ignore[arg-type]


def test_prompt_logprobs_are_bounded_by_the_entries_the_answer_would_hold() -> None:
    # 64 prompts of 2,000 ids at top 20: 2.7 M entries (82 MB of JSON for a 0.7 MB body)
    bomb = {"prompt": [[5] * 2000] * 64, "max_tokens": 0, "echo": True, "logprobs": 20}
    with pytest.raises(ApiError) as e:
        _ids(bomb)
    assert e.value.status == 400 and e.value.param == "logprobs"
    assert "2688000 prompt logprobs" in e.value.message and str(MAX_PROMPT_LOGPROB_ENTRIES) in e.value.message
    with pytest.raises(ApiError) as e:  # vLLM's field, beside an answer, counts the same
        _ids({"prompt": [[5] * 2000] * 64, "max_tokens": 1, "prompt_logprobs": 20})
    assert e.value.param == "prompt_logprobs"
    # lm-eval's loglikelihood batch at its logprobs 1: 64 prompts of 4,096 tokens fit exactly
    lm_eval = {"prompt": [[5] * 4096] * 64, "max_tokens": 0, "echo": True, "logprobs": 1}
    assert len(_ids(lm_eval)) == 64
    assert prompt_logprob_entries(CompletionRequest.model_validate({"model": "m", **lm_eval}), 64 * 4096) \
        == MAX_PROMPT_LOGPROB_ENTRIES
    # n multiplies: every choice carries its prompt's logprobs
    with pytest.raises(ApiError):
        _ids({"prompt": [[5] * 4096] * 32, "n": 2, "max_tokens": 0, "echo": True, "logprobs": 2})
    # streamed, the first chunk is built on the loop: a quarter of the bound
    with pytest.raises(ApiError) as e:
        _ids({**lm_eval, "stream": True})
    assert "at most 131072 in one streamed request" in e.value.message
    assert len(_ids({**lm_eval, "prompt": [[5] * 4096] * 16, "stream": True})) == 16
    # no prompt logprobs asked (echo alone, or logprobs without echo): no bound but the tokens'
    assert len(_ids({"prompt": [[5] * 2000] * 64, "echo": True})) == 64
    assert len(_ids({"prompt": [[5] * 2000] * 64, "logprobs": 20})) == 64
