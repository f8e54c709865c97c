"""A request preempted for another model's room resumes when its model comes back
(``Generation._resume``): sent again with its output so far, or, when the model came back with a
context too small to hold that output and one more token (a comeback given less room), ended
there as ``length`` with what it had — as it would have ended at its context's end — never
refused as an invalid request mid-answer."""

from __future__ import annotations

import asyncio
from typing import Any

from agent.metrics import Metrics
from agent.worker.client import EngineRequest, Preempted
from agent.worker.generation import Generation
from engine.sampling import SamplingParams
from engine.worker import protocol as P


class Detok:
    def __init__(self, tokenizer: Any = None, context_ids: Any = None) -> None: ...

    def push(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def flush(self) -> str:
        return ""


class Worker:
    def __init__(self) -> None:
        self.added: list[tuple[str, list[int]]] = []

    def add(self, req_id: str, model: str, prompt_token_ids: list[int], sampling: SamplingParams,
            queue: Any = None, grammar: str = "", output_token_ids: list[int] | None = None,
            resumable: bool = False) -> EngineRequest:
        self.added.append((req_id, list(output_token_ids or ())))
        return EngineRequest(req_id, model, queue)

    def abort(self, req_id: str) -> None: ...


async def _preempted_after_two_tokens(context: int) -> tuple[Generation, Worker, list[int]]:
    """A request of a 3-token prompt, 20 tokens at most, preempted after 2; its model comes back
    with ``context`` tokens."""
    asked: list[int] = []

    async def comeback(choices: int) -> int:
        asked.append(choices)
        return context

    w = Worker()
    gen = Generation(w, Metrics(), "m", "cmpl-1", None, [], Detok, None, comeback=comeback)
    gen.start([1, 2, 3], [SamplingParams(temperature=0, max_tokens=20)])
    gen.put_nowait(P.TokenOutput("cmpl-1-0", [5, 6], None, None, 3))
    gen.put_nowait(Preempted("cmpl-1-0", "m"))
    for _ in range(100):
        await asyncio.sleep(0)
        if gen._resuming is None and asked:
            break
    return gen, w, asked


async def test_a_preempted_request_resumes_with_its_output_so_far() -> None:
    gen, w, asked = await _preempted_after_two_tokens(context=64)
    assert asked == [1] and w.added == [("cmpl-1-0", []), ("cmpl-1-0.r1", [5, 6])]
    assert not gen.over and gen.failure is None


async def test_one_whose_model_came_back_with_too_small_a_context_ends_as_length_with_its_output() -> None:
    gen, w, asked = await _preempted_after_two_tokens(context=5)  # 3 + 2 tokens: no room for one more
    assert asked == [1] and w.added == [("cmpl-1-0", [])]  # not sent again
    (choice,) = gen.choices.values()
    assert gen.over and gen.failure is None
    assert choice.finish_reason == "length" and choice.token_ids == [5, 6] and "".join(choice.text) == "<5><6>"


async def test_a_length_ending_releases_the_tokens_a_stop_string_held_with_their_logprobs() -> None:
    """Streamed with logprobs and a stop string "END": the output "x", "E", "N" holds back "EN"
    (it may start the stop string) and its two tokens with it. Ended as length at the comeback,
    the last delta gives that text and those tokens with their logprobs: the stream's tokens are
    its text, as everywhere else."""
    from text.detokenizer import StopMatcher

    text = {7: "x", 8: "E", 9: "N"}

    class Chars(Detok):
        def push(self, ids: list[int]) -> str:
            return "".join(text[i] for i in ids)

    async def comeback(choices: int) -> int:
        return 6  # the prompt's 3 and the output's 3: no room for a 7th token

    gen = Generation(Worker(), Metrics(), "m", "cmpl-2", None, ["END"], Chars, StopMatcher, comeback=comeback)
    deltas: list[Any] = []
    gen.on_delta = deltas.append
    gen.start([1, 2, 3], [SamplingParams(temperature=0, max_tokens=20, logprobs=0)])
    gen.put_nowait(P.TokenOutput("cmpl-2-0", [7, 8, 9], None, [[-0.1, []], [-0.2, []], [-0.3, []]], 3))
    assert "".join(d.text for d in deltas) == "x" and [t for d in deltas for t in d.token_ids] == [7]
    gen.put_nowait(Preempted("cmpl-2-0", "m"))
    for _ in range(100):
        await asyncio.sleep(0)
        if gen.over:
            break
    assert gen.over and deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == "xEN" and [t for d in deltas for t in d.token_ids] == [7, 8, 9]
    assert [lp for d in deltas for lp in (d.logprobs or [])] == [[-0.1, []], [-0.2, []], [-0.3, []]]
