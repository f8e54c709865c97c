"""EngineCore: loaded models, their requests, and the step loop (docs/architecture.md).

Each loaded model is a :class:`ModelSlot` with its own scheduler, block manager, KV cache and
runner. :meth:`EngineCore.step` runs one model per call: the busy model with the least
weighted service so far (virtual time advanced by step seconds / weight), so one busy model
cannot starve another. Outputs of aborts and unloads are queued and returned by the next step.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.block_manager import BlockManager, PageAllocator
from engine.config import ModelConfig, load_model_config
from engine.errors import EngineError, RequestError
from engine.kv_cache import KVCache, KVSpec
from engine.loader import load_weights
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaModel
from engine.sampling import SamplingParams, SamplingParamsError
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_BUDGET = 4 << 30
GPU_BUDGET_FRACTION = 0.9


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    device_bytes: int
    kv_pages: int
    block_size: int


@dataclass
class RequestOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # None | "stop" | "length" | "abort"
    logprobs: list | None  # one entry per new token: {"token_id", "logprob", "top_logprobs"}
    num_prompt_tokens: int


@dataclass
class ModelSlot:
    name: str
    config: ModelConfig
    model: LlamaModel
    kv: KVCache
    runner: ModelRunner
    scheduler: Scheduler
    weight: float
    weight_bytes: int
    info: ModelInfo
    vtime: float = 0.0
    steps: int = 0
    last_step_s: float = 1e-3

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes + self.kv.nbytes


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise EngineError(f"bad device {device!r}: {e}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' asked for but CUDA is not available")
    return d


class EngineCore:
    """Loads models and steps their requests. Not thread-safe: one caller drives it."""

    def __init__(self, device: str = "auto", max_num_batched_tokens: int = 2048,
                 memory_budget_bytes: int | None = None, *, block_size: int = 16,
                 max_prefill_chunk: int | None = None, dtype: str | None = None, seed: int | None = None,
                 decode_buckets: tuple[int, ...] = ()) -> None:
        self.device = resolve_device(device)
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise EngineError("max_num_batched_tokens must be an integer >= 1")
        if not isinstance(block_size, int) or block_size < 1:
            raise EngineError("block_size must be an integer >= 1")
        if dtype is not None and dtype not in _DTYPES:
            raise EngineError(f"dtype must be one of {sorted(_DTYPES)}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.memory_budget_bytes = memory_budget_bytes
        self.block_size = block_size
        self.max_prefill_chunk = max_prefill_chunk
        self.dtype_override = dtype
        self.decode_buckets = tuple(decode_buckets)  # decode batch sizes padded to (graph buckets)
        self._slots: dict[str, ModelSlot] = {}
        self._req_model: dict[str, str] = {}
        self._pending: list[RequestOutput] = []
        # Seeds for requests that bring none; instance-owned so two engines never share a stream.
        self._seed_rng = random.Random(seed) if seed is not None else random.SystemRandom()

    # -- models ----------------------------------------------------------------------------
    def _dtype_for(self, cfg: ModelConfig) -> torch.dtype:
        if self.dtype_override:
            return _DTYPES[self.dtype_override]
        if self.device.type == "cpu":
            return torch.float32  # CPU matmuls in half precision are slow and inexact
        return torch.bfloat16 if cfg.dtype == "float32" else _DTYPES[cfg.dtype]

    def _kv_budget(self, weight_bytes: int, workspace: int) -> int:
        used = sum(s.device_bytes for s in self._slots.values()) + weight_bytes + workspace
        if self.memory_budget_bytes is not None:
            total = int(self.memory_budget_bytes)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * GPU_BUDGET_FRACTION) - workspace
        else:
            total = DEFAULT_CPU_BUDGET
        return total - used

    def load_model(self, name: str, model_dir: str | Path, max_model_len: int = 4096, max_num_seqs: int = 256,
                   weight: float = 1.0, *, num_kv_pages: int | None = None, block_size: int | None = None) -> ModelInfo:
        """Load weights, size the KV cache, and make the model schedulable."""
        if not isinstance(name, str) or not name:
            raise EngineError("model name must be a non-empty string")
        if name in self._slots:
            raise EngineError(f"model {name!r} is already loaded")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise EngineError("weight must be a positive number")
        for key, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise EngineError(f"{key} must be an integer >= 2, got {v!r}")
        cfg = load_model_config(model_dir)
        max_len = min(max_model_len, cfg.max_position_embeddings)
        if cfg.sliding_window is not None:
            max_len = min(max_len, cfg.sliding_window)  # inside the window attention is full
        bs = block_size or self.block_size
        dtype = self._dtype_for(cfg)
        model = LlamaModel(cfg, dtype, self.device)
        weight_bytes = load_weights(model, model_dir)
        model.build_rope_cache(max_len)
        spec = KVSpec(cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim, dtype)
        pages_per_seq = -(-max_len // bs)
        if num_kv_pages is None:
            # Activations of the largest step, with room for the float32 logits.
            workspace = self.max_num_batched_tokens * (cfg.hidden_size * 8 + cfg.intermediate_size * 4) * 4 \
                + max_num_seqs * cfg.vocab_size * 8
            avail = self._kv_budget(weight_bytes, workspace)
            num_kv_pages = min(max(avail, 0) // spec.page_bytes, pages_per_seq * max_num_seqs)
        if num_kv_pages < pages_per_seq:
            raise EngineError(
                f"model {name!r}: room for {num_kv_pages} KV pages, one {max_len}-token sequence needs {pages_per_seq}"
            )
        kv = KVCache.allocate(spec, num_kv_pages, self.device)
        try:
            sched = Scheduler(
                SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                max_model_len=max_len, max_prefill_chunk=self.max_prefill_chunk,
                                eos_token_ids=cfg.eos_token_ids),
                BlockManager(bs, PageAllocator(num_kv_pages)),
            )
        except SchedulerConfigError as e:
            raise EngineError(str(e)) from None
        runner = ModelRunner(model, kv, self.max_num_batched_tokens, max_num_seqs, max_len,
                             decode_buckets=self.decode_buckets)
        info = ModelInfo(name, cfg.vocab_size, max_len, list(cfg.eos_token_ids), weight_bytes + kv.nbytes,
                         num_kv_pages, bs)
        busy = [s.vtime for s in self._slots.values() if s.scheduler.has_unfinished()]
        self._slots[name] = ModelSlot(name, cfg, model, kv, runner, sched, float(weight), weight_bytes, info,
                                      vtime=min(busy) if busy else 0.0)
        return info

    def unload_model(self, name: str) -> None:
        """Abort what is left of the model's requests (reported by the next step) and free it."""
        slot = self._slots.get(name)
        if slot is None:
            raise EngineError(f"model {name!r} is not loaded")
        for req_id in [r for r, m in self._req_model.items() if m == name]:
            self.abort_request(req_id)
        del self._slots[name]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def models(self) -> dict[str, ModelInfo]:
        return {n: s.info for n, s in self._slots.items()}

    # -- requests --------------------------------------------------------------------------
    def add_request(self, req_id: str, model: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises :class:`RequestError` (an EngineError naming ``param``) on bad input."""
        if not isinstance(req_id, str) or not req_id:
            raise RequestError("req_id must be a non-empty string", "req_id")
        if req_id in self._req_model:
            raise RequestError(f"request {req_id!r} is already in flight", "req_id")
        slot = self._slots.get(model)
        if slot is None:
            raise RequestError(f"model {model!r} is not loaded", "model")
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams", "sampling")
        try:
            params.validate()
        except SamplingParamsError as e:
            raise RequestError(str(e), e.field) from e
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise RequestError("prompt_token_ids must be a non-empty list of token ids", "prompt_token_ids")
        vocab = slot.config.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestError(f"prompt token {t!r} is not an id of this model (0 <= id < {vocab})",
                                   "prompt_token_ids")
        max_len = slot.scheduler.config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise RequestError(f"prompt of {len(prompt_token_ids)} tokens does not fit max_model_len={max_len} "
                               f"with room for one generated token", "prompt_token_ids")
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(63))
        else:
            params = dataclasses.replace(params)  # the engine's own copy
        params.stop_token_ids = list(params.stop_token_ids)
        if not slot.scheduler.has_unfinished():
            # An idle model joins at the busy models' virtual time: no banked credit.
            busy = [s.vtime for s in self._slots.values() if s.scheduler.has_unfinished()]
            slot.vtime = max(slot.vtime, min(busy)) if busy else slot.vtime
        slot.scheduler.add(req_id, list(prompt_token_ids), params)
        self._req_model[req_id] = model

    def abort_request(self, req_id: str) -> None:
        """Abort; no-op when unknown or finished. Pages are freed now; the output comes next step."""
        model = self._req_model.pop(req_id, None)
        if model is None:
            return
        seq = self._slots[model].scheduler.abort(req_id)
        if seq is not None:
            self._pending.append(RequestOutput(req_id, [], "abort", None, seq.num_prompt_tokens))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or any(s.scheduler.has_unfinished() for s in self._slots.values())

    # -- the loop --------------------------------------------------------------------------
    def _pick(self) -> ModelSlot | None:
        busy = [s for s in self._slots.values() if s.scheduler.has_unfinished()]
        return min(busy, key=lambda s: s.vtime) if busy else None

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch of one model; outputs of every request that moved."""
        outs, self._pending = self._pending, []
        slot = self._pick()
        if slot is None:
            return outs
        t0 = time.perf_counter()
        sched_out = slot.scheduler.schedule()
        if sched_out.is_empty:
            # Nothing admissible (no pages for it now): charge a nominal step so the pick moves
            # on to the other models instead of choosing this one again forever.
            slot.vtime += slot.last_step_s / slot.weight
            return outs
        try:
            result = slot.runner.execute(sched_out)
        except Exception as e:
            # Keep the books straight: the batch's requests end as aborted (pages freed, outputs
            # queued for the next step), then the failure surfaces to the caller.
            for entry in sched_out.seqs:
                self.abort_request(entry.req_id)
            self._pending[:0] = outs
            raise EngineError(f"model {slot.name!r}: step failed: {type(e).__name__}: {e}") from e
        logprobs = {}
        for idx, entry in enumerate(e for e in sched_out.seqs if e.sample):
            logprobs[entry.req_id] = result.logprobs[idx]
        for seq in slot.scheduler.update(sched_out, result.token_ids):
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            lp = logprobs.get(seq.req_id)
            outs.append(RequestOutput(seq.req_id, [seq.token_ids[-1]], reason, [lp] if lp is not None else None,
                                      seq.num_prompt_tokens))
            if reason is not None:
                self._req_model.pop(seq.req_id, None)
        slot.steps += 1
        slot.last_step_s = time.perf_counter() - t0  # measured after the token copy (the host sync)
        slot.vtime += slot.last_step_s / slot.weight
        return outs

    def stats(self) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "running": s.scheduler.num_running,
                "waiting": s.scheduler.num_waiting,
                "kv_pages_used": s.scheduler.blocks.num_used_pages,
                "kv_pages_total": s.scheduler.blocks.num_total_pages,
                "device_bytes": s.device_bytes,
            }
            for name, s in self._slots.items()
        }
