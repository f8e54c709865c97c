"""The whole engine on CPU with the Triton kernels (TRITON_INTERPRET=1) against the torch
references: same tokens for greedy and seeded sampling, across chunked prefill and page
boundaries. Proves the engine's real call patterns (strided q/k views of the fused qkv, metadata
dtypes, mixed prefill + decode steps) are what the kernels handle."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():  # pragma: no cover - covered by tests/gpu on a GPU machine
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")

from engine.kernels import _dispatch  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreted():
    """The Triton kernels run interpreted while this module's tests run (Triton reads the switch
    when a kernel module is first imported, at a test's first Triton call); restored after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def test_engine_tokens_identical_with_triton_kernels(make_tiny_model, monkeypatch):
    model_dir = make_tiny_model("llama")
    prompts = [[1, 5, 9, 13, 2, 7, 3, 8, 21, 4, 6, 11, 19, 20, 22, 23, 24, 30], [3, 4, 5], [7] * 40]
    params = [SamplingParams(temperature=0, max_tokens=10),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5, max_tokens=10),
              SamplingParams(temperature=1.0, min_p=0.05, seed=9, max_tokens=10)]
    got = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("INFIRE_KERNELS", mode)
        monkeypatch.setattr(_dispatch, "_forced", None)  # read again at the next kernel call
        llm = LLM(model_dir, device="cpu", max_model_len=128, block_size=16, max_prefill_chunk=16, dtype="float32")
        got[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(len(t) == 10 for t in got["torch"])
    assert got["triton"] == got["torch"]


def test_cascade_attention_keeps_every_token(make_tiny_model, monkeypatch):
    """18 requests forking from one 48-token prompt, served from the prefix cache: with the
    Triton kernels the decode steps plan cascade tiles (the shared pages read once a tile,
    engine/runner/cascade.py), and every token — greedy and seeded — is the reference's."""
    model_dir = make_tiny_model("llama")
    shared = [(i * 7) % 50 + 3 for i in range(48)]
    prompts = [shared + [60 + i, 61 + i] for i in range(18)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=6, ignore_eos=True) for i in range(18)]
    got, planned = {}, {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("INFIRE_KERNELS", mode)
        monkeypatch.setattr(_dispatch, "_forced", None)  # read again at the next kernel call
        llm = LLM(model_dir, device="cpu", max_model_len=128, block_size=4, dtype="float32", max_num_seqs=32)
        llm.generate([shared + [1]], SamplingParams(temperature=0, max_tokens=1))  # indexes the shared pages
        got[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        planned[mode] = next(iter(llm.core.slots.values())).runner.cascade_rows
        stats = next(iter(llm.core.stats().values()))  # what status and Prometheus report
        assert stats.cascade == (mode == "triton") and stats.cascade_rows == planned[mode]
    assert planned["torch"] == 0  # the reference reads every row's context: no plan is made
    assert planned["triton"] >= 18 * 5  # every decode step of the 18 rows
    assert got["triton"] == got["torch"]
