"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers on the same random
weights (CPU, float32): logits at every prefill position and greedy tokens, with the engine's
paged KV, chunked prefill and prefix caching; make-model's presets load in transformers; a
checkpoint that disagrees with its config is refused naming the tensor or field.

The generated weights give near-uniform routing (std 0.02 router), where the top-k pick is
decided by rounding; the "sharp" copies scale the router by 50 (and attention as the dense
oracle does), so each token's experts are clear and a routing bug changes the logits.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import load_model_config
from engine.core.engine_core import EngineCore
from engine.errors import EngineError, ModelConfigError, WeightsError
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.sampling import SamplingParams
from tests.sharp import sharpen

ARCHS = ["qwen3_moe", "mixtral"]
LOGITS_ATOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [400]]


def _sharp_moe(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    sharpen(src, dst, 20.0, 4.0)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        for k in t:
            if k.endswith(".gate.weight"):  # the router
                t[k] = t[k] * 50.0
            elif k.endswith((".w1.weight", ".w2.weight", ".w3.weight")):  # mixtral's experts (not *proj)
                t[k] = t[k] * 4.0
        save_file(t, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def moe_model(make_tiny_model, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = _sharp_moe(make_tiny_model(arch), tmp_path_factory.mktemp("moe") / arch)
        return made[arch]

    return get


def _hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _core(model_dir, **kw) -> EngineCore:
    core = EngineCore(EngineOptions(max_num_batched_tokens=kw.pop("budget", 256), block_size=4,
                                    max_prefill_chunk=kw.pop("chunk", None), seed=0), device="cpu")
    core.load_model(LoadSpec("m", str(model_dir), max_model_len=128, max_num_seqs=8, **kw))
    return core


def _greedy(core: EngineCore, prompts, n: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", "m", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.req_id] += o.new_token_ids
    return out


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt)
    with torch.no_grad():
        first = hf(torch.tensor([ids])).logits[0].float()
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):], first


@pytest.mark.parametrize("arch", ARCHS)
def test_the_config_reads_as_transformers_does(arch, make_tiny_model):
    cfg = load_model_config(make_tiny_model(arch))
    raw = json.loads((make_tiny_model(arch) / "config.json").read_text())
    assert cfg.num_experts == raw.get("num_experts", raw.get("num_local_experts")) == 8
    assert cfg.experts_per_token == raw["num_experts_per_tok"] == 2
    assert cfg.sparse_layers == ((1,) if arch == "qwen3_moe" else (0, 1))  # qwen3_moe's step 2: layer 0 dense
    assert cfg.qk_norm == (arch == "qwen3_moe")


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_and_greedy_tokens_match_transformers(arch, moe_model):
    d = moe_model(arch)
    hf = _hf(d)
    core = _core(d)
    # every prefill position: a prompt alone in a step, the engine's logits of all its rows
    runner = core.slots.get("m").runner
    seen = []
    orig = runner.forward_logits
    runner.forward_logits = lambda step: seen.append(step) or orig(step)
    got = _greedy(core, PROMPTS, 10)
    for i, p in enumerate(PROMPTS):
        want, first = _hf_greedy(hf, p, 10)
        assert got[f"r{i}"] == want, (arch, i)
    assert seen  # the engine ran its own steps (no graphs on CPU)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_prefill_position_matches(arch, moe_model):
    from ops.bench.fp8_accuracy import prefill_logits

    d = moe_model(arch)
    hf = _hf(d)
    logits = prefill_logits(_core(d), "m", PROMPTS[:3])
    start = 0
    for p in PROMPTS[:3]:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
        assert (logits[start:start + len(p)] - want).abs().max().item() <= LOGITS_ATOL
        start += len(p)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_prefix_caching_give_the_same_tokens(arch, moe_model):
    d = moe_model(arch)
    whole = _greedy(_core(d), PROMPTS, 8)
    assert _greedy(_core(d, chunk=4, budget=16), PROMPTS, 8) == whole
    cached = _core(d, prefix_caching=True)
    _greedy(cached, PROMPTS, 8)
    assert _greedy(cached, PROMPTS, 8) == whole  # the second round reads its prefixes from the cache


def test_the_ledger_books_every_expert(moe_model):
    d = moe_model("qwen3_moe")
    core = _core(d)
    params = sum(p.numel() for p in _hf(d).parameters())
    assert core.memory().models["m"].weights == params * 4  # float32, every expert counted once


def test_fp8_and_tensor_parallel_are_refused_with_the_reason(moe_model):
    core = EngineCore(EngineOptions(max_num_batched_tokens=256, seed=0), device="cpu")
    with pytest.raises(EngineError, match="mixture-of-experts"):
        core.load_model(LoadSpec("m", str(moe_model("mixtral")), max_model_len=128, max_num_seqs=8,
                                 quantization="fp8"))
    assert "m" not in core.models()


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def test_a_checkpoint_that_disagrees_with_its_config_is_refused_by_name(make_tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    src = make_tiny_model("mixtral")

    def drop_expert(d: Path) -> None:
        for f in d.glob("*.safetensors"):
            t = load_file(f)
            t.pop("model.layers.1.block_sparse_moe.experts.7.w2.weight", None)
            save_file(t, f, metadata={"format": "pt"})

    def fewer_experts_in_config(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        c["num_local_experts"] = 4  # the checkpoint holds 8
        (d / "config.json").write_text(json.dumps(c))

    def bad_top_k(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        c["num_experts_per_tok"] = 9
        (d / "config.json").write_text(json.dumps(c))

    core = EngineCore(EngineOptions(max_num_batched_tokens=256, seed=0), device="cpu")
    for name, edit, err, words in (("missing", drop_expert, WeightsError, "experts.7.w2"),
                                   ("fewer-in-config", fewer_experts_in_config, WeightsError,
                                    "block_sparse_moe.gate.weight' has shape [8, 64], expected [4, 64]"),
                                   ("topk", bad_top_k, ModelConfigError, "num_experts_per_tok")):
        d = _broken_copy(src, tmp_path / name, edit)
        with pytest.raises(err, match=re.escape(words)):
            core.load_model(LoadSpec(name, str(d), max_model_len=128, max_num_seqs=8))
        assert name not in core.models()
