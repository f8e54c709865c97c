"""Long positions against transformers (CPU, float32): Llama 3.1's rope scaling through the whole
engine path a long prompt takes — chunked prefill over the paged cache, 32k positions deep.

The tiny Llama is given Llama 3.1's rope (theta 500000, llama3 scaling: factor 8 from 8,192) and
a 32,768-token context, and made "sharp" (q/k projections x 20) so attention is peaked and a
wrong angle at a far position moves the logits. The prompt runs as 2,048-token chunks, each
reading the chunks before it from pages (what the scheduler does with a long prompt; 4,096
would take 5 GB of float32 scores on the reference path);
transformers runs the same chunks over its own cache. Every position's logits must agree (seen:
the engine with the scaling left out is 1.1 off from the first chunk on).
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.sampling import SamplingParams
from engine.sched.scheduler import ScheduledSeq, SchedulerOutput
from tests.integration.test_engine_oracle import engine
from tests.sharp import sharpen

CTX, CHUNK = 32768, 2048
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def long_llama(make_tiny_model, tmp_path_factory):
    d = sharpen(make_tiny_model("llama"), tmp_path_factory.mktemp("long") / "llama31", 20.0, 4.0)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(max_position_embeddings=CTX, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_logits_32k_positions_deep_match_transformers_with_llama_3_1_rope(long_llama):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vocab = json.loads((long_llama / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(1, vocab, (CTX,)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(long_llama, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    core = engine(long_llama, budget=CHUNK, block_size=16, max_model_len=CTX)
    slot = core.slots.get("m")
    blocks = slot.scheduler.blocks
    blocks.ensure_capacity(0, CTX)
    cache = transformers.DynamicCache()
    with torch.inference_mode():
        for start in range(0, CTX, CHUNK):
            chunk = prompt[start:start + CHUNK]
            out = SchedulerOutput()
            out.seqs.append(ScheduledSeq(0, "r0", chunk, start, blocks.block_table(0), start + CHUNK == CTX, 0,
                                         SamplingParams(temperature=0)))
            step = slot.runner.prepare(out)
            got = slot.model.compute_logits(slot.model(step.input_ids, step.positions, slot.kv, step.meta))
            want = hf(torch.tensor([chunk]), past_key_values=cache, use_cache=True,
                      position_ids=torch.arange(start, start + len(chunk))[None]).logits[0].float()
            err = (got - want).abs().max().item()
            assert err <= 2e-5, f"positions {start}..{start + len(chunk)}: max |engine - transformers| {err:.2e}"
