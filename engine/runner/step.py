"""The plain records a model runner hands around (how a step runs, its device inputs, a launched
step, a result)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.models.llama import AttentionMetadata

if TYPE_CHECKING:
    from engine.runner.cuda_graphs import GraphSet


@dataclass(frozen=True, slots=True)
class StepPlan:
    """How one step runs, chosen once from its shape before its inputs are staged
    (:meth:`engine.runner.model_runner.ModelRunner.step_plan`), then executed as it says.

    ``graphs`` / ``bucket``: the graph set (decode or mixed-step) and the bucket the step replays;
    None: it runs eagerly. Once its inputs are staged, a step that carries a cascade plan replays
    the bucket's cascade variant; a bucket (or variant) without a graph runs the same forward
    eagerly. ``pad_to``: a decode-only step's rows padded to its decode bucket, graph or not (the
    same kernels either way). ``pad_tokens``: a mixed-step graph's bucket, the tokens padded to it
    and every sequence slot filled. At most one of the two pads is set.
    """

    graphs: GraphSet | None = None
    bucket: int = 0
    pad_to: int | None = None
    pad_tokens: int | None = None


EAGER = StepPlan()  # no graph, no padding: exact shapes


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
    """A launched step whose sampling waits for the step before: the forward pass is queued; its
    grammar masks and its ruled rows' logit rules (engine/runner/logit_rules.py) need the tokens
    of the step before (ModelRunner.sample_masked)."""

    out: Any  # engine.sched.scheduler.SchedulerOutput
    entries: list[int]  # index into out.seqs of each sampled row
    logits: torch.Tensor  # [S, V] float32
    rows: list[tuple[int, Any]]  # (sampled row, its grammar) of the constrained rows
    graph: bool  # the forward was a graph replay (host-time accounting)
    stream: Any  # the stream the forward was queued on (CUDA), where the sampling follows it
    ruled: list[tuple[int, Any]] = field(default_factory=list)  # (sampled row, its ScheduledSeq) with logit rules


@dataclass
class PendingStep:
    """A launched step: the sampled ids are on their way to host memory.

    Made by one of its named constructors: :meth:`empty` (nothing sampled), :meth:`copying` (ids
    sampled, their copy to the host queued), :meth:`with_logprobs` (ids and logits kept on the
    device for the logprobs), :meth:`awaiting_masks` (not sampled yet: its grammar masks come
    first). The last one is the only one that changes afterwards, once, by :meth:`sampled`."""

    num_sampled: int
    ids_host: torch.Tensor | None  # pinned [S] int64 view (CUDA), filled when ``ready`` fires
    ready: torch.cuda.Event | None
    ids: torch.Tensor | None  # device ids (CPU path: read directly)
    logits: torch.Tensor | None  # kept only when logprobs are wanted
    want_logprobs: list[int | None] | None
    masked: MaskedSample | None = None  # not sampled yet: its grammar masks come first
    # An empty step's end on the device (CUDA): nothing to copy, so its collect does not wait, but
    # it writes K/V pages, and its model's pages freed meanwhile go back only once it fires.
    written: torch.cuda.Event | None = None

    @classmethod
    def empty(cls, written: torch.cuda.Event | None = None) -> PendingStep:
        """A step that samples nothing (prefill chunks short of their prompts' ends); ``written``
        fires when its work is done (CUDA)."""
        return cls(0, None, None, None, None, None, written=written)

    @classmethod
    def copying(cls, num_sampled: int, ids: torch.Tensor, ids_host: torch.Tensor | None = None,
                ready: torch.cuda.Event | None = None) -> PendingStep:
        """Sampled ``ids`` on the device; on CUDA their copy into pinned ``ids_host`` is queued
        behind ``ready``, elsewhere (None) they are read directly."""
        return cls(num_sampled, ids_host, ready, ids, None, None)

    @classmethod
    def with_logprobs(cls, ids: torch.Tensor, logits: torch.Tensor, want: list[int | None]) -> PendingStep:
        """Sampled ``ids`` and their rows' ``logits`` kept on the device: ``want`` (one entry per
        sampled row) asks for logprobs, which the collect computes from them."""
        return cls(len(want), None, None, ids, logits, want)

    @classmethod
    def awaiting_masks(cls, masked: MaskedSample) -> PendingStep:
        """A step whose forward is queued and whose sampling waits for its grammar masks
        (``ModelRunner.sample_masked``, which completes it with :meth:`sampled`)."""
        return cls(len(masked.entries), None, None, None, None, None, masked)

    def sampled(self, done: PendingStep) -> None:
        """A step that was :meth:`awaiting_masks` is sampled now, as ``done`` (from
        :meth:`copying` or :meth:`with_logprobs`): it takes over its ids, their event and the
        logprobs' logits. In place, since the engine already holds this step."""
        self.masked = None
        self.ids_host, self.ready, self.ids = done.ids_host, done.ready, done.ids
        self.logits, self.want_logprobs = done.logits, done.want_logprobs

    def done(self) -> bool:
        """Whether the step's ids have reached host memory: its ``ready`` event has fired, or it
        has none (CPU, logprobs wanted, nothing sampled). Never blocks."""
        return self.masked is None and (self.ready is None or self.ready.query())


@dataclass
class StepResult:
    token_ids: list[int]  # one per scheduled entry with ``sample`` set, in order
    logprobs: list[dict | None]  # aligned with token_ids; None where not requested
