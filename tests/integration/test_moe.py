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
from tests.engine_run import assert_chunks_and_cache_keep_tokens, cpu_core, greedy, hf_float32
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
    hf = hf_float32(d)
    core = cpu_core(d)
    # every prefill position: a prompt alone in a step, the engine's logits of all its rows
    runner = core.slots.get("m").runner
    seen = []
    orig = runner.forward_logits
    runner.forward_logits = lambda step: seen.append(step) or orig(step)
    got = greedy(core, PROMPTS, 10)
    for i, p in enumerate(PROMPTS):
        want, first = _hf_greedy(hf, p, 10)
        assert got[f"r{i}"] == want, (arch, i)
    assert seen  # the engine ran its own steps (no graphs on CPU)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_prefill_position_matches(arch, moe_model):
    from ops.bench.fp8_accuracy import prefill_logits

    d = moe_model(arch)
    hf = hf_float32(d)
    logits = prefill_logits(cpu_core(d), "m", PROMPTS[:3])
    start = 0
    for p in PROMPTS[:3]:
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].float()
        assert (logits[start:start + len(p)] - want).abs().max().item() <= LOGITS_ATOL
        start += len(p)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_prefix_caching_give_the_same_tokens(arch, moe_model):
    assert_chunks_and_cache_keep_tokens(moe_model(arch), PROMPTS, chunk=4)


def test_the_ledger_books_every_expert(moe_model):
    d = moe_model("qwen3_moe")
    core = cpu_core(d)
    params = sum(p.numel() for p in hf_float32(d).parameters())
    assert core.memory().models["m"].weights == params * 4  # float32, every expert counted once


def _fp8_experts_of(core: EngineCore) -> list:
    return [layer.experts for layer in core.slots.get("m").model.layers if layer.experts is not None]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_experts_are_quantized_at_load_and_track_the_unquantized_model(arch, moe_model, make_tiny_model):
    """quantization = "fp8" on an unquantized checkpoint: every expert's gate-up and down rows
    become e4m3 with a scale per expert and channel, exactly as quantizing each checkpoint
    tensor by itself gives (a row landing in another expert's rows, or a scale in another's,
    shows); the router stays unquantized; the experts compute what their dequantized weights
    compute (the same logits to the bit); the ledger books the smaller bytes; and the model's
    logits follow the unquantized model's (on the plain weights: the sharpened copies amplify
    the dense projections' per-token rounding of the activations to ~0.9 cosine for Mixtral)."""
    from safetensors.torch import load_file

    from engine.kernels.fp8 import quantize_weight
    from ops.bench.fp8_accuracy import prefill_logits

    d = moe_model(arch)
    ref, q = cpu_core(d), cpu_core(d, quantization="fp8")
    experts = _fp8_experts_of(q)
    assert experts and all(e.gate_up_w.dtype == torch.float8_e4m3fn and e.router_w.dtype == torch.float32
                           for e in experts)
    tensors = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        tensors.update(load_file(f))
    layer = next(i for i, x in enumerate(q.slots.get("m").model.layers) if x.experts is not None)
    ex = q.slots.get("m").model.layers[layer].experts
    name = {"mixtral": f"model.layers.{layer}.block_sparse_moe.experts.1.w2.weight",
            "qwen3_moe": f"model.layers.{layer}.mlp.experts.1.down_proj.weight"}[arch]
    codes, scale = quantize_weight(tensors[name])
    assert torch.equal(ex.down_w[1].view(torch.uint8), codes.view(torch.uint8))
    torch.testing.assert_close(ex.down_s[1], scale)
    up = {"mixtral": f"model.layers.{layer}.block_sparse_moe.experts.2.w3.weight",
          "qwen3_moe": f"model.layers.{layer}.mlp.experts.2.up_proj.weight"}[arch]
    codes, scale = quantize_weight(tensors[up])  # the second half of expert 2's gate-up rows
    assert torch.equal(ex.gate_up_w[2, ex.inter:].view(torch.uint8), codes.view(torch.uint8))
    torch.testing.assert_close(ex.gate_up_s[2, ex.inter:], scale)
    assert q.memory().models["m"].weights < ref.memory().models["m"].weights
    fp8 = prefill_logits(q, "m", PROMPTS[:3])
    for e in experts:  # the same values, widened ahead of time
        e.gate_up_w = torch.nn.Parameter(e.gate_up_w.float() * e.gate_up_s[..., None], requires_grad=False)
        e.down_w = torch.nn.Parameter(e.down_w.float() * e.down_s[..., None], requires_grad=False)
        e.gate_up_s = e.down_s = None
    torch.testing.assert_close(prefill_logits(q, "m", PROMPTS[:3]), fp8, atol=1e-5, rtol=1e-5)
    plain = make_tiny_model(arch)
    ref, q = cpu_core(plain), cpu_core(plain, quantization="fp8")
    cos = torch.nn.functional.cosine_similarity(prefill_logits(ref, "m", PROMPTS[:3]),
                                                prefill_logits(q, "m", PROMPTS[:3]), dim=-1)
    assert cos.min().item() >= 0.99, cos
    out = greedy(q, PROMPTS[:3], 6)
    assert all(len(v) == 6 for v in out.values())


@pytest.mark.parametrize("arch,layout", [("mixtral", "channel"), ("qwen3_moe", "block128")])
def test_an_fp8_moe_checkpoint_loads_its_experts_codes_and_scales(arch, layout, moe_model, tmp_path):
    """A folder written as a pre-quantized FP8 checkpoint (``channel``: the derived artifact's
    layout; ``block128``: the hub's Qwen3 FP8 releases): its experts' e4m3 codes and scales land
    in their rows (block scales turned into the engine's channel scales as for dense
    projections), and the model gives the logits of the same model quantized at load."""
    from engine.weights.fp8_writer import quantize_folder
    from ops.bench.fp8_accuracy import prefill_logits

    d = quantize_folder(moe_model(arch), tmp_path / "fp8", layout)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == ("fp8" if layout == "block128" else "compressed-tensors")
    routers = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate"}[arch]
    ignore = cfg["quantization_config"]["ignore"]  # the routers stay unquantized, and say so
    assert ignore[0] == "lm_head" and ignore[1:] and all(n.endswith(routers) for n in ignore[1:])
    ckpt, at_load = cpu_core(d, quantization="fp8"), cpu_core(moe_model(arch), quantization="fp8")
    for e1, e2 in zip(_fp8_experts_of(ckpt), _fp8_experts_of(at_load)):
        if layout == "channel":  # the engine's own scheme: codes and scales copied as written
            assert torch.equal(e1.gate_up_w.view(torch.uint8), e2.gate_up_w.view(torch.uint8))
            torch.testing.assert_close(e1.down_s, e2.down_s)
        else:  # 128 x 128 blocks, then each band re-quantized per row: rounded at the block's scale
            for w1, s1, w2, s2 in ((e1.gate_up_w, e1.gate_up_s, e2.gate_up_w, e2.gate_up_s),
                                   (e1.down_w, e1.down_s, e2.down_w, e2.down_s)):
                a, b = w1.float() * s1[..., None], w2.float() * s2[..., None]
                for x, y in zip(a, b):  # expert by expert
                    assert (x - y).abs().max() <= 0.13 * y.abs().max()  # two roundings of half a step
    a, b = prefill_logits(ckpt, "m", PROMPTS[:2]), prefill_logits(at_load, "m", PROMPTS[:2])
    if layout == "channel":
        torch.testing.assert_close(a, b)
    else:
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item() >= 0.97


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


def test_the_loaders_row_views_follow_a_replaced_stack(make_tiny_model):
    """The loader finds an FP8 stack's scales by the identity of the row view weight_slots gave
    it: both must name the same object, and a stack replaced by new storage gets new views (an
    old one would fill memory the model no longer reads)."""
    from engine.config import load_model_config
    from engine.models.llama import LlamaModel

    cfg = load_model_config(make_tiny_model("qwen3_moe"))
    model = LlamaModel(cfg, torch.float32, "cpu", "fp8")
    slots, scales = model.weight_slots(), model.row_scales()
    ex = next(x.experts for x in model.layers if x.experts is not None)
    expert_dests = {id(d) for n, (d, _, _) in slots.items() if ".experts." in n}
    assert expert_dests and expert_dests <= set(scales)
    ex.gate_up_w = torch.nn.Parameter(torch.empty_like(ex.gate_up_w), requires_grad=False)
    gu, _ = ex.rows()
    assert gu.data_ptr() == ex.gate_up_w.data_ptr() and id(gu) in model.row_scales()
    assert id(gu) in {id(d) for d, _, _ in model.weight_slots().values()}
