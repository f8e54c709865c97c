"""The inference gateway's view of a node during a bench: its model-server protocol gauges
(agent/gateway_metrics.py) scraped from ``/metrics`` as the endpoint picker scrapes them (it
refreshes every 50 ms by default), parsed with prometheus_client's own text parser.

A thread polls while the bench's load runs; ``summary()`` gives the node-level series (no labels:
what the picker reads with its default flags) over the window — how high queued, running and KV
utilization went, their medians — and one scrape after the load has drained, where the protocol
says running and queued are 0 again. Scraping costs the agent CPU like a real picker would, so a
run with it is not compared with one without for CPU figures.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agent.gateway_metrics import CACHE_INFO, KV_USAGE, RUNNING, WAITING
from ops.bench.workload import percentile

GAUGES = {"waiting": WAITING, "running": RUNNING, "kv_usage": KV_USAGE}


def node_gauges(text: str) -> dict[str, Any]:
    """The unlabelled sample of each protocol gauge in one exposition (None where absent), and
    the node's cache_config_info labels (None while its models do not share one block size)."""
    out: dict[str, Any] = {k: None for k in GAUGES}
    out["cache_config"] = None
    names = {v: k for k, v in GAUGES.items()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names and not s.labels:
                out[names[s.name]] = s.value
            elif s.name == CACHE_INFO and "model_name" not in s.labels and out["cache_config"] is None:
                out["cache_config"] = dict(s.labels)
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return node_gauges(r.read().decode())


class GaugeSampler:
    """Scrape ``url``'s gauges every ``interval`` seconds between ``start()`` and ``stop()``."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url, interval
        self.samples: list[dict[str, Any]] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gauge-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.samples.append(scrape(self.url))
            except OSError:
                self.failures += 1
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def start(self) -> "GaugeSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self, after: dict[str, Any] | None) -> dict[str, Any]:
        """The window's figures; ``after``: one scrape once the load has drained (or None)."""
        out: dict[str, Any] = {"interval_s": self.interval, "samples": len(self.samples), "failures": self.failures}
        for key in GAUGES:
            vals = [s[key] for s in self.samples if s[key] is not None]
            out[key] = {"max": max(vals) if vals else None, "p50": percentile(vals, 50)}
        out["cache_config"] = next((s["cache_config"] for s in self.samples if s["cache_config"]), None)
        out["after"] = None if after is None else {k: after[k] for k in GAUGES}
        return out
