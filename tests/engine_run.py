"""Driving an EngineCore to the end in tests: every request's outputs, in order."""

from __future__ import annotations

from typing import Any


def run_outputs(core: Any, reqs: dict) -> dict[str, list]:
    """Add ``reqs`` ({req_id: (prompt ids, SamplingParams)}) to model ``"m"`` and step until
    none is left; {req_id: its RequestOutputs}."""
    for rid, (prompt, p) in reqs.items():
        core.add_request(rid, "m", prompt, p)
    got: dict[str, list] = {r: [] for r in reqs}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.req_id].append(o)
    return got


def greedy(core: Any, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    """``n`` greedy tokens of each prompt on model ``"m"``: {``r{i}``: token ids}."""
    from engine.sampling import SamplingParams

    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)}
    return {r: [t for o in outs for t in o.new_token_ids] for r, outs in run_outputs(core, reqs).items()}


def cpu_core(model_dir: Any, **kw: Any) -> Any:
    """An EngineCore on the CPU serving ``model_dir`` as ``"m"`` (block size 4, max_model_len 128,
    8 sequences): ``budget`` (step tokens, 256) and ``chunk`` (prefill chunk) for the options, the
    rest for the LoadSpec (quantization, prefix caching)."""
    from engine.core.engine_core import EngineCore
    from engine.load_spec import LoadSpec
    from engine.options import EngineOptions

    core = EngineCore(EngineOptions(max_num_batched_tokens=kw.pop("budget", 256), block_size=4,
                                    max_prefill_chunk=kw.pop("chunk", None), seed=0), device="cpu")
    core.load_model(LoadSpec("m", str(model_dir), max_model_len=128, max_num_seqs=8, **kw))
    return core


def hf_float32(model_dir: Any) -> Any:
    """The transformers model of ``model_dir`` in float32 (the oracle), or the test is skipped."""
    import pytest
    import torch

    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def assert_chunks_and_cache_keep_tokens(model_dir: Any, prompts: list[list[int]], chunk: int) -> None:
    """Greedy tokens of ``prompts`` are the same whole, in prefill chunks of ``chunk`` under a
    16-token step budget, and with prefix caching on a second round that reads its prefixes
    from the cache."""
    whole = greedy(cpu_core(model_dir), prompts, 8)
    assert greedy(cpu_core(model_dir, chunk=chunk, budget=16), prompts, 8) == whole
    cached = cpu_core(model_dir, prefix_caching=True)
    greedy(cached, prompts, 8)
    assert greedy(cached, prompts, 8) == whole  # the second round reads its prefixes from the cache
