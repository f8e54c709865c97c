"""EngineCore's model half: validate, book, load (or restore from the warm tier), unload.

A mixin of :class:`engine.core.EngineCore` (split out so each file stays short); it uses the
core's ``ledger``, ``pool``, ``picker``, ``warm_tier``, ``_slots``, ``device`` and limits. Order of
a load: check the arguments and the config (nothing touched) → the ledger's verdict (refusal
with the numbers, before the device is touched) → fit the pool → book the weights → build the
model → pages, scheduler, runner (graphs) → measured warm-up → schedulable.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig, load_model_config
from engine.core_memory import LoadNeeds, load_needs
from engine.core_types import ModelInfo, ModelSlot
from engine.errors import EngineError
from engine.loader import load_or_restore, stash_weights, warm_key
from engine.memory import LoadPlan, LoadRefused
from engine.models.llama import LlamaModel
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError

if TYPE_CHECKING:  # pragma: no cover
    from engine.fair_share import FairSharePicker
    from engine.memory import MemoryLedger
    from engine.page_pool import PagePool
    from engine.warm_tier import WarmTier

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoader:
    """The load/unload half of EngineCore."""

    ledger: "MemoryLedger"
    pool: "PagePool | None"
    picker: "FairSharePicker"
    warm_tier: "WarmTier | None"
    device: torch.device
    dtype_override: str | None
    block_size: int
    max_num_batched_tokens: int
    max_prefill_chunk: int | None
    page_bytes: int | None
    warmup: bool
    _slots: dict[str, ModelSlot]
    _req_model: dict[str, str]

    def _settle(self) -> None:  # pragma: no cover - EngineCore's: finish the step in flight
        raise NotImplementedError
    # -- models ----------------------------------------------------------------------------
    def _dtype_for(self, cfg: ModelConfig) -> torch.dtype:
        if self.dtype_override:
            return DTYPES[self.dtype_override]
        if self.device.type == "cpu":
            return torch.float32  # CPU matmuls in half precision are slow and inexact
        return torch.bfloat16 if cfg.dtype == "float32" else DTYPES[cfg.dtype]

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
        self._settle()  # no step in flight while pages, pool and slots change
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
        self._settle()
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

