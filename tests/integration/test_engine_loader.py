"""Loader: safetensors only, sharded or not, every tensor accounted for; the offline LLM API."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import load_model_config
from engine.errors import EngineError, ModelConfigError, WeightsError
from engine.llm import LLM
from engine.weights.loader import load_weights
from engine.models.llama import LlamaModel
from engine.sampling import SamplingParams, SamplingParamsError


@pytest.fixture()
def model_copy(make_tiny_model, tmp_path):
    def copy(arch: str = "llama"):
        dst = tmp_path / arch
        shutil.copytree(make_tiny_model(arch), dst)
        return dst

    return copy


def load(d):
    cfg = load_model_config(d)
    m = LlamaModel(cfg, torch.float32, "cpu")
    load_weights(m, d)
    return m


def tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_fused_weights_are_filled_in_place(model_copy):
    d = model_copy("qwen2")
    m = load(d)
    t = tensors(d)
    cfg = m.cfg
    layer = m.layers[1]
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    a, p = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert torch.equal(layer.qkv_w[:q], t[a + "q_proj.weight"])
    assert torch.equal(layer.qkv_w[q:q + kv], t[a + "k_proj.weight"])
    assert torch.equal(layer.qkv_w[q + kv:], t[a + "v_proj.weight"])
    assert torch.equal(layer.qkv_b[q:q + kv], t[a + "k_proj.bias"])
    assert torch.equal(layer.gate_up_w[:inter], t[p + "gate_proj.weight"])
    assert torch.equal(layer.gate_up_w[inter:], t[p + "up_proj.weight"])


def test_tied_embeddings_share_the_tensor(model_copy):
    m = load(model_copy("qwen3"))
    assert m.cfg.tie_word_embeddings and m.lm_head is m.embed


def test_sharded_checkpoint_loads_the_same(model_copy):
    d = model_copy("llama")
    whole = load(d)
    t = tensors(d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    names = sorted(t)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: t[k] for k in keys}, d / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = load(d)
    for (n1, p1), (n2, p2) in zip(whole.named_parameters(), sharded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_pickle_weights_are_refused(model_copy):
    d = model_copy()
    t = tensors(d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    torch.save(t, d / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pickle"):
        load(d)


@pytest.mark.parametrize("damage,match", [
    ("drop", "missing weights"),
    ("shape", "shape"),
    ("extra", "unexpected tensor"),
    ("dtype", "dtype"),
    ("header", "safetensors|header|short"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor(model_copy, damage, match):
    d = model_copy()
    f = sorted(d.glob("*.safetensors"))[0]
    t = load_file(f)
    name = "model.layers.0.self_attn.k_proj.weight"
    if damage == "drop":
        del t[name]
    elif damage == "shape":
        t[name] = t[name][:-1].clone()
    elif damage == "extra":
        t["model.layers.0.self_attn.rogue.weight"] = torch.zeros(2)
    elif damage == "dtype":
        t[name] = t[name].to(torch.int32)
    if damage == "header":
        f.write_bytes(b"\xff" * 7)
    else:
        save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=match):
        load(d)


def test_remote_code_config_is_refused_at_load(model_copy):
    d = model_copy()
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Model"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="remote code"):
        LLM(d, device="cpu", max_model_len=64, max_num_seqs=2)


def test_transformers5_config_spelling_loads_the_same_model(model_copy):
    d = model_copy("llama")
    hub = load_model_config(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), **cfg.pop("rope_scaling")}
    cfg["dtype"] = cfg.pop("torch_dtype")
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(d) == hub


def test_llm_generate_text_and_ids_in_prompt_order(make_tiny_model):
    d = make_tiny_model("llama")
    llm = LLM(d, device="cpu", max_model_len=64, max_num_seqs=4, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    res = llm.generate(["hello world", [40, 41, 42], "a longer prompt with several words in it"], greedy)
    assert len(res) == 3 and all(len(r.token_ids) == 5 and r.finish_reason == "length" for r in res)
    assert res[1].prompt_token_ids == [40, 41, 42]
    assert res[0].prompt_token_ids == llm.tokenizer.encode("hello world")
    assert res[2].text == llm.tokenizer.decode(res[2].token_ids)
    # Same prompt alone gives the same tokens; a single prompt needs no list around it.
    alone = llm.generate("a longer prompt with several words in it", greedy)
    assert alone[0].token_ids == res[2].token_ids
    assert llm.generate([40, 41, 42], greedy)[0].token_ids == res[1].token_ids
    per_prompt = llm.generate([[40, 41], [42]], [greedy, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)])
    assert [len(r.token_ids) for r in per_prompt] == [5, 2]


def test_llm_rejects_bad_params_before_queueing(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), device="cpu", max_model_len=64, max_num_seqs=2)
    with pytest.raises(SamplingParamsError, match="top_p"):
        llm.generate([[1, 2]], SamplingParams(top_p=2.0))
    with pytest.raises(EngineError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    with pytest.raises(EngineError, match="not an id"):
        llm.generate([[1, 10**7]], SamplingParams(max_tokens=1))
    assert not llm.core.has_unfinished_requests()
    assert llm.core.stats()["default"].kv_pages_used == 0


def test_tied_head_saved_anyway_is_ignored(model_copy):
    d = model_copy("qwen3")
    f = sorted(d.glob("*.safetensors"))[0]
    t = load_file(f)
    t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])
    save_file(t, f, metadata={"format": "pt"})
    m = load(d)
    assert m.lm_head is m.embed and m.embed.abs().sum() > 0


def test_llm_interrupted_generate_leaves_nothing_behind(make_tiny_model):
    llm = LLM(make_tiny_model("llama"), device="cpu", max_model_len=64, max_num_seqs=4, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate([[40, 41, 42], [7, 8]], greedy)
    real_step = llm.core.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    llm.core.step = flaky_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[40, 41, 42], [7, 8]], greedy)
    assert not llm.core.has_unfinished_requests()
    assert llm.core.stats()["default"].kv_pages_used == 0
    llm.core.step = real_step
    again = llm.generate([[40, 41, 42], [7, 8]], greedy)
    assert [r.token_ids for r in again] == [r.token_ids for r in want]
