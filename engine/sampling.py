"""Sampling parameters of one request, validated once, at construction (no torch import).

The sampling itself runs on the device in ``engine.kernels.sample``; this module only carries
and checks the numbers. Every bound is checked when a :class:`SamplingParams` is made, with a
:class:`SamplingParamsError` naming the field, so the agent can answer a 400 with ``param``
set; the value is frozen, so a made one stays valid. It crosses the worker protocol as a record
(``Add.sampling``), and a refusal there is the frame's ProtocolError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP_TOKEN_IDS = 1024
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it
SEED_MAX = (1 << 63) - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is out of bounds; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _is_int(x: Any) -> bool:
    # bool is an int subclass; True as a token count is a caller bug, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature`` 0 means greedy; ``top_k`` 0 and ``top_p`` 1 and ``min_p`` 0 mean off;
    ``seed`` None lets the engine draw one at admission so every request is reproducible from
    its seed; ``logprobs`` None returns none, N returns the chosen token's logprob and the top N.

    Logit rules (engine/runner/logit_rules.py), applied before the filters above, in this order:
    ``repetition_penalty`` r (1 = off; a token of the prompt or the output so far has its logit
    divided by r when positive, multiplied when negative), ``frequency_penalty`` (minus f times
    the token's count in the output) and ``presence_penalty`` (minus p once it occurs in the
    output), ``logit_bias`` ((token id, bias) pairs added to the logits), and ``min_tokens`` (no
    end-of-sequence or stop token id before that many output tokens). The logprobs a request asks
    for are of the logits after its rules. Construction raises :class:`SamplingParamsError` on
    the first bad field; ``stop_token_ids`` and ``logit_bias`` are copied (lists of their own),
    so the caller's may change afterwards.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # The prompt's logprobs: each prompt token's (after the first) and the top N at its position,
    # from the prefill's logits (engine/runner/prompt_logprobs.py); such a prompt is computed whole
    # (the prefix cache is not read for it).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingParamsError("top_k", f"must be an integer in [0, {MAX_TOP_K}] (0 = off)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", "must be a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX):
            raise SamplingParamsError("seed", f"must be null or an integer in [0, {SEED_MAX}]")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise SamplingParamsError("max_tokens", f"must be an integer in [1, {MAX_TOKENS_LIMIT}]")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", "must be a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise SamplingParamsError("stop_token_ids", f"{t!r} is not a token id (integer >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", "must be true or false")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError("logprobs", f"must be null or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError("prompt_logprobs", f"must be null or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise SamplingParamsError(name, f"must be a number in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise SamplingParamsError("repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        # One flag the scheduler reads for every entry of every step: a request without rules
        # takes the sampler's usual path and pays nothing for them.
        object.__setattr__(self, "_rules", self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                           or self.repetition_penalty != 1.0 or bool(self.logit_bias) or self.min_tokens > 0)
        object.__setattr__(self, "_history", self._rules or self.prompt_logprobs is not None)

    @property
    def has_logit_rules(self) -> bool:
        """Whether any logit rule (penalties, bias, min_tokens) applies to this request."""
        return self._rules  # type: ignore[attr-defined]

    @property
    def reads_history(self) -> bool:
        """Whether the runner reads this request's token list (logit rules, prompt logprobs):
        the one flag the scheduler checks per entry."""
        return self._history  # type: ignore[attr-defined]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _bias_pairs(bias: Any) -> list[tuple[int, float]]:
    """``logit_bias`` as a list of (token id, bias) pairs, each id once: from pairs (the wire's
    lists of two) or a mapping; a SamplingParamsError on anything else. Token ids are checked
    against the model's vocabulary where it is known (EngineCore.add_request)."""
    items = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(items, (list, tuple, type({}.items()))):
        raise SamplingParamsError("logit_bias", "must be (token id, bias) pairs")
    out: list[tuple[int, float]] = []
    seen: set[int] = set()
    for pair in items:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise SamplingParamsError("logit_bias", "must be (token id, bias) pairs")
        tok, b = pair
        if not _is_int(tok) or tok < 0:
            raise SamplingParamsError("logit_bias", f"{tok!r} is not a token id (integer >= 0)")
        if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"the bias of token {tok} must be a number in "
                                                    f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if tok in seen:
            raise SamplingParamsError("logit_bias", f"token {tok} appears twice")
        seen.add(tok)
        out.append((tok, float(b)))
        if len(out) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens")
    return out
