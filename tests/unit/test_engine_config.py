"""Model config parsing: hub and transformers-5 spellings, families, and refusals."""

from __future__ import annotations

import json

import pytest

from engine.config import ATTENTION_FLOP_TIME, attention_pair_cost, load_model_config, parse_config
from engine.errors import ModelConfigError

LLAMA31_HUB = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def tf5(cfg: dict) -> dict:
    """The same config as transformers 5 writes it."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    params = {"rope_theta": cfg["rope_theta"], **(cfg.get("rope_scaling") or {"rope_type": "default"})}
    out.update(rope_parameters=params, dtype=cfg["torch_dtype"])
    return out


def test_llama31_hub_and_tf5_spellings_agree():
    a = parse_config(LLAMA31_HUB)
    b = parse_config(tf5(LLAMA31_HUB))
    assert a == b
    assert a.family == "llama" and a.head_dim == 128 and a.rope_theta == 500000.0
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_scaling["factor"] == 8.0
    assert "rope_theta" not in a.rope_scaling
    assert a.eos_token_ids == (128001, 128008, 128009) and a.bos_token_id == 128000
    assert a.dtype == "bfloat16" and not a.qkv_bias and not a.qk_norm and not a.tie_word_embeddings
    assert a.q_size == 4096 and a.kv_size == 1024


def test_attention_pair_cost_is_attention_time_over_the_matmuls_a_token_takes():
    """Llama-3.1-8B: 4 * 32 * 32 * 128 FLOPs a (query, key) pair over 2 * 6.98e9 weights of
    projections and MLP a token, each attention FLOP 1.7 matmul FLOPs' time: a token ~15.6k
    positions deep takes as long in attention as in its matmuls. A mixture of experts counts the
    experts a token takes, not all of them."""
    a = attention_pair_cost(parse_config(LLAMA31_HUB))
    flops = 4 * 32 * 32 * 128 / (2 * 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336))
    assert a == pytest.approx(ATTENTION_FLOP_TIME * flops) and ATTENTION_FLOP_TIME == 1.7
    assert 15_000 < 1 / a < 16_000
    moe = parse_config({**LLAMA31_HUB, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                        "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 1024,
                        "head_dim": 128, "decoder_sparse_step": 1, "mlp_only_layers": []})
    per_layer = 4096 * 6144 + 4096 * 4096 + 8 * 3 * 4096 * 1024 + 4096 * 64
    assert attention_pair_cost(moe) == pytest.approx(ATTENTION_FLOP_TIME * 4 * 32 * 32 * 128 / (2 * 32 * per_layer))


def test_default_rope_in_tf5_form_is_no_scaling():
    cfg = tf5({**LLAMA31_HUB, "rope_scaling": None})
    c = parse_config(cfg)
    assert c.rope_scaling is None and c.rope_theta == 500000.0


def test_families_set_their_flags():
    base = {k: v for k, v in LLAMA31_HUB.items() if k not in ("architectures", "rope_scaling")}
    q2 = parse_config({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 4096})
    assert q2.family == "qwen2" and q2.qkv_bias and not q2.o_bias and q2.sliding_window is None
    q3 = parse_config({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 256, "tie_word_embeddings": True})
    assert q3.qk_norm and q3.head_dim == 256 and q3.q_size == 32 * 256 and q3.tie_word_embeddings and not q3.qkv_bias
    m = parse_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096, "attention_bias": True})
    assert m.family == "mistral" and m.sliding_window == 4096 and not m.qkv_bias
    ll = parse_config({**base, "attention_bias": True, "mlp_bias": True})
    assert ll.qkv_bias and ll.o_bias and ll.mlp_bias
    by_type = parse_config({**base, "model_type": "qwen3", "architectures": None})
    assert by_type.family == "qwen3"


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"auto_map": {"AutoModelForCausalLM": "x.Model"}}, "remote code"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported model"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
        ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}},
         r"compressed-tensors, format pack-quantized\) is not supported"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, r"\(fp8\) is not supported"),
        ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}}, "not supported"),
        ({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}}, "not supported"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers"),
        ({"num_key_value_heads": 5}, "multiple"),
        ({"head_dim": 7}, "even"),
        ({"torch_dtype": "int8"}, "dtype"),
        ({"rope_theta": -1}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_scaling": "big"}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"eos_token_id": [-1]}, "eos_token_id"),
        ({"vocab_size": True}, "vocab_size"),
    ],
)
def test_bad_configs_are_refused_with_the_key_named(patch, match):
    with pytest.raises(ModelConfigError, match=match):
        parse_config({**LLAMA31_HUB, **patch})


def test_load_from_folder_merges_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31_HUB, "eos_token_id": 128001}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert load_model_config(tmp_path).eos_token_ids == (128001, 128009)


def test_folder_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_model_config(tmp_path)


def test_usable_len_is_capped_by_positions_and_window():
    from engine.config import usable_len

    cfg = parse_config(LLAMA31_HUB)
    assert usable_len(cfg, 1 << 30) == cfg.max_position_embeddings
    assert usable_len(cfg, 64) == 64
    windowed = parse_config({**LLAMA31_HUB, "sliding_window": 100})
    assert usable_len(windowed, 4096) == 100


def test_engine_options_are_the_daemons_defaults_and_strictly_typed():
    from agent.config import EngineSettings
    from engine.errors import EngineError
    from engine.options import EngineOptions

    opts = EngineOptions()
    e = EngineSettings()
    for name in ("max_num_batched_tokens", "decode_step_tokens", "page_bytes", "cuda_graphs", "async_steps",
                 "shared_step_tokens", "quiet_window_ms"):
        assert getattr(e, name) == getattr(opts, name)
    assert EngineOptions.from_dict({"cuda_graphs": False, "device": "cpu"}) == EngineOptions(cuda_graphs=False)
    assert EngineOptions(quiet_window_ms=250).quiet_window_s == 0.25
    for bad in ({"cuda_graphs": 1}, {"max_num_batched_tokens": "4096"}, {"quiet_window_ms": 60_001},
                {"shared_step_tokens": -1}, {"page_bytes": True}, {"async_steps": None}, {"decode_step_tokens": 0}):
        with pytest.raises(EngineError, match=next(iter(bad))):
            EngineOptions.from_dict(bad)


def test_the_worker_refuses_a_mistyped_engine_option_with_its_name():
    from engine.worker.setup import make_core

    core, device, err = make_core({"engine": "core", "device": "cpu", "cuda_graphs": "no"})
    assert core is None and device == "none" and "cuda_graphs" in err
    core, device, err = make_core({"engine": "core", "device": "cpu", "cuda_graphs": False, "quiet_window_ms": 0,
                                   "shared_step_tokens": 0, "page_bytes": None})
    assert err == "" and device == "cpu"
    assert not core.options.cuda_graphs and core.policy.quiet_window_s == 0 and core.policy.shared_step_tokens == 0


def test_the_early_cuda_context_is_only_for_a_cuda_device() -> None:
    """make_core opens the CUDA context beside torch's import, for the device the options name;
    the CPU and engine-less workers never touch the driver (on a GPU, tests/gpu checks torch
    then runs in that context)."""
    from engine.worker.setup import cuda_index, open_cuda_context

    assert [cuda_index(d) for d in ("auto", "cuda", "cuda:0", "cuda:3", "cpu", "cuda:x", "meta")] == [
        0, 0, 0, 3, None, None, None]
    assert open_cuda_context("cpu") is None


# Llama 4 Scout's text config as the hub publishes it (inside an image-and-text config there)
SCOUT_TEXT = {
    "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 10485760,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
    "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
    "no_rope_layers": [], "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "hidden_act": "silu",
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def test_llama4_scouts_image_and_text_config_gives_its_language_model():
    cfg = parse_config({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                        "text_config": SCOUT_TEXT, "vision_config": {"hidden_size": 1408}})
    assert cfg.family == "llama4" and cfg.checkpoint_prefix == "language_model."
    assert cfg.skipped_prefixes == ("vision_model.", "multi_modal_projector.")
    assert cfg.sparse_layers == tuple(range(48)) and cfg.num_experts == 16 and cfg.experts_per_token == 1
    assert cfg.router == "sigmoid" and cfg.shared_expert_intermediate_size == cfg.expert_intermediate_size == 8192
    assert cfg.intermediate_size == 16384
    assert cfg.nope_layers == tuple(range(3, 48, 4))  # no_rope_layers [] → every fourth layer
    assert cfg.chunked_layers == tuple(i for i in range(48) if i % 4 != 3) and cfg.attention_chunk == 8192
    assert cfg.attn_temperature == (8192.0, 0.1) and cfg.interleaved_rope and cfg.qk_l2_norm
    text = parse_config({**SCOUT_TEXT, "architectures": ["Llama4ForCausalLM"]})
    assert text.checkpoint_prefix == "" and text.skipped_prefixes == ()
    assert text.sparse_layers == cfg.sparse_layers and text.nope_layers == cfg.nope_layers
    # Maverick's interleaving: every other layer sparse
    assert parse_config({**SCOUT_TEXT, "interleave_moe_layer_step": 2}).sparse_layers == tuple(range(1, 48, 2))


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
        ({"no_rope_layers": [2] * 48}, "no_rope_layers"),
        ({"layer_types": ["sliding_attention"] * 48}, "layer_types"),
        ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 48}, "attention_chunk_size"),
        ({"attention_chunk_size": 0}, "attention_chunk_size"),
        ({"moe_layers": [48]}, "moe_layers"),
        ({"num_local_experts": 1024}, "experts"),
        ({"use_qk_norm": "yes"}, "use_qk_norm"),
        ({"floor_scale": 0}, "floor_scale"),
    ],
)
def test_bad_llama4_configs_are_refused_with_the_key_named(patch, match):
    with pytest.raises(ModelConfigError, match=match):
        parse_config({**SCOUT_TEXT, "architectures": ["Llama4ForCausalLM"], **patch})


def test_an_image_and_text_llama4_config_without_its_text_config_is_refused():
    with pytest.raises(ModelConfigError, match="text_config"):
        parse_config({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4"})


def test_llama4s_attention_pair_cost_counts_its_shared_expert_and_only_its_unchunked_layers():
    import dataclasses

    cfg = parse_config({**SCOUT_TEXT, "architectures": ["Llama4ForCausalLM"]})
    assert attention_pair_cost(dataclasses.replace(cfg, shared_expert_intermediate_size=0)) > attention_pair_cost(cfg)
    # 36 of 48 layers attend inside 8k chunks: a deep token's attention grows in the other 12 only
    unchunked = dataclasses.replace(cfg, chunked_layers=())
    assert attention_pair_cost(cfg) == pytest.approx(attention_pair_cost(unchunked) * 12 / 48)


def test_a_llama4_config_that_leaves_keys_out_gets_transformers_defaults_not_other_families():
    """transformers' Llama4TextConfig assumes theta 500000, eps 1e-5 and head_dim 128 where a key
    is missing; taking the Llama family's 10000 would run the wrong rope silently."""
    sparse = {k: v for k, v in SCOUT_TEXT.items() if k not in (
        "rope_theta", "rope_scaling", "rms_norm_eps", "head_dim", "intermediate_size_mlp", "attention_chunk_size",
        "floor_scale", "attn_scale", "max_position_embeddings", "num_experts_per_tok")}
    cfg = parse_config({**sparse, "architectures": ["Llama4ForCausalLM"], "num_attention_heads": 32})
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.head_dim) == (500000.0, 1e-5, 128)
    assert cfg.intermediate_size == 16384 and cfg.attention_chunk == 8192 and cfg.attn_temperature == (8192.0, 0.1)
    assert cfg.max_position_embeddings == 131072 and cfg.experts_per_token == 1
    # transformers 5's rope_parameters keeps its own theta, which the default does not shadow
    tf5_form = parse_config({**sparse, "architectures": ["Llama4ForCausalLM"],
                             "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}})
    assert tf5_form.rope_theta == 250000.0


def test_llama4s_temperature_flag_is_read_as_the_hub_writes_it():
    """Scout's published config says ``"attn_temperature_tuning": 4``: a truthy number turns it on."""
    on = parse_config({**SCOUT_TEXT, "architectures": ["Llama4ForCausalLM"], "attn_temperature_tuning": 4})
    off = parse_config({**SCOUT_TEXT, "architectures": ["Llama4ForCausalLM"], "attn_temperature_tuning": False})
    assert on.attn_temperature == (8192.0, 0.1) and off.attn_temperature is None
