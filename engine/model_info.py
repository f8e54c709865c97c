"""What a loaded model is, as the engine runs it: :class:`ModelInfo` (no torch import).

``EngineCore.load_model`` / ``finish_load`` return it, ``EngineCore.models()`` lists it and the
worker's ``Loaded.info`` carries it to the agent as a record, every field present.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    device_bytes: int  # at its load: weights + workspace (held) + its guaranteed KV pages: what its leaving frees
    kv_pages: int
    block_size: int  # tokens per KV page
    # what the load runs with (a pre-quantized checkpoint is "fp8" whatever was asked); None: the
    # checkpoint's dtype
    quantization: str | None = None
    kv_cache_dtype: str | None = None
