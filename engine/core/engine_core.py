"""EngineCore: the loaded models, their requests, and the step loop (docs/architecture.md).

Several models share one device under one budget (docs/multi-model.md). ``EngineCore(options,
device, budget)`` is built from one :class:`~engine.options.EngineOptions` and loads what one
:class:`~engine.load_spec.LoadSpec` describes. It owns the requests (which model each belongs to,
the outputs not yet returned), the step in flight and the loop; it hands each other concern to
one collaborator, reachable as an attribute where a caller needs it:

- ``slots``, a :class:`~engine.core.model_table.ModelTable`: the loaded models;
- ``pools``, the :class:`~engine.core.pool_keeper.PoolKeeper`: the :class:`~engine.core.ledger.MemoryLedger`
  (every byte booked: weights, workspace, the KV pool), the shared
  :class:`~engine.kv.page_pool.PagePool` (a guaranteed minimum of pages per model, the rest to
  whoever asks), its resizes, and the runners over it;
- ``loader``, the :class:`~engine.core.loading.ModelLoader`: loads (three phases, one in flight)
  and unloads; it calls back into the core (``_settle``) to finish the step in flight before
  pages, pool or slots change, since that step and its outputs are the core's;
- ``picker``, the :class:`~engine.core.fair_share.FairSharePicker`: which model runs each step
  (weighted fair share of measured step time);
- ``policy``, the :class:`~engine.core.step_policy.StepPolicy`: the multi-model rules of a step
  (yield, cap, urgent, hold, overlap).

Each loaded model is a :class:`~engine.core.slot.ModelSlot` with its own scheduler, block manager
(over the pool's allocator for it) and runner (over the pool's views). Outputs of aborts and
unloads are returned by the next step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from engine.core.fair_share import FairSharePicker
from engine.core.ledger import LoadPlan
from engine.core.load_notes import LoadNotes, setting as notes_setting
from engine.core.loading import ModelLoader, PendingLoad
from engine.core.memory_plan import make_ledger
from engine.core.model_table import ModelTable
from engine.core.pool_keeper import PoolKeeper
from engine.core.slot import ModelInfo, ModelSlot, RequestOutput
from engine.core.step_policy import StepPolicy
from engine.errors import EngineError, ModelNotLoaded, RequestError
from engine.grammar.compiler import GrammarCompiler
from engine.grammar.matcher import RequestGrammar
from engine.load_spec import LoadSpec
from engine.options import EngineOptions
from engine.runner.step import PendingStep, StepResult
from engine.runner.streams import StreamPool
from engine.sampling import SamplingParams
from engine.stats import MemoryStats, ModelStats
from engine.sched.scheduler import SchedulerOutput
from engine.weights.warm_tier import WarmTier

__all__ = ["EngineCore", "InFlight"]

# Loads and unloads quiet this long before the KV pool grows into the room unloads left (under
# churn the next load would shrink it straight back; off a GPU a grow rebuilds every runner).
POOL_GROW_QUIET_S = 10.0
# How often a busy engine looks whether its models waited for KV pages (then the pool grows, where
# it grows in place: EngineCore._grow_under_pressure).
POOL_PRESSURE_CHECK_S = 1.0

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


@dataclasses.dataclass
class InFlight:
    """A launched step (``pending``), or one a synchronous runner already ran (``result``).

    The only place the core looks at a step's device event: :meth:`ready` and :meth:`wait`.
    :meth:`EngineCore.yielded` hands this object out, so a caller can wait for a yielded step
    without knowing what the device uses to signal it.
    """

    slot: ModelSlot
    out: SchedulerOutput
    pending: PendingStep | None
    result: StepResult | None
    t_launch: float
    holds: bool = False  # an urgent prefill: another model's next step is not queued beside it

    def ready(self) -> bool:
        """Whether the step's ids are on the host (no wait)."""
        return self.pending is None or self.pending.done()

    def wait(self) -> None:
        """Block until the step's ids are on the host (on CUDA a blocking-sync event: the thread
        sleeps); raises what the device raises when the step failed."""
        if self.pending is not None and self.pending.ready is not None:
            self.pending.ready.synchronize()

    @property
    def collect_now(self) -> bool:
        """Whether the step must be collected before anything else is launched: it ran
        synchronously, it wants logprobs, which read the logits at collect, or its grammar rows
        are not sampled yet (a later launch would overwrite the logits both read)."""
        return (self.pending is None or self.pending.want_logprobs is not None
                or self.pending.masked is not None)


def _fired(event: Any) -> bool:
    """Whether a step's event has fired. A device that fails the query is broken (the worker
    goes, ``device_usable``): nothing runs on it any more, and the failure to report is the
    step's own, not this one."""
    try:
        return bool(event.query())
    except RuntimeError:
        return True


def _step_figures(runner) -> dict:
    """A runner's step counters as ModelStats has them (a model without a runner keeps its zeros)."""
    return dict(steps=runner.steps, decode_graph_steps=runner.graph_steps, mixed_graph_steps=runner.mixed_graph_steps,
                host_s=round(runner.host_seconds, 6), wait_s=round(runner.wait_seconds, 6))


class EngineCore:
    """Loads models and steps their requests. Not thread-safe: one caller drives it.

    ``options``: every behaviour switch (:class:`~engine.options.EngineOptions`, whose defaults
    are the daemon's). ``device``: "auto" (CUDA when there is one), "cpu", "cuda", "cuda:N" or a
    ``torch.device``. ``budget``: the memory budget, bytes, or on CUDA a fraction of the device's
    total; None: 90 % of what CUDA has free now, 4 GiB on CPU (``pools.ledger.budget`` is the
    resolved bytes).

    Its collaborators are reachable for callers that need them: ``pools`` (the
    :class:`~engine.core.pool_keeper.PoolKeeper`: ``pools.ledger``, ``pools.pool``), ``loader``
    (the :class:`~engine.core.loading.ModelLoader`: ``loader.pending`` is the load in flight,
    ``loader.last_load_timings``, ``loader.warm_tier``), ``policy``
    (:class:`~engine.core.step_policy.StepPolicy`) and ``picker``.
    """

    def __init__(self, options: EngineOptions | None = None, device: str | torch.device = "auto",
                 budget: int | float | None = None) -> None:
        self.options = options = options if options is not None else EngineOptions()
        self.device = resolve_device(device)
        self.budget = budget  # as given (None: the default); pools.ledger.budget is the resolved bytes
        cuda = self.device.type == "cuda"
        # Steps overlap with the host's work for the next one (see step()); off on CPU, where a
        # launch runs to completion anyway (unless a test asks for it there too).
        self.async_steps = options.async_steps and (cuda or options.async_on_cpu)
        # Streams the runners borrow and give back (each new stream costs a cuBLAS workspace for good).
        self.streams = StreamPool(self.device) if cuda else None
        self.picker = FairSharePicker()
        self.slots = ModelTable()  # the loaded models (the loader adds and removes them)
        self._req_model: dict[str, str] = {}
        # Models whose requests are stepped ahead of every other model's until they have none
        # (:meth:`expedite`): a model draining so a load can take its room.
        self._expedited: set[str] = set()
        self._pending: list[RequestOutput] = []
        # Requests ended (aborted) because their grammar went over its mask budget: req_id -> why;
        # the worker reports each as the request's error instead of its abort.
        self.grammar_errors: dict[str, str] = {}
        self._inflight: InFlight | None = None
        self._yielded_at: float | None = None  # when the last step() returned with a yielding model's step in flight
        self._last_done = 0.0
        self._pressure_at = 0.0  # the last look for page waits (_grow_under_pressure), and their count then
        self._page_waits = 0
        self.pools = PoolKeeper(make_ledger(budget, self.device), self.device, self.slots, options, self.streams)
        # Host copies of unloaded models' weights, so a reload is one device copy (the loader's).
        warm_tier = WarmTier(options.warm_tier_bytes) if options.warm_tier_bytes else None
        notes = LoadNotes(options.load_notes_path, notes_setting(self.device)) \
            if options.load_notes_path is not None else None
        self.loader = ModelLoader(self.pools, self.slots, self.picker, warm_tier, self._settle, options,
                                  device=self.device, notes=notes)
        self.policy = StepPolicy(self.slots, options, cuda=cuda)
        # Seeds for requests that bring none; instance-owned so two engines never share a stream.
        self._seed_rng = random.Random(options.seed) if options.seed is not None else random.SystemRandom()

    # -- read accessors --------------------------------------------------------------------
    def in_flight(self) -> InFlight | None:
        """The step launched and not yet collected, if any."""
        return self._inflight

    # -- models ----------------------------------------------------------------------------
    def check_load(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> LoadPlan:
        """The plan of a load without doing it (:meth:`ModelLoader.check_load`)."""
        return self.loader.check_load(spec, evictable)

    def load_model(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> ModelInfo:
        """Book, load weights, give the model its KV pages and make it schedulable
        (:meth:`ModelLoader.load_model`: raises :class:`~engine.core.ledger.LoadRefused` before
        the device is touched when it does not fit; with ``evictable``, the idle models whose
        unload would make room). ``spec.quantization="fp8"``: FP8 projections;
        ``spec.kv_cache_dtype="fp8"``: an e4m3 KV cache (twice the tokens a page)."""
        return self.loader.load_model(spec, evictable)

    def begin_load(self, spec: LoadSpec, evictable: tuple[str, ...] | list[str] = ()) -> PendingLoad:
        """Phase 1 of a load here, phase 2 in a load thread (:meth:`ModelLoader.begin_load`);
        end it with :meth:`finish_load` or :meth:`cancel_load`."""
        return self.loader.begin_load(spec, evictable)

    def finish_load(self, pending: PendingLoad) -> ModelInfo:
        """Phase 3 of a load: install the model (:meth:`ModelLoader.finish_load`)."""
        return self.loader.finish_load(pending)

    def cancel_load(self, pending: PendingLoad) -> None:
        """Stop a load begun here and release what it booked (:meth:`ModelLoader.cancel_load`)."""
        self.loader.cancel_load(pending)

    def unload_model(self, name: str) -> None:
        """Abort what is left of the model's requests (reported by the next step) and free it:
        every page back to the pool, every byte out of the ledger; the pool is trimmed when idle.
        A model still loading (:meth:`begin_load`) has its load cancelled instead."""
        pending = self.loader.pending
        if name not in self.slots and pending is not None and pending.name == name:
            self.loader.cancel_load(pending)
            return
        slot = self.slots.get(name)
        self._settle()
        self._expedited.discard(name)  # a later load of this name competes as any other
        self._abort_model(name)
        if slot.grammar is not None:
            slot.grammar.close()
        del slot
        self.loader.unload(name)

    def expedite(self, name: str, on: bool = True) -> bool:
        """Step ``name``'s requests ahead of every other model's until it has none left (False:
        not loaded). For a model that admits nothing more because a load waits for its room
        (the agent drains it): in turn with the others, at one step per busy model, a request of
        128 tokens held it ~5 s on the H200 (38 ms a token, the bf16 density run at b55f48c:
        seven 8Bs), the load and every request behind that load waiting; ahead of them it needs
        only its own steps (~4.6 ms each at batch 1), for which the others wait (the agent drains
        a model with a long generation left only when no other will do). Unloading it ends the
        flag, and so does ``on`` False (its drain called off: it admits requests again and is
        stepped in turn)."""
        if name not in self.slots:
            return False
        if on:
            self._expedited.add(name)
        else:
            self._expedited.discard(name)
        return True

    def models(self) -> dict[str, ModelInfo]:
        return {n: s.info for n, s in self.slots.items()}

    def memory(self) -> MemoryStats:
        """The budget and who holds it (:meth:`PoolKeeper.memory`)."""
        return self.pools.memory()

    # -- requests --------------------------------------------------------------------------
    def compile_grammar(self, model: str, grammar: str) -> Future[RequestGrammar]:
        """A matcher of ``grammar`` over ``model``'s vocabulary, compiled on that model's grammar
        thread (engine/grammar/compiler.py), for :meth:`add_request`; the future raises
        ``GrammarError``. Raises :class:`ModelNotLoaded` when the model is not loaded."""
        slot = self.slots.find(model)
        if slot is None:
            raise ModelNotLoaded(f"model {model!r} is not loaded", "model")
        if slot.grammar is None:
            slot.grammar = GrammarCompiler(Path(slot.model_dir) / "tokenizer.json", slot.config.vocab_size,
                                           list(slot.config.eos_token_ids))
        return slot.grammar.compile(grammar)

    def add_request(self, req_id: str, model: str, prompt_token_ids: list[int], params: SamplingParams,
                    grammar: RequestGrammar | None = None, output_token_ids: list[int] | tuple[int, ...] = ()) -> None:
        """Queue a request; raises :class:`RequestError` (an EngineError naming ``param``) on bad input.
        ``grammar``: from :meth:`compile_grammar`, constrains the output (one request's own).
        ``output_token_ids``: output it had before its model was preempted for another's room
        (the agent resumes it): computed again with the prompt, counted as output (``max_tokens``,
        ``min_tokens``, penalties, the seeded sampler's step), accepted by ``grammar`` first."""
        if not isinstance(req_id, str) or not req_id:
            raise RequestError("req_id must be a non-empty string", "req_id")
        if req_id in self._req_model:
            raise RequestError(f"request {req_id!r} is already in flight", "req_id")
        slot = self.slots.find(model)
        if slot is None:
            raise ModelNotLoaded(f"model {model!r} is not loaded", "model")
        if slot.broken:
            raise EngineError(f"model {model!r} cannot run: {slot.broken}")
        if not isinstance(params, SamplingParams):  # valid once made (engine/sampling.py)
            raise RequestError("params must be a SamplingParams", "sampling")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise RequestError("prompt_token_ids must be a non-empty list of token ids", "prompt_token_ids")
        vocab = slot.config.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestError(f"prompt token {t!r} is not an id of this model (0 <= id < {vocab})",
                                   "prompt_token_ids")
        if not isinstance(output_token_ids, (list, tuple)):
            raise RequestError("output_token_ids must be a list of token ids", "output_token_ids")
        for t in output_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestError(f"output token {t!r} is not an id of this model (0 <= id < {vocab})",
                                   "output_token_ids")
        if len(output_token_ids) >= params.max_tokens:
            raise RequestError(f"{len(output_token_ids)} output tokens already: nothing left of max_tokens="
                               f"{params.max_tokens}", "output_token_ids")
        for t, _ in params.logit_bias:
            if t >= vocab:
                raise RequestError(f"logit_bias names token {t}, not an id of this model (0 <= id < {vocab})",
                                   "logit_bias")
        max_len = slot.scheduler.config.max_model_len
        if len(prompt_token_ids) + len(output_token_ids) >= max_len:
            raise RequestError(f"prompt of {len(prompt_token_ids) + len(output_token_ids)} tokens does not fit "
                               f"max_model_len={max_len} with room for one generated token", "prompt_token_ids")
        if grammar is not None and not all(grammar.accept(t) for t in output_token_ids):
            raise RequestError("the output to resume from is not in the request's grammar", "output_token_ids")
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(63))
        slot.scheduler.add(req_id, list(prompt_token_ids), params, grammar, output_token_ids=list(output_token_ids))
        self._req_model[req_id] = model
        slot.last_request_t = time.perf_counter()

    def abort_request(self, req_id: str) -> None:
        """Abort; no-op when unknown or finished. Pages are freed now; the output comes next step."""
        model = self._req_model.pop(req_id, None)
        if model is None:
            return
        slot = self.slots.get(model)
        seq = slot.scheduler.abort(req_id)
        if slot.runner is not None:
            slot.runner.prompt_logprobs.pop(req_id, None)
        if seq is not None:
            self._pending.append(RequestOutput(req_id, [], "abort", None, seq.num_prompt_tokens,
                                               seq.num_cached_tokens))

    def _abort_model(self, name: str) -> None:
        """Abort every request of ``name`` (outputs from the next step)."""
        for req_id in [r for r, m in self._req_model.items() if m == name]:
            self.abort_request(req_id)

    def device_usable(self) -> bool:
        """Whether the device still runs work after a failed step: an out-of-memory or a bad input
        leaves it usable (the failure was one model's), a sticky CUDA error (an illegal address)
        does not (every later launch fails: the process must go)."""
        if self.device.type != "cuda":
            return True
        try:  # this thread's stream only: a load thread may be capturing (engine/runner/cuda_graphs.py)
            stream = torch.cuda.current_stream(self.device)
            stream.synchronize()
            torch.empty(1, device=self.device).add_(1)
            stream.synchronize()
        except RuntimeError:
            return False
        return True

    def has_unfinished_requests(self) -> bool:
        return (bool(self._pending) or self._inflight is not None
                or any(s.scheduler.has_unfinished() for s in self.slots.values()))

    def grow_idle_pool(self) -> bool:
        """While no request is in the engine: grow the KV pool into the room unloads left, once
        loads and unloads have been quiet for :data:`POOL_GROW_QUIET_S` (a swap's unload no
        longer grows it only for its load to shrink it: ``PoolKeeper.trim``); True when it did."""
        if self.has_unfinished_requests() or self.loader.pending is not None:
            return False
        return self.pools.grow_when_quiet(POOL_GROW_QUIET_S)

    def _grow_under_pressure(self) -> None:
        """While busy, at most every :data:`POOL_PRESSURE_CHECK_S`: when a model waited for KV
        pages since the last look (an admission held back, a sequence preempted for room) and
        loads and unloads have been quiet for :data:`POOL_GROW_QUIET_S`, grow the pool into the
        room unloads left (``PoolKeeper.grow_under_pressure``: only a pool that grows in place,
        on a GPU, and is below what its models could use). An idle engine grows it anyway
        (:meth:`grow_idle_pool`); a busy one never did, so a pool left small by churn stayed
        small while its models queued for pages."""
        now = time.monotonic()
        if now - self._pressure_at < POOL_PRESSURE_CHECK_S:
            return
        self._pressure_at = now
        waits = sum(s.scheduler.page_waits for s in self.slots.values())
        starved, self._page_waits = waits > self._page_waits, waits
        if starved and self.loader.pending is None:
            self.pools.grow_under_pressure(POOL_GROW_QUIET_S)

    def capture_idle_graph(self) -> bool:
        """While no request is in the engine: capture one CUDA graph a runner still defers to
        its first use; False when there was nothing to do (busy, or every graph captured). A
        failed capture leaves that bucket to run eagerly (it is logged by the caller)."""
        if self.has_unfinished_requests():
            return False
        for slot in self.slots.values():
            if slot.runner is not None and slot.runner.capture_next_deferred():
                return True
        return False

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch of one model; outputs of every request that moved.

        Schedule (the picked model's next batch), launch it, complete what is due. With
        asynchronous steps (the default on CUDA) the batch is launched and this call returns the
        outputs of the *previous* launch, collected after the new one was queued: the host
        schedules and prepares step N+1 while the GPU runs step N. A decode scheduled ahead of its
        previous token reads that token on the device (scheduler PLACEHOLDER). The policy decides
        when a model yields (:meth:`yielded`), when a batch must not be queued behind the step in
        flight, and how a batch is launched.
        """
        self._catch_up()
        self._grow_under_pressure()
        outs, self._pending = self._pending, []
        prev, self._inflight = self._inflight, None
        if self._yielded_at is not None and prev is not None:  # how long the caller slept on it
            prev.slot.yield_wait_s += time.perf_counter() - self._yielded_at
        self._yielded_at = None
        new = None
        try:
            # schedule: while the busy model yields, its next step waits until its step in flight
            # is collected; meanwhile only the other models are scheduled (a quiet model's new
            # prompt goes out at once, beside the busy step's tail, on its high-priority stream).
            # (an expedited model never yields: its drain is what a load waits for, and in its
            # gaps the others' steps would go ahead of it, not only a quiet model's prompt)
            yielding = prev is not None and prev.slot.name not in self._expedited and self.policy.yields(prev.slot)
            slot, batch = self._schedule(exclude=prev.slot if yielding else None)
            if batch is None and yielding and not prev.ready():
                self._yield_step(prev)  # the caller waits for it or for a new request
                return outs
            # launch: behind the step in flight when the policy lets it, else after collecting it
            if batch is not None:
                # (a step that must be collected first is, whatever the policy: an error after its
                # launch can leave one in flight)
                if prev is not None and (prev.collect_now
                                         or not self.policy.overlaps(slot, batch, prev.slot, prev.holds)):
                    prev, done = None, prev
                    try:
                        outs.extend(self._complete(done))
                    except EngineError as e:  # the batch was scheduled: its books must not stay half-done
                        raise self._failed(slot, batch, e) from e
                new = self._launch(slot, batch)
            # complete: the step launched before, and the new one when it cannot stay in flight
            if prev is not None:
                prev, done = None, prev
                outs.extend(self._complete(done))
            if new is not None and new.pending is not None and new.pending.masked is not None:
                # its grammars have every earlier token now: masks on the host while its forward runs
                try:
                    new.slot.runner.sample_masked(new.pending)
                except Exception as e:
                    failed, new = new, None
                    error = self._failed(failed.slot, failed.out, e)
                    self._step_done(failed.slot, None, wait=True)  # its forward still runs: its pages go after it
                    raise error from e
            if new is not None and new.collect_now:
                new, done = None, new
                outs.extend(self._complete(done))
        except EngineError:
            self._inflight = new if new is not None else prev  # still collectable by the next step
            self._pending[:0] = outs
            raise
        self._inflight = new
        if new is None and not self.has_unfinished_requests():
            # going idle: the empty steps left behind (an aborted prompt's chunks) end here, or
            # their models' freed pages would stay held, and counted, until the next request
            self._catch_up(wait=True)
        return outs

    def yielded(self) -> InFlight | None:
        """After a :meth:`step` that returned while a yielding model's step was still running:
        that step, whose :meth:`InFlight.wait` returns once its ids are in. The caller waits for
        it or a new request, whichever comes first, before the next call (instead of calling
        again at once); the same object is returned until the next :meth:`step`. None otherwise."""
        f = self._inflight
        if self._yielded_at is None or f is None or f.pending is None:
            return None
        return f

    def _yield_step(self, prev: InFlight) -> None:
        prev.slot.yield_waits += 1
        self._inflight, self._yielded_at = prev, time.perf_counter()

    def _settle(self) -> None:
        """Finish the step in flight, if any; its outputs are returned by the next step."""
        f, self._inflight = self._inflight, None
        if f is not None:
            self._pending.extend(self._complete(f))
        self._catch_up(wait=True)

    def _pick(self, exclude: ModelSlot | None) -> ModelSlot | None:
        busy = []
        for n, s in self.slots.items():
            if s is exclude or not s.scheduler.has_unfinished():
                continue
            if s.runner is None:  # broken (PoolKeeper.reattach_runner): its requests end, it is never stepped
                self._abort_model(n)
                continue
            busy.append(n)
        urgent: list[str] = []
        if self._expedited:  # an expedited model goes first while it has work; its flag ends with its work
            self._expedited.intersection_update(busy if exclude is None else busy + [exclude.name])
            urgent = [n for n in busy if n in self._expedited]
        name = self.picker.pick(urgent or busy)
        return self.slots.get(name) if name is not None else None

    def _schedule(self, exclude: ModelSlot | None) -> tuple[ModelSlot | None, SchedulerOutput | None]:
        """The picked model and its next batch (None when nothing is admissible: no pages for it
        now, or only tokens in flight; then a nominal step is charged so the pick moves on to the
        other models instead of choosing this one forever)."""
        slot = self._pick(exclude)
        if slot is None:
            return None, None
        cap = self.policy.step_tokens(slot)
        batch = slot.scheduler.schedule(cap) if cap else slot.scheduler.schedule()
        if batch.is_empty:
            self.picker.charge(slot.name, slot.last_step_s)
            return slot, None
        return slot, batch

    def _launch(self, slot: ModelSlot, batch: SchedulerOutput) -> InFlight:
        """Queue the batch on the device (or run it: synchronous steps)."""
        t0 = time.perf_counter()
        try:
            if not self.async_steps:
                return InFlight(slot, batch, None, slot.runner.execute(batch), t0)
            plan = self.policy.launch(slot, batch)
        except Exception as e:
            raise self._failed(slot, batch, e) from e
        slot.pages.step_launched()  # its pages freed from now on wait for it (engine/kv/page_pool.py)
        try:
            pending = slot.runner.launch(batch, plan.urgent)
        except Exception as e:  # part of it may be queued: its pages go once that has run
            error = self._failed(slot, batch, e)
            self._step_done(slot, None, wait=True)
            raise error from e
        return InFlight(slot, batch, pending, None, t0, plan.holds)

    def _failed(self, slot: ModelSlot, batch: SchedulerOutput, e: Exception) -> EngineError:
        """Keep the books straight after a failed step: its requests end as aborted (pages freed,
        outputs queued for the next step); the error to raise."""
        for entry in batch.seqs:
            self.abort_request(entry.req_id)
        return EngineError(f"model {slot.name!r}: step failed: {type(e).__name__}: {e}")

    def _complete(self, f: InFlight) -> list[RequestOutput]:
        """Wait for a launched step's ids, apply them to its scheduler, return the outputs."""
        ok = False
        try:
            outs = self._apply(f)
            ok = True
            return outs
        finally:
            if f.pending is not None:
                self._step_done(f.slot, f.pending.written, wait=not ok)

    def _step_done(self, slot: ModelSlot, written: Any, wait: bool = False) -> None:
        """A step of ``slot`` is collected: count it done on the device with its page source, so
        the pages its model freed behind it go back (engine/kv/page_pool.py). Its collect waited
        for its ids; an empty step (``written``, no ids) may still run: it waits in
        ``slot.behind`` until it has (:meth:`_catch_up`). ``wait``: a step given up (its launch
        or collect failed), waited for here. A step done means its model's earlier ones are."""
        if not wait and written is not None and not _fired(written):
            slot.behind.append(written)
            return
        if wait and slot.runner is not None:
            # A device that fails the wait is broken (device_usable says so and the worker goes):
            # the failure being handled is the one to report, not this one.
            with contextlib.suppress(RuntimeError):
                slot.runner.wait_device()
        for _ in range(len(slot.behind) + 1):
            slot.pages.step_done()
        slot.behind.clear()

    def _catch_up(self, wait: bool = False) -> None:
        """Count done the empty steps left behind whose work has run (``wait``: all, waiting)."""
        for slot in self.slots.values():
            while slot.behind and (wait or _fired(slot.behind[0])):
                slot.behind[0].synchronize()  # popped once done: a failed wait leaves the count whole
                slot.behind.pop(0)
                slot.pages.step_done()

    def _apply(self, f: InFlight) -> list[RequestOutput]:
        slot, batch = f.slot, f.out
        try:
            result = f.result if f.result is not None else slot.runner.collect(f.pending)
        except Exception as e:
            raise self._failed(slot, batch, e) from e
        outs: list[RequestOutput] = []
        logprobs = {}
        if any(lp is not None for lp in result.logprobs):  # most steps want none: no map then
            for idx, entry in enumerate(e for e in batch.seqs if e.sample):
                logprobs[entry.req_id] = result.logprobs[idx]
        for seq in slot.scheduler.update(batch, result.token_ids):
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            lp = logprobs.get(seq.req_id) if logprobs else None
            plp = None
            if seq.params.prompt_logprobs is not None and seq.num_tokens == seq.num_prompt_tokens + 1:
                got = slot.runner.prompt_logprobs.pop(seq.req_id, {})
                plp = [got.get(p) for p in range(1, seq.num_prompt_tokens)]
            outs.append(RequestOutput(seq.req_id, [seq.token_ids[-1]], reason, [lp] if lp is not None else None,
                                      len(seq.prompt_token_ids), seq.num_cached_tokens, plp))
            if reason is not None:
                self._req_model.pop(seq.req_id, None)
                if seq.grammar is not None and seq.grammar.error is not None:
                    self.grammar_errors[seq.req_id] = seq.grammar.error
        now = time.perf_counter()
        slot.steps += 1
        # The step's share of the device: from its launch, or from the previous step's end when
        # it was queued behind that one (measured after the token copy, the host sync).
        slot.last_step_s = now - max(f.t_launch, self._last_done)
        self._last_done = now
        self.picker.charge(slot.name, slot.last_step_s)
        return outs

    def stats(self) -> dict[str, ModelStats]:
        """Per model: requests, KV pages, device bytes, steps yielded to a quiet model; with prefix caching, its index's
        pages and the prompt tokens looked up and found since the load; where steps plan cascade
        attention, the rows and steps planned; once it had a constrained request, its grammar
        compiles, cache hits and seconds, mask-filling seconds, masked rows and steps (engine/stats.py:
        the figures of a feature a model does not use are 0, and its flag says so)."""
        out = {}
        for name, s in self.slots.items():
            blocks, runner, grammar = s.scheduler.blocks, s.runner, s.grammar
            prefix = blocks.prefix
            cascade = runner is not None and bool(runner.bufs.cascade_rows)  # cascade plans (Triton kernels)
            constrained = grammar is not None and runner is not None  # constrained decoding: compiles, masks
            out[name] = ModelStats(
                running=s.scheduler.num_running, waiting=s.scheduler.num_waiting,
                kv_pages_used=blocks.num_used_pages, kv_pages_total=blocks.num_total_pages,
                device_bytes=s.device_bytes, yield_waits=s.yield_waits, yield_wait_s=round(s.yield_wait_s, 6),
                prefix_caching=prefix is not None,
                prefix_cached_pages=len(prefix) if prefix is not None else 0,
                prefix_queried_tokens=prefix.queried_tokens if prefix is not None else 0,
                prefix_hit_tokens=prefix.hit_tokens if prefix is not None else 0,
                cascade=cascade,
                cascade_rows=runner.cascade_rows if cascade else 0,
                cascade_steps=runner.cascade_steps if cascade else 0,
                cascade_long_rows=runner.cascade_long_rows if cascade else 0,
                constrained=constrained,
                grammar_compiles=grammar.compiled if constrained else 0,
                grammar_cache_hits=grammar.hits if constrained else 0,
                grammar_compile_s=round(grammar.compile_seconds, 6) if constrained else 0.0,
                grammar_mask_s=round(runner.mask_seconds, 6) if constrained else 0.0,
                grammar_masked_rows=runner.masked_rows if constrained else 0,
                grammar_masked_steps=runner.masked_steps if constrained else 0,
                tokens_to_go=s.scheduler.tokens_to_go,
                broken=s.broken,
                **(_step_figures(runner) if runner is not None else {}),
            )
        return out

    def drop_prefix_cache(self, name: str) -> int:
        """Forget ``name``'s prefix index (its free cached pages become plain free pages; pages
        of running sequences stay theirs); returns the entries dropped (0: caching is off)."""
        slot = self.slots.get(name)
        self._settle()  # no step in flight: the next one's admissions see the empty index
        return slot.scheduler.blocks.drop_prefix_cache()
