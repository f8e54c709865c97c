"""What the engine holds, per model, in device memory and in its warm tier: :class:`ModelStats`
(``EngineCore.stats()``), :class:`MemoryStats` (``EngineCore.memory()``) and
:class:`WarmTierStats` (``WarmTier.stats()``), torch-free records the worker's ``Status`` carries
to the agent.

Every field is always present. A figure of a feature a model does not use is 0, and a flag says
whether it uses it (``prefix_caching``, ``cascade``, ``constrained``): a view that shows those
figures only where they mean something decides from the flag, never from a missing key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelStats:
    """One loaded model's requests, KV pages and device bytes now, and its counters since its load."""

    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int  # the most it could hold now
    device_bytes: int  # weights + workspace + the pages it holds (MemoryStats has the split by kind)
    yield_waits: int  # times its step was yielded to a quiet model (shown as "parked")
    yield_wait_s: float  # the caller's sleep on those (shown as "parked_s")
    prefix_caching: bool  # it keeps a prefix index: the prefix_* figures are its
    prefix_cached_pages: int  # pages its index holds (in use or free)
    prefix_queried_tokens: int  # prompt tokens its admissions looked up
    prefix_hit_tokens: int  # ... and found
    cascade: bool  # its steps may plan cascade attention (Triton kernels): the cascade_* figures are its
    cascade_rows: int  # rows that read a shared prefix once a tile
    cascade_steps: int  # steps with a cascade plan
    constrained: bool  # it had a constrained request: the grammar_* figures are its
    grammar_compiles: int  # cache misses
    grammar_cache_hits: int
    grammar_compile_s: float
    grammar_mask_s: float  # host seconds filling token masks
    grammar_masked_rows: int
    grammar_masked_steps: int
    # The most output tokens one of its requests may still produce (Scheduler.tokens_to_go): how
    # far it is from idle, which the agent reads to pick the busy model to drain for a load
    tokens_to_go: int = 0
    # Why the model cannot run (its runner could not be rebuilt after a pool resize: its requests
    # are aborted until a reload); "" while it can (engine/core/pool_keeper.py reattach_runner)
    broken: str = ""
    # Its runner's steps since the load: all launched, those replayed from a decode graph and
    # from a mixed-step graph, the host seconds building and launching them and blocked waiting
    # for their ids (a window's step time = its seconds / its steps; host near it: CPU-bound)
    steps: int = 0
    decode_graph_steps: int = 0
    mixed_graph_steps: int = 0
    host_s: float = 0.0
    wait_s: float = 0.0
    # rows whose own long context a cascade tile split (engine/runner/cascade.py, "Long rows"),
    # counted per step; 0 without cascade plans
    cascade_long_rows: int = 0


@dataclass(frozen=True)
class ModelMemory:
    """One model's share of the budget, in bytes (and its KV pages)."""

    weights: int
    workspace: int
    kv_min: int  # its guaranteed KV pages' bytes
    kv_used: int  # the bytes of the pages it holds
    kv_pages_used: int
    kv_pages_total: int


@dataclass(frozen=True)
class MemoryStats:
    """The budget and who holds it, in bytes: ``used`` is the loaded models' weights + workspace,
    + ``step`` (room for the steps on the device, two of the largest, booked once for all models), + ``vacant``, + the
    whole KV pool (``kv``), of which the models' pages hold ``kv_used``, + ``untracked``. ``models``: the models on the shared pool (a tensor-parallel model, which owns
    its cache, has no row)."""

    budget: int
    used: int
    free: int
    weights: int
    workspace: int
    kv: int
    kv_used: int
    page_bytes: int
    kv_pages: int
    kv_pages_free: int
    untracked: int  # what the device holds beyond the books (MemoryLedger.reconcile), in ``used``
    # What the device says this engine holds now beyond its start-up baseline, the allocator's
    # cached free memory included (what NVML shows of the process, less the CUDA context); 0 off
    # CUDA. Above ``used`` by what was cached or captured since the last reconcile.
    device: int
    models: dict[str, ModelMemory]
    models_omitted: int  # rows left out of ``models`` (:meth:`largest`)
    # Unloaded models' weights and workspace kept for the next load of their kind (vacancies,
    # engine/core/vacancy.py): on the device, in ``used``, and a load's to take (not in ``free``'s
    # way: the next load claims or drops them first).
    vacant: int = 0
    # KV pool re-creations since the engine started and their seconds (each one rebuilds every
    # loaded model's runner, graphs included: what a swap costs the models that stay). History,
    # not books: two splits with the same books are equal whatever these say.
    step: int = 0  # two steps of the largest (engine/core/ledger.py: why once, not a sum over models)
    pool_resizes: int = field(default=0, compare=False)
    pool_resize_s: float = field(default=0.0, compare=False)

    def largest(self, n: int) -> MemoryStats:
        """This split with at most ``n`` model rows, the largest by weights first; the rest are
        counted in ``models_omitted``."""
        names = sorted(self.models, key=lambda m: -self.models[m].weights)
        return dataclasses.replace(self, models={m: self.models[m] for m in names[:n]},
                                   models_omitted=self.models_omitted + max(0, len(names) - n))


@dataclass(frozen=True)
class WarmTierStats:
    """The warm tier's host memory (engine/weights/warm_tier.py), in bytes. ``ready``: what a put
    may take now. With pinning on (CUDA) that is the arena's page-locked prefix, which grows from
    0 to ``budget`` in the background after the worker starts: until it covers a model, an
    unload keeps nothing there (so a node's first swaps after a start are from the page cache).
    Without pinning it is the whole budget."""

    budget: int
    ready: int
    used: int  # the stored copies' bytes
    models: int  # how many copies are stored (models loading the same files the same way share one)
