"""Agent parts that need no daemon: sd_notify, request schema helpers, metrics registries, CLI rendering."""

from __future__ import annotations

import os
import socket

import pytest
from pydantic import ValidationError

from agent.commands._admin import human_duration, table
from cache.sizes import human_bytes
from agent.commands.status import render
from agent.metrics import Metrics
from agent.http.openai_schema import MAX_JSON_DEPTH, ChatCompletionRequest, CompletionRequest, first_error, json_depth_ok
from agent.systemd import Notifier


def _listen(path: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    return s


def test_notifier_path_socket(tmp_path) -> None:
    sock = _listen(str(tmp_path / "n.sock"))
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "4000000"})
    assert n.enabled and n.watchdog_interval_s == 2.0
    assert n.ready("serving")
    assert sock.recv(100) == b"READY=1\nSTATUS=serving"
    n.extend_timeout(1.5)
    assert sock.recv(100) == b"EXTEND_TIMEOUT_USEC=1500000"
    n.stopping()
    assert sock.recv(100) == b"STOPPING=1\nSTATUS=draining"
    n.close()
    sock.close()


def test_notifier_abstract_socket_and_watchdog_pid() -> None:
    name = f"infire-test-{os.getpid()}"
    sock = _listen(b"\0" + name.encode())
    n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None  # the watchdog is someone else's (pid 1), not ours
    assert n.watchdog()
    assert sock.recv(100) == b"WATCHDOG=1"
    sock.close()


def test_notifier_off_without_socket_and_survives_missing_listener(tmp_path) -> None:
    assert not Notifier({}).enabled and Notifier({}).ready("x") is False
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).ready("x") is False


def test_json_depth() -> None:
    nested: object = 0
    for _ in range(MAX_JSON_DEPTH):
        nested = {"a": nested}
    assert json_depth_ok(nested)
    assert not json_depth_ok([nested])
    assert json_depth_ok({"prompt": list(range(10000))})


def test_first_error_names_the_param() -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": 5}]})
    param, msg = first_error(e.value)
    assert param == "messages.0.content" and msg.startswith("messages.0.content:")
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 2})
    assert first_error(e.value) == ("best_of", "best_of: unknown or unsupported parameter")


def test_prompt_shapes() -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    for bad in ([], [True], [1, "a"], [-1], [["a"], ["b"]]):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})


def test_chat_output_limit_and_logprobs() -> None:
    r = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_tokens": 5, "max_completion_tokens": 7,
        "logprobs": True})
    assert r.output_limit() == 7 and r.logprobs_count() == 0 and r.messages[0].text() == "ab"


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
    a.refresh_engine({"m": {"running": 2, "waiting": 1, "kv_pages_used": 3, "kv_pages_total": 9, "device_bytes": 10,
                            "parked": 4, "parked_s": 0.012}})
    text = a.render().decode()
    assert 'infire_running_sequences{model="m"} 2.0' in text and "infire_gpu_used_bytes 10.0" in text
    assert 'infire_parked_steps{model="m"} 4.0' in text and 'infire_parked_seconds{model="m"} 0.012' in text
    a.forget_model("m")
    text = a.render().decode()
    assert 'infire_running_sequences{model="m"}' not in text and 'infire_parked_steps{model="m"}' not in text


def test_status_rendering() -> None:
    assert human_bytes(None) == "-" and human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.0 GiB"
    assert human_duration(59) == "59s" and human_duration(3700) == "1h01m"
    assert table(["A", "BB"], [["x", "y"]]).splitlines() == ["A  BB", "x  y"]
    st = {"version": "0.1.0", "uptime_s": 65, "ready": False, "draining": False,
          "worker": {"pid": 7, "alive": True, "device": "cpu", "restarts": 2},
          "budget": {"total_bytes": 1 << 30, "used_bytes": 1 << 20}, "cache": {"max_bytes": 1 << 30, "used_bytes": 0},
          "models": [{"name": "m", "state": "failed", "reason": "load failed: boom", "device_bytes": 0,
                      "kv_pages": {"used": 0, "total": 0}, "in_flight": 0, "last_used": None}]}
    st["models"].append({"name": "p", "state": "pulling", "pull": {"done_bytes": 1 << 29, "total_bytes": 1 << 30},
                         "device_bytes": 0, "kv_pages": {}, "in_flight": 0, "last_used": None})
    out = render(st)
    assert "pulling 50% of 1.0 GiB" in out
    assert "NOT READY" in out and "worker restarts: 2" in out and "load failed: boom" in out and "never" in out
    assert "engine:" not in out  # no memory report from the worker yet
    st["engine"] = {"memory": {"budget": 4 << 30, "used": 3 << 30, "weights": 2 << 30, "workspace": 0,
                               "kv": 1 << 30, "kv_used": 1 << 29, "kv_pages": 64, "kv_pages_free": 32}}
    line = next(ln for ln in render(st).splitlines() if ln.startswith("engine:"))
    assert line == ("engine: 3.0 GiB of 4.0 GiB = weights 2.0 GiB + workspace 0 B + KV pool 1.0 GiB "
                    "(512.0 MiB in use, 32 of 64 pages free)"), line
