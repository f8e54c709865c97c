"""Prometheus metrics: one registry per instance, model state, engine gauges, forgetting a model."""

from __future__ import annotations

from agent.metrics import Metrics
from tests.records import model_stats


def test_metrics_registries_are_per_instance() -> None:
    a, b = Metrics(), Metrics()
    a.requests.labels(model="m", status="200").inc()
    assert b'infire_requests_total{model="m",status="200"} 1.0' in a.render()
    assert b"infire_requests_total{" not in b.render()
    a.set_model_state("m", "ready")
    a.set_model_state("m", "draining")
    text = a.render().decode()
    assert 'infire_model_state{model="m",state="draining"} 1.0' in text
    assert 'infire_model_state{model="m",state="ready"} 0.0' in text
    a.refresh_engine({"m": model_stats(running=2, waiting=1, kv_pages_used=3, kv_pages_total=9, device_bytes=10,
                                       yield_waits=4, yield_wait_s=0.012, prefix_caching=True, prefix_cached_pages=7,
                                       prefix_queried_tokens=900, prefix_hit_tokens=640, cascade=True,
                                       cascade_rows=321, cascade_steps=20)})
    text = a.render().decode()
    assert 'infire_running_sequences{model="m"} 2.0' in text and 'infire_gpu_memory_bytes{model="m"} 10.0' in text
    assert 'infire_parked_steps{model="m"} 4.0' in text and 'infire_parked_seconds{model="m"} 0.012' in text
    assert 'infire_prefix_queried_tokens{model="m"} 900.0' in text and 'infire_prefix_hit_tokens{model="m"} 640.0' in text
    assert 'infire_prefix_cached_pages{model="m"} 7.0' in text
    assert 'infire_cascade_rows{model="m"} 321.0' in text
    a.forget_model("m")
    text = a.render().decode()
    assert 'infire_running_sequences{model="m"}' not in text and 'infire_parked_steps{model="m"}' not in text
    assert 'infire_prefix_hit_tokens{model="m"}' not in text and 'infire_cascade_rows{model="m"}' not in text


def test_an_unloaded_model_leaves_no_ghost_series() -> None:
    """The sequence a CPU churn pass caught: the manager forgets a model it unloaded, the next
    refresh still sees the last Status's row of it (stale: the Status came before the Unloaded),
    later Statuses no longer list it. Its series must stay gone, and the per-model bytes must be
    what is still loaded."""
    a = Metrics()
    a.refresh_engine({"m": model_stats(device_bytes=10, kv_pages_used=3), "n": model_stats(device_bytes=5)})
    a.forget_model("m")  # the manager's unload
    a.refresh_engine({"m": model_stats(device_bytes=10, kv_pages_used=3), "n": model_stats(device_bytes=5)},
                     stale={"m"})
    text = a.render().decode()
    assert 'model="m"' not in text and 'infire_gpu_memory_bytes{model="n"} 5.0' in text
    # and without the manager's forget_model (a model that left another way): gone at the first
    # Status that no longer lists it
    a.refresh_engine({"n": model_stats(device_bytes=5)})
    a.refresh_engine({})
    text = a.render().decode()
    assert 'infire_gpu_memory_bytes{model="n"}' not in text and 'infire_kv_pages_total{model="n"}' not in text


def test_feature_series_follow_the_flags_not_the_figures() -> None:
    """A model without cascade plans or constrained requests has no cascade or grammar series
    (its figures are 0 in the record); one with them has every series, zeros included."""
    a = Metrics()
    a.refresh_engine({"plain": model_stats(running=1),
                      "both": model_stats(cascade=True, constrained=True, grammar_compiles=2, grammar_mask_s=0.5)})
    text = a.render().decode()
    assert 'model="plain"' in text and 'infire_prefix_hit_tokens{model="plain"} 0.0' in text
    assert 'infire_cascade_rows{model="plain"}' not in text and 'infire_grammar_compiles{model="plain"}' not in text
    assert 'infire_cascade_rows{model="both"} 0.0' in text and 'infire_grammar_compiles{model="both"} 2.0' in text
    assert 'infire_grammar_mask_seconds{model="both"} 0.5' in text
    assert 'infire_grammar_masked_steps{model="both"} 0.0' in text


def test_the_loop_histogram_exposes_what_prometheus_clients_histogram_does() -> None:
    """The inter-token latency's own histogram (observed per token): the same bucket, count and
    sum lines as prometheus_client's Histogram for the same observations, edges included."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from agent.metrics import _ITL_BUCKETS, LoopHistogram

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("h_seconds", "doc", ["model"], buckets=_ITL_BUCKETS, registry=theirs)
    loop = LoopHistogram("h_seconds", "doc", ["model"], buckets=_ITL_BUCKETS, registry=ours)
    for model, v in [("a", 0.0005), ("a", 0.001), ("a", 0.0011), ("b", 0.016), ("a", 5.0), ("a", 7.5)]:
        ref.labels(model=model).observe(v)
        loop.labels(model=model).observe(v)
    want = [ln for ln in generate_latest(theirs).decode().splitlines() if "_created" not in ln]
    assert generate_latest(ours).decode().splitlines() == want
    assert 'h_seconds_bucket{le="0.001",model="a"} 2.0' in want  # an edge counts in its own bucket
    loop.remove("b")
    assert 'model="b"' not in generate_latest(ours).decode()
