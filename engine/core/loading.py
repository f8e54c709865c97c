"""ModelLoader: validate, book, load (or restore from the warm tier) and unload models.

A load is one :class:`~engine.load_spec.LoadSpec` (and, per attempt, the models the caller would
evict). The loader owns the load in flight (its :class:`PendingLoad`) and adds and removes the
models of the core's :class:`~engine.core.model_table.ModelTable`; the bytes are booked through
the :class:`~engine.core.pool_keeper.PoolKeeper`'s verbs (``plan``, ``book``, ``pages_for``,
``record_workspace``, ``release``, ``trim``), the step share through the
:class:`~engine.core.fair_share.FairSharePicker`, and unloaded weights go to the
:class:`~engine.weights.warm_tier.WarmTier`. ``settle`` (the core's) finishes the step in flight
before anything a step reads (pages, pool, slots) changes: the step and its outputs are the
core's, and the loader settles at points inside its phases that the core does not see.

A load has three phases, so a caller that keeps stepping other models is not paused by the
seconds a large model's weights take (:meth:`ModelLoader.begin_load`, then ``finish_load``):

1. on the caller's thread: check the spec against this engine and the config (nothing touched) →
   the ledger's verdict (a refusal with the numbers, before the device is touched) → fit the
   pool → book the weights → register the model's pages in the pool (its minimum is held back
   from then on): ``PoolKeeper.book``;
2. in a load thread: build the model, read its weights (or restore them from the warm tier) on
   side streams, the rope cache; an event recorded behind them orders the caller's later use;
3. back on the caller's thread: scheduler, runner (graph capture), the measured warm-up (skipped
   when the warm tier or the load notes hold the workspace figure of this model at this shape)
   → schedulable.

``load_model`` is the three in a row. One load is in flight at a time; a failed or cancelled
load releases exactly what it booked. ``last_load_timings`` has each phase's seconds.
"""

from __future__ import annotations

import contextlib
import logging
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ModelConfig, attention_pair_cost, load_model_config, mlp_names, usable_len
from engine.core.fair_share import FairSharePicker
from engine.core.ledger import LoadPlan
from engine.core.load_notes import LoadNotes
from engine.core.memory_plan import LoadNeeds, Workspace, load_needs, workspace_margin
from engine.core.model_table import ModelTable
from engine.core.pool_keeper import PoolKeeper
from engine.core.slot import ModelInfo, ModelSlot
from engine.core.vacancy import Vacancy
from engine.errors import EngineError, LoadOptionError, WeightsError
from engine.load_spec import LoadSpec
from engine.options import DTYPE_NAMES, EngineOptions
from engine.kernels.fp8 import fp8_supported
from engine.kernels.fp8_format import FP8
from engine.models.llama import QUANTIZATIONS, LlamaModel
from engine.runner.capture_gate import CaptureGate
from engine.runner.cuda_graphs import DEFAULT_MIXED_BUCKETS
from engine.runner.prebuild import RunnerBuild, prebuild_wanted
from engine.sched.block_manager import BlockManager
from engine.sched.prefix_index import PrefixIndex
from engine.sched.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError
from engine.weights.loader import WeightsReady, load_or_restore, stash_weights, warm_key
from engine.weights.warm_tier import WarmTier

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
log = logging.getLogger(__name__)


def workspace_key(cfg: ModelConfig, quantization: str | None) -> str:
    """What a load's measured workspace (graph pools, the largest step's activations) depends on
    besides its shape: the computation (the config) and the weights' format on the device, not
    the files' identity or the model's name. Twelve names of one 8B (or a pre-quantized FP8
    checkpoint and one quantized at load) share one measurement, so only the first load of a
    kind warms up on the step thread, where every other model's steps wait for it."""
    # Not the checkpoint's own dtype (the device's is in the shape), nor the tokens that end a
    # sequence; a checkpoint pre-quantized per channel lands on the device as a quantization at
    # load does (other FP8 layouts keep their scales' shapes, so they stay apart).
    skip = {"raw", "dtype", "fp8_checkpoint", "eos_token_ids", "bos_token_id"}
    fields = sorted((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in skip)
    layout = None if cfg.fp8_checkpoint in (None, "channel") else cfg.fp8_checkpoint
    doc = repr((fields, quantization, layout))
    return "compute:" + hashlib.sha256(doc.encode()).hexdigest()[:32]


def weights_key(model_dir: str | Path, compute_key: str, dtype: torch.dtype) -> str:
    """The warm-tier key of a load's device bytes: its files' identity, its computation (the
    quantization in it) and the device dtype (engine/weights/loader.py ``warm_key``); names that
    load the same files the same way share one copy."""
    return warm_key(model_dir, f"{compute_key}|{dtype}")


# A model loaded at its own context never goes below this many tokens for lack of room (below it
# the ledger evicts or refuses as for any load); 4,096 was the fixed default before.
CONTEXT_FLOOR = 4096


def scheduler_config(cfg: ModelConfig, options: EngineOptions, max_num_seqs: int, max_len: int) -> SchedulerConfig:
    """A load's scheduler limits: the engine's step budgets, the load's sequences and context,
    the model's end ids and its attention's cost (engine.config.attention_pair_cost)."""
    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
                           max_model_len=max_len, max_prefill_chunk=options.max_prefill_chunk,
                           eos_token_ids=cfg.eos_token_ids, attention_cost=attention_pair_cost(cfg),
                           decode_step_tokens=options.decode_step_tokens)


def context_cap(own: int, room_bytes: int, page_bytes: int, tokens_per_page: int) -> int:
    """The longest sequence of a load at its own context (``own`` tokens) whose pages fit
    ``room_bytes``, in whole pages, never below ``CONTEXT_FLOOR`` (or ``own`` when shorter)."""
    fit = max(0, room_bytes) // page_bytes * tokens_per_page
    return min(own, max(min(own, CONTEXT_FLOOR), fit))


KV_CACHE_DTYPES = ("fp8",)


def kv_dtype_for(kv_cache_dtype: str | None, device: torch.device) -> torch.dtype | None:
    """The KV cache's dtype for a load's ``kv_cache_dtype`` (None: the model's own dtype), or an
    LoadOptionError with the reason. ``"fp8"``: e4m3 at unit scale (K and V of the Llama family stay
    far inside e4m3's +-448; a value beyond saturates), a byte an element: a page holds twice
    the tokens of a bf16 one."""
    if kv_cache_dtype is None:
        return None
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise LoadOptionError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: {', '.join(KV_CACHE_DTYPES)}")
    ok, why = fp8_supported(device)
    if not ok:
        raise LoadOptionError(f"kv_cache_dtype {kv_cache_dtype!r}: {why}")
    return FP8


def load_quantization(cfg: ModelConfig, asked: str | None) -> str | None:
    """The quantization a load runs with: the one asked for, or "fp8" for a pre-quantized FP8
    checkpoint (its format decides: its bf16 weights do not exist)."""
    return asked or ("fp8" if cfg.fp8_checkpoint else None)


def check_quantization(quantization: str | None, cfg: ModelConfig, device: torch.device) -> None:
    """Refuse (LoadOptionError, with the reason) a quantization this engine, model or device cannot run."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise LoadOptionError(f"quantization {quantization!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
    ok, why = fp8_supported(device)
    if not ok:
        raise LoadOptionError(f"quantization {quantization!r}: {why}")
    sizes = [("hidden_size", cfg.hidden_size),
             (mlp_names(cfg.family).dense_size_key, cfg.intermediate_size),
             ("num_attention_heads * head_dim", cfg.q_size), ("num_key_value_heads * head_dim", cfg.kv_size)]
    if cfg.shared_expert_intermediate_size:  # the shared expert is a dense FP8 MLP of the experts' size
        sizes.append(("intermediate_size", cfg.shared_expert_intermediate_size))
    for key, v in sizes:
        if v % 16:
            raise LoadOptionError(f"quantization {quantization!r}: {key} = {v} is not a multiple of 16 (FP8 GEMMs need it)")


def dtype_for(cfg: ModelConfig, override: str | None, device: torch.device) -> torch.dtype:
    """The dtype a model runs in: ``override`` (a DTYPES name), else float32 on CPU (half-precision
    matmuls there are slow and inexact), else the checkpoint's half type (bfloat16 for float32)."""
    if override:
        return DTYPES[override]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if cfg.dtype == "float32" else DTYPES[cfg.dtype]


@dataclass
class PendingLoad:
    """A load between its phases: booked in the ledger and the pool, its weights being read in a
    load thread. Everything it is loaded with is decided before it is made (``begin_load``);
    what changes afterwards is the load's progress: ``timings`` (each phase's seconds), the
    thread's ``future`` (takes a done callback, run on the load thread), ``cancel``, and ``trim``
    (an unload meanwhile left the pool to be trimmed when this load ends). ``done()`` is true
    once ``finish_load`` would not block."""

    spec: LoadSpec
    cfg: ModelConfig
    max_len: int  # spec.max_model_len capped by the model's context
    dtype: torch.dtype
    needs: LoadNeeds
    quantization: str | None  # what the load runs with (a pre-quantized checkpoint is "fp8")
    key: str  # the weights' warm-tier key (warm_key)
    compute_key: str  # what the model computes (workspace_key): the load notes' key
    shape: str  # what its measured workspace depends on besides the weights (the load's shape)
    prebuild: bool  # build the runner beside the weights (engine.runner.prebuild)
    vacancy: Vacancy | None  # an unloaded model's tensors and runner it loads into (engine/core/vacancy.py)
    started: float
    timings: dict[str, float] = field(default_factory=dict)
    future: Future = field(default_factory=Future)
    cancel: threading.Event = field(default_factory=threading.Event)
    trim: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    def done(self) -> bool:
        return self.future.done()


def drop_result(p: PendingLoad) -> None:
    """Forget a finished load thread's model, so its device memory goes with the undo."""
    f = p.future
    if f.done() and not f.cancelled() and f.exception() is None:
        p.future = Future()
        p.future.cancel()


class ModelLoader:
    """Loads and unloads the models of one engine (see the module docstring).

    ``slots``: the core's :class:`~engine.core.model_table.ModelTable` (a model enters it at
    install, leaves at unload). ``options``: the engine's; every load is built with its limits (``dtype``,
    ``block_size``, ``max_num_batched_tokens``, ``max_prefill_chunk``, ``page_bytes``, ``warmup``,
    ``prebuild_runner``). ``warm_tier``: the host copies of unloaded weights (None: off; a
    benchmark may swap it). ``notes``: measured workspaces kept across processes (None: this
    process only).
    """

    def __init__(self, pools: PoolKeeper, slots: ModelTable, picker: FairSharePicker,
                 warm_tier: WarmTier | None, settle: Callable[[], None], options: EngineOptions, *,
                 device: torch.device, notes: LoadNotes | None = None) -> None:
        self._pools = pools
        self._slots = slots
        self._picker = picker
        self.warm_tier = warm_tier
        self._settle = settle
        self.device = device
        self.options = options
        self.block_size = options.block_size
        self.max_num_batched_tokens = options.max_num_batched_tokens
        self.max_prefill_chunk = options.max_prefill_chunk
        self.page_bytes = options.page_bytes
        # the measured warm-up at load (None in the options: on CUDA)
        self.warmup = device.type == "cuda" if options.warmup is None else options.warmup
        self.prebuild_runner = options.prebuild_runner  # None: on CUDA (engine/runner/prebuild.py)
        self.notes = notes
        self.pending: PendingLoad | None = None  # the load in flight
        self.last_load_timings: dict[str, float] = {}

    def dtype_for(self, cfg: ModelConfig) -> torch.dtype:
        """The dtype a model of ``cfg`` runs in on this engine."""
        return dtype_for(cfg, self.options.dtype, self.device)

    def check_new(self, name: str) -> None:
        """Refuse a load of a model that is loaded or loading here (the spec checked itself)."""
        if name in self._slots:
            raise EngineError(f"model {name!r} is already loaded")
        if self.pending is not None and self.pending.name == name:
            raise EngineError(f"model {name!r} is already loading")

    def _prepare(self, spec: LoadSpec) -> tuple[ModelConfig, str | None, int, torch.dtype, LoadNeeds]:
        """Validate a load here and compute what it needs (config, quantization, usable length,
        dtype, needs); touches nothing."""
        self.check_new(spec.name)
        cfg = load_model_config(spec.model_dir)
        quantization = load_quantization(cfg, spec.quantization)
        check_quantization(quantization, cfg, self.device)
        kv_dtype = kv_dtype_for(spec.kv_cache_dtype, self.device)
        max_len = usable_len(cfg, spec.max_model_len)
        dtype = self.dtype_for(cfg)
        if quantization and self.device.type == "cuda" and dtype != torch.bfloat16:
            # cuBLASLt's row-wise FP8 GEMM writes bf16 (float32 only on some GPUs and cuBLAS versions)
            raise LoadOptionError(f"quantization {quantization!r} runs in bfloat16 on a GPU, not {dtype}")
        pool_pb = self._pools.shared_page_bytes()
        if pool_pb is None:
            pool_pb = self.page_bytes

        def needs_at(length: int) -> LoadNeeds:
            return load_needs(cfg, dtype, max_len=length, max_num_seqs=spec.max_num_seqs,
                              max_num_batched_tokens=self.max_num_batched_tokens, pool_page_bytes=pool_pb,
                              block_size=spec.block_size or self.block_size,
                              explicit_block_size=spec.block_size is not None, num_kv_pages=spec.num_kv_pages,
                              quantization=quantization, kv_dtype=kv_dtype)

        compute_key = workspace_key(cfg, quantization)
        key = weights_key(spec.model_dir, compute_key, dtype)

        def with_known(n: LoadNeeds, length: int) -> LoadNeeds:
            # A workspace measured before at this shape is what this load will hold: booked in
            # place of the estimate (which, made for any model, was 2.4x the measured 0.61 GiB of
            # an 8B at the density bench's shape: H100, docs/perf.md, the room probe rows).
            known = self._known_workspace(key, compute_key, self._workspace_shape(spec.max_num_seqs, length, dtype, n))
            return n if known is None else dataclasses.replace(n, workspace=known)

        needs = with_known(needs_at(max_len), max_len)
        if spec.max_model_len is None and spec.num_kv_pages is None:
            capped = context_cap(max_len, self._pools.room() - self._pools.beside_pool(needs),
                                 needs.page_bytes, needs.tokens_per_page)
            if capped < max_len:
                log.warning("model %s: max_model_len %d, not its context of %d: one sequence of that does not "
                            "fit the %d bytes the budget has beside the models loaded (set max_model_len to "
                            "choose)", spec.name, capped, max_len, self._pools.room())
                max_len, needs = capped, with_known(needs_at(capped), capped)
        return cfg, quantization, max_len, dtype, needs

    def check_load(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> LoadPlan:
        """The plan of a load without doing it: which of ``evictable`` (idle models, least recently
        used first) must be unloaded first, and the numbers; raises :class:`~engine.core.ledger.LoadRefused` (with
        ``needed``/``free``/``evictable``/``budget``/``short``) when even that is not enough."""
        return self._pools.plan(spec.name, self._prepare(spec)[4], evictable)

    def load_model(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> ModelInfo:
        """Book, load weights, give the model its KV pages and make it schedulable.

        A load that does not fit now raises :class:`~engine.core.ledger.LoadRefused` before the device is touched;
        with ``evictable`` its ``evict`` names the idle models whose unload would make room.
        The three phases in a row (the weights still read in the load thread).
        """
        return self.finish_load(self.begin_load(spec, evictable))

    def begin_load(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> PendingLoad:
        """Phase 1 of a load on this thread (validate, the ledger's verdict, fit the pool, book the
        weights, register the pages), then start phase 2 (the weights) in a load thread.

        Raises what ``load_model`` raises for a refusal or a bad argument, with nothing booked;
        an ``EngineError`` while another load is in flight. Every returned load must be ended
        by :meth:`finish_load` or :meth:`cancel_load`: until then its books stay taken.
        """
        t0 = time.perf_counter()
        name = spec.name
        cfg, quantization, max_len, dtype, needs = self._prepare(spec)
        if self.pending is not None:
            raise EngineError(f"model {self.pending.name!r} is loading; one load at a time")
        t1 = time.perf_counter()
        self._settle()  # no step in flight while pages, pool and slots change
        # Its pages registered now, not after the weights: while they load, other models' bursts
        # must not take the pages its minimum needs.
        compute_key = workspace_key(cfg, quantization)
        key = weights_key(spec.model_dir, compute_key, dtype)
        shape = self._workspace_shape(spec.max_num_seqs, max_len, dtype, needs)
        vacancy = self._pools.claim(compute_key, shape)  # the others go in book() if it needs their room
        if vacancy is not None:  # booked as the vacancy was: its graph pools are on the device already
            needs = dataclasses.replace(needs, workspace=vacancy.workspace)
        try:
            t_pool = self._pools.book(name, cfg, needs, evictable, vacancy)
        except BaseException:
            if vacancy is not None:
                self._pools.discard(vacancy, books=True)  # its memory (and books, if book() kept them)
            raise
        # Only while no other model is on the engine: on the H200, runners built on the load thread
        # beside other models' steps (12 FP8 8Bs loading under traffic) failed their decode-graph
        # capture (cudaErrorStreamCaptureInvalidated) and failed a stepping model's step
        # (cudaErrorStreamCaptureIsolation); the cause is not found yet (docs/multi-model.md). A
        # load beside others captures on the step thread in phase 3 instead.
        prebuild = self.warmup and self.prebuild_runner is not False and len(self._slots) == 0 and prebuild_wanted(
            self.device, self._known_workspace(key, compute_key, shape), allow_cpu=bool(self.prebuild_runner)) and (
            vacancy is None or vacancy.runner is None)
        pending = PendingLoad(spec, cfg, max_len, dtype, needs, quantization, key, compute_key, shape, prebuild,
                              vacancy, t0, timings={"config_s": t1 - t0, "book_s": time.perf_counter() - t1,
                                                    "pool_s": t_pool, "vacancy": 1.0 if vacancy else 0.0})
        self.pending = pending
        gate = self._pools.streams.gate if self._pools.streams is not None else None
        if gate is not None:  # no step captures a graph beside the load thread's device work
            gate.shut(name)
        try:
            threading.Thread(target=self._load_thread, args=(pending, gate), name=f"engine-load-{name}",
                             daemon=True).start()
        except BaseException:  # no thread: nothing of the load may stay taken
            if gate is not None:
                gate.reopen()
            self.pending = None
            self._undo_load(name, pending)
            raise
        return pending

    def _load_thread(self, p: PendingLoad, gate: CaptureGate | None) -> None:
        result, error, running = None, None, False
        try:
            running = p.future.set_running_or_notify_cancel()
            if running:
                try:
                    result = self._read_weights(p)
                except BaseException as e:  # handed to finish_load, which undoes the booking and raises it
                    # Without its traceback: the frames it holds would keep the half-filled weights alive.
                    error = e.with_traceback(None)
        finally:
            if gate is not None:
                gate.reopen()  # before the outcome: whoever waits on it may capture at once
        if not running:
            return
        if error is not None:
            p.future.set_exception(error)
        else:
            p.future.set_result(result)

    def _read_weights(self, p: PendingLoad) -> WeightsReady:
        """Phase 2, on the load thread: the model's tensors, filled, and the rope cache."""
        cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
            t0 = time.perf_counter()
            v, kept = p.vacancy, None
            if v is not None:
                # Same computation at the same shape: every tensor, the rope table (of this
                # context) included, is what a new model would allocate; only the weights differ.
                # Everything taken off the vacancy at once: if the read fails, this frame's end
                # lets it all go (nothing of it is booked any more).
                model, kept = v.model, (v.generation, v.kv, v.runner) if v.runner is not None else None
                v.model = v.kv = v.runner = None
                if v.landing is not None:  # the unload's stash still reads these tensors
                    v.landing.synchronize()
                model.cfg = p.cfg  # what the files are read by (an FP8 checkpoint's layout)
                ta = tb = time.perf_counter()
            else:
                model = LlamaModel(p.cfg, p.dtype, self.device, p.quantization)
                ta = time.perf_counter()
                model.build_rope_cache(p.max_len)  # computed, not read: before the runner build needs it
                tb = time.perf_counter()
            build = None
            if p.prebuild:
                gen = self._pools.generation
                build = RunnerBuild(lambda: (gen, *self._pools.new_runner(p.name, p.cfg, model, p.spec.max_num_seqs, p.max_len)),
                                    self.device, p.name, self._pools.streams)
            try:
                nbytes, source = load_or_restore(model, p.spec.model_dir, self.warm_tier, p.key, cancel=p.cancel)
            finally:
                built = build.result() if build is not None else None  # never left using the model
            key = p.key if source == "warm" or self._same_files(p) else None
            runner = kept or built  # a vacancy's is checked against the pool's generation at install
            ready = None
            if cuda:
                # The copies ran on side streams that were synchronised; the rope cache went on
                # this thread's current stream: the caller's stream waits on this event.
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            p.timings.update(alloc_s=ta - t0, rope_s=tb - ta, weights_s=time.perf_counter() - tb,
                             warm=1.0 if source == "warm" else 0.0,
                             prebuilt_runner_s=build.seconds if build is not None else 0.0)
            return WeightsReady(model, nbytes, source, ready, runner, key)

    @staticmethod
    def _same_files(p: PendingLoad) -> bool:
        """Whether the files just read are those the load's key was taken from. A pull commits a
        new snapshot by renaming it into place (new inodes), so a key taken again after the read
        differs when that happened in between: stashed under the old key, another version's
        bytes would be restored to a name still on the old files. (Only a second commit putting
        the first version's blobs back within one read could hide it.)"""
        try:
            return weights_key(p.spec.model_dir, p.compute_key, p.dtype) == p.key
        except (OSError, WeightsError):  # gone or half-replaced right now
            return False

    def finish_load(self, pending: PendingLoad) -> ModelInfo:
        """Phase 3: wait for the weights (if they are still coming), then install the model on
        this thread: scheduler, runner (graphs), warm-up, schedulable. On any failure, here or
        in the load thread, everything the load booked is released and the error raised."""
        if pending is not self.pending:
            raise EngineError(f"the load of {pending.name!r} is not in flight")
        t0 = time.perf_counter()
        weights = None
        try:
            weights = pending.future.result()
            t1 = time.perf_counter()
            self._settle()
            info = self._install(pending, weights)
        except BaseException:
            weights = None  # the traceback keeps this frame: the weights must not stay with it
            self.pending = None
            self._settle()
            drop_result(pending)
            self._undo_load(pending.name, pending)
            raise
        self.pending = None
        if pending.trim:
            self._pools.trim()  # the trim an unload skipped while this load was in flight
        self._pools.release_cached()
        pending.timings.update(wait_s=t1 - t0, total_s=time.perf_counter() - pending.started)
        self.last_load_timings = dict(pending.timings)
        return info

    def cancel_load(self, pending: PendingLoad) -> None:
        """Stop a load begun here: the weight read stops at its next chunk, then everything it
        booked is released (this waits for the load thread to let go of the weights)."""
        if pending is not self.pending:
            raise EngineError(f"the load of {pending.name!r} is not in flight")
        pending.cancel.set()
        try:
            pending.future.exception()  # wait; its outcome no longer matters
        finally:
            self.pending = None
            self._settle()
            drop_result(pending)
            self._undo_load(pending.name, pending)

    def _undo_load(self, name: str, pending: PendingLoad | None = None) -> None:
        """Release what a load booked: slot, picker entry, the vacancy it claimed (whatever of it
        the load thread did not take: its books went at booking), then its books
        (:meth:`_release_books`)."""
        if pending is not None and pending.vacancy is not None:
            self._pools.discard(pending.vacancy, give_back=False)  # the release below gives back
            pending.vacancy = None
        self._slots.remove(name)
        if name in self._picker:
            self._picker.remove_model(name)
        self._release_books(name)

    def _release_books(self, name: str) -> None:
        """A model's books (:meth:`PoolKeeper.release`); the pool's trim is left to the end of a
        load in flight."""
        self._pools.release(name, trim=self.pending is None)
        if self.pending is not None:
            self.pending.trim = True

    def _known_workspace(self, key: str, compute_key: str, shape: str) -> Workspace | None:
        """The workspace measured before at this shape: the warm tier's note of these weights,
        else the load notes of this computation (any model of the same config and quantization,
        this process or an earlier one); None without a warm-up to skip."""
        if not self.warmup:
            return None
        # (a Workspace: the tier keeps what unload() noted there)
        known = self.warm_tier.noted(key, shape) if self.warm_tier is not None else None
        if known is None and self.notes is not None:
            known = self.notes.get(compute_key, shape)
        return known

    def _workspace_shape(self, max_num_seqs: int, max_len: int, dtype: torch.dtype, needs: LoadNeeds) -> str:
        """What a measured workspace figure depends on besides the weights: the step's limits,
        the graphs captured at load, the block-table width and the KV cache's dtype (also what
        makes one runner serve another model: engine/core/vacancy.py)."""
        return repr((str(self.device), str(dtype), max_num_seqs, max_len, needs.tokens_per_page, needs.kv_dtype,
                     self.max_num_batched_tokens, self.max_prefill_chunk, tuple(self._pools.decode_buckets),
                     self._pools.cuda_graphs, self._pools.mixed_buckets or DEFAULT_MIXED_BUCKETS))

    def _install(self, p: PendingLoad, w: WeightsReady) -> ModelInfo:
        if w.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(w.ready)
        t0 = time.perf_counter()
        cfg, needs, spec, name = p.cfg, p.needs, p.spec, p.name
        pages = self._pools.pages_for(name)
        try:
            sched = Scheduler(
                scheduler_config(cfg, self.options, spec.max_num_seqs, p.max_len),
                # The index's salt: what else decides the K/V of a token at a position.
                BlockManager(needs.tokens_per_page, pages,
                             PrefixIndex(f"{p.key}|{p.dtype}|kv={spec.kv_cache_dtype}") if spec.prefix_caching else None),
            )
        except SchedulerConfigError as e:
            raise EngineError(str(e)) from None
        slot = ModelSlot(name, cfg, w.model, None, None, sched, float(spec.weight), w.nbytes,
                         ModelInfo(name, cfg.vocab_size, p.max_len, list(cfg.eos_token_ids), 0, 0, 0),
                         pages=pages, needs=needs, max_num_seqs=spec.max_num_seqs,
                         workspace=needs.workspace, warm_key=w.key, model_dir=spec.model_dir)
        self._slots.add(slot)
        # A vacancy's workspace was measured (or booked) for this computation at this shape.
        known = p.vacancy.workspace if p.vacancy is not None else self._known_workspace(
            p.key, p.compute_key, p.shape)
        # A runner built beside the weights (or a vacancy's) serves when nothing is to be measured
        # and the pool's memory is the one it was built on; otherwise it is dropped before the
        # measurement.
        pre, w.runner = w.runner, None
        if pre is not None and (known is None or pre[0] != self._pools.generation):
            pre = None
        cuda = self.device.type == "cuda"
        measure = self.warmup and known is None and cuda  # the warm-up's largest step too
        build = pre is None and cuda  # a runner built here: what it holds is measured
        held_before = self._pools.device_reserved() if build else 0
        self._pools.start_peak()
        t1 = time.perf_counter()
        if pre is not None:
            slot.kv, slot.runner = pre[1], pre[2]
        else:
            self._pools.attach_runner(slot)
        del pre
        t2 = time.perf_counter()
        if self.warmup and known is None:
            self._pools.warm_up(slot)
        t3 = time.perf_counter()
        if cuda:
            # What stays (graph pools whole, the runner's buffers, its streams' cuBLAS workspaces:
            # the allocator's segments once its cache is handed back) plus what steps the warm-up
            # does not take may add beside another model's step (workspace_margin); and what the
            # largest step run here (the warm-up's: every row sampled) took on top while it ran,
            # booked for all models from the largest (engine/core/ledger.py). Not floored by the
            # estimate, which booked 2.4x an 8B's measured figure (H100, docs/perf.md, the room
            # probe rows).
            step = max(0, self._pools.device_peak() - self._pools.device_allocated())
            held = (max(0, self._pools.device_reserved() - held_before) + workspace_margin(cfg, spec.max_num_seqs)
                    if build else 0)
            if measure:
                slot.workspace = Workspace(held, step)
            else:
                # Carried over (a vacancy, the warm tier's or the load notes' figure: this load
                # built its runner at most, whose eager runs at its largest buckets are less than
                # the warm-up's step), or no warm-up: each part floored by what was measured here.
                base = known if known is not None else needs.workspace
                slot.workspace = Workspace(max(held, base.held), max(step, base.step))
        else:
            slot.workspace = known if known is not None else needs.workspace
        self._pools.record_workspace(name, slot.workspace)
        if self.warmup and known is None and self.notes is not None:
            self.notes.put(p.compute_key, p.shape, slot.workspace)  # the next load of its kind books it
        self._picker.add_model(name, float(spec.weight))
        slot.info = ModelInfo(name, cfg.vocab_size, p.max_len, list(cfg.eos_token_ids),
                              w.nbytes + slot.workspace.held + needs.min_kv_bytes, pages.num_total,
                              needs.tokens_per_page, quantization=p.quantization, kv_cache_dtype=spec.kv_cache_dtype)
        p.timings.update(install_s=t1 - t0, runner_s=t2 - t1, warmup_s=t3 - t2,
                         warmup_skipped=1.0 if self.warmup and known is not None else 0.0,
                         measure_s=time.perf_counter() - t3)
        return slot.info

    def unload(self, name: str) -> None:
        """Free a loaded model whose requests are aborted and whose step is settled: weights to
        the warm tier (when it keeps them), every page back to the pool, every byte out of the
        ledger (its weights and runner kept as a vacancy, booked as such, for the next load: the
        next load takes or drops it); the pool is trimmed when idle."""
        slot = self._slots.get(name)
        stashed, landing = stash_weights(self.warm_tier, slot.warm_key, slot.model) if (
            slot.warm_key is not None and slot.model is not None) else (False, None)
        if stashed and self.warmup and slot.needs is not None:
            # The workspace booked for it was measured (or carried over): a reload at this shape
            # books the same figure and skips the warm-up step.
            shape = self._workspace_shape(slot.max_num_seqs, slot.scheduler.config.max_model_len,
                                          slot.model.dtype, slot.needs)
            self.warm_tier.note(slot.warm_key, shape, slot.workspace)
        self._slots.remove(name)
        if name in self._picker:
            self._picker.remove_model(name)
        # Its tensors and runner kept for the next load of its kind (engine/core/vacancy.py)
        kept = slot.needs is not None and slot.model is not None and self._pools.vacate(
            slot, workspace_key(slot.config, slot.info.quantization),
            self._workspace_shape(slot.max_num_seqs, slot.scheduler.config.max_model_len, slot.model.dtype,
                                  slot.needs), landing)
        slot.runner = slot.kv = slot.model = None
        del slot
        if not kept:
            self._release_books(name)
