"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers on the same weights:
every prompt token after the first, across prefill chunks, with prefix caching on (such a
prompt is computed whole), beside requests that ask nothing; and the frame that carries them."""

from __future__ import annotations

import pytest
import torch

from engine.core.engine_core import EngineCore
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from engine.worker import protocol as P
from tests.engine_run import run_outputs
from tests.sharp import sharpen

PROMPT = [5, 9, 2, 7, 11, 3, 9, 9, 40, 41, 42, 7, 7, 300, 12]


@pytest.fixture(scope="module")
def model_dir(make_tiny_model, tmp_path_factory):
    return sharpen(make_tiny_model("llama"), tmp_path_factory.mktemp("plp") / "llama", 20.0, 4.0)


def _core(model_dir, chunk: int | None = 4, prefix: bool = True) -> EngineCore:
    core = EngineCore(EngineOptions(max_num_batched_tokens=64, block_size=4, seed=0, max_prefill_chunk=chunk),
                      device="cpu")
    core.load_model(LoadSpec("m", str(model_dir), max_model_len=128, max_num_seqs=8, prefix_caching=prefix))
    return core


def _hf_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("chunk", [None, 4, 5], ids=["whole", "chunks-of-4", "chunks-of-5"])
def test_every_prompt_token_matches_transformers(model_dir, chunk):
    want = _hf_logprobs(model_dir, PROMPT)
    core = _core(model_dir, chunk)
    outs = run_outputs(core, {"a": (PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)),
                       "b": ([4, 5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))})
    first = outs["a"][0]
    plp = first.prompt_logprobs
    assert len(plp) == len(PROMPT) - 1 and all(o.prompt_logprobs is None for o in outs["a"][1:])
    for pos, e in enumerate(plp, start=1):
        assert e["token_id"] == PROMPT[pos]
        assert abs(e["logprob"] - want[pos - 1, PROMPT[pos]].item()) < 1e-4, pos
        top = torch.topk(want[pos - 1], 2)
        assert [t["token_id"] for t in e["top_logprobs"]] == top.indices.tolist()
        assert all(abs(t["logprob"] - v) < 1e-4 for t, v in zip(e["top_logprobs"], top.values.tolist()))
    assert all(o.prompt_logprobs is None for o in outs["b"])
    assert core.slots.get("m").runner.prompt_logprobs == {}  # handed out: nothing kept


def test_a_cached_prefix_is_computed_again_for_its_logprobs(model_dir):
    core = _core(model_dir, None)
    plain = SamplingParams(temperature=0, max_tokens=1)
    run_outputs(core, {"warm": (PROMPT, plain)})  # its blocks are in the prefix index now
    again = run_outputs(core, {"hit": (PROMPT, plain)})["hit"][0]
    assert again.num_cached_tokens > 0
    asked = run_outputs(core, {"lp": (PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))})["lp"][0]
    assert asked.num_cached_tokens == 0 and len(asked.prompt_logprobs) == len(PROMPT) - 1
    assert all(e is not None and e["top_logprobs"] == [] for e in asked.prompt_logprobs)


def test_an_abort_mid_prefill_leaves_nothing_behind(model_dir):
    core = _core(model_dir, 4)
    core.add_request("a", "m", PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    core.step()  # one chunk computed: its logprobs are held for the first token
    assert core.slots.get("m").runner.prompt_logprobs
    core.abort_request("a")
    assert core.slots.get("m").runner.prompt_logprobs == {}


def test_the_frame_carries_them_and_checks_their_count():
    entry = {"token_id": 3, "logprob": -0.5, "top_logprobs": []}
    msg = P.Tokens(step=1, outputs=[P.pack_output("r", [7], None, None, 3, 0, [entry, entry]),
                                    P.pack_output("s", [8], None, None, 3, 0)])
    back = P.unpack_outputs(P.decode(P.encode(msg)[P.HEADER_BYTES:]))
    assert back[0].prompt_logprobs == [entry, entry] and back[1].prompt_logprobs is None
    bad = P.Tokens(step=1, outputs=[P.pack_output("r", [7], None, None, 3, 0, [entry])])
    with pytest.raises(P.ProtocolError):
        P.unpack_outputs(P.decode(P.encode(bad)[P.HEADER_BYTES:]))
