"""The model-server protocol's gauges, under the names the inference gateway's endpoint picker
reads by default (vLLM's), beside the agent's own ``infire_*`` series.

The protocol (gateway-api-inference-extension, proposal 003) fixes their meaning, not ours:

- ``vllm:num_requests_waiting`` (TotalQueuedRequests): admitted but not yet running — requests
  waiting for their model's load, inside the agent before the engine has them (tokenizing, the
  grammar), and in the engine's queue;
- ``vllm:num_requests_running`` (TotalRunningRequests): sequences in the engine (prefilling or
  decoding);
- ``vllm:kv_cache_usage_perc`` (KVCacheUtilization): 0-1, the shared KV pool's pages in use;
- ``vllm:cache_config_info`` (value 1): ``block_size`` (tokens per page) and ``num_gpu_blocks``
  (pages) as labels, for prefix-aware scoring.

Each family holds the node as a whole first (no labels: what the picker reads with its default
flags, which take the first series of a family), then one series per loaded model
(``model_name``, as vLLM labels it). The node's ``cache_config_info`` is there only while its
models share one block size (a page holds a model's tokens in that model's layout). LoRA adapters
are not served: no ``vllm:lora_requests_info`` (the picker's ``--lora-info-metric ""``).

:func:`gateway_view` is a pure function of what the agent knows (the worker's last stats and
memory split, each model's admitted requests and load waiters); :class:`GatewayCollector`
exposes its last result at a scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.stats import MemoryStats, ModelStats

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class Load:
    """One model's figures for the protocol."""

    waiting: int
    running: int
    kv_usage: float  # 0-1
    block_size: int | None = None  # tokens per page (None: not loaded)
    num_blocks: int = 0


@dataclass(frozen=True)
class Admitted:
    """What the agent holds of one model: engine requests admitted (prompts × n, running ones
    included) and requests waiting for its load."""

    in_flight: int
    load_waiters: int
    block_size: int | None  # the loaded model's tokens per page


@dataclass(frozen=True)
class GatewayView:
    node: Load
    models: dict[str, Load] = field(default_factory=dict)


def gateway_view(stats: Mapping[str, ModelStats], memory: MemoryStats | None,
                 admitted: Mapping[str, Admitted]) -> GatewayView:
    """The protocol's figures from the worker's last ``stats`` and ``memory`` (both a status
    period old at most) and the agent's live ``admitted`` counts. Waiting is never below the
    engine's own queue; running is the engine's."""
    models: dict[str, Load] = {}
    for name in sorted(set(stats) | set(admitted)):
        s, a = stats.get(name), admitted.get(name)
        running = s.running if s is not None else 0
        engine_waiting = s.waiting if s is not None else 0
        in_agent = max(0, (a.in_flight if a is not None else 0) - running)  # admitted, not running yet
        waiting = max(engine_waiting, in_agent) + (a.load_waiters if a is not None else 0)
        usage = s.kv_pages_used / s.kv_pages_total if s is not None and s.kv_pages_total else 0.0
        models[name] = Load(waiting, running, min(1.0, usage), a.block_size if a is not None else None,
                            s.kv_pages_total if s is not None else 0)
    if memory is not None and memory.kv_pages:
        pool = min(1.0, (memory.kv_pages - memory.kv_pages_free) / memory.kv_pages)
    else:  # no shared pool (tensor-parallel models own their caches): the pages of every model
        total = sum(m.num_blocks for m in models.values())
        pool = sum(m.kv_usage * m.num_blocks for m in models.values()) / total if total else 0.0
    sizes = {m.block_size for m in models.values() if m.block_size is not None}
    block = sizes.pop() if len(sizes) == 1 else None
    blocks = (memory.kv_pages if memory is not None and memory.kv_pages else
              sum(m.num_blocks for m in models.values()))
    node = Load(sum(m.waiting for m in models.values()), sum(m.running for m in models.values()), pool,
                block, blocks)
    return GatewayView(node, models)


class GatewayCollector(Collector):
    """Exposes the last :class:`GatewayView` given to :meth:`update` (an empty node before it)."""

    def __init__(self) -> None:
        self._view = GatewayView(Load(0, 0, 0.0))

    def update(self, view: GatewayView) -> None:
        self._view = view

    def collect(self) -> Iterable[GaugeMetricFamily]:
        v = self._view
        rows = list(v.models.items())
        for name, doc, value in ((WAITING, "Requests admitted and not yet running (node, then per model)",
                                  lambda m: m.waiting),
                                 (RUNNING, "Requests running in the engine (node, then per model)",
                                  lambda m: m.running),
                                 (KV_USAGE, "Fraction of KV-cache pages in use, 0-1 (node: the shared pool)",
                                  lambda m: m.kv_usage)):
            fam = GaugeMetricFamily(name, doc, labels=None)
            fam.add_sample(name, {}, float(value(v.node)))
            for model, m in rows:
                fam.add_sample(name, {"model_name": model}, float(value(m)))
            yield fam
        info = GaugeMetricFamily(CACHE_INFO, "KV cache configuration: block_size (tokens per page) and "
                                             "num_gpu_blocks (pages) as labels")
        if v.node.block_size is not None:
            info.add_sample(CACHE_INFO, {"block_size": str(v.node.block_size),
                                         "num_gpu_blocks": str(v.node.num_blocks)}, 1.0)
        for model, m in rows:
            if m.block_size is not None:
                info.add_sample(CACHE_INFO, {"model_name": model, "block_size": str(m.block_size),
                                             "num_gpu_blocks": str(m.num_blocks)}, 1.0)
        yield info
