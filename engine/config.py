"""config.json → :class:`ModelConfig` for the Llama family (no torch import).

Reads both spellings in the wild: as model hubs publish it (``rope_theta``, ``rope_scaling``,
``torch_dtype``) and as transformers 5 writes it (``rope_parameters`` holding the theta and the
scaling, ``dtype``). Refuses remote code (``auto_map``), quantized checkpoints other than the
FP8 layouts :func:`_fp8_checkpoint` names, and anything outside Llama 3.x / Mistral / Qwen2 /
Qwen3, the mixtures of experts Qwen3-MoE and Mixtral, and Llama 4's text model (its own
checkpoint, or the language model inside a Llama 4 image-and-text checkpoint, whose vision
tower is not loaded), with a :class:`ModelConfigError` naming the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.errors import ModelConfigError

MAX_CONFIG_BYTES = 1 << 20

# architectures entry / model_type → family. Families differ only in flags set below.
_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "llama4_text": "llama4", "llama4": "llama4"}
# A Llama 4 image-and-text checkpoint: its text model's config and tensors live under these names.
_LLAMA4_WRAPPER = "Llama4ForConditionalGeneration"
LLAMA4_TEXT_PREFIX = "language_model."
LLAMA4_SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")  # its vision tower, never loaded
# What transformers' Llama4TextConfig assumes for a key its config.json leaves out, where that
# differs from the other families' defaults below (a config without rope_theta must not run at
# 10000): applied before anything is read.
_LLAMA4_DEFAULTS = MappingProxyType({
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "head_dim": 128, "max_position_embeddings": 131072,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16, "num_experts_per_tok": 1,
    "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192.0, "attn_scale": 0.1,
    "use_qk_norm": True, "no_rope_layer_interval": 4, "interleave_moe_layer_step": 1})
MAX_EXPERTS = 512


@dataclass(frozen=True)
class MlpNames:
    """Where a family's checkpoint keeps a decoder layer's MLP, under ``model.layers.<i>.``: a
    dense layer's block; a sparse layer's experts' block, its router, each expert's gate, up and
    down projections (``experts.<j>.<name>.weight``), and the block of the dense shared expert
    beside them, where the family has one; ``dense_size_key``: the config.json field of a dense
    layer's MLP size."""

    dense: str = "mlp."
    experts: str = "mlp."
    router: str = "gate.weight"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: str = ""
    dense_size_key: str = "intermediate_size"


_MLP_NAMES = MappingProxyType({
    "mixtral": MlpNames(experts="block_sparse_moe.", projections=("w1", "w3", "w2")),
    # Llama 4 may also keep each projection of every expert in one tensor (engine.weights.slots);
    # its intermediate_size is an expert's
    "llama4": MlpNames(dense="feed_forward.", experts="feed_forward.", router="router.weight",
                       shared="feed_forward.shared_expert.", dense_size_key="intermediate_size_mlp"),
})


def mlp_names(family: str) -> MlpNames:
    """A family's :class:`MlpNames` (the dense families' and Qwen3-MoE's are the default)."""
    return _MLP_NAMES.get(family, MlpNames())


# Every family's router tensor, by the end of its name (the FP8 writer leaves routers unquantized)
ROUTER_SUFFIXES = tuple(sorted({"." + n.experts + n.router for n in (MlpNames(), *_MLP_NAMES.values())}))
_DTYPES = {"bfloat16", "float16", "float32"}
_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral | llama4
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    dtype: str  # the checkpoint's dtype name
    sliding_window: int | None  # when set, sequences are capped at it (full attention inside)
    # A pre-quantized FP8 checkpoint's weight scales (engine.weights.fp8_checkpoint): "channel" or
    # "tensor" (compressed-tensors float-quantized), "block128" (quant_method "fp8", 128x128); None: not one
    fp8_checkpoint: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mixture of experts (qwen3_moe, mixtral): the routed experts, how many each token takes,
    # each expert's intermediate size, whether the top-k weights are renormalised to sum to 1,
    # and the layers whose MLP is the experts (the others keep the dense MLP). 0 / (): dense.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()
    # How the router weighs an expert: "softmax" (softmax over all experts, the top k, weights on
    # the experts' outputs) or "sigmoid" (Llama 4: the top k logits, each one's sigmoid scaling
    # the token *into* its expert). Llama 4's sparse layers also run a dense shared expert of
    # this intermediate size (0: none) beside the routed ones.
    router: str = "softmax"
    shared_expert_intermediate_size: int = 0
    # Llama 4's attention: layers without rotary embeddings ("NoPE"), whose queries are scaled
    # by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` when ``attn_temperature`` is
    # (floor_scale, attn_scale); layers whose attention stays inside chunks of
    # ``attention_chunk`` positions; rope on interleaved pairs; a weightless RMS norm of q and k
    # after rope in the layers that rotate.
    nope_layers: tuple[int, ...] = ()
    attn_temperature: tuple[float, float] | None = None
    chunked_layers: tuple[int, ...] = ()
    attention_chunk: int = 0
    interleaved_rope: bool = False
    qk_l2_norm: bool = False
    # where the checkpoint keeps the text model's tensors ("" or "language_model.")
    checkpoint_prefix: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def skipped_prefixes(self) -> tuple[str, ...]:
        """Top-level tensor names the checkpoint holds that are not loaded: an image-and-text
        checkpoint's vision tower beside its language model."""
        return LLAMA4_SKIPPED_PREFIXES if self.checkpoint_prefix == LLAMA4_TEXT_PREFIX else ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# The matmuls' TFLOP/s at prefill sizes against the prefill attention kernel's, on an H100
# (docs/perf.md, the 2026-12-06 prefill rows): ~750 (the 32k prompt's TTFT at d6724cf less its
# attention time, over its matmul FLOPs) against 442 causal at 32k (c1cce7e).
ATTENTION_FLOP_TIME = 1.7


def attention_pair_cost(cfg: ModelConfig) -> float:
    """The work of one (query, key) pair of attention (QK^T and PV over every layer and query
    head: 4 * layers * heads * head_dim FLOPs) as a fraction of one token's pass through the
    linear layers (2 FLOPs a weight it reads: projections, the MLP or the experts a token takes).
    The scheduler costs prefill chunks by it (SchedulerConfig.attention_cost), so it is a ratio of
    times: the FLOPs' ratio (~3.8e-5 for Llama-3.1-8B) times ``ATTENTION_FLOP_TIME``, what an
    attention FLOP costs in time against a matmul FLOP: a token ~15.6k positions deep takes as
    long in attention as in its matmuls. Layers that attend inside chunks (Llama 4's) read at
    most a chunk of keys a token whatever its depth, so only the others' pairs grow with it."""
    h = cfg.hidden_size
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    dense = 3 * h * cfg.intermediate_size
    routed = (cfg.experts_per_token * 3 * h * cfg.expert_intermediate_size + h * cfg.num_experts
              + 3 * h * cfg.shared_expert_intermediate_size)
    sparse = set(cfg.sparse_layers) if cfg.num_experts else set()
    linear = sum(attn + (routed if i in sparse else dense) for i in range(cfg.num_layers))
    full = cfg.num_layers - len(cfg.chunked_layers)
    return ATTENTION_FLOP_TIME * 4 * full * cfg.num_heads * cfg.head_dim / (2 * linear)


def usable_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The longest sequence a load of ``cfg`` serves when asked for ``max_model_len`` (None: its
    own context): capped by the model's positions and its sliding window (inside the window
    attention is full)."""
    max_len = cfg.max_position_embeddings if max_model_len is None else min(max_model_len, cfg.max_position_embeddings)
    if cfg.sliding_window is not None:
        max_len = min(max_len, cfg.sliding_window)
    return max_len


def _int(cfg: dict, key: str, *, minimum: int = 1, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ModelConfigError(f"config.json: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _float(cfg: dict, key: str, default: Any = None, *, positive: bool = True) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ModelConfigError(f"config.json: {key} must be a positive number, got {v!r}")
    return float(v)


def _token_ids(v: Any, key: str) -> tuple[int, ...]:
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    for t in vals:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ModelConfigError(f"config.json: {key} must be a token id or a list of them, got {v!r}")
    return tuple(vals)


def _family(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelConfigError("config.json: architectures must be a list")
    for a in archs:
        if a in _ARCHS:
            return _ARCHS[a]
    mt = cfg.get("model_type")
    if not archs and mt in _MODEL_TYPES:
        return _MODEL_TYPES[mt]
    raise ModelConfigError(
        f"config.json: unsupported model (architectures={archs!r}, model_type={mt!r}); "
        f"supported: {', '.join(sorted(_ARCHS))}"
    )


def _rope(cfg: dict) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from rope_parameters (transformers 5) or rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ModelConfigError("config.json: rope_parameters must be an object")
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelConfigError("config.json: rope_scaling must be an object or null")
    merged: dict[str, Any] = {}
    if scaling:
        merged.update(scaling)
    if params:
        merged.update(params)
    theta_src = merged if "rope_theta" in merged else cfg
    theta = _float(theta_src, "rope_theta", 10000.0)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ModelConfigError(f"config.json: rope type {kind!r} is not supported (supported: {sorted(_ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    out = {k: v for k, v in merged.items() if k not in ("rope_theta", "type")}
    out["rope_type"] = kind
    need = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"] if kind == "llama3" else [])
    for k in need:
        _float(out, k)  # present and a positive number
    return theta, out


def _scheme(qc: Any) -> str:
    """A quantization_config's scheme in a few words, for a refusal."""
    if not isinstance(qc, dict):
        return repr(qc)[:60]
    parts = [str(qc.get("quant_method", "?"))[:40]]
    if isinstance(qc.get("format"), str):
        parts.append(f"format {qc['format'][:40]}")
    return ", ".join(parts)


def _fp8_checkpoint(qc: Any) -> str | None:
    """The weight-scale layout of a supported pre-quantized FP8 checkpoint, None for an unquantized
    one; ModelConfigError naming the scheme for anything else.

    Supported: compressed-tensors ``float-quantized`` with 8-bit float weights, strategy
    ``channel`` or ``tensor`` (input scales dynamic or static: a static ``input_scale`` is checked
    and then not used, activations are quantized per token as the engine's own FP8 models are);
    ``quant_method: "fp8"`` with e4m3 weights in 128x128 blocks (``weight_scale_inv``)."""
    if not qc:
        return None
    refuse = ModelConfigError(f"config.json: quantization_config ({_scheme(qc)}) is not supported; supported: "
                              "compressed-tensors float-quantized FP8 (channel or tensor weight scales) and "
                              "quant_method fp8 with 128x128 blocks")
    if not isinstance(qc, dict):
        raise refuse
    if qc.get("kv_cache_scheme"):
        # calibrated K/V scales (self_attn.k_scale, v_scale): the FP8 KV cache runs at unit scale
        raise ModelConfigError(f"config.json: quantization_config ({_scheme(qc)}) carries a kv_cache_scheme "
                               "(calibrated KV scales), which this engine does not read")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3" or qc.get("weight_block_size") != [128, 128]:
            raise refuse
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise refuse
        return "block128"
    if method != "compressed-tensors" or qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise refuse
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise refuse
    (group,) = groups.values()
    w = group.get("weights") if isinstance(group, dict) else None
    a = group.get("input_activations") if isinstance(group, dict) else None
    if (not isinstance(w, dict) or w.get("num_bits") != 8 or w.get("type") != "float"
            or w.get("strategy") not in ("channel", "tensor") or w.get("dynamic", False)
            or not w.get("symmetric", True)):  # asymmetric weights carry zero points
        raise refuse
    if a is not None and (not isinstance(a, dict) or a.get("num_bits") != 8 or a.get("type") != "float"):
        raise refuse
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise refuse
    return w["strategy"]


def parse_config(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Validate a parsed config.json (and optional generation_config.json) into a ModelConfig."""
    if not isinstance(cfg, dict):
        raise ModelConfigError("config.json must hold a JSON object")
    if cfg.get("auto_map"):
        raise ModelConfigError("config.json: auto_map asks for remote code, which this engine never runs")
    fp8_checkpoint = _fp8_checkpoint(cfg.get("quantization_config"))
    family = _family(cfg)
    outer = cfg
    wrapped = family == "llama4" and (_LLAMA4_WRAPPER in (cfg.get("architectures") or [])
                                      or cfg.get("model_type") == "llama4")
    if wrapped:
        cfg = cfg.get("text_config")
        if not isinstance(cfg, dict):
            raise ModelConfigError("config.json: a Llama 4 image-and-text checkpoint needs a text_config object")
    if family == "llama4":
        # rope_parameters (transformers 5) carries its own theta: the default must not shadow it
        defaults = {k: v for k, v in _LLAMA4_DEFAULTS.items()
                    if not (k == "rope_theta" and isinstance(cfg.get("rope_parameters"), dict))}
        cfg = {**defaults, **cfg}
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise ModelConfigError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim")
    else:
        if hidden % heads:
            raise ModelConfigError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if head_dim % 2:
        raise ModelConfigError(f"config.json: head_dim {head_dim} must be even (rotary embeddings)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or outer.get("dtype") or outer.get("torch_dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise ModelConfigError(f"config.json: dtype {dtype!r} is not supported ({sorted(_DTYPES)})")
    theta, scaling = _rope(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    if family == "qwen2":
        qkv_bias, o_bias = True, False
    elif family == "mistral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = attention_bias
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    else:
        window = cfg.get("sliding_window")
    if window is not None:
        window = _int({"sliding_window": window}, "sliding_window")
    eos = _token_ids(cfg.get("eos_token_id"), "eos_token_id")
    if generation_config and generation_config.get("eos_token_id") is not None:
        eos = tuple(dict.fromkeys(eos + _token_ids(generation_config["eos_token_id"], "generation_config eos_token_id")))
    bos = cfg.get("bos_token_id")
    layers = _int(cfg, "num_hidden_layers")
    moe = _experts(cfg, family, layers)
    llama4 = _llama4(cfg, layers, wrapped) if family == "llama4" else {}
    return ModelConfig(
        family=family,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, mlp_names(family).dense_size_key),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(cfg, "max_position_embeddings", default=4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        dtype=dtype,
        sliding_window=window,
        fp8_checkpoint=fp8_checkpoint,
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        **moe,
        **llama4,
        raw=outer,
    )


def _experts(cfg: dict, family: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a qwen3_moe or mixtral config ({} for a dense family),
    each bound checked, as transformers reads them."""
    if family == "qwen3_moe":
        n, inter = _int(cfg, "num_experts"), _int(cfg, "moe_intermediate_size")
        norm = cfg.get("norm_topk_prob", False)
        step = _int(cfg, "decoder_sparse_step", default=1)
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ModelConfigError("config.json: mlp_only_layers must be a list of layer indices")
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    elif family == "mixtral":
        n, inter, norm = _int(cfg, "num_local_experts"), _int(cfg, "intermediate_size"), True
        sparse = tuple(range(layers))
    elif family == "llama4":
        n, inter, norm = _int(cfg, "num_local_experts"), _int(cfg, "intermediate_size"), False
        if cfg.get("moe_layers") is not None:
            sparse = tuple(sorted(set(_layer_list(cfg, "moe_layers", layers))))
        else:
            step = _int(cfg, "interleave_moe_layer_step")
            sparse = tuple(range(step - 1, layers, step))
    else:
        return {}
    k = _int(cfg, "num_experts_per_tok")
    if n > MAX_EXPERTS:
        raise ModelConfigError(f"config.json: {n} experts, more than the {MAX_EXPERTS} this engine serves")
    if k > n:
        raise ModelConfigError(f"config.json: num_experts_per_tok {k} is more than the {n} experts")
    if not isinstance(norm, bool):
        raise ModelConfigError("config.json: norm_topk_prob must be true or false")
    moe = {"num_experts": n, "experts_per_token": k, "expert_intermediate_size": inter, "norm_topk_prob": norm,
           "sparse_layers": sparse}
    if family == "llama4":  # a sigmoid router and a shared expert of the experts' size
        moe.update(router="sigmoid", shared_expert_intermediate_size=inter)
    return moe


def _layer_list(cfg: dict, key: str, layers: int) -> list[int]:
    v = cfg.get(key)
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in v):
        raise ModelConfigError(f"config.json: {key} must be a list of layer indices below {layers}")
    return v


def _flags(cfg: dict, key: str, layers: int) -> list[int] | None:
    """A list of one 0/1 flag a layer (Llama 4's no_rope_layers), or None when absent."""
    v = cfg.get(key)
    if v is None or v == []:
        return None
    if not isinstance(v, list) or len(v) != layers or any(x not in (0, 1) or isinstance(x, bool) for x in v):
        raise ModelConfigError(f"config.json: {key} must list one 0 or 1 for each of the {layers} layers")
    return v


def _llama4(cfg: dict, layers: int, wrapped: bool) -> dict[str, Any]:
    """Llama 4's per-layer attention (see ModelConfig), read as transformers does: a layer rotates
    where ``no_rope_layers`` holds 1 (by default every layer but each ``no_rope_layer_interval``-th),
    its attention is chunked where ``layer_types`` says ``chunked_attention`` (by default: the
    layers that rotate, when ``attention_chunk_size`` is set)."""
    rope = _flags(cfg, "no_rope_layers", layers)
    if rope is None:
        every = _int(cfg, "no_rope_layer_interval")
        rope = [int((i + 1) % every != 0) for i in range(layers)]
    chunk = cfg["attention_chunk_size"]
    if chunk is not None:
        chunk = _int({"attention_chunk_size": chunk}, "attention_chunk_size")
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if (not isinstance(kinds, list) or len(kinds) != layers
            or any(k not in ("chunked_attention", "full_attention") for k in kinds)):
        raise ModelConfigError(f"config.json: layer_types must list chunked_attention or full_attention for each "
                               f"of the {layers} layers")
    chunked = tuple(i for i, k in enumerate(kinds) if k == "chunked_attention")
    if chunked and chunk is None:
        raise ModelConfigError("config.json: layer_types asks for chunked attention but attention_chunk_size is null")
    temperature = None
    if cfg["attn_temperature_tuning"]:  # a truthy number counts, as readers of the hub's configs take it
        temperature = (_float(cfg, "floor_scale"), _float(cfg, "attn_scale"))
    qk = cfg["use_qk_norm"]
    if not isinstance(qk, bool):
        raise ModelConfigError("config.json: use_qk_norm must be true or false")
    return {"nope_layers": tuple(i for i, r in enumerate(rope) if not r), "attn_temperature": temperature,
            "chunked_layers": chunked, "attention_chunk": chunk if chunked else 0, "interleaved_rope": True,
            "qk_l2_norm": qk, "checkpoint_prefix": LLAMA4_TEXT_PREFIX if wrapped else ""}


def _read_json(path: Path) -> Any:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{path.name} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path.name} is not valid JSON: {e}") from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` for extra eos ids) of a model folder."""
    d = Path(model_dir)
    path = d / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{d}: no config.json")
    gen_path = d / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else None
    return parse_config(_read_json(path), gen if isinstance(gen, dict) else None)
