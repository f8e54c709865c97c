"""The runner's cascade graph variants (engine/runner/cuda_graphs.py, "Cascade variants"), on CPU
with a stand-in graph set that runs each captured forward eagerly: a step with a plan and no
variant of its bucket runs eagerly and asks for one; the variant is captured before the next
step's inputs are staged; later steps replay it; tokens are the torch reference's throughout."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():  # pragma: no cover - tests/gpu/test_cascade_gpu.py replays real graphs
    pytest.skip("CPU stand-in for the graphs", allow_module_level=True)
pytest.importorskip("triton")

from engine.kernels import _dispatch  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.runner.cuda_graphs import DecodeGraphs, MixedGraphs  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tests.graph_stand_in import StandInGraphs  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreted():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _run(model_dir, monkeypatch, mode: str, stand_in: bool):
    monkeypatch.setenv("INFIRE_KERNELS", mode)
    monkeypatch.setattr(_dispatch, "_forced", None)  # read again at the next kernel call
    llm = LLM(model_dir, device="cpu", max_model_len=128, block_size=4, dtype="float32", max_num_seqs=32)
    runner = next(iter(llm.core._slots.values())).runner
    fake = None
    if stand_in:
        runner.decode_buckets = (1, 8, 16, 24, 32)
        fake = runner.graphs = StandInGraphs(runner, DecodeGraphs, runner.decode_buckets)
    shared = [(i * 7) % 50 + 3 for i in range(48)]
    llm.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))  # indexes the shared pages
    prompts = [shared + [60 + i, 61 + i] for i in range(18)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return [o.token_ids for o in outs], fake, runner


def test_a_cascade_variant_is_captured_after_an_eager_step_and_then_replayed(make_tiny_model, monkeypatch):
    model_dir = make_tiny_model("llama")
    want, _, _ = _run(model_dir, monkeypatch, "torch", stand_in=False)
    got, fake, runner = _run(model_dir, monkeypatch, "triton", stand_in=True)
    assert got == want
    assert runner.cascade_rows >= 18 * 4
    ev = fake.events
    captures = [i for i, e in enumerate(ev) if e[0] == "capture"]
    assert [ev[i][1] for i in captures] == [24]  # 18 decode rows: bucket 24, asked for once
    cascade_replays = [i for i, e in enumerate(ev) if e == ("replay", 24, True)]
    assert cascade_replays and min(cascade_replays) > captures[0]  # only after its capture
    assert not fake.cascade_wanted
    # the plain graphs never replayed a step that had a plan (the stand-in asserts the variant)
    assert ("replay", 24, False) not in ev[captures[0]:]


def test_mixed_steps_with_a_plan_run_eagerly_then_replay_their_variant(make_tiny_model, monkeypatch):
    """Prompts arriving while others decode (mixed steps: one-token rows over the shared pages
    beside prefill chunks): the first mixed step of a bucket with a plan runs the forward its
    variant will capture, eagerly (its sequence slots past the step empty, as a replay has them),
    the variant is captured next, and every token is the reference's."""
    model_dir = make_tiny_model("llama")
    shared = [(i * 5) % 40 + 3 for i in range(40)]
    prompts = [shared + [60 + i] * (1 + i % 3) for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    got, events = {}, None
    for mode in ("torch", "triton"):
        monkeypatch.setenv("INFIRE_KERNELS", mode)
        monkeypatch.setattr(_dispatch, "_forced", None)
        llm = LLM(model_dir, device="cpu", max_model_len=128, block_size=4, dtype="float32", max_num_seqs=16,
                  max_num_batched_tokens=24)
        runner = next(iter(llm.core._slots.values())).runner
        if mode == "triton":
            runner.mixed_buckets = (8, 16, 24, 32)
            fake = runner.mixed = StandInGraphs(runner, MixedGraphs, runner.mixed_buckets)
        llm.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))
        got[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        if mode == "triton":
            events = fake.events
    assert got["triton"] == got["torch"]
    captured = [e[1] for e in events if e[0] == "capture"]
    assert captured, events
    first = events.index(("capture", captured[0], True))
    assert ("replay", captured[0], True) in events[first:]
    assert all(e != ("replay", b, True) for b in captured for e in events[:first])


def test_a_cascade_variant_that_failed_to_capture_is_not_asked_for_again():
    """The capture of a variant fails (the step that waited for it fails with it); later steps
    with a plan run eagerly instead of asking again (and failing every other step)."""
    from types import SimpleNamespace

    from engine.runner.cuda_graphs import CudaGraphError

    g = StandInGraphs(SimpleNamespace(bufs=None, model=None, kv=None), DecodeGraphs, (16,))

    def boom(b, cascade=False):
        raise RuntimeError("graph pool exhausted")

    g._capture_one = boom
    assert not g.ready(16, cascade=True) and g.cascade_wanted == {16}
    with pytest.raises(CudaGraphError, match="cascade"):
        g.capture_pending(16)
    assert not g.ready(16, cascade=True) and not g.cascade_wanted
    g.capture_pending(16)  # nothing pending: no capture, no error
    assert g.ready(16)  # its plain graph still replays
