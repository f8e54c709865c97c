"""Daemon lifecycle: worker death mid-stream, SIGTERM drain, sd_notify, with a real daemon (CPU)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time

from tests.integration.agent_harness import Daemon, publish_tiny
from tests.s3_fault_proxy import bucket, moto_endpoint, proxy  # noqa: F401 - fixtures

MODEL = "tiny"
CTX = 256


def _open_stream(d: Daemon, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _events(resp: http.client.HTTPResponse) -> list[str]:
    """Every SSE data payload until the server ends the response (cleanly or not)."""
    out = []
    try:
        for line in resp:
            if line.startswith(b"data: "):
                out.append(line[6:].decode().strip())
    except (http.client.IncompleteRead, ConnectionError):
        pass
    return out


def test_worker_sigkill_mid_stream_then_recovers(make_tiny_model, tmp_path) -> None:
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    d = Daemon(tmp_path, store_url=url, models=[{"name": MODEL, "preload": True, "max_model_len": 2048}],
               env={"INFIRE_SERVER__DRAIN_TIMEOUT": "0.3"}).start(timeout=120)
    try:
        pid = d.status()["worker"]["pid"]
        # A pull asked while it is loaded marks its next load to pull first: the restart's reload
        # is that load (it once failed it, "cannot go from loading to pulling").
        code, body = d.post(f"/admin/v1/models/{MODEL}/pull", headers={"Authorization": "Bearer test-admin-token"})
        assert code == 200, body
        conn, resp = _open_stream(d, CTX - 16)
        first = resp.readline()
        assert first.startswith(b"data: ")
        os.kill(pid, signal.SIGKILL)
        events = _events(resp)
        conn.close()
        assert events and "[DONE]" not in events
        err = json.loads(events[-1])["error"]
        assert err["code"] == "worker_died" and "signal 9" in err["message"]
        # The node is not ready while the worker is gone; the model reloads by itself and its own
        # probe says when it is back (a preload model does not hold the node out: docs/operations.md).
        d.wait_for("/readyz", 503, timeout=10)
        d.wait_for(f"/readyz/{MODEL}", 200, timeout=90)
        d.wait_for("/readyz", 200, timeout=30)
        st = d.status()
        assert st["worker"]["pid"] != pid and st["worker"]["restarts"] == 1
        assert "load_error" not in d.logs()
        assert next(m for m in st["models"] if m["name"] == MODEL)["state"] == "ready"
        code, body = d.post("/v1/completions", {"model": MODEL, "prompt": "again", "max_tokens": 3,
                                                "temperature": 0, "ignore_eos": True})
        assert code == 200 and body["usage"]["completion_tokens"] == 3
        _, metrics = d.get("/metrics")
        assert "infire_worker_restarts_total 1.0" in metrics
        # Past the drain deadline, SIGTERM aborts what is left and says so in the stream.
        conn, resp = _open_stream(d, 2000)  # seconds of work on any CPU: outlives the 0.3 s drain
        assert resp.readline().startswith(b"data: ")
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        events = _events(resp)
        conn.close()
        assert d.proc.wait(20) == 0 and time.monotonic() - t0 < 10
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "shutting_down"
    finally:
        d.stop()


class _NotifyListener:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except (TimeoutError, socket.timeout):
                continue

    def keys(self) -> list[str]:
        return [line.split("=", 1)[0] + ("=1" if line.startswith(("READY=1", "STOPPING=1", "WATCHDOG=1")) else "")
                for m in list(self.messages) for line in m.splitlines() if not line.startswith("STATUS=")]

    def close(self) -> None:
        self._stop.set()
        self._t.join()
        self.sock.close()


def test_sigterm_drains_and_sd_notify_order(make_tiny_model, tmp_path) -> None:
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    listener = _NotifyListener(str(tmp_path / "notify.sock"))
    d = Daemon(tmp_path, store_url=url, models=[{"name": MODEL, "preload": True, "max_model_len": CTX}],
               env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"})
    try:
        d.start(timeout=120)
        time.sleep(1.2)  # at least one watchdog period after READY
        # A wedged worker (stopped, so no heartbeats) must silence the watchdog and fail /readyz.
        worker = d.status()["worker"]["pid"]
        os.kill(worker, signal.SIGSTOP)
        try:
            d.wait_for("/readyz", 503, timeout=10)
            time.sleep(1.0)
            n = listener.keys().count("WATCHDOG=1")
            time.sleep(2.0)
            assert listener.keys().count("WATCHDOG=1") == n
        finally:
            os.kill(worker, signal.SIGCONT)
        d.wait_for("/readyz", 200, timeout=20)
        time.sleep(1.2)
        assert listener.keys().count("WATCHDOG=1") > n
        conn, resp = _open_stream(d, 48)
        assert resp.readline().startswith(b"data: ")
        d.proc.send_signal(signal.SIGTERM)
        events = _events(resp)  # the in-flight stream is allowed to finish
        conn.close()
        assert events[-1] == "[DONE]"
        usage_free = [json.loads(e) for e in events[:-1]]
        finish = [c["choices"][0]["finish_reason"] for c in usage_free if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish == ["length"]
        assert d.proc.wait(30) == 0
    finally:
        d.stop()
        listener.close()
    keys = listener.keys()
    assert "READY=1" in keys and "STOPPING=1" in keys, keys
    ready, stopping = keys.index("READY=1"), keys.index("STOPPING=1")
    assert ready < stopping and keys.count("READY=1") == 1
    assert "EXTEND_TIMEOUT_USEC" in keys[:ready]  # the worker start and model load took a while
    assert "WATCHDOG=1" in keys[ready:stopping]
    statuses = [line for m in listener.messages for line in m.splitlines() if line.startswith("STATUS=")]
    assert any(f"{MODEL} ready" in s for s in statuses), statuses


def test_engine_less_worker_supervision_via_daemon(tmp_path) -> None:
    """Without an engine the daemon still serves probes and restarts a killed worker."""
    d = Daemon(tmp_path, engine="none", env={"INFIRE_SERVER__ADMIN_TOKEN": "",
                                             "INFIRE_SERVER__KEEPALIVE_TIMEOUT": "1"}).start(ready=True, timeout=60)
    try:
        # Idle limit: a connection that sends nothing, or stops mid-headers, is closed.
        for first in (b"", b"GET /livez HTTP/1.1\r\nHost: x\r\n"):
            with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
                s.sendall(first)
                t0 = time.monotonic()
                assert s.recv(100) == b"" and time.monotonic() - t0 < 5
        code, body = d.get("/admin/v1/status", {"Authorization": "Bearer "})
        assert code == 401 and "unix socket" in body["error"]["message"]  # no token: no admin over TCP
        # A second agent on the same admin socket refuses to start instead of stealing it.
        second = Daemon(tmp_path, engine="none")
        try:
            second.start(ready=False, timeout=30)
            raise AssertionError("a second agent started on a live admin socket")
        except RuntimeError as e:
            assert "exited with 1" in str(e) and "another agent is listening" in second.logs()
        pid = d.engine_status()["worker"]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while d.engine_status()["worker"]["pid"] in (pid, None):  # restarted (liveness stays 200 meanwhile)
            assert d.get("/livez")[0] == 200 and time.monotonic() < deadline
            time.sleep(0.05)
        d.wait_for("/readyz", 200, timeout=30)
    finally:
        assert d.stop() == 0


def test_stopping_while_a_download_stalls_answers_the_waiting_load(make_tiny_model, tmp_path, proxy, bucket) -> None:
    """SIGTERM while an admin load waits on a pull whose blob stalls mid-body: the waiting client
    gets 503 ``shutting_down`` at once (its connection was cut when the shutdown's grace ran out
    while the pull's threads waited for the read's timeout), and the agent exits without waiting
    for the stalled read (the cancel ends it: cache/downloader.py, _Readers)."""
    from cache.publish import publish_model
    from tests.s3_fault_proxy import Fault, s3_store

    store = s3_store(proxy.url, bucket)
    publish_model(store, make_tiny_model("llama"), MODEL)
    store.close()
    proxy.add(Fault("stall", match="/blobs/", after=4096, delay=12, times=100))
    d = Daemon(tmp_path, store_url=f"s3://{bucket}/store",
               env={"INFIRE_STORE__ENDPOINT_URL": proxy.url, "INFIRE_STORE__PATH_STYLE": "true",
                    "INFIRE_STORE__REGION": "us-east-1"})
    try:
        d.start(timeout=120)
        answer: list = []
        t = threading.Thread(target=lambda: answer.append(d.post(
            f"/admin/v1/models/{MODEL}/load?wait=1&timeout=60", headers={"Authorization": "Bearer test-admin-token"},
            timeout=60)))
        t.start()
        deadline = time.monotonic() + 10
        while not proxy.total_blob_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        t.join(15)
        assert answer and answer[0][0] == 503 and answer[0][1]["error"]["code"] == "shutting_down", answer
        assert time.monotonic() - t0 < 3
        assert d.proc.wait(20) == 0, d.logs()[-3000:]
        assert time.monotonic() - t0 < 8  # the stall lasts 12 s
    finally:
        d.stop()
