"""The model-server protocol's gauges (agent/gateway_metrics.py): what they say from the agent's
figures, and how they read through prometheus_client's own text parser as the endpoint picker
reads them (its default flags take a family's first series: the node's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.gateway_metrics import (CACHE_INFO, KV_USAGE, RUNNING, WAITING, Admitted, GatewayCollector, Load,
                                   gateway_view)
from engine.stats import MemoryStats
from tests.records import model_stats


def _memory(pages: int, free: int) -> MemoryStats:
    return MemoryStats(budget=100, used=60, free=40, weights=30, workspace=10, kv=20, kv_used=5, page_bytes=2,
                       kv_pages=pages, kv_pages_free=free, untracked=0, device=0, models={}, models_omitted=0)


def test_queued_is_admitted_and_not_running_running_is_the_engines_kv_is_the_pool():
    stats = {"a": model_stats(running=4, waiting=2, kv_pages_used=30, kv_pages_total=60),
             "b": model_stats(running=1, waiting=0, kv_pages_used=10, kv_pages_total=50)}
    admitted = {"a": Admitted(in_flight=9, load_waiters=0, block_size=16),  # 4 running, 5 admitted before
                "b": Admitted(in_flight=1, load_waiters=0, block_size=16),
                "c": Admitted(in_flight=0, load_waiters=3, block_size=None)}  # loading, 3 waiting for it
    v = gateway_view(stats, _memory(100, 60), admitted)
    assert v.models["a"] == Load(waiting=5, running=4, kv_usage=0.5, block_size=16, num_blocks=60)
    assert v.models["b"] == Load(waiting=0, running=1, kv_usage=0.2, block_size=16, num_blocks=50)
    assert v.models["c"] == Load(waiting=3, running=0, kv_usage=0.0, block_size=None, num_blocks=0)
    assert v.node == Load(waiting=8, running=5, kv_usage=0.4, block_size=16, num_blocks=100)
    # the engine's queue is never hidden by a stale admission count
    assert gateway_view({"a": model_stats(running=1, waiting=6)}, None,
                        {"a": Admitted(3, 0, 16)}).models["a"].waiting == 6


def test_the_node_has_no_block_size_while_its_models_differ():
    v = gateway_view({"a": model_stats(kv_pages_total=8), "b": model_stats(kv_pages_total=8)}, _memory(16, 16),
                     {"a": Admitted(0, 0, 16), "b": Admitted(0, 0, 32)})
    assert v.node.block_size is None and v.node.kv_usage == 0.0


def test_the_exposition_reads_node_first_then_each_model():
    registry = CollectorRegistry()
    gauges = GatewayCollector()
    registry.register(gauges)
    gauges.update(gateway_view({"m": model_stats(running=2, waiting=1, kv_pages_used=3, kv_pages_total=12)},
                               _memory(12, 9), {"m": Admitted(3, 0, 16)}))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    for name in (WAITING, RUNNING, KV_USAGE):
        samples = fams[name].samples
        assert fams[name].type == "gauge" and samples[0].labels == {}, name  # the node: the picker's default
        assert [s.labels for s in samples[1:]] == [{"model_name": "m"}]
    assert [s.value for s in fams[WAITING].samples] == [1.0, 1.0]
    assert [s.value for s in fams[RUNNING].samples] == [2.0, 2.0]
    assert [s.value for s in fams[KV_USAGE].samples] == [0.25, 0.25]
    info = fams[CACHE_INFO].samples
    assert info[0].labels == {"block_size": "16", "num_gpu_blocks": "12"} and info[0].value == 1.0
    assert info[1].labels == {"model_name": "m", "block_size": "16", "num_gpu_blocks": "12"}
