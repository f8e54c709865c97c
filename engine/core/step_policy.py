"""StepPolicy: how the engine treats a quiet model next to a busy one.

It owns the multi-model rules of the step loop (docs/multi-model.md has the measurements behind
each): when a busy model *yields* (its next step waits for the one in flight, so a quiet model's
new prompt goes out at once: :meth:`EngineCore.yielded`), how many tokens a step may take while
another model is active (``shared_step_tokens``), which step goes on the high-priority stream
(*urgent*, engine/runner/streams.py), whether an urgent prefill *holds* the other models' next
launch, and whether a batch may be launched behind the step in flight (*overlap*). It reads the
loaded models (the core's :class:`~engine.core.model_table.ModelTable`, never changed here) and
nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.model_table import ModelTable
from engine.core.slot import ModelSlot
from engine.options import EngineOptions
from engine.sched.scheduler import SchedulerOutput

# A model yields to another only when it has at least this many times that one's requests: two
# about equally busy models (both saturated, both at light load) keep launching ahead.
QUIET_RATIO = 4


def requests(slot: ModelSlot) -> int:
    """A model's requests in the engine: running and waiting."""
    return slot.scheduler.num_running + slot.scheduler.num_waiting


@dataclass(frozen=True)
class LaunchPlan:
    """How a scheduled batch goes out: on the high-priority stream (``urgent``), and whether
    another model's next step must not be queued beside it (``holds``)."""

    urgent: bool = False
    holds: bool = False


class StepPolicy:
    """The rules over ``slots`` (the core's table of loaded models).

    From ``options`` (:class:`~engine.options.EngineOptions`, which checks them):
    ``quiet_window_s``, how long a model's request keeps it "active" (0: no yielding; the cap
    then holds only while another model has requests); ``shared_step_tokens``, the step cap
    while another model is active (0: no cap). ``cuda``: the device runs steps
    asynchronously, so launch order matters (on CPU every batch may overlap).
    """

    def __init__(self, slots: ModelTable, options: EngineOptions, *, cuda: bool) -> None:
        self._slots = slots
        self.quiet_window_s = options.quiet_window_s
        self.shared_step_tokens = options.shared_step_tokens
        self._cuda = cuda

    def step_tokens(self, slot: ModelSlot) -> int | None:
        """The most tokens ``slot``'s next batch may take (None: its scheduler's own limit): the
        shared cap while another model has requests or had one within the quiet window (a model
        beside idle ones keeps its full steps)."""
        if self.shared_step_tokens and self._others_active(slot):
            return self.shared_step_tokens
        return None

    def yields(self, slot: ModelSlot) -> bool:
        """Whether ``slot``'s next step waits until its step in flight is collected (the other
        models are scheduled meanwhile, and ``step()`` returns instead of blocking on it while
        nothing else has work: ``EngineCore.yielded``): some model with at most a
        ``QUIET_RATIO``-th of its requests had one within ``quiet_window_s``.

        Launching ahead queues the busy model's next step before the host can see a request that
        arrives while the current one runs; the quiet model's prefill then shares the GPU with that
        step, or waits for it. Yielding costs the busy model its launch-ahead (the host's prepare
        time idles the GPU) only while a quieter model is active; two equally busy models keep it."""
        if not self.quiet_window_s or len(self._slots) < 2:
            return False
        since = time.perf_counter() - self.quiet_window_s
        mine = requests(slot)
        return any(s is not slot and s.last_request_t >= since and requests(s) * QUIET_RATIO <= mine
                   for s in self._slots.values())

    def overlaps(self, slot: ModelSlot, batch: SchedulerOutput, prev_slot: ModelSlot, prev_holds: bool) -> bool:
        """Whether ``batch`` may be launched behind the step in flight (of ``prev_slot``). Not one
        that runs eagerly on CUDA: its hundreds of launches would queue behind that step and hold
        its tokens back for the whole of a large step (a quiet model's TTFT next to a flooded one).
        Nor another model's batch behind a quiet model's prefill (``prev_holds``): that prefill is
        a first token someone waits for, and on its own it finishes in one step's time instead of
        sharing the GPU with two of the busy model's steps (the one already queued and this one)."""
        if not self._cuda:
            return True
        if prev_holds and prev_slot is not slot:
            return False
        return batch.num_batched_tokens <= slot.runner.graph_tokens

    def launch(self, slot: ModelSlot, batch: SchedulerOutput) -> LaunchPlan:
        """How ``batch`` is launched. Urgent: its model has fewer requests than every other model
        with work (the quiet one next to a flooded one), so its kernels are served first while the
        other's step drains. An urgent batch that prefills holds the others' next launch."""
        urgent = self._urgent(slot)
        return LaunchPlan(urgent, urgent and batch.num_batched_tokens > batch.num_decodes)

    def _urgent(self, slot: ModelSlot) -> bool:
        if len(self._slots) < 2:
            return False
        mine = requests(slot)
        others = [requests(s) for s in self._slots.values() if s is not slot and s.scheduler.has_unfinished()]
        return bool(others) and mine < min(others)

    def _others_active(self, slot: ModelSlot) -> bool:
        """Whether another model has requests, or had one within the quiet window."""
        since = time.perf_counter() - self.quiet_window_s
        return any(s is not slot and (s.scheduler.has_unfinished() or s.last_request_t >= since)
                   for s in self._slots.values())
