"""One request's state inside the engine: tokens, progress, status (plain data, no torch)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling import SamplingParams


class Grammar(Protocol):
    """What the scheduler needs of a request's grammar (engine/grammar/matcher.py)."""

    def accept(self, token: int) -> bool:
        """Advance by one token; False when the grammar refuses it."""

    @property
    def finished(self) -> bool:
        """Nothing but the end may follow."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its pages were freed; recompute on resume)
    RUNNING = "running"  # holds pages; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos or a stop token id
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """A request's tokens and how far the model has computed them.

    ``token_ids`` is prompt + output so far. ``num_computed_tokens`` counts the tokens whose
    K/V sit in the cache; the next step computes ``token_ids[num_computed_tokens:]`` (or a chunk
    of it) and, once it reaches the end, samples one more token. Preemption resets
    ``num_computed_tokens`` to 0: the output tokens are kept and recomputed like prompt tokens.
    """

    seq_id: int
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; higher is newer (preemption victims are the newest)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Tokens sampled by a launched step whose values the host does not know yet (0 or 1; up to
    # 2 for a moment while the next step is scheduled ahead). They count as computed positions.
    num_inflight: int = 0
    # Prefix caching: the key chain of the full blocks of known tokens so far, how many of those
    # blocks are indexed, and how many prompt tokens the first admission found cached.
    block_keys: list[bytes] = field(default_factory=list)
    num_indexed_blocks: int = 0
    num_cached_tokens: int = 0
    # Constrained decoding: accepts each token as it arrives (engine/grammar/matcher.py).
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_inflight - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Exactly one token (the last sampled, known or in flight) is left to compute."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens + self.num_inflight > 0
