"""LoadSpec: one model's load, the one value that carries it from the settings to the loader.

Built once from a model's settings in the agent (``agent.config.ModelSettings.load_spec``) and
carried whole: the manager → ``WorkerClient.load`` → ``protocol.Load.spec`` (a record, decoded
strictly) → the worker → ``EngineCore.check_load / load_model / begin_load`` → ``ModelLoader`` →
its ``PendingLoad`` → the model's scheduler, block manager and ``PrefixIndex``. The per-attempt
offer of models to evict (``evictable``) is not part of it: it goes beside the spec.

Its own checks (``__post_init__``) are the stateless ones, with the texts the engine always gave;
what depends on the engine (already loaded, quantization on this device, the budget) is the
loader's. Torch-free, so the agent can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError


@dataclass(frozen=True)
class LoadSpec:
    """``name``: the model's name in the engine. ``model_dir``: its snapshot folder (a ``Path``
    is kept as its string). ``max_model_len``: the longest sequence (capped by the model's own
    context); None: the model's own context, capped by what the budget holds for one sequence
    beside the models loaded (engine/core/loading.py). ``max_num_seqs``: sequences in a step at most. ``weight``: its share of GPU time
    when models compete. ``num_kv_pages``: exactly this many KV pages (None: sized from the
    budget). ``block_size``: tokens per KV page (None: the engine's, or as many as fit the shared
    pool's page). ``prefix_caching``: share the model's full KV pages by prefix
    (engine/sched/prefix_index.py). ``quantization``: None (the checkpoint's dtype) or "fp8"
    (FP8 projections). ``kv_cache_dtype``: None (the model's dtype) or "fp8" (an e4m3 KV cache).
    """

    name: str
    model_dir: str
    max_model_len: int | None = None
    max_num_seqs: int = 256
    weight: float = 1.0
    num_kv_pages: int | None = None
    block_size: int | None = None
    prefix_caching: bool = True
    quantization: str | None = None
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model_dir, Path):
            object.__setattr__(self, "model_dir", str(self.model_dir))
        if not isinstance(self.name, str) or not self.name:
            raise EngineError("model name must be a non-empty string")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise EngineError("weight must be a positive number")
        for key, v in (("max_model_len", self.max_model_len), ("max_num_seqs", self.max_num_seqs)):
            if key == "max_model_len" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise EngineError(f"{key} must be an integer >= 2, got {v!r}")
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise EngineError("block_size must be an integer >= 1")
