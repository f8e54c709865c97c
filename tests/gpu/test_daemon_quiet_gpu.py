"""The daemon on CUDA with a flooded model and a quiet one (defaults: shared step cap, quiet window).

While the quiet model is active the flooded model's step is yielded instead of waited on
(engine.core.engine_core.EngineCore.yielded); the worker's selector then sleeps until the step's event fires
(engine/worker/step_waiter.py) or a request comes. Every request is answered in full, the quiet model's
greedy text is its text alone, and the worker woke for yielded steps promptly: a waiter that never
fired would leave each yielded step to the selector's 0.25 s status timeout. (The status keys keep
their names: ``parked`` counts the yields, ``parked_s`` the sleep on them.) Skipped without CUDA.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FLOOD, FLOOD_TOKENS, QUIET_TOKENS = 48, 96, 8
PROMPT = list(range(100, 164))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from cache.publish import publish_model
    from cache.store import open_store
    from modelgen.make import make_model
    from tests.integration.agent_harness import Daemon

    tmp = tmp_path_factory.mktemp("daemon-quiet")
    url = (tmp / "store").as_uri()
    store = open_store(url)
    try:
        publish_model(store, make_model(tmp / "busy", "llama", "small", seed=0), "busy")
        publish_model(store, make_model(tmp / "quiet", "qwen3", "small", seed=1), "quiet")
    finally:
        store.close()
    d = Daemon(tmp, store_url=url, env={"INFIRE_GPU__DEVICE": "cuda", "INFIRE_CACHE__MAX_BYTES": "16GiB"},
               models=[{"name": "busy", "preload": True, "max_model_len": 512, "max_num_seqs": 64},
                       {"name": "quiet", "preload": True, "max_model_len": 512, "max_num_seqs": 4}])
    d.start(timeout=300)
    yield d
    d.stop()


def _complete(d, model: str, prompt: list[int], n: int) -> dict:
    code, body = d.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                            "ignore_eos": True}, timeout=120)
    assert code == 200, body
    return body


def test_a_flooded_model_yields_to_a_quiet_one_and_every_answer_is_whole(daemon):
    # Both models warm first: on a fresh machine the busy model's first steps (kernel builds,
    # deferred graphs) took long enough once that its flood had not started when the quiet
    # requests came, and nothing yielded.
    _complete(daemon, "busy", [7] * 40, FLOOD_TOKENS)
    solo = _complete(daemon, "quiet", PROMPT, QUIET_TOKENS)["choices"][0]["text"]
    before = daemon.engine_status()["engine"]["models"]["busy"]
    flood: list[dict] = []
    threads = [threading.Thread(target=lambda i=i: flood.append(_complete(daemon, "busy", [7 + i] * 40, FLOOD_TOKENS)))
               for i in range(FLOOD)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the flood is running
    quiet = []
    for _ in range(5):
        quiet.append(_complete(daemon, "quiet", PROMPT, QUIET_TOKENS)["choices"][0]["text"])
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=300)
    assert len(flood) == FLOOD
    assert all(r["usage"]["completion_tokens"] == FLOOD_TOKENS and r["choices"][0]["finish_reason"] == "length"
               for r in flood)
    assert quiet == [solo] * 5
    time.sleep(0.6)  # the worker's next status carries the counters
    busy = daemon.engine_status()["engine"]["models"]["busy"]
    yields = busy["parked"] - before["parked"]
    slept = busy["parked_s"] - before["parked_s"]
    assert yields > 0, busy
    assert slept / yields < 0.1, (yields, slept)  # woken by the step's event, not the status timeout
