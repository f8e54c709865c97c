"""EngineCore: loaded models, their requests, and the step loop (docs/architecture.md).

Several models share one device under one budget (docs/multi-model.md): a
:class:`~engine.memory.MemoryLedger` books every byte (weights, workspace, the KV pool), one
:class:`~engine.page_pool.PagePool` holds the KV pages of every model (a guaranteed minimum
each, the rest to whoever asks), and a :class:`~engine.fair_share.FairSharePicker` chooses
which model runs each step (weighted fair share of measured step time). Each loaded model is a
:class:`ModelSlot` with its own scheduler, block manager (over the pool's allocator for it)
and runner (over the pool's views). Outputs of aborts and unloads are returned by the next step.

Pool size policy: the pool is re-created only when no sequence holds a page, so a resize never
copies KV data. A load computes the pool's target (the budget beside all weights and workspace,
capped by what the models can use); if the pool must shrink to make room for the weights, or
grow to back the new model's minimum, while sequences are live, those sequences are preempted
(they recompute later, token-identical); a mere grow waits until the pool is idle. An unload
trims the pool when it leaves it idle.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig, load_model_config
from engine.core_memory import DEFAULT_CPU_BUDGET, GPU_BUDGET_FRACTION, LoadNeeds, load_needs, make_ledger
from engine.core_pool import PoolKeeper
from engine.core_types import ModelInfo, ModelSlot, RequestOutput
from engine.errors import EngineError, RequestError
from engine.fair_share import FairSharePicker
from engine.loader import load_or_restore, stash_weights, warm_key
from engine.warm_tier import WarmTier
from engine.cuda_graphs import DEFAULT_BUCKETS
from engine.memory import LoadPlan, LoadRefused
from engine.models.llama import LlamaModel
from engine.page_pool import PagePool
from engine.sampling import SamplingParams, SamplingParamsError
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError

__all__ = ["DEFAULT_CPU_BUDGET", "GPU_BUDGET_FRACTION", "EngineCore", "LoadPlan", "LoadRefused",
           "ModelInfo", "ModelSlot", "RequestOutput"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


class EngineCore(PoolKeeper):
    """Loads models and steps their requests. Not thread-safe: one caller drives it.

    ``memory_budget`` (or the older ``memory_budget_bytes``): bytes, or on CUDA a fraction of
    the device's total; None: 90 % of what CUDA has free now, 4 GiB on CPU. ``page_bytes``: the
    pool's page size; None: set by the first load to ``block_size`` tokens of that model.
    ``warmup``: run one largest-batch step at load to measure the workspace (None: on CUDA).
    """

    def __init__(self, device: str = "auto", max_num_batched_tokens: int = 2048,
                 memory_budget_bytes: int | None = None, *, block_size: int = 16,
                 max_prefill_chunk: int | None = None, dtype: str | None = None, seed: int | None = None,
                 decode_buckets: tuple[int, ...] | None = None, memory_budget: int | float | None = None,
                 page_bytes: int | None = None, warmup: bool | None = None, warm_tier_bytes: int = 0) -> None:
        self.device = resolve_device(device)
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise EngineError("max_num_batched_tokens must be an integer >= 1")
        if not isinstance(block_size, int) or block_size < 1:
            raise EngineError("block_size must be an integer >= 1")
        if dtype is not None and dtype not in _DTYPES:
            raise EngineError(f"dtype must be one of {sorted(_DTYPES)}")
        if memory_budget is not None and memory_budget_bytes is not None:
            raise EngineError("give memory_budget or memory_budget_bytes, not both")
        if page_bytes is not None and (isinstance(page_bytes, bool) or not isinstance(page_bytes, int)
                                       or page_bytes < 1):
            raise EngineError("page_bytes must be a positive integer")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.max_prefill_chunk = max_prefill_chunk
        self.dtype_override = dtype
        if decode_buckets is None:  # CUDA graphs by default where they exist; none on CPU
            decode_buckets = DEFAULT_BUCKETS if self.device.type == "cuda" else ()
        self.decode_buckets = tuple(decode_buckets)  # decode batch sizes padded to (graph buckets)
        if isinstance(warm_tier_bytes, bool) or not isinstance(warm_tier_bytes, int) or warm_tier_bytes < 0:
            raise EngineError("warm_tier_bytes must be an integer >= 0")
        # Host copies of unloaded models' weights, so a reload is one device copy.
        self.warm_tier = WarmTier(warm_tier_bytes) if warm_tier_bytes else None
        self.page_bytes = page_bytes
        self.warmup = self.device.type == "cuda" if warmup is None else bool(warmup)
        self._budget_arg = memory_budget if memory_budget is not None else memory_budget_bytes
        self.ledger = make_ledger(self._budget_arg, self.device)
        self.pool: PagePool | None = None  # created by the first load (it knows the page size)
        self.picker = FairSharePicker()
        self._slots: dict[str, ModelSlot] = {}
        self._req_model: dict[str, str] = {}
        self._pending: list[RequestOutput] = []
        # Seeds for requests that bring none; instance-owned so two engines never share a stream.
        self._seed_rng = random.Random(seed) if seed is not None else random.SystemRandom()

    @property
    def memory_budget_bytes(self) -> int | float | None:
        """The budget as given (None: the default); ``memory()["budget"]`` is the resolved bytes."""
        return self._budget_arg

    @memory_budget_bytes.setter
    def memory_budget_bytes(self, value: int | float | None) -> None:
        if self._slots:
            raise EngineError("the memory budget can only change while no model is loaded")
        self.ledger = make_ledger(value, self.device)
        self._budget_arg = value

    # -- models ----------------------------------------------------------------------------
    def _dtype_for(self, cfg: ModelConfig) -> torch.dtype:
        if self.dtype_override:
            return _DTYPES[self.dtype_override]
        if self.device.type == "cpu":
            return torch.float32  # CPU matmuls in half precision are slow and inexact
        return torch.bfloat16 if cfg.dtype == "float32" else _DTYPES[cfg.dtype]

    def _check_load_args(self, name: str, weight: float, max_model_len: int, max_num_seqs: int) -> None:
        """The arguments every load takes, checked before any file is read."""
        if not isinstance(name, str) or not name:
            raise EngineError("model name must be a non-empty string")
        if name in self._slots:
            raise EngineError(f"model {name!r} is already loaded")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise EngineError("weight must be a positive number")
        for key, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 2:
                raise EngineError(f"{key} must be an integer >= 2, got {v!r}")

    def _prepare(self, name: str, model_dir: str | Path, max_model_len: int, max_num_seqs: int,
                 weight: float, num_kv_pages: int | None,
                 block_size: int | None) -> tuple[ModelConfig, int, torch.dtype, LoadNeeds]:
        """Validate a load and compute what it needs; touches nothing."""
        self._check_load_args(name, weight, max_model_len, max_num_seqs)
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or block_size < 1):
            raise EngineError("block_size must be an integer >= 1")
        cfg = load_model_config(model_dir)
        max_len = min(max_model_len, cfg.max_position_embeddings)
        if cfg.sliding_window is not None:
            max_len = min(max_len, cfg.sliding_window)  # inside the window attention is full
        dtype = self._dtype_for(cfg)
        pool_pb = self.pool.page_bytes if self.pool is not None and self.pool.models() else self.page_bytes
        needs = load_needs(cfg, dtype, max_len=max_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=self.max_num_batched_tokens, pool_page_bytes=pool_pb,
                           block_size=block_size or self.block_size,
                           explicit_block_size=block_size is not None, num_kv_pages=num_kv_pages)
        return cfg, max_len, dtype, needs

    def check_load(self, name: str, model_dir: str | Path, max_model_len: int = 4096, max_num_seqs: int = 256,
                   *, num_kv_pages: int | None = None, block_size: int | None = None,
                   evictable: tuple[str, ...] | list[str] = ()) -> LoadPlan:
        """The plan of a load without doing it: which of ``evictable`` (idle models, least recently
        used first) must be unloaded first, and the numbers; raises :class:`LoadRefused` (with
        ``needed``/``free``/``evictable``/``budget``/``short``) when even that is not enough."""
        _, _, _, needs = self._prepare(name, model_dir, max_model_len, max_num_seqs, 1.0, num_kv_pages, block_size)
        return self.ledger.check_load(name, needs.weight_bytes, needs.workspace_bytes, needs.min_kv_bytes,
                                      evictable=list(evictable))

    def load_model(self, name: str, model_dir: str | Path, max_model_len: int = 4096, max_num_seqs: int = 256,
                   weight: float = 1.0, *, num_kv_pages: int | None = None, block_size: int | None = None,
                   evictable: tuple[str, ...] | list[str] = ()) -> ModelInfo:
        """Book, load weights, give the model its KV pages and make it schedulable.

        A load that does not fit now raises :class:`LoadRefused` before the device is touched;
        with ``evictable`` its ``evict`` names the idle models whose unload would make room.
        """
        cfg, max_len, dtype, needs = self._prepare(name, model_dir, max_model_len, max_num_seqs, weight,
                                                   num_kv_pages, block_size)
        try:
            plan = self.ledger.check_load(name, needs.weight_bytes, needs.workspace_bytes, needs.min_kv_bytes)
        except LoadRefused as e:
            raise self._refusal(name, needs, e, evictable) from None
        self._fit_pool(needs, plan.kv_pool_bytes_after)
        try:
            self.ledger.reserve_weights(name, needs.weight_bytes, workspace_estimate=needs.workspace_bytes,
                                        min_kv_bytes=needs.min_kv_bytes)
        except EngineError:
            self._fit_pool(None, None)
            raise
        try:
            return self._build(name, model_dir, cfg, max_len, dtype, needs, max_num_seqs, float(weight))
        except BaseException:
            if self.pool is not None and name in self.pool.models():
                self.pool.free_all(name)
                self.pool.unregister(name)
            self.ledger.release(name)
            self._slots.pop(name, None)
            if name in self.picker:
                self.picker.remove_model(name)
            self._release_device_memory()
            self._fit_pool(None, None)
            raise

    def _refusal(self, name: str, needs: LoadNeeds, e: LoadRefused, evictable) -> LoadRefused:
        """The refusal with what evicting the offered models (those loaded here) would do."""
        offered = tuple(m for m in dict.fromkeys(evictable) if m in self.ledger)  # an offer may be stale
        if not offered:
            return e
        try:
            plan = self.ledger.check_load(name, needs.weight_bytes, needs.workspace_bytes, needs.min_kv_bytes,
                                          evictable=list(offered))
        except LoadRefused as full:
            return full
        snap = self.ledger.snapshot()
        total = sum(snap.weights[m] + snap.workspace[m] + snap.kv_min[m] for m in offered)
        return LoadRefused(name, needed=e.needed, free=e.free, evictable=total, budget=e.budget,
                           evictable_models=offered, parts=e.parts, evict=plan.evict)

    def _build(self, name: str, model_dir: str | Path, cfg: ModelConfig, max_len: int, dtype: torch.dtype,
               needs: LoadNeeds, max_num_seqs: int, weight: float) -> ModelInfo:
        model = LlamaModel(cfg, dtype, self.device)
        key = warm_key(name, model_dir)
        weight_bytes, _source = load_or_restore(model, model_dir, self.warm_tier, key)
        model.build_rope_cache(max_len)
        self.pool.register(name, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           dtype=dtype, min_pages=needs.min_pages, max_pages=needs.want_pages,
                           tokens_per_page=needs.tokens_per_page)
        pages = self.pool.allocator_for(name)
        try:
            sched = Scheduler(
                SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                max_model_len=max_len, max_prefill_chunk=self.max_prefill_chunk,
                                eos_token_ids=cfg.eos_token_ids),
                BlockManager(needs.tokens_per_page, pages),
            )
        except SchedulerConfigError as e:
            raise EngineError(str(e)) from None
        slot = ModelSlot(name, cfg, model, None, None, sched, weight, weight_bytes,
                         ModelInfo(name, cfg.vocab_size, max_len, list(cfg.eos_token_ids), 0, 0, 0),
                         pages=pages, needs=needs, max_num_seqs=max_num_seqs,
                         workspace_bytes=needs.workspace_bytes, warm_key=key)
        self._slots[name] = slot
        before = self._device_allocated()
        self._attach_runner(slot)
        if self.warmup:
            self._warm_up(slot)
        measured = self._device_peak() - before if self.device.type == "cuda" else None
        if measured is not None:
            # Graph pools and the warm-up's activations, measured; never below the estimate,
            # because the warm-up may not have reached the largest step's peak.
            slot.workspace_bytes = max(measured, needs.workspace_bytes)
            self.ledger.record_workspace(name, slot.workspace_bytes)
        self.picker.add_model(name, weight)
        slot.info = ModelInfo(name, cfg.vocab_size, max_len, list(cfg.eos_token_ids),
                              weight_bytes + slot.workspace_bytes + needs.min_kv_bytes, pages.num_total,
                              needs.tokens_per_page)
        return slot.info

    def unload_model(self, name: str) -> None:
        """Abort what is left of the model's requests (reported by the next step) and free it:
        every page back to the pool, every byte out of the ledger; the pool is trimmed when idle."""
        slot = self._slots.get(name)
        if slot is None:
            raise EngineError(f"model {name!r} is not loaded")
        for req_id in [r for r, m in self._req_model.items() if m == name]:
            self.abort_request(req_id)
        if slot.warm_key is not None and slot.model is not None:
            stash_weights(self.warm_tier, slot.warm_key, slot.model)
        del self._slots[name]
        if name in self.picker:
            self.picker.remove_model(name)
        pooled = slot.pages is not None
        slot.runner = slot.kv = slot.model = None
        del slot
        if pooled:
            self.pool.free_all(name)  # the backstop: the aborts freed them through the block manager
            self.pool.unregister(name)
            self._release_device_memory()
            self.ledger.release(name)
            self._fit_pool(None, None)
        else:
            self._release_device_memory()

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
        busy = [n for n, s in self._slots.items() if s.scheduler.has_unfinished()]
        for n in busy:
            if n not in self.picker:  # a slot added by a subclass without the picker
                self.picker.add_model(n, self._slots[n].weight)
        name = self.picker.pick(busy)
        return self._slots[name] if name is not None else None

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
            self.picker.charge(slot.name, slot.last_step_s)
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
        self.picker.charge(slot.name, slot.last_step_s)
        return outs

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per model: requests, KV pages (used, and the most it could hold now) and device
        bytes (weights + workspace + the pages it holds); ``memory()`` has the split by kind."""
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
