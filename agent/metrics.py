"""Prometheus metrics of one agent (names fixed in docs/architecture.md; ops/ depends on them).

Each :class:`Metrics` owns its own ``CollectorRegistry``, so two apps in one process (tests)
never share counters. Gauges that mirror engine or manager state are refreshed by
``refresh()`` right before a scrape instead of on every change.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from agent.gateway_metrics import GatewayCollector
from engine.stats import ModelStats, WarmTierStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)
_LOAD_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 600)

class LoopHistogram:
    """A labelled histogram observed and collected on one thread (the agent's event loop), in the
    exposition of ``prometheus_client.Histogram`` (``_bucket``, ``_count``, ``_sum``).

    The inter-token latency is observed once per token of every stream: ``Histogram.observe``
    takes a lock for the sum and for the bucket (2.6 µs an observe on this repository's CPU box,
    0.4 µs for this bisect into a list: ``python -m ops.bench.host_costs``), ~5 % of the agent's
    samples under py-spy at concurrency 200 on the H200 (79d127b). Per-request histograms stay
    ``prometheus_client``'s."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc, self._labelnames = name, documentation, list(labelnames)
        self._bounds = sorted(float(b) for b in buckets)
        self._le = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        self._children: dict[tuple[str, ...], LoopHistogram.Child] = {}
        registry.register(self)

    class Child:
        """One label set's counts: ``counts[i]`` observations in bucket i (not cumulative)."""

        def __init__(self, bounds: list[float]) -> None:
            self._bounds = bounds
            self.counts = [0] * (len(bounds) + 1)
            self.sum = 0.0

        def observe(self, value: float) -> None:
            self.counts[bisect.bisect_left(self._bounds, value)] += 1
            self.sum += value

    def labels(self, **labels: str) -> "LoopHistogram.Child":
        key = tuple(str(labels[n]) for n in self._labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopHistogram.Child(self._bounds)
        return child

    def remove(self, *values: str) -> None:
        del self._children[tuple(values)]

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)]

    def collect(self) -> list[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for key, child in list(self._children.items()):
            total, buckets = 0, []
            for le, n in zip(self._le, child.counts):
                total += n
                buckets.append((le, total))
            fam.add_metric(list(key), buckets, child.sum)
        return [fam]


MODEL_STATES = ("absent", "pulling", "cached", "loading", "ready", "draining", "unloading", "failed")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("infire_requests", "Finished HTTP API requests", ["model", "status"], registry=r)
        self.prompt_tokens = Counter("infire_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("infire_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.ttft = Histogram("infire_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = LoopHistogram("infire_inter_token_latency_seconds", "Time between output chunks", ["model"],
                                 buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("infire_e2e_request_latency_seconds", "Request latency", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("infire_queue_depth", "Requests waiting in the engine", ["model"], registry=r)
        self.running = Gauge("infire_running_sequences", "Sequences running in the engine", ["model"], registry=r)
        self.kv_used = Gauge("infire_kv_pages_used", "KV-cache pages in use", ["model"], registry=r)
        self.kv_total = Gauge("infire_kv_pages_total", "KV-cache pages available", ["model"], registry=r)
        self.gpu_memory = Gauge("infire_gpu_memory_bytes", "Device memory held by a model", ["model"], registry=r)
        # Since the model's load (the engine's counts; a gauge because a reload starts them again).
        self.parked = Gauge("infire_parked_steps", "Times the model's step was parked for a quieter model since "
                            "its load", ["model"], registry=r)
        self.parked_seconds = Gauge("infire_parked_seconds", "Engine loop's sleep on the model's parked steps since "
                                    "its load", ["model"], registry=r)
        self.prefix_queried = Gauge("infire_prefix_queried_tokens", "Prompt tokens looked up in the model's prefix "
                                    "cache since its load", ["model"], registry=r)
        self.prefix_hit = Gauge("infire_prefix_hit_tokens", "Prompt tokens found in the model's prefix cache (not "
                                "computed) since its load", ["model"], registry=r)
        self.prefix_pages = Gauge("infire_prefix_cached_pages", "KV pages the model's prefix cache indexes (in use or "
                                  "free)", ["model"], registry=r)
        self.cascade_rows = Gauge("infire_cascade_rows", "Decode rows that read a prefix shared with other rows once "
                                  "per tile of rows (cascade attention) since the model's load", ["model"], registry=r)
        self.constrained_requests = Counter("infire_constrained_requests", "Requests with a response_format "
                                            "grammar", ["model"], registry=r)
        self.grammar_compiles = Gauge("infire_grammar_compiles", "Grammars the worker compiled for the model (cache "
                                      "misses) since its load", ["model"], registry=r)
        self.grammar_compile_seconds = Gauge("infire_grammar_compile_seconds", "Seconds the worker spent compiling "
                                             "the model's grammars since its load", ["model"], registry=r)
        self.grammar_mask_seconds = Gauge("infire_grammar_mask_seconds", "Host seconds filling the model's token "
                                          "masks since its load", ["model"], registry=r)
        self.grammar_masked_rows = Gauge("infire_grammar_masked_rows", "Sampled rows the model's grammars masked "
                                         "since its load (mask seconds / rows = the mask time per row)", ["model"],
                                         registry=r)
        self.grammar_masked_steps = Gauge("infire_grammar_masked_steps", "Steps of the model with masked rows since "
                                          "its load (mask seconds / steps = the mask time per step)", ["model"],
                                          registry=r)
        self.gpu_budget = Gauge("infire_gpu_budget_bytes", "Device memory budget", registry=r)
        self.gpu_used = Gauge("infire_gpu_used_bytes", "Device memory the engine's books hold: weights, "
                              "workspaces, the whole KV pool and what the device holds beyond them (status's "
                              "gpu used; the per-model figures leave out the pool's free pages)", registry=r)
        self.warm_tier = Gauge("infire_warm_tier_bytes", "The warm tier's host memory: its budget, the share a "
                               "put may take now (page-locked so far) and what stored copies hold", ["kind"],
                               registry=r)
        self.warm_tier_models = Gauge("infire_warm_tier_models",
                                      "Weight copies stored in the warm tier (names sharing files share one)",
                                      registry=r)
        self.model_state = Gauge("infire_model_state", "1 for the model's current state", ["model", "state"], registry=r)
        self.load_seconds = Histogram("infire_model_load_seconds", "Model load time", ["model"],
                                      buckets=_LOAD_BUCKETS, registry=r)
        self.pull_seconds = Histogram("infire_pull_seconds", "Model pull time", ["model"],
                                      buckets=_LOAD_BUCKETS, registry=r)
        self.pull_failures = Counter("infire_pull_failures", "Failed pulls", ["model"], registry=r)
        self.preemptions = Counter("infire_preemptions", "Requests preempted for another model's room (each "
                                   "resumes once its model is back)", ["model"], registry=r)
        self.worker_restarts = Counter("infire_worker_restarts", "Engine worker restarts", registry=r)
        self.worker_up = Gauge("infire_worker_up", "1 while the engine worker is up", registry=r)
        self.ready = Gauge("infire_ready", "1 while /readyz answers 200", registry=r)
        self.cache_used = Gauge("infire_cache_used_bytes", "Disk cache bytes in use", registry=r)
        self.cache_max = Gauge("infire_cache_max_bytes", "Disk cache quota", registry=r)
        # The inference gateway's model-server protocol, under vLLM's names (agent/gateway_metrics.py)
        self.gateway = GatewayCollector()
        r.register(self.gateway)
        self._engine_models: set[str] = set()  # models whose engine series refresh_engine set last

    def set_model_state(self, model: str, state: str) -> None:
        for s in MODEL_STATES:
            self.model_state.labels(model=model, state=s).set(1.0 if s == state else 0.0)

    def refresh_engine(self, stats: Mapping[str, ModelStats], stale: Collection[str] = ()) -> None:
        """Mirror the worker's last ``EngineCore.stats()``: the cascade and grammar series only
        for a model that uses them (the prefix ones read 0 without a prefix cache). ``stale``:
        models loaded or unloaded since that Status (``WorkerState.stale_models``), whose rows
        describe the load before: left out. A model no longer mirrored loses its series, so an
        unloaded model leaves no ghost (set again from a stale row after the manager's
        ``forget_model``, they once outlived it for good: per-model bytes summing past the budget)."""
        live = {m: s for m, s in stats.items() if m not in stale}
        for gone in self._engine_models - live.keys():
            self.forget_model(gone)
        self._engine_models = set(live)
        for model, s in live.items():
            self.queue_depth.labels(model=model).set(s.waiting)
            self.running.labels(model=model).set(s.running)
            self.kv_used.labels(model=model).set(s.kv_pages_used)
            self.kv_total.labels(model=model).set(s.kv_pages_total)
            self.parked.labels(model=model).set(s.yield_waits)
            self.parked_seconds.labels(model=model).set(s.yield_wait_s)
            self.prefix_pages.labels(model=model).set(s.prefix_cached_pages)
            self.prefix_queried.labels(model=model).set(s.prefix_queried_tokens)
            self.prefix_hit.labels(model=model).set(s.prefix_hit_tokens)
            if s.cascade:
                self.cascade_rows.labels(model=model).set(s.cascade_rows)
            if s.constrained:
                self.grammar_compiles.labels(model=model).set(s.grammar_compiles)
                self.grammar_compile_seconds.labels(model=model).set(s.grammar_compile_s)
                self.grammar_mask_seconds.labels(model=model).set(s.grammar_mask_s)
                self.grammar_masked_rows.labels(model=model).set(s.grammar_masked_rows)
                self.grammar_masked_steps.labels(model=model).set(s.grammar_masked_steps)
            self.gpu_memory.labels(model=model).set(s.device_bytes)

    def refresh_budget(self, budget: Mapping[str, Any]) -> None:
        """Mirror ``AgentContext.budget()``: the node's device figures are the ones status shows."""
        self.gpu_budget.set(budget["total_bytes"] or 0)
        self.gpu_used.set(budget["used_bytes"] or 0)

    def refresh_warm_tier(self, tier: WarmTierStats | None) -> None:
        """Mirror the worker's last ``WarmTier.stats()``; no series without a warm tier."""
        if tier is None:
            self.warm_tier.clear()
            self.warm_tier_models.set(0)
            return
        for kind, value in (("budget", tier.budget), ("ready", tier.ready), ("used", tier.used)):
            self.warm_tier.labels(kind=kind).set(value)
        self.warm_tier_models.set(tier.models)

    def forget_model(self, model: str) -> None:
        """Drop per-model engine gauges after an unload, so dashboards do not show ghosts."""
        for g in (self.queue_depth, self.running, self.kv_used, self.kv_total, self.gpu_memory, self.parked,
                  self.parked_seconds, self.prefix_pages, self.prefix_queried, self.prefix_hit, self.cascade_rows,
                  self.grammar_compiles,
                  self.grammar_compile_seconds, self.grammar_mask_seconds, self.grammar_masked_rows,
                  self.grammar_masked_steps):
            try:
                g.remove(model)
            except KeyError:
                pass

    def drop_model(self, model: str) -> None:
        """Drop every series of a model name the agent forgets (one the store does not know)."""
        self.forget_model(model)
        for s in MODEL_STATES:
            try:
                self.model_state.remove(model, s)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
