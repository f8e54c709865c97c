"""Mixed-step graph inputs (engine/runner/cuda_graphs.py), checked on CPU without a graph: every
step is padded to a token bucket and run through the exact forward a captured graph replays
(full-size sequence buffers, padding tokens that belong to no sequence, the prefill kernel for
every row), and must give the tokens of the unpadded engine — with the torch references and with
the Triton kernels under the interpreter."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():  # pragma: no cover - tests/gpu covers the captured graphs
    pytest.skip("CPU emulation of the graphs; tests/gpu replays real ones", allow_module_level=True)

from engine.kernels import _dispatch  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.runner.cuda_graphs import DEFAULT_MIXED_BUCKETS, MixedGraphs  # noqa: E402
from engine.runner import model_runner  # noqa: E402
from engine.runner.model_runner import graph_buckets  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tests.graph_stand_in import StandInGraphs  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 2, 7, 3, 8, 21, 4, 6, 11, 19, 20, 22, 23, 24, 30], [3, 4, 5], [7] * 40, [9, 2]]
PARAMS = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)]


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreted():
    """The Triton kernels run interpreted while this module's tests run (Triton reads the switch
    when a kernel module is first imported, at a test's first Triton call); restored after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _generate(model_dir, padded: bool, missing: int | None = None):
    """Tokens of PROMPTS; ``padded``: through stood-in mixed graphs (``missing``: a bucket left
    without its graph, as a failed capture leaves it)."""
    llm = LLM(model_dir, device="cpu", max_model_len=128, block_size=4, max_prefill_chunk=16, dtype="float32",
              max_num_seqs=4)
    runner = next(iter(llm.core.slots.values())).runner
    fake = None
    if padded:
        runner.mixed_buckets = (8, 16, 24, 32, 64)
        fake = runner.mixed = StandInGraphs(runner, MixedGraphs, runner.mixed_buckets)
        fake.graphs.pop(missing, None)
    outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return outs, fake


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_every_step_padded_to_a_token_bucket_gives_the_same_tokens(make_tiny_model, monkeypatch, kernels):
    pytest.importorskip("triton") if kernels == "triton" else None
    monkeypatch.setenv("INFIRE_KERNELS", kernels)
    monkeypatch.setattr(_dispatch, "_forced", None)  # read again at the next kernel call
    model_dir = make_tiny_model("llama")
    plain, _ = _generate(model_dir, padded=False)
    padded, fake = _generate(model_dir, padded=True)
    assert [len(t) for t in plain] == [p.max_tokens for p in PARAMS]
    assert padded == plain
    # prefill chunks, mixed steps and decode steps all went through the padded forward, and
    # some of them carried padding tokens that belong to no sequence
    assert len(fake.replayed) >= 12 and {8, 24} <= set(fake.replayed)


def test_a_bucket_left_without_its_graph_runs_its_steps_eagerly(make_tiny_model, monkeypatch):
    """A capture that failed (the worker reports it and goes on) leaves its bucket without a
    graph: that bucket's steps run the padded forward eagerly, the others still replay."""
    model_dir = make_tiny_model("llama")
    plain, _ = _generate(model_dir, padded=False)
    forward, buckets = MixedGraphs._forward, []

    def counted(bufs, model, kv, bucket, cascade=False):
        buckets.append(bucket)
        return forward(bufs, model, kv, bucket, cascade)

    monkeypatch.setattr(MixedGraphs, "_forward", staticmethod(counted))
    padded, fake = _generate(model_dir, padded=True, missing=8)
    assert padded == plain
    assert 8 in buckets and 8 not in fake.replayed and 24 in fake.replayed


def test_prepare_pads_tokens_and_fills_every_sequence_slot(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), device="cpu", max_model_len=64, block_size=4, dtype="float32",
              max_num_seqs=4)
    core = llm.core
    slot = next(iter(core.slots.values()))
    core.add_request("a", slot.name, [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    out = slot.scheduler.schedule()
    step = slot.runner.prepare(out, pad_tokens=8)
    assert step.input_ids.tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert step.meta.slot_mapping.tolist()[5:] == [-1, -1, -1]
    assert step.meta.query_start_loc.tolist() == [0, 5, 5, 5, 5]  # max_num_seqs + 1 entries
    assert step.meta.seq_lens.tolist() == [5, 0, 0, 0]
    assert step.meta.block_tables.shape == (1, slot.runner.max_pages)
    # the graph's LM head takes min(bucket, max_num_seqs) rows: the sampled one first, then row 0
    assert step.meta.max_query_len >= 2 and step.logits_rows.tolist() == [4, 0, 0, 0]
    with pytest.raises(ValueError):
        slot.runner.prepare(out, pad_tokens=4)  # fewer than the step's tokens



class _RecordedGraphs:
    """Stands in for a graph set: records the buckets the runner asks it to capture."""

    captures: list[tuple[str, tuple[int, ...]]] = []

    def __init__(self, *args, **kwargs) -> None:
        self.pool, self.deferred, self.graphs = None, set(), {}

    def capture(self, buckets, defer=()) -> None:
        self.captures.append((type(self).__name__, tuple(buckets)))


class _Decode(_RecordedGraphs):
    pass


class _Mixed(_RecordedGraphs):
    pass


@pytest.mark.parametrize("on", [True, False])
def test_cuda_graphs_off_captures_neither_decode_nor_mixed_graphs(make_tiny_model, monkeypatch, on):
    """A runner built with ``cuda_graphs=False`` plans no graph of either kind (where graphs
    exist, on CUDA: stood in for here), while it still pads decode steps to its buckets."""
    cuda = torch.device("cuda")
    assert graph_buckets(cuda, False, (1, 2, 4), (16, 32)) == ((), ())
    assert graph_buckets(torch.device("cpu"), True, (1, 2, 4), (16, 32)) == ((), ())
    llm = LLM(make_tiny_model("llama"), device="cpu", max_model_len=64, block_size=4, dtype="float32",
              max_num_seqs=4)
    base = next(iter(llm.core.slots.values())).runner
    monkeypatch.setattr(model_runner, "graph_buckets", lambda dev, *a: graph_buckets(cuda, *a))
    monkeypatch.setattr(model_runner, "DecodeGraphs", _Decode)
    monkeypatch.setattr(model_runner, "MixedGraphs", _Mixed)
    monkeypatch.setattr(_RecordedGraphs, "captures", [])
    runner = model_runner.ModelRunner(base.model, base.kv, base.max_step_tokens, base.max_seqs, base.max_model_len,
                                      decode_buckets=(1, 2, 4), cuda_graphs=on)
    mixed = tuple(b for b in DEFAULT_MIXED_BUCKETS if b <= base.max_step_tokens)
    assert runner.decode_buckets == (1, 2, 4) and runner.mixed_buckets == mixed and mixed
    if on:
        assert _RecordedGraphs.captures == [("_Decode", (1, 2, 4)), ("_Mixed", mixed)]
        assert isinstance(runner.graphs, _Decode) and isinstance(runner.mixed, _Mixed)
    else:
        assert _RecordedGraphs.captures == []
        assert runner.graphs is None and runner.mixed is None and runner.graph_tokens == 0
