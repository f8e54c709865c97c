"""Llama 4's text model against transformers on the same random weights (CPU, float32).

The tiny preset has two layers: layer 0 rotates q and k (interleaved pairs), normalises them and
attends inside chunks of 16 positions with a dense MLP; layer 1 is a NoPE layer (no rope, a query
temperature that steps every 8 positions, attention over everything) whose MLP is one routed
expert (sigmoid score on the way in) beside a shared expert. Prompts of up to 45 tokens cross
chunk boundaries and temperature steps, so a wrong mask, rotation, scale or routing changes the
logits. Both checkpoint forms of the experts (one tensor per projection of every expert, as
transformers saves them; one tensor an expert, as FP8 checkpoints keep them) load the same model;
an image-and-text checkpoint's language model loads with its vision tower passed over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import load_model_config
from engine.errors import WeightsError
from tests.engine_run import assert_chunks_and_cache_keep_tokens, cpu_core, greedy, hf_float32
from tests.sharp import sharpen

LOGITS_ATOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 75)), [400], list(range(100, 133))]


def _sharp(src: Path, dst: Path) -> Path:
    """Peaked attention (q/k × 20, other projections × 4) and a router × 50, so each token's
    expert is clear; the fused experts scaled as the per-expert projections are."""
    from safetensors.torch import load_file, save_file

    sharpen(src, dst, 20.0, 4.0)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        for k in t:
            if k.endswith(".router.weight"):
                t[k] = t[k] * 50.0
            elif k.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                t[k] = t[k] * 4.0
        save_file(t, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def llama4(make_tiny_model, tmp_path_factory) -> Path:
    return _sharp(make_tiny_model("llama4"), tmp_path_factory.mktemp("llama4") / "sharp")





def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _prefill_logits(model_dir, prompts) -> torch.Tensor:
    from ops.bench.fp8_accuracy import prefill_logits

    return prefill_logits(cpu_core(model_dir), "m", prompts)


def _assert_prefill_matches(model_dir, hf, prompts=PROMPTS) -> None:
    logits = _prefill_logits(model_dir, prompts)
    start = 0
    for p in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
        err = (logits[start:start + len(p)] - want).abs().max().item()
        assert err <= LOGITS_ATOL, (len(p), err)
        start += len(p)


def test_the_config_reads_as_transformers_does(make_tiny_model):
    d = make_tiny_model("llama4")
    cfg = load_model_config(d)
    hf_cfg = hf_float32(d).config
    assert cfg.family == "llama4" and cfg.router == "sigmoid" and cfg.experts_per_token == 1
    assert cfg.sparse_layers == tuple(hf_cfg.moe_layers) == (1,)
    assert cfg.nope_layers == tuple(i for i, r in enumerate(hf_cfg.no_rope_layers) if not r) == (1,)
    assert cfg.chunked_layers == tuple(i for i, t in enumerate(hf_cfg.layer_types) if t == "chunked_attention")
    assert cfg.attention_chunk == hf_cfg.attention_chunk_size == 16
    assert cfg.intermediate_size == hf_cfg.intermediate_size_mlp  # the dense layers' MLP
    assert cfg.expert_intermediate_size == cfg.shared_expert_intermediate_size == hf_cfg.intermediate_size
    assert cfg.attn_temperature == (hf_cfg.floor_scale, hf_cfg.attn_scale)
    assert cfg.interleaved_rope and cfg.qk_l2_norm and not cfg.qk_norm


def test_every_prefill_position_matches_transformers(llama4):
    _assert_prefill_matches(llama4, hf_float32(llama4))


def test_greedy_tokens_match_transformers_past_chunk_boundaries(llama4):
    hf = hf_float32(llama4)
    got = greedy(cpu_core(llama4), PROMPTS, 12)
    for i, p in enumerate(PROMPTS):
        assert got[f"r{i}"] == _hf_greedy(hf, p, 12), i


def test_chunked_prefill_and_prefix_caching_give_the_same_tokens(llama4):
    assert_chunks_and_cache_keep_tokens(llama4, PROMPTS, chunk=5)


def test_the_ledger_books_every_weight(llama4):
    params = sum(p.numel() for p in hf_float32(llama4).parameters())
    assert cpu_core(llama4).memory().models["m"].weights == params * 4  # float32, each expert once


def _per_expert(src: Path, dst: Path) -> Path:
    """``src`` with its fused experts written one tensor an expert (the FP8 hub layout's names)."""
    from safetensors.torch import load_file, save_file

    from engine.weights.fp8_writer import unfused

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        save_file({n: v.contiguous() for k, x in t.items() for n, v in unfused(k, x)}, f, metadata={"format": "pt"})
    return dst


def test_fused_and_per_expert_checkpoints_load_the_same_model(llama4, tmp_path):
    split = _per_expert(llama4, tmp_path / "split")
    names = json.dumps(sorted(_tensor_names(split)))
    assert "experts.0.gate_proj.weight" in names and "gate_up_proj" not in names
    torch.testing.assert_close(_prefill_logits(split, PROMPTS[:3]), _prefill_logits(llama4, PROMPTS[:3]),
                               atol=0, rtol=0)


def _tensor_names(d: Path) -> list[str]:
    from safetensors import safe_open

    out = []
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out += list(h.keys())
    return out


def test_a_checkpoint_with_both_forms_of_one_layers_experts_is_refused(llama4, tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.weights.fp8_writer import unfused

    d = shutil.copytree(llama4, tmp_path / "both")
    f = next(d.glob("*.safetensors"))
    t = load_file(f)
    fused = next(k for k in t if k.endswith("experts.down_proj"))
    t.update({n: v.contiguous() for n, v in unfused(fused, t[fused])[:1]})
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="appears twice"):
        cpu_core(d)


def test_a_fused_experts_tensor_of_the_wrong_shape_is_refused_naming_it(llama4, tmp_path):
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(llama4, tmp_path / "bad")
    f = next(d.glob("*.safetensors"))
    t = load_file(f)
    fused = next(k for k in t if k.endswith("experts.gate_up_proj"))
    t[fused] = t[fused].transpose(1, 2).contiguous()  # the engine's orientation, not the checkpoint's
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match="gate_up_proj.*shape"):
        cpu_core(d)


def test_the_language_model_of_an_image_and_text_checkpoint_loads_without_its_vision_tower(llama4, tmp_path):
    """Llama 4's released checkpoints are image-and-text: the text model's config under
    ``text_config``, its tensors under ``language_model.``, a vision tower beside them."""
    d = _wrap(llama4, tmp_path / "wrapped")
    cfg = load_model_config(d)
    assert cfg.checkpoint_prefix == "language_model." and cfg.num_layers == 2
    torch.testing.assert_close(_prefill_logits(d, PROMPTS[:2]), _prefill_logits(llama4, PROMPTS[:2]), atol=0, rtol=0)


def test_fp8_quantized_at_load_tracks_the_unquantized_model(make_tiny_model):
    """quantization = "fp8": the dense projections and the shared expert quantized per channel,
    the routed experts' rows quantized as they land from the fused tensors (transposed first)."""
    from engine.kernels.fp8 import quantize_weight

    d = make_tiny_model("llama4")
    ref, q = cpu_core(d), cpu_core(d, quantization="fp8")
    layer = q.slots.get("m").model.layers[1]
    assert layer.experts.gate_up_w.dtype == torch.float8_e4m3fn and layer.gate_up_w.dtype == torch.float8_e4m3fn
    from safetensors.torch import load_file

    t = {k: v for f in d.glob("*.safetensors") for k, v in load_file(f).items()}
    gate_up = t["model.layers.1.feed_forward.experts.gate_up_proj"][3].t().contiguous()  # expert 3, [2I, H]
    codes, scales = quantize_weight(gate_up.float())
    assert torch.equal(layer.experts.gate_up_w[3].view(torch.uint8), codes.view(torch.uint8))
    torch.testing.assert_close(layer.experts.gate_up_s[3], scales)
    from ops.bench.fp8_accuracy import prefill_logits

    a, b = prefill_logits(ref, "m", PROMPTS[:3]), prefill_logits(q, "m", PROMPTS[:3])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cos.min().item() >= 0.99, cos.min().item()


def test_the_fp8_writer_keeps_one_tensor_an_expert_and_it_loads_as_quantized_at_load(make_tiny_model, tmp_path):
    from engine.weights.fp8_writer import quantize_folder
    from ops.bench.fp8_accuracy import prefill_logits

    d = make_tiny_model("llama4")
    out = quantize_folder(d, tmp_path / "fp8", "channel")
    names = _tensor_names(out)
    assert "model.layers.1.feed_forward.experts.7.down_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    assert "model.layers.1.feed_forward.router" in json.loads((out / "config.json").read_text())[
        "quantization_config"]["ignore"]
    torch.testing.assert_close(prefill_logits(cpu_core(out, quantization="fp8"), "m", PROMPTS[:3]),
                               prefill_logits(cpu_core(d, quantization="fp8"), "m", PROMPTS[:3]), atol=1e-5, rtol=1e-5)


def _wrap(src: Path, dst: Path, tie: bool = False) -> Path:
    """``src`` as the language model of an image-and-text checkpoint (with a vision tower's and a
    projector's tensors beside it); ``tie``: its head tied to the embedding and saved anyway."""
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(src, dst)
    text = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {k: v for k, v in text.items() if k != "architectures"} | {"model_type": "llama4_text",
                                                                                  "tie_word_embeddings": tie},
        "vision_config": {"hidden_size": 8}, "torch_dtype": text["torch_dtype"]}))
    for f in d.glob("*.safetensors"):
        t = {"language_model." + k: v for k, v in load_file(f).items()}
        if tie and "language_model.lm_head.weight" in t:
            t["language_model.lm_head.weight"] = t["language_model.model.embed_tokens.weight"].clone()
        t["vision_model.model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 8)
        t["multi_modal_projector.linear_1.weight"] = torch.zeros(8, 8)
        save_file(t, f, metadata={"format": "pt"})
    index = d / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return d


def test_a_tied_image_and_text_checkpoint_may_carry_its_head_anyway(llama4, tmp_path):
    d = _wrap(llama4, tmp_path / "tied", tie=True)
    core = cpu_core(d)
    model = core.slots.get("m").model
    assert model.lm_head is model.embed


def test_the_fp8_writer_on_an_image_and_text_checkpoint_lists_what_it_left_unquantized(llama4, tmp_path):
    from engine.weights.fp8_writer import quantize_folder

    out = quantize_folder(_wrap(llama4, tmp_path / "wrapped"), tmp_path / "fp8", "channel")
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "language_model.lm_head" in ignore and "language_model.model.layers.1.feed_forward.router" in ignore
    assert "re:vision_model\\..*" in ignore and "re:multi_modal_projector\\..*" in ignore
    from safetensors import safe_open

    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            assert h.get_tensor("vision_model.model.layers.0.self_attn.q_proj.weight").dtype == torch.float32
    torch.testing.assert_close(_prefill_logits(out, PROMPTS[:2]).float(), _prefill_logits(llama4, PROMPTS[:2]),
                               atol=0.5, rtol=0)  # loads (weights-only FP8 of float32 weights: close, not equal)
