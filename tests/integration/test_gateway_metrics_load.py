"""The model-server protocol's gauges on a real daemon under load (CPU, tiny model, loopback):
queued rises past ``max_num_seqs`` and falls back, running follows the engine, KV utilization
follows the pages in use — read from /metrics with prometheus_client's own parser, as the
inference gateway's endpoint picker reads them."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from agent.gateway_metrics import CACHE_INFO, KV_USAGE, RUNNING, WAITING
from tests.integration.agent_harness import Daemon, publish_tiny

MODEL = "tiny"
SEQS = 2


def _gauges(d: Daemon) -> dict[str, dict[str, float]]:
    """{family: {model_name or "node": value}} from one scrape."""
    with urllib.request.urlopen(d.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in (WAITING, RUNNING, KV_USAGE):
            out[fam.name] = {s.labels.get("model_name", "node"): s.value for s in fam.samples}
        elif fam.name == CACHE_INFO:
            out[fam.name] = {s.labels.get("model_name", "node"): float(s.labels["num_gpu_blocks"]) for s in fam.samples}
    return out


def _stream(d: Daemon, results: list, max_tokens: int) -> None:
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10, 11, 12] * 4, "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(d.base + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            results.append((r.status, r.read().count(b"data:")))
    except Exception as e:  # noqa: BLE001 - counted: the test says which failed
        results.append((0, repr(e)))


def _until(d: Daemon, ok, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    seen: dict = {}
    while time.monotonic() < deadline:
        seen = _gauges(d)
        if ok(seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"gauges never got there: {seen}")


def test_the_gauges_move_as_the_protocol_says(make_tiny_model, tmp_path):
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    d = Daemon(tmp_path, store_url=url, models=[{"name": MODEL, "preload": True, "max_model_len": 512,
                                                 "max_num_seqs": SEQS, "max_queue": 16}])
    d.start(timeout=120)
    try:
        idle = _until(d, lambda g: g.get(RUNNING, {}).get("node") == 0 and g.get(WAITING, {}).get("node") == 0
                      and g.get(CACHE_INFO, {}).get(MODEL, 0) > 0)  # (once the worker's first status is in)
        assert idle[RUNNING] == {"node": 0.0, MODEL: 0.0} and idle[WAITING] == {"node": 0.0, MODEL: 0.0}
        assert idle[CACHE_INFO]["node"] > 0 and idle[CACHE_INFO][MODEL] > 0
        kv_idle = idle[KV_USAGE]["node"]
        results: list = []
        threads = [threading.Thread(target=_stream, args=(d, results, 400)) for _ in range(6)]
        for t in threads:
            t.start()
        # six admitted, two running: four queued (running never above max_num_seqs)
        busy = _until(d, lambda g: g[RUNNING]["node"] == SEQS and g[WAITING]["node"] >= 3)
        assert busy[RUNNING][MODEL] == SEQS and busy[WAITING][MODEL] == busy[WAITING]["node"]
        assert busy[KV_USAGE]["node"] > kv_idle and 0 < busy[KV_USAGE][MODEL] <= 1
        for t in threads:
            t.join(120)
        assert [r[0] for r in results] == [200] * 6, results
        done = _until(d, lambda g: g[RUNNING]["node"] == 0 and g[WAITING]["node"] == 0)
        assert done[KV_USAGE]["node"] <= kv_idle + 1e-9  # the pages went back
    finally:
        d.stop()
