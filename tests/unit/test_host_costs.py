"""ops/bench/host_costs.py measures what it says: a frozen heap leaves the collector almost nothing
to walk; both histograms are timed."""

from __future__ import annotations

from ops.bench.host_costs import gc_share, histogram_observe


def test_the_gc_probe_compares_the_heap_as_is_with_it_frozen():
    r = gc_share(steps=200)
    assert set(r) == {"as is", "frozen"}
    assert r["frozen"]["tracked_objects"] * 10 < r["as is"]["tracked_objects"]  # torch's objects frozen away
    assert all(0.0 <= v["share"] <= 1.0 and v["loop_s"] > 0 for v in r.values())


def test_the_histogram_probe_times_both_histograms():
    r = histogram_observe(n=2000)
    assert r["prometheus_client_us"] > 0 and r["loop_histogram_us"] > 0
