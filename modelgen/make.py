"""Random-weight Hugging Face model folders: the test and benchmark models.

``make_model(out_dir, arch, preset, seed)`` writes ``config.json`` (as transformers expects
for the architecture), ``generation_config.json``, safetensors shards (with an index when
there is more than one), ``tokenizer.json`` and ``tokenizer_config.json``.

Weights are normal with std 0.02, norm weights 1.0. Each tensor is drawn from its own
generator seeded by ``(seed, tensor name)``, in fixed-size row chunks, so the output is
deterministic for a seed on a device type (CPU and CUDA draw different numbers) and memory
holds at most one chunk of one tensor at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from modelgen.safetensors_writer import (
    DEFAULT_MAX_SHARD_BYTES,
    TensorSpec,
    index_json,
    plan_shards,
    shard_file_names,
    write_shard,
)
from modelgen.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    EOT_TOKEN,
    PAD_TOKEN,
    build_tokenizer,
    special_ids,
    tokenizer_config,
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "llama4")
PRESETS = ("tiny", "small", "llama-3.1-8b", "qwen3-30b-a3b", "mixtral-8x7b", "llama4-scout")
INIT_STD = 0.02

# Elements drawn per chunk: bounds host memory for the 8B preset's big matrices. Part of
# the determinism contract: changing it changes the weights a seed gives.
_CHUNK_ELEMS = 1 << 24

_ARCH_CLASS = MappingProxyType({
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "llama4": ("Llama4ForCausalLM", "llama4_text"),
})
# Mixture-of-experts presets (tiny and small only): experts, experts per token, each expert's
# intermediate size. qwen3_moe's and llama4's layers alternate (decoder_sparse_step /
# interleave_moe_layer_step 2): layer 0 keeps the dense MLP, so both kinds of layer are
# exercised; mixtral's are all sparse. Llama 4 sends a token to one expert (and its shared one).
_EXPERTS = MappingProxyType({"tiny": (8, 2, 64), "small": (16, 4, 128), "qwen3-30b-a3b": (128, 8, 768),
                             "mixtral-8x7b": (8, 2, 14336), "llama4-scout": (16, 1, 8192)})
SPARSE_STEP = {"qwen3_moe": 2, "mixtral": 1, "llama4": 2}
# Llama 4's attention at the test presets: chunks and a temperature floor small enough that
# short prompts cross chunk boundaries and change the NoPE layers' query scale; the last layer
# of each test preset is a NoPE one (tiny has two layers: rope, then NoPE).
_LLAMA4_TEST_CHUNK = 16
_LLAMA4_TEST_FLOOR = 8


class ModelGenError(ValueError):
    """Bad arguments to the model generator (unknown arch/preset, unusable output dir)."""


@dataclass(frozen=True)
class Shape:
    """A preset's dimensions; the architecture decides the rest (biases, norms, rope)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_position: int
    vocab: int | None  # None: the tokenizer's size
    dtype: str  # "float32" | "bfloat16"
    qwen3_head_dim: int  # head_dim for qwen3; other archs use hidden // heads


_PRESETS = MappingProxyType({
    # qwen3's head_dim differs from hidden // heads in tiny/small so that path is exercised.
    "tiny": Shape(64, 2, 4, 2, 128, 2048, None, "float32", 32),
    "small": Shape(256, 4, 8, 2, 512, 4096, None, "float32", 64),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, 131072, 128256, "bfloat16", 128),
    # the real models' shapes (their dense intermediate sizes; the experts' below)
    "qwen3-30b-a3b": Shape(2048, 48, 32, 4, 6144, 40960, 151936, "bfloat16", 128),
    "mixtral-8x7b": Shape(4096, 32, 32, 8, 14336, 32768, 32000, "bfloat16", 128),
    # Llama 4 Scout's text model (intermediate: its dense MLP size, intermediate_size_mlp)
    "llama4-scout": Shape(5120, 48, 40, 8, 16384, 10485760, 202048, "bfloat16", 128),
})
# Each full-size preset is one architecture's; tiny and small fit every architecture.
_PRESET_ARCH = MappingProxyType({"llama-3.1-8b": ("llama", "qwen2", "qwen3", "mistral"),
                                 "qwen3-30b-a3b": ("qwen3_moe",), "mixtral-8x7b": ("mixtral",),
                                 "llama4-scout": ("llama4",)})


def _check(arch: str, preset: str) -> Shape:
    if arch not in ARCHS:
        raise ModelGenError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if preset not in _PRESETS:
        raise ModelGenError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if preset in _PRESET_ARCH and arch not in _PRESET_ARCH[preset]:
        raise ModelGenError(f"preset {preset!r} has the shapes of {', '.join(_PRESET_ARCH[preset])} presets, "
                            f"not {arch}")
    if arch in SPARSE_STEP and preset not in _EXPERTS:
        raise ModelGenError(f"{arch} comes in the presets {', '.join(_EXPERTS)}, not {preset!r}")
    return _PRESETS[preset]


def head_dim(arch: str, preset: str) -> int:
    shape = _check(arch, preset)
    return shape.qwen3_head_dim if arch in ("qwen3", "qwen3_moe") else shape.hidden // shape.heads


def sparse_step(arch: str, preset: str) -> int:
    """Every how many layers one has experts (0: none): the test presets of qwen3_moe and llama4
    alternate, the real Qwen3-30B-A3B and Llama 4 Scout have them in every layer."""
    if arch not in SPARSE_STEP:
        return 0
    return 1 if preset in ("qwen3-30b-a3b", "llama4-scout") else SPARSE_STEP[arch]


def sparse_layer(arch: str, preset: str, i: int) -> bool:
    """Whether layer ``i`` of ``arch``/``preset`` has experts for its MLP."""
    step = sparse_step(arch, preset)
    return step > 0 and (i + 1) % step == 0


def ties_embeddings(arch: str, preset: str) -> bool:
    """qwen3 tiny/small tie lm_head to the embedding (as small Qwen3 models do)."""
    _check(arch, preset)
    return arch == "qwen3" and preset in ("tiny", "small")


def model_config(arch: str, preset: str, vocab_size: int, specials: dict[str, int]) -> dict:
    """``config.json`` for ``arch``/``preset`` with the given vocabulary and special ids."""
    shape = _check(arch, preset)
    cls, model_type = _ARCH_CLASS[arch]
    eos = [specials[EOS_TOKEN], specials[EOT_TOKEN]]
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": head_dim(arch, preset),
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-5 if arch in ("llama", "mistral") else 1e-6,
        "use_cache": True,
        "tie_word_embeddings": ties_embeddings(arch, preset),
        "attention_dropout": 0.0,
        "bos_token_id": specials[BOS_TOKEN],
        "eos_token_id": eos,
        "pad_token_id": specials[PAD_TOKEN],
        "torch_dtype": shape.dtype,
    }
    if arch == "llama":
        # Llama 3.1's scaling; the original context is 1/16 of the full one as in 8B, so the
        # low-, mid- and high-frequency bands all occur even at tiny head sizes.
        cfg["rope_theta"] = 500000.0
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": shape.max_position // 16,
        }
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
        cfg["pretraining_tp"] = 1
    elif arch == "llama4":
        n, _, inter = _EXPERTS[preset]
        full = preset == "llama4-scout"
        cfg.update(intermediate_size=inter, intermediate_size_mlp=shape.intermediate, num_local_experts=n,
                   num_experts_per_tok=1, interleave_moe_layer_step=sparse_step(arch, preset),
                   rope_theta=500000.0, attention_bias=False, use_qk_norm=True, attn_temperature_tuning=True,
                   attention_chunk_size=8192 if full else _LLAMA4_TEST_CHUNK,
                   floor_scale=8192 if full else _LLAMA4_TEST_FLOOR, attn_scale=0.1,
                   no_rope_layers=[int((i + 1) % 4 != 0 and (full or i != shape.layers - 1))
                                   for i in range(shape.layers)],
                   router_aux_loss_coef=0.001, router_jitter_noise=0.0, output_router_logits=False)
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 16.0 if full else 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 1.0 if full else 4.0,
                               "original_max_position_embeddings": 8192 if full else shape.max_position // 16}
    elif arch in ("mistral", "mixtral"):
        cfg["rope_theta"] = 1000000.0
        cfg["sliding_window"] = None
        if arch == "mixtral":
            n, k, inter = _EXPERTS[preset]
            cfg.update(num_local_experts=n, num_experts_per_tok=k, intermediate_size=inter,
                       router_jitter_noise=0.0, output_router_logits=False)
    else:
        cfg["rope_theta"] = 1000000.0
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = shape.layers
        if arch in ("qwen3", "qwen3_moe"):
            cfg["attention_bias"] = False
        if arch == "qwen3_moe":
            n, k, inter = _EXPERTS[preset]
            cfg.update(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=inter, norm_topk_prob=True,
                       decoder_sparse_step=sparse_step(arch, preset), mlp_only_layers=[], output_router_logits=False)
    return cfg


def tensor_specs(arch: str, preset: str, vocab_size: int) -> list[TensorSpec]:
    """Every weight the architecture has, in layer order, with HF names and shapes."""
    shape = _check(arch, preset)
    st = "BF16" if shape.dtype == "bfloat16" else "F32"
    h, d = shape.hidden, head_dim(arch, preset)
    q, kv = shape.heads * d, shape.kv_heads * d

    def w(name: str, *dims: int, init: str = "normal") -> TensorSpec:
        return TensorSpec(name, tuple(dims), st, init)

    specs = [w("model.embed_tokens.weight", vocab_size, h)]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        specs.append(w(p + "input_layernorm.weight", h, init="ones"))
        specs += [
            w(p + "self_attn.q_proj.weight", q, h),
            w(p + "self_attn.k_proj.weight", kv, h),
            w(p + "self_attn.v_proj.weight", kv, h),
        ]
        if arch == "qwen2":
            specs += [
                w(p + "self_attn.q_proj.bias", q),
                w(p + "self_attn.k_proj.bias", kv),
                w(p + "self_attn.v_proj.bias", kv),
            ]
        if arch in ("qwen3", "qwen3_moe"):
            specs += [
                w(p + "self_attn.q_norm.weight", d, init="ones"),
                w(p + "self_attn.k_norm.weight", d, init="ones"),
            ]
        specs += [
            w(p + "self_attn.o_proj.weight", h, q),
            w(p + "post_attention_layernorm.weight", h, init="ones"),
        ]
        if arch == "llama4":
            specs += _llama4_mlp(p, i, preset, h, shape.intermediate, w)
            continue
        if sparse_layer(arch, preset, i):
            n, _, inter = _EXPERTS[preset]
            block, (g, u, dn) = ((p + "block_sparse_moe.", ("w1", "w3", "w2")) if arch == "mixtral"
                                 else (p + "mlp.", ("gate_proj", "up_proj", "down_proj")))
            specs.append(w(block + "gate.weight", n, h))
            for j in range(n):
                x = f"{block}experts.{j}."
                specs += [w(x + g + ".weight", inter, h), w(x + u + ".weight", inter, h), w(x + dn + ".weight", h, inter)]
            continue
        specs += [
            w(p + "mlp.gate_proj.weight", shape.intermediate, h),
            w(p + "mlp.up_proj.weight", shape.intermediate, h),
            w(p + "mlp.down_proj.weight", h, shape.intermediate),
        ]
    specs.append(w("model.norm.weight", h, init="ones"))
    if not ties_embeddings(arch, preset):
        specs.append(w("lm_head.weight", vocab_size, h))
    return specs


def _llama4_mlp(p: str, i: int, preset: str, h: int, dense: int, w) -> list[TensorSpec]:
    """A Llama 4 layer's MLP as its checkpoints keep it: the dense MLP under ``feed_forward``, or
    the router, every expert's gate-up [E, H, 2I] and down [E, I, H] in one tensor each, and the
    shared expert."""
    f = p + "feed_forward."
    if not sparse_layer("llama4", preset, i):
        return [w(f + "gate_proj.weight", dense, h), w(f + "up_proj.weight", dense, h), w(f + "down_proj.weight", h, dense)]
    n, _, inter = _EXPERTS[preset]
    return [w(f + "router.weight", n, h), w(f + "experts.gate_up_proj", n, h, 2 * inter),
            w(f + "experts.down_proj", n, inter, h), w(f + "shared_expert.gate_proj.weight", inter, h),
            w(f + "shared_expert.up_proj.weight", inter, h), w(f + "shared_expert.down_proj.weight", h, inter)]


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _resolve_device(device: str) -> Any:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ModelGenError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelGenError("device cuda requested but CUDA is not available")
    return torch.device(device)


def _chunk_source(seed: int, device: Any) -> Callable[[TensorSpec], Iterator[memoryview]]:
    import torch

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}

    def chunks(spec: TensorSpec) -> Iterator[memoryview]:
        rows = spec.shape[0]
        row_elems = 1
        for dim in spec.shape[1:]:
            row_elems *= dim
        step = max(1, _CHUNK_ELEMS // row_elems)
        gen = torch.Generator(device=device)
        gen.manual_seed(_tensor_seed(seed, spec.name))
        for start in range(0, rows, step):
            n = min(step, rows - start)
            dims = (n, *spec.shape[1:])
            if spec.init == "ones":
                t = torch.ones(dims, dtype=dtypes[spec.dtype])
            else:
                t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
                t = (t * INIT_STD).to(dtypes[spec.dtype]).cpu()
            # Raw little-endian bytes; bf16 has no numpy dtype, so go through uint8.
            yield memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")

    return chunks


def make_model(
    out_dir: str | os.PathLike[str],
    arch: str,
    preset: str,
    seed: int = 0,
    device: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a random-weight model folder at ``out_dir`` and return its path.

    The folder is built next to ``out_dir`` and renamed into place at the end, so a crash
    or interrupt never leaves a half-written model under the final name. ``out_dir`` must
    not exist, or be an empty directory.
    """
    shape = _check(arch, preset)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelGenError(f"output {out} exists and is not an empty folder: pass --force to replace it, "
                            "or choose another --out")
    if out.parent.exists() and not out.parent.is_dir():
        raise ModelGenError(f"{out.parent} is not a directory")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ModelGenError(f"seed must be a non-negative integer, got {seed!r}")
    dev = _resolve_device(device)
    say = progress or (lambda _msg: None)

    tok = build_tokenizer()
    specials = special_ids(tok)
    vocab = _vocab(shape, tok)
    specs = tensor_specs(arch, preset, vocab)
    shards = plan_shards(specs, max_shard_bytes)
    names = shard_file_names(len(shards))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_metadata(tmp, arch, preset, tok, vocab, specials, shape.max_position)
        chunks = _chunk_source(seed, dev)
        for shard, name in zip(shards, names):
            say(f"writing {name} ({size_text(sum(s.nbytes for s in shard))})")
            write_shard(tmp / name, shard, chunks)
        if len(shards) > 1:
            _write_json(tmp / "model.safetensors.index.json", index_json(shards, names))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _vocab(shape: Shape, tok) -> int:
    """The preset's vocabulary, or the tokenizer's rounded up to a multiple of 64."""
    return shape.vocab if shape.vocab is not None else -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64


def _write_metadata(folder: Path, arch: str, preset: str, tok, vocab: int, specials, max_position: int) -> None:
    """config.json, generation_config.json and the tokenizer's files of a generated model."""
    cfg = model_config(arch, preset, vocab, specials)
    _write_json(folder / "config.json", cfg)
    _write_json(folder / "generation_config.json", {"bos_token_id": cfg["bos_token_id"],
                                                    "eos_token_id": cfg["eos_token_id"],
                                                    "pad_token_id": cfg["pad_token_id"]})
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", tokenizer_config(tok, max_position))
    _write_json(folder / "special_tokens_map.json",
                {"bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN, "pad_token": PAD_TOKEN})


def make_metadata_only(out_dir: str | os.PathLike[str], arch: str, preset: str) -> Path:
    """A generated model's folder without its weights (config, generation config, tokenizer):
    for benches that fill the weights on the device (``ops/bench/device_weights.py``) where a
    full-size checkpoint would not fit the disk. ``out_dir`` must not exist."""
    shape = _check(arch, preset)
    out = Path(out_dir)
    if out.exists():
        raise ModelGenError(f"output {out} exists")
    tok = build_tokenizer()
    vocab = _vocab(shape, tok)
    out.mkdir(parents=True)
    _write_metadata(out, arch, preset, tok, vocab, special_ids(tok), shape.max_position)
    return out


def size_text(n: int) -> str:
    """A byte count as people read it: ``572.2 KiB``, ``15.0 MiB``, ``16.07 GB`` (decimal from a
    gigabyte on, as Hugging Face counts checkpoints)."""
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    if n < 10**9:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1e9:.2f} GB"


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
