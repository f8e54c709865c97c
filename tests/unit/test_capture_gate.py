"""The capture gate (engine/runner/capture_gate.py): no serving step captures a CUDA graph while a
load thread works on the device, and a capture that fails never fails the step that asked.

- the loader shuts the gate before its load thread starts and opens it once that thread is done
  (weights read, or failed), before the load's outcome can be waited for;
- while it is shut a step of a deferred bucket runs eagerly and the bucket stays deferred; the
  first step after it opens captures it and replays it; idle captures wait too;
- a deferred capture the driver fails is logged, the bucket runs eagerly from then on, and every
  token is the eager reference's.

On CPU with the graph sets stood in for (tests/graph_stand_in.py: a 'capture' records, a
'replay' runs the recorded forward eagerly)."""

from __future__ import annotations

import threading

import pytest

from engine.llm import LLM
from engine.load_spec import LoadSpec
from engine.runner.capture_gate import CaptureGate
from engine.runner.cuda_graphs import DecodeGraphs
from engine.sampling import SamplingParams
from tests.graph_stand_in import StandInGraphs

P = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[3 + i, 7, 11, 5 + i] for i in range(3)]  # three rows: decode bucket 4


def _llm(model_dir) -> LLM:
    return LLM(model_dir, device="cpu", max_model_len=64, block_size=4, dtype="float32", max_num_seqs=8)


def _stand_in(llm: LLM, gate: CaptureGate, fail: set[int] | None = None) -> StandInGraphs:
    runner = next(iter(llm.core.slots.values())).runner
    runner.decode_buckets = (1, 2, 4, 8)
    runner.graphs = StandInGraphs(runner, DecodeGraphs, runner.decode_buckets, deferred=(2, 4, 8), gate=gate,
                                  fail=fail)
    return runner.graphs


@pytest.fixture(scope="module")
def reference(make_tiny_model):
    return [o.token_ids for o in _llm(make_tiny_model("llama")).generate(PROMPTS, P)]


def test_while_the_gate_is_shut_steps_run_eagerly_and_capture_after_it_opens(make_tiny_model, reference):
    llm = _llm(make_tiny_model("llama"))
    gate = CaptureGate()
    graphs = _stand_in(llm, gate)
    gate.shut("other")
    assert [o.token_ids for o in llm.generate(PROMPTS, P)] == reference
    assert graphs.events == [] and 4 in graphs.deferred  # every step eager; the bucket still waits
    assert not llm.core.capture_idle_graph()  # nor does an idle capture run meanwhile
    gate.reopen()
    assert [o.token_ids for o in llm.generate(PROMPTS, P)] == reference
    assert graphs.events[0] == ("capture", 4, False)  # the first step after captures it ...
    assert graphs.replayed[0] == 4 and 4 not in graphs.deferred  # ... and replays it


def test_a_failed_deferred_capture_leaves_its_bucket_eager_and_the_step_goes_on(make_tiny_model, reference, caplog):
    llm = _llm(make_tiny_model("llama"))
    graphs = _stand_in(llm, CaptureGate(), fail={4})
    assert [o.token_ids for o in llm.generate(PROMPTS, P)] == reference
    assert 4 in graphs.failed and 4 not in graphs.deferred and 4 not in graphs.replayed
    assert "capture of bucket 4 failed" in caplog.text
    assert [o.token_ids for o in llm.generate(PROMPTS, P)] == reference  # not tried again
    assert not any(e[0] == "capture" and e[1] == 4 for e in graphs.events)


def test_the_loader_holds_the_gate_shut_for_exactly_its_load_thread(make_tiny_model, monkeypatch):
    """On a CPU engine there is no stream pool (and no gate); the loader's protocol is checked
    with a gate handed in as the CUDA engine's pool carries it."""
    model_dir = make_tiny_model("llama")
    llm = _llm(model_dir)
    core, loader = llm.core, llm.core.loader
    gate = CaptureGate()
    monkeypatch.setattr(core.pools, "streams", type("Pool", (), {"gate": gate})())
    seen: list[str | None] = []
    release = threading.Event()
    read = loader._read_weights

    def slow_read(p):  # the gate as the load thread sees it while it reads
        seen.append(gate.shut_for)
        release.wait(10)
        return read(p)

    monkeypatch.setattr(loader, "_read_weights", slow_read)
    pending = core.begin_load(LoadSpec("b", model_dir, max_model_len=64, max_num_seqs=4))
    assert gate.shut_for == "b"  # shut before the thread could launch anything
    release.set()
    pending.future.exception(timeout=30)
    assert gate.open and seen == ["b"]  # open again before its outcome is out
    core.finish_load(pending)

    def failing_read(p):
        raise OSError("disk gone")

    monkeypatch.setattr(loader, "_read_weights", failing_read)
    pending = core.begin_load(LoadSpec("c", model_dir, max_model_len=64, max_num_seqs=4))
    with pytest.raises(OSError):
        core.finish_load(pending)
    assert gate.open  # a failed load thread opens it too
