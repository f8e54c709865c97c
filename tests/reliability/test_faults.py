"""Faults around live requests: clients that leave (queued, before the first token, mid-stream),
the worker SIGKILLed under load, SIGTERM with live streams, oversized work refused by admission,
and model folders the engine must refuse (pickle weights, remote code)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading

from tests.integration.agent_harness import Daemon, publish_tiny
from tests.reliability.rel_helpers import ADMIN, CTX, MODEL, healthy, idle, open_fds, open_stream, sse_events


def _pages_used(d: Daemon) -> int:
    return int(d.engine_stats(MODEL)["kv_pages"]["used"])


def test_clients_leaving_at_every_stage_leak_nothing(daemon, tally) -> None:
    idle(daemon)
    base_pages = _pages_used(daemon)
    base_fds = open_fds(daemon.proc.pid)
    for _ in range(3):
        # Fill the running slots, queue more behind them, then drop every kind of client.
        streams = [open_stream(daemon, CTX - 16) for _ in range(4)]
        for _, r in streams:
            assert r.status == 200 and r.readline().startswith(b"data: ")
        queued = [open_stream(daemon, CTX - 16) for _ in range(3)]  # accepted, waiting for a slot
        m = daemon.engine_stats(MODEL)
        assert m["in_flight"] == 7, m
        for c, _ in queued:  # leave while queued, before any token
            c.sock.shutdown(2)
            c.close()
        for c, r in streams:  # leave mid-stream
            r.readline()
            c.sock.shutdown(2)
            c.close()
        # Leave before the first token: send the request and hang up at once.
        for chat in (False, True):
            c, _ = open_stream(daemon, CTX - 16, chat=chat)
            c.close()
        m = idle(daemon)
        assert m["kv_pages"]["used"] == base_pages == 0, m
        tally["faults"] += 9
        tally["requests"] += 9
    assert open_fds(daemon.proc.pid) <= base_fds + 2
    healthy(daemon)


def test_oversized_batch_refused_by_admission_not_crashed(daemon, tally) -> None:
    limit = daemon.engine_stats(MODEL)["queue_limit"]
    results: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        code, _ = daemon.post("/v1/completions", {"model": MODEL, "prompt": [7] * (CTX - 40), "max_tokens": 32,
                                                  "n": 8, "temperature": 1, "ignore_eos": True}, timeout=120)
        with lock:
            results.append(code)

    threads = [threading.Thread(target=one) for _ in range(limit + 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) <= {200, 503}, results
    assert 503 in results and 200 in results, results
    idle(daemon, timeout=60)
    st = daemon.status()
    assert st["worker"]["restarts"] == 0 and st["worker"]["alive"]
    tally["requests"] += len(results)
    tally["deliberate_503"] += results.count(503)
    tally["faults"] += 1
    healthy(daemon)


def test_model_folders_with_pickles_or_remote_code_are_refused(daemon, make_tiny_model, tmp_path, tally) -> None:
    from cache.errors import ManifestError
    from cache.publish import publish_model
    from cache.store import open_store

    store = open_store(daemon.env["INFIRE_STORE__URL"])
    try:
        src = make_tiny_model("llama")
        pickled = tmp_path / "pickled"
        shutil.copytree(src, pickled)
        (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
        try:
            publish_model(store, pickled, "pickled")
        except ManifestError as e:
            assert "pickle" in str(e)
        else:
            raise AssertionError("a folder with a .bin file was published")
        remote = tmp_path / "remote"
        shutil.copytree(src, remote)
        cfg = json.loads((remote / "config.json").read_text())
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
        (remote / "config.json").write_text(json.dumps(cfg))
        publish_model(store, remote, "remote-code")
    finally:
        store.close()
    code, body = daemon.post("/admin/v1/models/remote-code/load?wait=true&timeout=60", headers=ADMIN, timeout=90)
    assert code == 500 and body["model"]["state"] == "failed", (code, body)
    assert "auto_map" in body["model"]["reason"], body
    code, body = daemon.post("/admin/v1/models/pickled/load?wait=true&timeout=60", headers=ADMIN, timeout=90)
    assert code in (404, 500), (code, body)
    code, _ = daemon.post("/v1/completions", {"model": "remote-code", "prompt": "x", "max_tokens": 1})
    assert code in (404, 503), code
    assert daemon.status()["worker"]["restarts"] == 0
    tally["bad_inputs"] += 2
    healthy(daemon)


def test_worker_sigkill_under_load_then_sigterm_with_live_streams(make_tiny_model, tmp_path, tally) -> None:
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    d = Daemon(tmp_path, store_url=url, models=[{"name": MODEL, "preload": True, "max_model_len": 2048,
                                                 "max_num_seqs": 8}],
               env={"INFIRE_SERVER__DRAIN_TIMEOUT": "1"}).start(timeout=120)
    try:
        pid = d.status()["worker"]["pid"]
        streams = [open_stream(d, 1500, chat=bool(i % 2)) for i in range(6)]
        for _, r in streams:
            assert r.status == 200 and r.readline().startswith(b"data: ")
        os.kill(pid, signal.SIGKILL)
        for c, r in streams:
            events = sse_events(r)
            c.close()
            assert events and "[DONE]" not in events
            assert json.loads(events[-1])["error"]["code"] == "worker_died"
        d.wait_for(f"/readyz/{MODEL}", 200, timeout=90)  # the model reloaded in the new worker
        d.wait_for("/readyz", 200, timeout=30)
        assert d.status()["worker"]["restarts"] == 1
        healthy(d)
        # SIGTERM with live streams: short ones finish, long ones get a clear error; exit 0.
        short = [open_stream(d, 4) for _ in range(2)]
        long = [open_stream(d, 1800) for _ in range(3)]
        for _, r in long:
            assert r.readline().startswith(b"data: ")
        d.proc.send_signal(signal.SIGTERM)
        for c, r in short:
            assert sse_events(r)[-1] == "[DONE]"
            c.close()
        for c, r in long:
            events = sse_events(r)
            c.close()
            assert events and json.loads(events[-1])["error"]["code"] == "shutting_down", events[-2:]
        assert d.proc.wait(30) == 0
        tally["faults"] += 2
        tally["requests"] += 14
    finally:
        d.stop()


def test_a_stopped_worker_is_killed_after_the_hang_bound_and_replaced(make_tiny_model, tmp_path, tally) -> None:
    """SIGSTOP (a hang: no frame at all, heartbeat included): past server.worker_hang_timeout
    the agent kills it; its streams end with an error naming why, a new worker serves."""
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    d = Daemon(tmp_path, store_url=url, models=[{"name": MODEL, "preload": True, "max_model_len": 2048,
                                                 "max_num_seqs": 8}],
               env={"INFIRE_SERVER__WORKER_HANG_TIMEOUT": "3s"}).start(timeout=120)
    try:
        pid = d.status()["worker"]["pid"]
        streams = [open_stream(d, 1500) for _ in range(2)]
        for _, r in streams:
            assert r.status == 200 and r.readline().startswith(b"data: ")
        os.kill(pid, signal.SIGSTOP)
        for c, r in streams:
            events = sse_events(r)
            c.close()
            err = json.loads(events[-1])["error"]
            assert err["code"] == "worker_died" and "sent nothing for" in err["message"], err
        d.wait_for(f"/readyz/{MODEL}", 200, timeout=90)  # reloaded in the new worker
        st = d.status()["worker"]
        assert st["pid"] != pid and st["restarts"] == 1, st
        code, body = d.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert code == 200, body
        logs = [json.loads(line) for line in d.logs().splitlines() if line.startswith("{")]
        assert any(r.get("event") == "worker_hung" for r in logs)
        tally["faults"] += 1
        tally["requests"] += 3
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        d.stop()
