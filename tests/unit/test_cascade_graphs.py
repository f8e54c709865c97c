"""The runner's cascade graph variants (engine/runner/cuda_graphs.py, "Cascade variants"), on CPU
with a stand-in graph set that runs each captured forward eagerly: the first step with a plan in
a bucket captures the bucket's variant on its staged inputs and replays it, as do the later ones;
tokens are the torch reference's throughout."""

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
    runner = next(iter(llm.core.slots.values())).runner
    fake = None
    if stand_in:
        runner.decode_buckets = (1, 8, 16, 24, 32)
        fake = runner.graphs = StandInGraphs(runner, DecodeGraphs, runner.decode_buckets)
    shared = [(i * 7) % 50 + 3 for i in range(48)]
    llm.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))  # indexes the shared pages
    prompts = [shared + [60 + i, 61 + i] for i in range(18)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return [o.token_ids for o in outs], fake, runner


def test_the_first_step_with_a_plan_captures_its_variant_and_replays_it(make_tiny_model, monkeypatch):
    model_dir = make_tiny_model("llama")
    want, _, _ = _run(model_dir, monkeypatch, "torch", stand_in=False)
    got, fake, runner = _run(model_dir, monkeypatch, "triton", stand_in=True)
    assert got == want
    assert runner.cascade_rows >= 18 * 4
    ev = fake.events
    captures = [i for i, e in enumerate(ev) if e[0] == "capture"]
    assert [ev[i] for i in captures] == [("capture", 24, True)]  # 18 decode rows: bucket 24, once
    assert ev[captures[0] + 1] == ("replay", 24, True)  # the step that captured it replays it
    # the plain graphs never replayed a step that had a plan (the stand-in asserts the variant)
    assert ("replay", 24, False) not in ev[captures[0]:]
    assert fake.staged == [24]  # captured on that step's inputs
    # every step with a plan replayed the variant: none ran eagerly first
    assert runner.cascade_steps == sum(1 for e in ev if e[0] == "replay" and e[2])


def test_mixed_steps_with_a_plan_capture_their_variant_and_replay_it(make_tiny_model, monkeypatch):
    """Prompts arriving while others decode (mixed steps: one-token rows over the shared pages
    beside prefill chunks): the first mixed step of a bucket with a plan captures the variant
    on its staged inputs (its sequence slots past the step empty, as a replay has them) and
    replays it, and every token is the reference's."""
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
        runner = next(iter(llm.core.slots.values())).runner
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
    assert fake.staged == captured  # each on the staged inputs of the step that needed it
    for b in captured:
        first = events.index(("capture", b, True))
        assert events[first + 1] == ("replay", b, True)
        assert ("replay", b, True) not in events[:first]


def test_a_cascade_variant_that_failed_to_capture_runs_its_steps_eagerly_and_is_not_tried_again(caplog):
    """The capture of a variant fails (any error: a compile, the graph pool): the step that
    needed it runs eagerly on its staged inputs (a capture ran nothing on them), and later
    steps with a plan run eagerly too instead of trying again."""
    from types import SimpleNamespace

    g = StandInGraphs(SimpleNamespace(bufs=None, model=None, kv=None), DecodeGraphs, (16,))
    tries = []

    def boom(b, cascade=False, staged=False):
        tries.append((b, cascade, staged))
        raise ValueError("out of resources")

    g._capture_one = boom
    assert not g.ready(16, cascade=True)
    assert tries == [(16, True, True)]  # on the step's staged inputs
    assert "bucket 16 (cascade) failed" in caplog.text
    assert not g.ready(16, cascade=True) and len(tries) == 1
    assert g.ready(16)  # its plain graph still replays
    assert not g.ready(32, cascade=True) and len(tries) == 1  # a bucket without a graph: no variant


def test_the_decode_warm_up_picks_one_bucket_per_decode_form(make_tiny_model, monkeypatch):
    """DecodeGraphs' choice of cascade warm-up buckets on a real runner's KV cache and model: the
    forms follow the split count of each batch (an H200's 132 SMs here), one bucket each."""
    from types import SimpleNamespace

    from engine.kernels import attention_triton

    llm = LLM(make_tiny_model("llama"), device="cpu", max_model_len=2048, block_size=16, dtype="bfloat16",
              max_num_seqs=64)
    runner = next(iter(llm.core.slots.values())).runner
    from engine.runner.step_buffers import StepBuffers

    # buffers with cascade regions (a CPU runner plans none), 16 rows a tile
    bufs = StepBuffers(torch.device("cpu"), max_step_tokens=64, max_seqs=64, max_pages=128, max_model_len=2048,
                       vocab_size=32, cascade_rows=16)
    fake = SimpleNamespace(kv=runner.kv, model=runner.model, bufs=bufs, device=torch.device("cpu"))
    monkeypatch.setattr(attention_triton, "_sm_count", lambda device: 132)
    k = runner.kv.k(0)
    planned = [64, 48, 32, 24, 16]
    got = DecodeGraphs._cascade_warm(fake, planned)
    forms = {}
    for b in planned:
        splits = attention_triton.decode_splits(b, k.shape[2], 2048, 64, 132)
        forms.setdefault(splits == 1 or attention_triton.triton.next_power_of_2(splits), b)
    assert got == sorted(forms.values(), reverse=True) and len(got) >= 2
    assert DecodeGraphs._cascade_warm(fake, []) == []
    assert MixedGraphs._cascade_warm(fake, planned) == [16]  # the mixed forms do not depend on the bucket
