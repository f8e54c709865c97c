"""A validated request's prompt as token ids, bounded by the model's context.

Chat prompts are built and rendered by :class:`text.chat_prompt.ChatPrompt`; completion prompts
are a text to tokenize or ids to check against the vocabulary, one or a list of them (a batch:
each checked alone, and their tokens bounded together). A prompt that cannot fit the
context by its length alone is refused before any tokenizing, and one that turns out too long is
refused before its ids are all built. Long texts render and tokenize in a thread (the tokenizer
drops the GIL), so the event loop keeps serving meanwhile. Every refusal is a 400 :class:`ApiError`
naming ``messages`` or ``prompt``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agent.http.api_error import ApiError
from agent.http.openai_schema import (MAX_PROMPT_LOGPROB_ENTRIES, MAX_PROMPT_TOKENS,
                                      MAX_STREAMED_PROMPT_LOGPROB_ENTRIES, ChatCompletionRequest,
                                      CompletionRequest)
from agent.http.request_body import off_loop
from text.chat_prompt import ChatPrompt
from text.tokenizer import Tokenizer, TokenLimitExceeded
from text.tool_calls import ToolFormat, tool_format

TOKENIZE_INLINE_CHARS = 16_384  # longer texts tokenize in a thread so the loop keeps serving


def too_long(n: int, ctx_len: int, chat: bool, *, exact: bool) -> ApiError:
    return ApiError(400, f"the prompt has {'' if exact else 'at least '}{n} tokens; this model's context is {ctx_len}",
                    param="messages" if chat else "prompt", code="context_length_exceeded")


async def prompt_ids(req: ChatCompletionRequest | CompletionRequest, tok: Tokenizer, vocab_size: int, ctx_len: int,
                     tool_fmt: ToolFormat | None, body_bytes: int = 0) -> list[int]:
    """The prompt's ids: not empty, and shorter than ``ctx_len`` (and :data:`MAX_PROMPT_TOKENS`).

    ``vocab_size``: the model's (as the engine loaded it), which ids sent as the prompt must be below;
    ``tool_fmt``: how the model writes tool calls (chat), for tools and a history with calls;
    ``body_bytes``: the request body's length (a large one builds its chat prompt off the loop,
    request_body.off_loop). A completion's list of prompts: :func:`prompts_ids`."""
    if isinstance(req, ChatCompletionRequest):
        return _checked(await _chat_ids(req, tok, ctx_len, tool_fmt, body_bytes), ctx_len, True)
    return (await prompts_ids(req, tok, vocab_size, ctx_len))[0]


async def prompts_ids(req: CompletionRequest, tok: Tokenizer, vocab_size: int, ctx_len: int) -> list[list[int]]:
    """The ids of each of a completion's prompts (one, or a list), each as :func:`prompt_ids`
    checks it, and together at most :data:`MAX_PROMPT_TOKENS`, with at most
    :data:`MAX_PROMPT_LOGPROB_ENTRIES` prompt logprobs to answer with
    (:data:`MAX_STREAMED_PROMPT_LOGPROB_ENTRIES` streamed)."""
    out = [_checked(await _completion_ids(p, tok, vocab_size, ctx_len), ctx_len, False) for p in req.prompts()]
    total = sum(len(ids) for ids in out)
    if total > MAX_PROMPT_TOKENS:
        raise ApiError(400, f"the prompts have {total} tokens together; at most {MAX_PROMPT_TOKENS}", param="prompt",
                       code="context_length_exceeded")
    entries = prompt_logprob_entries(req, total)
    bound = MAX_STREAMED_PROMPT_LOGPROB_ENTRIES if req.stream else MAX_PROMPT_LOGPROB_ENTRIES
    if entries > bound:
        top = req.wants_prompt_logprobs()
        raise ApiError(400, f"the answer would hold {entries} prompt logprobs ({total} prompt tokens x n={req.n} x "
                            f"{top} top + the token's own); at most {bound} in one {'streamed ' if req.stream else ''}"
                            "request: send fewer or shorter prompts, or ask for fewer top logprobs",
                       param="logprobs" if req.echo and req.logprobs is not None else "prompt_logprobs")
    return out


def prompt_logprob_entries(req: CompletionRequest, prompt_tokens: int) -> int:
    """How many prompt logprobs an answer to ``req`` holds: each choice carries its prompt's, a
    token's own and its top N at every position."""
    top = req.wants_prompt_logprobs()
    return 0 if top is None else prompt_tokens * req.n * (top + 1)


def _checked(ids: list[int], ctx_len: int, chat: bool) -> list[int]:
    if not ids:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    if len(ids) >= ctx_len or len(ids) > MAX_PROMPT_TOKENS:
        raise too_long(len(ids), ctx_len, chat, exact=True)
    return ids


def _chat_prompt(req: ChatCompletionRequest, fmt: ToolFormat) -> ChatPrompt:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.uses_tools and req.tools else None
    return ChatPrompt.build([m.template_view() for m in req.messages], tools, fmt)


async def _chat_ids(req: ChatCompletionRequest, tok: Tokenizer, ctx_len: int, tool_fmt: ToolFormat | None,
                    body_bytes: int) -> list[int]:
    limit = min(ctx_len, MAX_PROMPT_TOKENS + 1)
    fmt = tool_fmt if tool_fmt is not None else tool_format(tok.chat_template)
    prompt = await off_loop(body_bytes, _chat_prompt, req, fmt)  # 6 MB of tools: seconds of the loop otherwise
    return await _run(lambda: prompt.token_ids(tok, limit), prompt.chars, ctx_len, True)


async def _completion_ids(prompt: str | list[int], tok: Tokenizer, vocab_size: int, ctx_len: int) -> list[int]:
    limit = min(ctx_len, MAX_PROMPT_TOKENS + 1)
    if isinstance(prompt, str):
        text = prompt
        if (at_least := tok.min_tokens(text)) >= limit:  # O(1): no thread, no tokenizing
            raise too_long(at_least, ctx_len, False, exact=False)
        return await _run(lambda: tok.encode(text, limit=limit), len(text), ctx_len, False)
    bad = next((t for t in prompt if t >= vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary (size {vocab_size})", param="prompt")
    return list(prompt)


async def _run(work: Callable[[], list[int]], size: int, ctx_len: int, chat: bool) -> list[int]:
    """``work()`` (tokenizing ``size`` characters): inline when short, else in a thread."""
    try:
        ids = work() if size < TOKENIZE_INLINE_CHARS else await asyncio.to_thread(work)
    except TokenLimitExceeded as e:
        raise too_long(e.tokens, ctx_len, chat, exact=e.exact) from None
    except Exception as e:  # template errors, template output bounds
        param = "messages" if chat else "prompt"
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return list(ids)
