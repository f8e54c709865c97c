"""What the probes mean, against a real daemon (CPU, tiny models, a budget that holds two).

Ready: the worker is up and every pinned model is ready (a preload model counts until it has
been ready once: preload means "load at start"), so evicting a preload model for an autoloaded
one keeps the node in rotation. ``/readyz/{model}`` answers per model. Live: the agent itself,
never the worker's restart or a model's state.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny
from tests.integration.manager_helpers import CTX, SEQS, TOKEN, budget_for_two, complete, wait_state

NAMES = ("keep", "pre", "auto")


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probes")
    src = make_tiny_model("llama")
    url = publish_tiny(make_tiny_model, tmp / "store", NAMES)
    base = {"max_model_len": CTX, "max_num_seqs": SEQS, "keep_alive": -1}
    models = [{**base, "name": "keep", "preload": True, "pin": True}, {**base, "name": "pre", "preload": True},
              {**base, "name": "auto", "autoload": True}]
    d = Daemon(tmp, store_url=url, models=models,
               env={"INFIRE_GPU__CPU_MEMORY_BUDGET": str(budget_for_two(src)), "INFIRE_SERVER__AUTOLOAD_TIMEOUT": "30s"})
    d.start(timeout=180)  # /readyz 200: both preload models were loaded at start
    yield d
    d.stop()


def test_evicting_a_preload_model_for_an_autoloaded_one_keeps_the_node_ready(daemon) -> None:
    assert {m["name"]: m["state"] for m in daemon.status()["models"]} == {
        "keep": "ready", "pre": "ready", "auto": "absent"}
    assert daemon.post("/admin/v1/models/auto/pull?wait=true", headers=TOKEN, timeout=60)[0] == 200
    code, body = complete(daemon, "auto")  # autoload: evicts "pre" ("keep" is pinned)
    assert code == 200, body
    assert wait_state(daemon, "pre", {"cached"})["state"] == "cached"
    code, body = daemon.get("/readyz")
    assert code == 200 and body["checks"] == ["keep: ready"], body
    assert daemon.get("/readyz/keep")[0] == 200 and daemon.get("/readyz/auto")[0] == 200
    code, body = daemon.get("/readyz/pre")
    assert code == 503 and body["checks"][0].startswith("pre: cached")
    assert daemon.get("/readyz/never-heard-of")[0] == 404


def test_livez_ignores_the_worker_restart_and_readyz_follows_it(daemon) -> None:
    pid = daemon.status()["worker"]["pid"]
    os.kill(pid, signal.SIGKILL)
    saw_unready, deadline = False, time.monotonic() + 90
    while True:
        assert daemon.get("/livez", timeout=5)[0] == 200  # liveness never follows the worker
        code, _ = daemon.get("/readyz", timeout=5)
        saw_unready |= code == 503
        st = daemon.status()
        if saw_unready and code == 200 and st["worker"]["pid"] not in (pid, None):
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    assert wait_state(daemon, "keep", {"ready"}, timeout=60)["state"] == "ready"


def test_a_pinned_model_that_is_not_ready_makes_the_node_unready(daemon) -> None:
    code, body = daemon.post("/admin/v1/models/keep/unload?wait=true", headers=TOKEN, timeout=60)
    assert code == 200 and body["model"]["state"] == "cached", body
    code, body = daemon.get("/readyz")
    assert code == 503 and body["checks"] == ["keep: cached"], body
    assert daemon.get("/livez")[0] == 200
    assert daemon.post("/admin/v1/models/keep/unpin", headers=TOKEN)[0] == 200
    code, body = daemon.get("/readyz")
    assert code == 200 and body["checks"] == ["worker up"], body
