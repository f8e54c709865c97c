"""How a validated request's answer is to be decoded: its token limit, the sampling parameters of
each choice, and what constrains the text (a ``response_format``, a forced tool call, or nothing).

Everything here is decided from the request and the prompt's length alone; the grammar that
enforces the constraint is built from it by :class:`agent.http.structured.GrammarBuilder`.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.http.api_error import ApiError
from agent.http.openai_schema import ChatCompletionRequest, CompletionRequest, NamedToolChoice, ResponseFormat
from agent.http.structured import ForcedCall
from engine.sampling import SamplingParams, SamplingParamsError
from text.tool_calls import ToolFormat

DEFAULT_COMPLETION_TOKENS = 16


@dataclass(frozen=True)
class Decoding:
    max_tokens: int  # the answer's token limit, within the context
    samplings: list[SamplingParams]  # one per choice (``n``), validated
    constraint: ResponseFormat | ForcedCall | None  # what the grammar enforces; None: free text
    echo_only: bool = False  # max_tokens 0 with echo: the one token the engine samples is not sent

    @property
    def grammar_param(self) -> str:
        """The request field a grammar's failure in the engine is about."""
        return "tools" if isinstance(self.constraint, ForcedCall) else "response_format"


def plan_decoding(req: ChatCompletionRequest | CompletionRequest, n_prompt: int, ctx_len: int,
                  tool_fmt: ToolFormat | None) -> Decoding:
    """The decoding of ``req`` after a prompt of ``n_prompt`` tokens in a context of ``ctx_len``;
    ``tool_fmt``: how the model writes tool calls (chat). Raises a 400 :class:`ApiError`."""
    chat = isinstance(req, ChatCompletionRequest)
    limit = req.output_limit() if chat else req.max_tokens
    if limit is None:  # OpenAI's defaults: the rest of the context for chat, 16 for completions
        limit = ctx_len - n_prompt if chat else min(DEFAULT_COMPLETION_TOKENS, ctx_len - n_prompt)
    echo_only = limit == 0  # (completions with echo): the engine samples one token, which is not sent
    limit = max(limit, 1)
    if n_prompt + limit > ctx_len:
        raise ApiError(400, f"prompt ({n_prompt} tokens) + max_tokens ({limit}) exceeds this "
                            f"model's context of {ctx_len} tokens",
                       param="max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens",
                       code="context_length_exceeded")
    return Decoding(limit, sampling_params(req, limit), _constraint(req, tool_fmt), echo_only)


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> list[SamplingParams]:
    """One validated :class:`SamplingParams` per choice; a 400 naming the field when one is out of bounds."""
    logprobs = req.logprobs_count() if isinstance(req, ChatCompletionRequest) else req.logprobs
    prompt_logprobs = None if isinstance(req, ChatCompletionRequest) else req.wants_prompt_logprobs()
    out = []
    for i in range(req.n):
        # With a seed and n > 1 each choice gets its own seed, else the n answers are equal.
        seed = None if req.seed is None else (req.seed + i) % (1 << 63)
        try:  # checked as it is made (a frozen record)
            out.append(SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                                      min_p=req.min_p, seed=seed, max_tokens=max_tokens,
                                      ignore_eos=req.ignore_eos, logprobs=logprobs,
                                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                      repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias_pairs(),
                                      min_tokens=req.min_tokens, prompt_logprobs=prompt_logprobs))
        except SamplingParamsError as e:
            raise ApiError(400, str(e), param=e.field, code="invalid_value") from None
    return out


def _constraint(req: ChatCompletionRequest | CompletionRequest,
                tool_fmt: ToolFormat | None) -> ResponseFormat | ForcedCall | None:
    """A forced tool call (``tool_choice`` required or named) wins; else the ``response_format``
    (the schema refuses the two together)."""
    if isinstance(req, ChatCompletionRequest) and req.forces_call and tool_fmt is not None and req.tools:
        named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        offered = [t.function.model_dump(exclude_none=True) for t in req.tools
                   if named is None or t.function.name == named]
        return ForcedCall(tool_fmt, offered, req.parallel_tool_calls and not named)
    return req.response_format
