"""make-model: folders transformers loads and runs, exact shapes, sharding, determinism."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent.cli import main as cli_main
from modelgen import make as modelgen
from modelgen.make import ARCHS, ModelGenError, make_model, model_config, tensor_specs
from modelgen.safetensors_writer import plan_shards
from modelgen.tokenizer import build_tokenizer, special_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "llama4": "Llama4ForCausalLM",
}
MOE = ("qwen3_moe", "mixtral")


def _load(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_runs(make_tiny_model, arch, preset):
    path = make_tiny_model(arch, preset)
    model, info = _load(path)
    # Every weight on disk is used and none is left to random init by transformers.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert type(model).__name__ == _HF_CLASSES[arch]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|eot_id|>"

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Où est la gare? 日本 😀"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (1, ids.shape[1] + 4)
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_specific_fields(make_tiny_model, arch):
    path = make_tiny_model(arch)
    cfg = json.loads((path / "config.json").read_text())
    model, _ = _load(path)
    sd = model.state_dict()
    layer = "model.layers.0.self_attn."
    assert (layer + "q_proj.bias" in sd) == (arch == "qwen2")
    assert (layer + "q_norm.weight" in sd) == (arch in ("qwen3", "qwen3_moe"))
    if arch in MOE:  # transformers keeps the experts stacked; the checkpoint names them one by one
        n = cfg.get("num_experts", cfg.get("num_local_experts"))
        assert n == 8 and cfg["num_experts_per_tok"] == 2
        block = "mlp" if arch == "qwen3_moe" else "mlp"
        assert sd[f"model.layers.1.{block}.experts.gate_up_proj"].shape[0] == n
    if arch == "llama":
        assert cfg["rope_scaling"]["rope_type"] == "llama3"
        assert cfg["rope_theta"] == 500000.0
    if arch == "mistral":
        assert "sliding_window" in cfg and cfg["sliding_window"] is None
    if arch == "qwen3":
        # head_dim set apart from hidden/heads, and lm_head tied to the embedding.
        assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
        assert cfg["tie_word_embeddings"] is True
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert cfg["tie_word_embeddings"] is False
    # Weights are N(0, 0.02), norms exactly one.
    emb = sd["model.embed_tokens.weight"]
    assert 0.018 < emb.std().item() < 0.022 and abs(emb.mean().item()) < 0.002
    assert torch.equal(sd["model.norm.weight"], torch.ones_like(sd["model.norm.weight"]))


@pytest.mark.parametrize("preset", ["tiny", "small", "llama-3.1-8b", "qwen3-30b-a3b", "mixtral-8x7b", "llama4-scout"])
@pytest.mark.parametrize("arch", ARCHS)
def test_specs_match_transformers_module(arch, preset):
    """Names and shapes equal those of the transformers model built from our config (its experts
    stacked as transformers keeps them: the checkpoint's one tensor per expert, gate and up
    concatenated)."""
    tok = build_tokenizer()
    vocab = 128256 if preset == "llama-3.1-8b" else 512
    vocab = {"qwen3-30b-a3b": 151936, "mixtral-8x7b": 32000, "llama4-scout": 202048}.get(preset, vocab)
    own = {"llama-3.1-8b": ("llama", "qwen2", "qwen3", "mistral"), "qwen3-30b-a3b": ("qwen3_moe",),
           "mixtral-8x7b": ("mixtral",), "llama4-scout": ("llama4",)}
    if preset in own and arch not in own[preset]:
        with pytest.raises(ModelGenError, match="preset"):
            model_config(arch, preset, vocab, special_ids(tok))
        return
    cfg = model_config(arch, preset, vocab, special_ids(tok))
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    got = {s.name: s.shape for s in tensor_specs(arch, preset, vocab)}
    if arch in MOE:
        got = _stacked(got)
    assert got == expected


def _stacked(specs: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per-expert checkpoint names → transformers' stacked experts (mixtral's block_sparse_moe
    is its mlp there; w1/w3 gate/up, w2 down)."""
    out: dict[str, tuple[int, ...]] = {}
    experts: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in specs.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.(gate\.weight|experts\.(\d+)\.(\w+)\.weight)", name)
        if m is None:
            out[name] = shape
        elif m.group(3) is None:
            out[m.group(1) + "mlp.gate.weight"] = shape
        else:
            experts.setdefault(m.group(1), []).append((m.group(4), shape))
    for prefix, parts in experts.items():
        n = len(parts) // 3
        inter, hidden = next(s for k, s in parts if k in ("gate_proj", "w1"))
        out[prefix + "mlp.experts.gate_up_proj"] = (n, 2 * inter, hidden)
        out[prefix + "mlp.experts.down_proj"] = (n, hidden, inter)
    return out


def test_llama_8b_shape_and_shards():
    cfg = model_config("llama", "llama-3.1-8b", 128256, special_ids(build_tokenizer()))
    assert cfg["torch_dtype"] == "bfloat16"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (
        32, 4096, 32)
    assert (cfg["num_key_value_heads"], cfg["intermediate_size"]) == (8, 14336)
    assert cfg["max_position_embeddings"] == 131072
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 8192
    assert cfg["rope_scaling"]["factor"] == 8.0
    specs = tensor_specs("llama", "llama-3.1-8b", 128256)
    params = sum(s.nbytes for s in specs) // 2
    assert params == 8_030_261_248  # Llama-3.1-8B's parameter count
    shards = plan_shards(specs, 5 * 10**9)
    assert len(shards) == 4
    assert all(sum(s.nbytes for s in shard) <= 5 * 10**9 for shard in shards)


def test_sharded_folder_has_index_and_loads_identically(tmp_path, make_tiny_model):
    whole = make_tiny_model("qwen2")
    sharded = make_model(tmp_path / "sharded", "qwen2", "tiny", seed=0, device="cpu",
                         max_shard_bytes=200_000)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    sizes = sum(p.stat().st_size for p in sharded.glob("*.safetensors"))
    assert index["metadata"]["total_size"] < sizes  # headers are not counted
    from safetensors import safe_open

    total = 0
    for name, file in index["weight_map"].items():
        with safe_open(sharded / file, framework="pt") as f:
            total += f.get_tensor(name).numel() * 4
    assert total == index["metadata"]["total_size"]
    ids = torch.tensor([[506, 72, 406, 108, 111]])
    a, _ = _load(whole)
    b, info = _load(sharded)
    assert not info["missing_keys"]
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_seed_determinism(tmp_path, make_tiny_model):
    first = make_tiny_model("llama")
    again = make_model(tmp_path / "again", "llama", "tiny", seed=0, device="cpu")
    other = make_model(tmp_path / "other", "llama", "tiny", seed=1, device="cpu")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_chunked_generation_is_exact(tmp_path, monkeypatch):
    """Small chunks (many rows per tensor split) still give a valid file of right size."""
    monkeypatch.setattr(modelgen, "_CHUNK_ELEMS", 1000)
    path = make_model(tmp_path / "m", "mistral", "tiny", device="cpu")
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    specs = {s.name: s.shape for s in tensor_specs("mistral", "tiny", 512)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == specs


def test_cli_writes_folder(tmp_path, capsys):
    out = tmp_path / "cli-model"
    rc = cli_main(["make-model", "--arch", "qwen3", "--preset", "tiny", "--out", str(out),
                   "--seed", "3", "--device", "cpu", "--max-shard-size", "0.3MB"])
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.safetensors.index.json").exists()
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()


def test_cli_refuses_non_empty_output(tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc = cli_main(["make-model", "--arch", "llama", "--preset", "tiny", "--out", str(out)])
    assert rc == 2
    assert "not an empty folder: pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--arch", "gpt2", "--preset", "tiny"],
        ["--arch", "llama", "--preset", "huge"],
        ["--arch", "llama", "--preset", "tiny", "--seed", "-1"],
        ["--arch", "llama", "--preset", "tiny", "--seed", "x"],
        ["--arch", "llama", "--preset", "tiny", "--max-shard-size", "5XB"],
        ["--arch", "llama", "--preset", "tiny", "--max-shard-size", "0"],
    ],
)
def test_cli_rejects_bad_arguments(tmp_path, argv):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        cli_main(["make-model", *argv, "--out", str(out)])
    assert exc.value.code == 2
    assert not out.exists()


def test_cli_choices_match_library():
    from agent.commands import make_model as cmd

    assert cmd.ARCHS == modelgen.ARCHS and cmd.PRESETS == modelgen.PRESETS


def test_library_rejects_bad_arguments(tmp_path):
    with pytest.raises(ModelGenError, match="unknown arch"):
        make_model(tmp_path / "a", "gpt2", "tiny")
    with pytest.raises(ModelGenError, match="unknown preset"):
        make_model(tmp_path / "a", "llama", "medium")
    with pytest.raises(ModelGenError, match="seed"):
        make_model(tmp_path / "a", "llama", "tiny", seed=-3)
    with pytest.raises(ModelGenError, match="device"):
        make_model(tmp_path / "a", "llama", "tiny", device="tpu")
    assert list(tmp_path.iterdir()) == []


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(modelgen, "write_shard", boom)
    with pytest.raises(OSError, match="disk full"):
        make_model(tmp_path / "m", "llama", "tiny", device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_bf16_model_with_vocab_past_the_tokenizer(tmp_path, monkeypatch):
    """The 8B preset's traits (bf16, 128256-row vocab over a 512-token tokenizer) at a
    size a test can write: transformers loads it and our tokenizer decodes any id."""
    from text.tokenizer import REPLACEMENT, Tokenizer

    small_8b = modelgen.Shape(64, 1, 4, 2, 128, 2048, 4096, "bfloat16", 16)
    monkeypatch.setattr(modelgen, "_PRESETS", {**modelgen._PRESETS, "llama-3.1-8b": small_8b})
    path = make_model(tmp_path / "m", "llama", "llama-3.1-8b", device="cpu")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == 4096 and cfg["torch_dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[cfg["bos_token_id"], 4000]])).logits
    assert logits.shape == (1, 2, 4096)
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == 512
    assert tok.decode([4000, 4095]) == REPLACEMENT * 2


def test_tokenizer_is_independent_of_hash_seed():
    import subprocess
    import sys

    code = ("import hashlib; from modelgen.tokenizer import build_tokenizer; "
            "print(hashlib.sha256(build_tokenizer().to_str().encode()).hexdigest())")
    digests = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1


def test_learn_merges_stops_when_nothing_repeats():
    from modelgen.tokenizer import TokenizerBuildError, learn_merges

    # "abab" and "Ġabab" once each: (Ġ, abab) occurs once, so merging stops there.
    assert learn_merges("abab abab", 100) == [("a", "b"), ("ab", "ab")]
    assert learn_merges("xyz", 10) == []
    with pytest.raises(TokenizerBuildError):
        learn_merges("abc", -1)
    with pytest.raises(TokenizerBuildError):
        build_tokenizer(vocab_size=100)
