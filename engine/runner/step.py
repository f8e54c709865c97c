"""The plain records a model runner hands around (one step's device inputs, a launched step, a result)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.llama import AttentionMetadata


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_entries: list[int]  # index into SchedulerOutput.seqs for each sampled row
    is_decode_only: bool


@dataclass
class MaskedSample:
    """A launched step whose sampling waits for its grammar masks: the forward pass is queued,
    the masks need the tokens of the step before (ModelRunner.sample_masked)."""

    out: Any  # engine.sched.scheduler.SchedulerOutput
    entries: list[int]  # index into out.seqs of each sampled row
    logits: torch.Tensor  # [S, V] float32
    rows: list[tuple[int, Any]]  # (sampled row, its grammar) of the constrained rows
    graph: bool  # the forward was a graph replay (host-time accounting)
    stream: Any  # the stream the forward was queued on (CUDA), where the sampling follows it


@dataclass
class PendingStep:
    """A launched step: the sampled ids are on their way to host memory."""

    num_sampled: int
    ids_host: torch.Tensor | None  # pinned [S] int64 view (CUDA), filled when ``ready`` fires
    ready: torch.cuda.Event | None
    ids: torch.Tensor | None  # device ids (CPU path: read directly)
    logits: torch.Tensor | None  # kept only when logprobs are wanted
    want_logprobs: list[int | None] | None
    masked: MaskedSample | None = None  # not sampled yet: its grammar masks come first

    def done(self) -> bool:
        """Whether the step's ids have reached host memory: its ``ready`` event has fired, or it
        has none (CPU, logprobs wanted, nothing sampled). Never blocks."""
        return self.masked is None and (self.ready is None or self.ready.query())


@dataclass
class StepResult:
    token_ids: list[int]  # one per scheduled entry with ``sample`` set, in order
    logprobs: list[dict | None]  # aligned with token_ids; None where not requested
