"""The daemon's start from exec to ready, by phase (issue 18): admin status ``startup`` and the one
``startup`` log line, from a real daemon that preloads a tiny model on CPU. Only order and
consistency are checked here, never speed."""

from __future__ import annotations

import json
import time

from tests.integration.agent_harness import Daemon, publish_tiny

MODEL = "tiny"
TICK = 0.011  # the kernel's process start time is in 10 ms ticks; figures are rounded to 1 us
# The worker's own phases, one after another on its clock; worker_hello (ours) spans them.
WORKER = ["worker_python", "worker_torch", "worker_engine_imports", "worker_engine_core", "worker_device", "worker_sandbox"]
AGENT = ["agent_start", "http_listening", "worker_spawn", "worker_hello"]
MODEL_STEPS = ["model_pull", "model_verify", "model_room", "model_load", "model_tokenizer", "model_canary"]


def _startup_log(d: Daemon, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in d.logs().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "startup":
                return json.loads(line)
        time.sleep(0.1)
    raise AssertionError("no startup log line:\n" + d.logs()[-3000:])


def test_admin_status_has_the_start_by_phase_from_exec_to_ready(make_tiny_model, tmp_path) -> None:
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    d = Daemon(tmp_path, store_url=url, models=[{"name": MODEL, "preload": True, "max_model_len": 256}])
    t0 = time.monotonic()
    d.start(timeout=120)
    ready_seen = time.monotonic() - t0
    try:
        logged = _startup_log(d)  # logged once, at ready; the status keeps the same record from then on
        record = d.status()["startup"]
        assert record == {"phases": logged["phases"], "ready_s": logged["ready_s"]}
        phases = record["phases"]
        by_name = {p["name"]: p for p in phases}
        names = [p["name"] for p in phases]
        # Every phase of the agent, the worker and the preload model, each once, ordered by start.
        assert sorted(names) == sorted(AGENT + WORKER + MODEL_STEPS), names
        assert [p["start_s"] for p in phases] == sorted(p["start_s"] for p in phases)
        assert [n for n in names if n in WORKER] == WORKER
        for a, b in zip(WORKER, WORKER[1:]):
            assert abs(by_name[a]["start_s"] + by_name[a]["seconds"] - by_name[b]["start_s"]) < 1e-5
        assert all(p["start_s"] >= 0 and p["seconds"] >= 0 for p in phases), phases
        assert all(p["model"] == MODEL for p in phases if p["name"].startswith("model_"))
        # The worker's own phases (its clock) lie within its spawn and Hello (ours).
        first, hello = by_name["worker_spawn"], by_name["worker_hello"]
        hello_end = hello["start_s"] + hello["seconds"]
        worker = [by_name[n] for n in WORKER]
        assert worker[0]["start_s"] >= first["start_s"] - TICK
        assert worker[-1]["start_s"] + worker[-1]["seconds"] <= hello_end + TICK
        # The model loads after the worker's Hello and before the canary; the engine's own load
        # phases come with the load.
        load = by_name["model_load"]
        assert load["start_s"] >= hello_end - 1e-5
        assert by_name["model_canary"]["start_s"] >= load["start_s"] + load["seconds"] - 1e-5
        assert {"weights_s", "total_s"} <= set(load["parts"]) and load["parts"]["total_s"] <= load["seconds"]
        room = by_name["model_room"]  # the first part of the load: before the engine's load that took
        assert load["start_s"] - 1e-5 <= room["start_s"] <= room["start_s"] + room["seconds"] <= (
            load["start_s"] + load["seconds"] - load["parts"]["total_s"] + 1e-5)
        logs = [json.loads(line) for line in d.logs().splitlines() if line.startswith("{")]
        loaded = [r for r in logs if r.get("event") == "model_loaded" and r.get("model") == MODEL]
        assert len(loaded) == 1 and {"room", "load", "canary"} <= set(loaded[0]["phases"]), loaded
        assert loaded[0]["engine"]["total_s"] == round(load["parts"]["total_s"], 3)
        # The worker is started first: its start overlaps the agent's own imports and listeners.
        agent = by_name["agent_start"]
        assert first["start_s"] < agent["start_s"] + agent["seconds"] <= by_name["http_listening"]["start_s"] + 1e-5
        # Ready after every phase ended, after the sequential chain (spawn, Hello, load, canary),
        # and no later than this test saw /readyz 200 counted from before the exec.
        ready = record["ready_s"]
        assert all(p["start_s"] + p["seconds"] <= ready + 1e-5 for p in phases)
        chain = first["start_s"] + sum(by_name[n]["seconds"] for n in ("worker_spawn", "worker_hello", "model_load",
                                                                       "model_canary"))
        assert chain <= ready + 1e-5
        assert ready <= ready_seen + TICK
    finally:
        d.stop()


def test_the_record_of_a_restart_has_no_pull(make_tiny_model, tmp_path) -> None:
    url = publish_tiny(make_tiny_model, tmp_path / "store", MODEL)
    models = [{"name": MODEL, "preload": True, "max_model_len": 256}]
    Daemon(tmp_path, store_url=url, models=models).start(timeout=120).stop()
    d = Daemon(tmp_path, store_url=url, models=models).start(timeout=120)
    try:
        names = [p["name"] for p in d.status()["startup"]["phases"]]
        assert "model_load" in names and "model_pull" not in names and "worker_hello" in names
    finally:
        d.stop()


def _completion(d: Daemon) -> list:
    code, body = d.post("/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 8,
                                            "temperature": 0, "ignore_eos": True, "logprobs": 1})
    assert code == 200, body
    return body["choices"][0]["logprobs"]["tokens"]


def _workers_of(root) -> list[int]:
    """Engine worker processes started for a daemon under ``root`` (its cache dir is in their options)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "engine.worker" in cmd and str(root) in cmd:
            out.append(p.pid)
    return out


def test_a_start_killed_at_any_point_leaves_what_the_next_start_needs(make_tiny_model, tmp_path) -> None:
    """SIGKILL the agent at several points of a first start (pulling, the worker importing, the
    load): the worker goes with it, and the next start becomes ready and answers as a clean start
    does; no temporary file of the start (load notes, bytecode) is left behind."""
    import os
    import signal
    import subprocess
    import sys

    url = publish_tiny(make_tiny_model, tmp_path / "clean" / "store", MODEL)
    models = [{"name": MODEL, "preload": True, "max_model_len": 256}]
    clean = Daemon(tmp_path / "clean", store_url=url, models=models).start(timeout=120)
    try:
        want = _completion(clean)
    finally:
        clean.stop()
    root = tmp_path / "killed"
    root.mkdir()
    for delay in (0.2, 0.8, 1.5, 2.5, 4.0):
        d = Daemon(root, store_url=url, models=models)
        log = open(d.log_path, "ab")
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "serve"], cwd=d.env["PYTHONPATH"].split(os.pathsep)[0],
                                env=d.env, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        log.close()
        deadline = time.monotonic() + 30  # the worker dies with its agent (PDEATHSIG, EOF)
        while time.monotonic() < deadline and _workers_of(root):
            time.sleep(0.1)
        assert not _workers_of(root), delay
    d = Daemon(root, store_url=url, models=models).start(timeout=120)
    try:
        assert _completion(d) == want
        leftovers = [p for p in (root / "cache").rglob(".load-notes-*")]
        assert not leftovers, leftovers
    finally:
        d.stop()
