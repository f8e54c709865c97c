"""EngineCore: loaded models, their requests, and the step loop (docs/architecture.md).

Several models share one device under one budget (docs/multi-model.md): a
:class:`~engine.core.ledger.MemoryLedger` books every byte (weights, workspace, the KV pool), one
:class:`~engine.kv.page_pool.PagePool` holds the KV pages of every model (a guaranteed minimum
each, the rest to whoever asks), and a :class:`~engine.core.fair_share.FairSharePicker` chooses
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
import os
import random
import time
from typing import Any

import torch

from engine.core.loading import DTYPES, ModelLoader
from engine.core.memory_plan import DEFAULT_CPU_BUDGET, GPU_BUDGET_FRACTION, make_ledger
from engine.core.pool_keeper import PoolKeeper
from engine.core.step_policy import QuietPolicy, cap_when, quiet_window
from engine.core.slot import ModelInfo, ModelSlot, RequestOutput
from engine.runner.cuda_graphs import DEFAULT_BUCKETS
from engine.errors import EngineError, RequestError
from engine.core.fair_share import FairSharePicker
from engine.core.ledger import LoadPlan, LoadRefused
from engine.runner.step import PendingStep, StepResult
from engine.kv.page_pool import PagePool
from engine.sampling import SamplingParams, SamplingParamsError
from engine.sched.scheduler import SchedulerOutput
from engine.runner.streams import StreamPool
from engine.weights.warm_tier import WarmTier

__all__ = ["DEFAULT_CPU_BUDGET", "GPU_BUDGET_FRACTION", "EngineCore", "LoadPlan", "LoadRefused",
           "ModelInfo", "ModelSlot", "RequestOutput"]


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


def _done(f: "_InFlight") -> bool:
    """Whether a launched step's ids are ready (no wait)."""
    return f.pending is None or f.pending.ready is None or f.pending.ready.query()


@dataclasses.dataclass
class _InFlight:
    """A launched step (``pending``), or one a synchronous runner already ran (``result``)."""

    slot: ModelSlot
    out: SchedulerOutput
    pending: PendingStep | None
    result: StepResult | None
    t_launch: float
    holds: bool = False  # an urgent prefill: another model's next step is not queued beside it


class EngineCore(ModelLoader, PoolKeeper, QuietPolicy):
    """Loads models and steps their requests. Not thread-safe: one caller drives it.

    ``memory_budget`` (or the older ``memory_budget_bytes``): bytes, or on CUDA a fraction of
    the device's total; None: 90 % of what CUDA has free now, 4 GiB on CPU. ``page_bytes``: the
    pool's page size; None: set by the first load to ``block_size`` tokens of that model.
    ``warmup``: run one largest-batch step at load to measure the workspace (None: on CUDA).
    ``async_steps``: launch step N+1 before collecting step N (None: on CUDA; see :meth:`step`).
    ``shared_step_tokens``: while another model is active (see ``_capped``), no step takes more
    tokens than this, so a model whose request arrives waits for at most one short step of another
    (None: off).
    ``quiet_window_s``: see :meth:`_yields` (None: ``INFIRE_QUIET_WINDOW_MS``, unset = 0 = off).
    """

    def __init__(self, device: str = "auto", max_num_batched_tokens: int = 2048,
                 memory_budget_bytes: int | None = None, *, block_size: int = 16,
                 max_prefill_chunk: int | None = None, dtype: str | None = None, seed: int | None = None,
                 decode_buckets: tuple[int, ...] | None = None, memory_budget: int | float | None = None,
                 page_bytes: int | None = None, warmup: bool | None = None, warm_tier_bytes: int = 0,
                 async_steps: bool | None = None, shared_step_tokens: int | None = None,
                 quiet_window_s: float | None = None) -> None:
        self.device = resolve_device(device)
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise EngineError("max_num_batched_tokens must be an integer >= 1")
        if not isinstance(block_size, int) or block_size < 1:
            raise EngineError("block_size must be an integer >= 1")
        if dtype is not None and dtype not in DTYPES:
            raise EngineError(f"dtype must be one of {sorted(DTYPES)}")
        if memory_budget is not None and memory_budget_bytes is not None:
            raise EngineError("give memory_budget or memory_budget_bytes, not both")
        if page_bytes is not None and (isinstance(page_bytes, bool) or not isinstance(page_bytes, int)
                                       or page_bytes < 1):
            raise EngineError("page_bytes must be a positive integer")
        self.max_num_batched_tokens = max_num_batched_tokens
        if shared_step_tokens is not None and (isinstance(shared_step_tokens, bool)
                                               or not isinstance(shared_step_tokens, int) or shared_step_tokens < 1):
            raise EngineError("shared_step_tokens must be None or an integer >= 1")
        self.shared_step_tokens = shared_step_tokens
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
        # Streams the runners borrow and give back (each new stream costs a cuBLAS workspace for good).
        self.streams = StreamPool(self.device) if self.device.type == "cuda" else None
        self.picker = FairSharePicker()
        self._slots: dict[str, ModelSlot] = {}
        self._req_model: dict[str, str] = {}
        self._pending: list[RequestOutput] = []
        # Steps overlap with the host's work for the next one (see step()); off on CPU, where a
        # launch runs to completion anyway.
        self.async_steps = self.device.type == "cuda" if async_steps is None else bool(async_steps)
        self._inflight: _InFlight | None = None
        self._parked = False  # the last step() left a yielding model's step in flight, not done
        self._parked_at = 0.0
        # A quiet model's prefill runs without another model's step queued behind it (_overlaps);
        # INFIRE_URGENT_HOLDS=0 turns that off (benchmarks compare both).
        self.urgent_holds = os.environ.get("INFIRE_URGENT_HOLDS", "1") != "0"
        # While a quieter model had a request within this window, a busy model's step is collected
        # before anything else is scheduled (_yields). None: INFIRE_QUIET_WINDOW_MS, else 0 = off.
        self.quiet_window_s = quiet_window(quiet_window_s)
        self.cap_when = cap_when()  # when shared_step_tokens applies (_capped)
        self._last_done = 0.0
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
        slot.last_request_t = time.perf_counter()

    def abort_request(self, req_id: str) -> None:
        """Abort; no-op when unknown or finished. Pages are freed now; the output comes next step."""
        model = self._req_model.pop(req_id, None)
        if model is None:
            return
        seq = self._slots[model].scheduler.abort(req_id)
        if seq is not None:
            self._pending.append(RequestOutput(req_id, [], "abort", None, seq.num_prompt_tokens))

    def has_unfinished_requests(self) -> bool:
        return (bool(self._pending) or self._inflight is not None
                or any(s.scheduler.has_unfinished() for s in self._slots.values()))

    # -- the loop --------------------------------------------------------------------------
    def _settle(self) -> None:
        """Finish the step in flight, if any; its outputs are returned by the next step."""
        f, self._inflight = self._inflight, None
        if f is not None:
            self._pending.extend(self._complete(f))

    def _pick(self, exclude: ModelSlot | None = None) -> ModelSlot | None:
        busy = [n for n, s in self._slots.items() if s.scheduler.has_unfinished() and s is not exclude]
        for n in busy:
            if n not in self.picker:  # a slot added by a subclass without the picker
                self.picker.add_model(n, self._slots[n].weight)
        name = self.picker.pick(busy)
        return self._slots[name] if name is not None else None

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch of one model; outputs of every request that moved.

        With asynchronous steps (the default on CUDA) the batch is launched and this call
        returns the outputs of the *previous* launch, collected after the new one was queued:
        the host schedules and prepares step N+1 while the GPU runs step N. A decode scheduled
        ahead of its previous token reads that token on the device (scheduler PLACEHOLDER).
        """
        outs, self._pending = self._pending, []
        prev, self._inflight = self._inflight, None
        new = None
        if self._parked and prev is not None:  # how long the caller slept on the parked step
            prev.slot.parked_s += time.perf_counter() - self._parked_at
        self._parked = False
        try:
            # Yielding: the busy model's next step waits until its step in flight is collected;
            # meanwhile only the other models are scheduled (a quiet model's new prompt goes out
            # at once, beside the busy step's tail, on its high-priority stream).
            yielding = prev is not None and self._yields(prev.slot)
            slot = self._pick(exclude=prev.slot if yielding else None)
            sched_out = self._schedule(slot) if slot is not None else None
            if yielding and sched_out is None:
                if not _done(prev):  # parked: the caller waits for it or for a new request
                    prev.slot.parked += 1
                    self._inflight, prev, self._parked, self._parked_at = prev, None, True, time.perf_counter()
                    return outs
                prev, done = None, prev
                outs.extend(self._complete(done))
                return outs
            if prev is not None and sched_out is not None and not self._overlaps(slot, sched_out, prev):
                prev, done = None, prev
                try:
                    outs.extend(self._complete(done))
                except EngineError as e:  # the batch was scheduled: its books must not stay half-done
                    raise self._failed(slot, sched_out, e) from e
            if sched_out is not None:
                new = self._launch(slot, sched_out)
            if prev is not None:
                prev, done = None, prev
                outs.extend(self._complete(done))
            if new is not None and (new.pending is None or new.pending.want_logprobs is not None):
                # ran synchronously, or wants logprobs, which read the logits at collect (a later
                # launch would overwrite them): complete it now
                new, done = None, new
                outs.extend(self._complete(done))
        except EngineError:
            self._inflight = new if new is not None else prev  # still collectable by the next step
            self._pending[:0] = outs
            raise
        self._inflight = new
        return outs

    def parked(self) -> "torch.cuda.Event | None":
        """After a :meth:`step` that returned while a yielding model's step was still running:
        the event its ids' arrival records. The caller waits for that event or a new request,
        whichever comes first, before the next call (instead of calling again at once). None
        otherwise."""
        f = self._inflight
        if not self._parked or f is None or f.pending is None:
            return None
        return f.pending.ready

    def _schedule(self, slot: ModelSlot) -> SchedulerOutput | None:
        """The model's next batch, None when nothing is admissible (no pages for it now, or only
        tokens in flight): then a nominal step is charged so the pick moves on to the other
        models instead of choosing this one forever."""
        if self.shared_step_tokens and self._capped(slot):
            sched_out = slot.scheduler.schedule(self.shared_step_tokens)
        else:
            sched_out = slot.scheduler.schedule()
        if sched_out.is_empty:
            self.picker.charge(slot.name, slot.last_step_s)
            return None
        return sched_out

    def _overlaps(self, slot: ModelSlot, sched_out: SchedulerOutput, prev: _InFlight) -> bool:
        """Whether a batch may be launched behind the step in flight. Not one that runs eagerly
        on CUDA: its hundreds of launches would queue behind that step and hold its tokens back
        for the whole of a large step (a quiet model's TTFT next to a flooded one). Nor another
        model's batch behind a quiet model's prefill (``holds``): that prefill is a first token
        someone waits for, and on its own it finishes in one step's time instead of sharing the
        GPU with two of the busy model's steps (the one already queued and this one)."""
        if self.device.type != "cuda":
            return True
        if prev.holds and prev.slot is not slot:
            return False
        return sched_out.num_batched_tokens <= getattr(slot.runner, "graph_tokens", 0)

    def _launch(self, slot: ModelSlot, sched_out: SchedulerOutput) -> _InFlight:
        """Queue the batch on the device (or run it: synchronous steps)."""
        t0 = time.perf_counter()
        try:
            if self.async_steps:
                urgent = self._urgent(slot)
                holds = urgent and self.urgent_holds and sched_out.num_batched_tokens > sched_out.num_decodes
                return _InFlight(slot, sched_out, slot.runner.launch(sched_out, urgent), None, t0, holds)
            return _InFlight(slot, sched_out, None, slot.runner.execute(sched_out), t0)
        except Exception as e:
            raise self._failed(slot, sched_out, e) from e

    def _failed(self, slot: ModelSlot, sched_out, e: Exception) -> EngineError:
        """Keep the books straight after a failed step: its requests end as aborted (pages freed,
        outputs queued for the next step); the error to raise."""
        for entry in sched_out.seqs:
            self.abort_request(entry.req_id)
        return EngineError(f"model {slot.name!r}: step failed: {type(e).__name__}: {e}")

    def _complete(self, f: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's ids, apply them to its scheduler, return the outputs."""
        slot, sched_out = f.slot, f.out
        try:
            result = f.result if f.result is not None else slot.runner.collect(f.pending)
        except Exception as e:
            raise self._failed(slot, sched_out, e) from e
        outs: list[RequestOutput] = []
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
        now = time.perf_counter()
        slot.steps += 1
        # The step's share of the device: from its launch, or from the previous step's end when
        # it was queued behind that one (measured after the token copy, the host sync).
        slot.last_step_s = now - max(f.t_launch, self._last_done)
        self._last_done = now
        self.picker.charge(slot.name, slot.last_step_s)
        return outs

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per model: requests, KV pages (used, and the most it could hold now), device bytes
        (weights + workspace + the pages it holds; ``memory()`` has the split by kind), and how
        often its step was parked for a quiet model and how long the caller slept on those."""
        return {
            name: {
                "running": s.scheduler.num_running,
                "waiting": s.scheduler.num_waiting,
                "kv_pages_used": s.scheduler.blocks.num_used_pages,
                "kv_pages_total": s.scheduler.blocks.num_total_pages,
                "device_bytes": s.device_bytes,
                "parked": s.parked,
                "parked_s": round(s.parked_s, 6),
            }
            for name, s in self._slots.items()
        }
