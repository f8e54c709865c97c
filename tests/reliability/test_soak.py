"""Load and soak on CPU: concurrent streaming clients with random aborts while a second model is
loaded and unloaded over and over. Afterwards: no 5xx but deliberate 503s, and no growth in
RSS, open fds (agent and worker) or KV pages in use.

``RELIABILITY_SOAK_S`` sets the length (default 30 s); ``RELIABILITY_SOAK_CLIENTS`` the clients.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
from collections import Counter

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny
from tests.reliability.rel_helpers import ADMIN, MODEL, healthy, open_fds, rss_bytes

OTHER = "tiny-b"
SOAK_S = float(os.environ.get("RELIABILITY_SOAK_S", "30"))
CLIENTS = int(os.environ.get("RELIABILITY_SOAK_CLIENTS", "8"))
RSS_SLACK = 48 << 20
FD_SLACK = 4


def _client(d: Daemon, seed: int, stop: threading.Event, counts: Counter[str], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        model = MODEL if rng.random() < 0.75 else OTHER
        chat = rng.random() < 0.5
        body = {"model": model, "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.8]),
                "ignore_eos": True, "stream": rng.random() < 0.8, "seed": rng.randint(0, 1000)}
        body.update({"messages": [{"role": "user", "content": "soak " * rng.randint(1, 20)}]} if chat
                    else {"prompt": "soak " * rng.randint(1, 20)})
        abort_after = rng.randint(1, 6) if rng.random() < 0.2 else None
        local: Counter[str] = Counter(requests=1)
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            local[f"status_{r.status}"] += 1
            if r.status != 200:
                r.read()
            elif body["stream"]:
                for i, line in enumerate(r):
                    if line.startswith(b"data: {"):
                        local["chunks"] += 1
                        if b'"error"' in line:
                            local["stream_errors"] += 1
                    if abort_after is not None and i >= abort_after:
                        local["aborts"] += 1
                        break
            else:
                local["tokens"] += json.loads(r.read())["usage"]["completion_tokens"]
        except (OSError, http.client.HTTPException) as e:
            local[f"client_error_{type(e).__name__}"] += 1
        finally:
            conn.close()
        with lock:
            counts.update(local)


def _loader(d: Daemon, stop: threading.Event, counts: Counter[str], lock: threading.Lock) -> None:
    while not stop.wait(3.0):
        for op in ("unload", "load"):
            code, _ = d.post(f"/admin/v1/models/{OTHER}/{op}?wait=true&timeout=30", headers=ADMIN, timeout=60)
            with lock:
                counts[f"admin_{op}_{code}"] += 1


def _resources(d: Daemon) -> dict[str, int]:
    wpid = d.status()["worker"]["pid"]
    return {"agent_rss": rss_bytes(d.proc.pid), "worker_rss": rss_bytes(wpid), "agent_fds": open_fds(d.proc.pid),
            "worker_fds": open_fds(wpid), "pages": sum(int(d.engine_stats(m)["kv_pages"]["used"])
                                                       for m in (MODEL, OTHER))}


def _settle(d: Daemon) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        models = {m["name"]: m for m in d.engine_status()["models"]}
        # The worker's stats arrive with its heartbeats: wait until they show nothing held.
        if all(models[m]["in_flight"] == 0 and models[m]["state"] == "ready" and models[m]["running"] == 0
               and models[m]["waiting"] == 0 and models[m]["kv_pages"]["used"] == 0 for m in (MODEL, OTHER)):
            return
        if models[OTHER]["state"] in ("cached", "absent", "failed"):
            d.post(f"/admin/v1/models/{OTHER}/load?wait=true&timeout=30", headers=ADMIN, timeout=60)
        time.sleep(0.1)
    raise AssertionError(f"the agent did not settle: {models}")


@pytest.mark.timeout(SOAK_S + 240)  # the suite's per-test limit would cut a long soak short
def test_soak_streaming_with_aborts_and_load_unload(make_tiny_model, tmp_path, tally) -> None:
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    publish_tiny(lambda arch: make_tiny_model(arch, seed=1), tmp_path / "store", OTHER)
    d = Daemon(tmp_path, store_url=url, models=[
        {"name": MODEL, "preload": True, "max_model_len": 256, "max_num_seqs": 8},
        {"name": OTHER, "preload": True, "max_model_len": 256, "max_num_seqs": 4}]).start(timeout=120)
    try:
        counts: Counter[str] = Counter()
        lock = threading.Lock()
        warm_stop = threading.Event()  # a short warm-up: pools, arenas and caches reach their size
        warm = [threading.Thread(target=_client, args=(d, 1000 + i, warm_stop, Counter(), lock)) for i in range(4)]
        for t in warm:
            t.start()
        time.sleep(min(5.0, SOAK_S / 4))
        warm_stop.set()
        for t in warm:
            t.join()
        _settle(d)
        before = _resources(d)
        stop = threading.Event()
        threads = [threading.Thread(target=_client, args=(d, i, stop, counts, lock)) for i in range(CLIENTS)]
        threads.append(threading.Thread(target=_loader, args=(d, stop, counts, lock)))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(SOAK_S)
        stop.set()
        for t in threads:
            t.join(timeout=90)
        elapsed = time.monotonic() - t0
        _settle(d)
        after = _resources(d)
        five_xx = sum(v for k, v in counts.items() if k.startswith("status_5") and k != "status_503")
        admin_5xx = sum(v for k, v in counts.items() if k.startswith("admin_") and k.endswith(("_500", "_502")))
        assert five_xx == 0 and admin_5xx == 0, counts
        assert counts["status_200"] > CLIENTS, counts
        assert not any(k.startswith("client_error") for k in counts), counts
        assert after["pages"] == before["pages"] == 0, (before, after)
        assert after["agent_fds"] <= before["agent_fds"] + FD_SLACK, (before, after)
        assert after["worker_fds"] <= before["worker_fds"] + FD_SLACK, (before, after)
        assert after["agent_rss"] - before["agent_rss"] < RSS_SLACK, (before, after)
        assert after["worker_rss"] - before["worker_rss"] < RSS_SLACK, (before, after)
        healthy(d)
        tally["requests"] += counts["requests"]
        tally["deliberate_503"] += counts["status_503"]
        tally["faults"] += counts["aborts"] + counts["admin_unload_200"]
        tally["soak_seconds"] += round(elapsed)
        tally["soak_requests"] += counts["requests"]
        tally["soak_chunks"] += counts["chunks"] + counts["tokens"]
        print(f"soak: {elapsed:.0f}s {CLIENTS} clients {dict(counts)} before={before} after={after} "
              f"{counts['requests'] / elapsed:.1f} req/s {(counts['chunks'] + counts['tokens']) / elapsed:.1f} tok/s")
    finally:
        d.stop()
