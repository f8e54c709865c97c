"""How the runner runs a step (engine/runner/model_runner.py, "A launch has three phases"):

- the plan is chosen once, from the step's shape, before its inputs are staged: a decode-only
  step whose rows all sample replays the decode graph of its batch bucket; any other step the
  mixed-step graph of its token bucket; a step no graph takes runs eagerly, a decode-only one
  still padded to its decode bucket;
- a launched step is one of four kinds of PendingStep, each from its named constructor, and only
  a step awaiting its grammar masks changes afterwards, once, when it is sampled.

The graph sets are stood in for (tests/graph_stand_in.py): a plan only names them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.llm import LLM
from engine.runner.cuda_graphs import DecodeGraphs, MixedGraphs
from engine.runner.step import EAGER, MaskedSample, PendingStep, StepPlan
from engine.sampling import SamplingParams
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput
from tests.graph_stand_in import StandInGraphs

P = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def runner(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), device="cpu", max_model_len=64, block_size=4, dtype="float32", max_num_seqs=8)
    r = next(iter(llm.core.slots.values())).runner
    r.decode_buckets, r.mixed_buckets = (1, 2, 4), (8, 16)
    r.graphs = StandInGraphs(r, DecodeGraphs, r.decode_buckets)
    r.mixed = StandInGraphs(r, MixedGraphs, r.mixed_buckets)
    return r


def _out(decodes: int, prefill: int = 0, prefill_samples: bool = False) -> SchedulerOutput:
    """``decodes`` one-token decodes, then a prefill chunk of ``prefill`` tokens."""
    seqs = [ScheduledSeq(i, f"d{i}", [1], 4, [0, 1], True, 0, P) for i in range(decodes)]
    if prefill:
        seqs.append(ScheduledSeq(decodes, "p", [1] * prefill, 0, [0], prefill_samples, 0, P))
    return SchedulerOutput(seqs, num_decodes=decodes, num_batched_tokens=decodes + prefill)


def test_a_decode_only_step_replays_the_decode_graph_of_its_batch_bucket(runner):
    assert runner.step_plan(_out(3)) == StepPlan(runner.graphs, 4, pad_to=4)
    assert runner.step_plan(_out(1)) == StepPlan(runner.graphs, 1, pad_to=1)


def test_a_mixed_step_replays_the_mixed_graph_of_its_token_bucket(runner):
    assert runner.step_plan(_out(3, prefill=4)) == StepPlan(runner.mixed, 8, pad_tokens=8)
    assert runner.step_plan(_out(0, prefill=9, prefill_samples=True)) == StepPlan(runner.mixed, 16, pad_tokens=16)
    # a decode-only batch past the largest decode bucket is a mixed step by its tokens
    assert runner.step_plan(_out(5)) == StepPlan(runner.mixed, 8, pad_tokens=8)


def test_a_step_past_the_largest_buckets_runs_eagerly(runner):
    assert runner.step_plan(_out(2, prefill=30)) is EAGER
    assert runner.step_plan(SchedulerOutput()) is EAGER


def test_without_graphs_a_decode_only_step_is_still_padded_to_its_bucket(runner, monkeypatch):
    monkeypatch.setattr(runner, "graphs", None)
    monkeypatch.setattr(runner, "mixed", None)
    assert runner.step_plan(_out(3)) == StepPlan(pad_to=4)
    assert runner.step_plan(_out(3, prefill=4)) is EAGER


def test_a_plan_is_a_frozen_value(runner):
    plan = runner.step_plan(_out(3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.bucket = 8


def test_each_kind_of_pending_step_has_its_constructor():
    ids, logits = torch.tensor([3, 1]), torch.zeros(2, 5)
    empty = PendingStep.empty()
    assert empty.num_sampled == 0 and empty.done()
    copying = PendingStep.copying(2, ids)  # no event (CPU): the ids are read directly
    assert (copying.num_sampled, copying.ids, copying.logits, copying.ready) == (2, ids, None, None) and copying.done()
    lp = PendingStep.with_logprobs(ids, logits, [None, 2])
    assert lp.num_sampled == 2 and lp.logits is logits and lp.want_logprobs == [None, 2] and lp.done()


def test_a_step_awaiting_its_masks_is_done_once_it_is_sampled(runner):
    masked = MaskedSample(out=None, entries=[0, 2], logits=torch.zeros(2, 5), rows=[], graph=False, stream=None)
    pending = PendingStep.awaiting_masks(masked)
    assert pending.num_sampled == 2 and pending.masked is masked and not pending.done()
    ids = torch.tensor([4, 0])
    pending.sampled(PendingStep.copying(2, ids))
    assert pending.masked is None and pending.ids is ids and pending.done()
    assert runner.collect(pending).token_ids == [4, 0]
