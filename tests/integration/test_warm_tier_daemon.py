"""The warm tier as an operator sees it through the daemon (CPU, a tiny model): /metrics and the
admin status show its budget, the share ready for a put and what an unload stored there, read with
prometheus_client's own parser."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.agent_harness import Daemon, publish_tiny
from tests.integration.manager_helpers import CTX, SEQS, admin, complete, wait_state

TIER = 64 << 20


def _tier_metrics(d: Daemon) -> dict[str, float]:
    code, text = d.get("/metrics")
    assert code == 200
    got: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "infire_warm_tier_bytes":
                got[s.labels["kind"]] = s.value
            elif s.name == "infire_warm_tier_models":
                got["models"] = s.value
    return got


def _wait_tier(d: Daemon, want: dict[str, float], timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        got = _tier_metrics(d)
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)  # the worker's Status comes every STATUS_INTERVAL_S


def test_the_warm_tier_is_shown_in_metrics_and_status_and_fills_on_an_unload(make_tiny_model, tmp_path):
    publish_tiny(make_tiny_model, tmp_path / "store", "tiny")
    models = [{"name": "tiny", "max_model_len": CTX, "max_num_seqs": SEQS, "keep_alive": -1, "autoload": False}]
    d = Daemon(tmp_path, models=models, env={"INFIRE_GPU__WARM_TIER_BYTES": str(TIER)}).start(timeout=120)
    try:
        # Off CUDA nothing is page-locked: the whole budget is ready at once, nothing stored yet.
        got = _wait_tier(d, {"budget": TIER, "ready": TIER, "used": 0, "models": 0})
        assert got == {"budget": TIER, "ready": TIER, "used": 0, "models": 0}, got
        assert admin(d, "tiny", "load")[0] == 200 and complete(d, "tiny")[0] == 200
        assert admin(d, "tiny", "unload")[0] == 200
        wait_state(d, "tiny", {"cached"})
        got = _wait_tier(d, {"models": 1})
        assert got["models"] == 1 and 0 < got["used"] <= TIER and got["ready"] == TIER, got
        tier = d.engine_status()["engine"]["warm_tier"]
        assert tier == {"budget": TIER, "ready": TIER, "used": got["used"], "models": 1}, tier
    finally:
        d.stop()


def test_without_a_warm_tier_there_is_no_series(make_tiny_model, tmp_path):
    publish_tiny(make_tiny_model, tmp_path / "store", "tiny")
    d = Daemon(tmp_path, models=[{"name": "tiny", "max_model_len": CTX, "max_num_seqs": SEQS}]).start(timeout=120)
    try:
        assert complete(d, "tiny")[0] == 200
        deadline = time.monotonic() + 20
        while 'infire_gpu_memory_bytes{model="tiny"}' not in d.get("/metrics")[1]:  # a Status mirrored
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert _tier_metrics(d) == {"models": 0}
        assert d.engine_status()["engine"]["warm_tier"] is None
    finally:
        d.stop()
