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
    Construction raises :class:`SamplingParamsError` on the first bad field; ``stop_token_ids``
    is copied (a list of its own), so the caller's list may change afterwards.
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
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
