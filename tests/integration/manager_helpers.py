"""Shared pieces of the ModelManager integration tests: a budget sized from the real models,
streams that hold a request in flight, and polling helpers."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

from tests.integration.agent_harness import Daemon
from engine.load_spec import LoadSpec

TOKEN = {"Authorization": "Bearer test-admin-token"}
CTX, SEQS = 256, 4


def budget_for_two(model_dir: Path, max_num_batched_tokens: int | None = None) -> int:
    """A CPU memory budget that holds two of these models but refuses a third, from the engine's
    own sizes, checked by loading in-process (and raising if it does not hold). The step budget
    defaults to the daemon's, since the workspace the engine books grows with it."""
    from agent.config import EngineSettings
    from engine.core.engine_core import EngineCore
    from engine.options import EngineOptions

    if max_num_batched_tokens is None:
        max_num_batched_tokens = EngineSettings().max_num_batched_tokens
    from engine.errors import EngineError
    from engine.worker.load_refusal import _estimate_need

    def core(budget: int) -> EngineCore:
        return EngineCore(EngineOptions(max_num_batched_tokens=max_num_batched_tokens), device="cpu", budget=budget)

    probe = core(1 << 34)
    info = probe.load_model(LoadSpec("x", str(model_dir), max_model_len=CTX, max_num_seqs=SEQS))
    full, weights = info.device_bytes, probe.slots.get("x").weight_bytes
    min_kv = -(-CTX // info.block_size) * (full - weights) // info.kv_pages  # one longest sequence
    need = _estimate_need(probe, LoadSpec("x", str(model_dir), max_model_len=CTX, max_num_seqs=SEQS))  # weights + workspace + min_kv
    # Two models as loaded, plus the second's workspace, plus half of what a third needs beyond
    # its workspace: two fit, a third does not. The engine's own loads below are the proof,
    # whichever way it books memory (per-model caches or the ledger with a shared pool).
    budget = 2 * full + need - (weights + min_kv) + (weights + min_kv) // 2
    c = core(budget)
    infos = [c.load_model(LoadSpec(n, str(model_dir), max_model_len=CTX, max_num_seqs=SEQS)) for n in ("a", "b")]
    if any(i.device_bytes != full for i in infos):
        raise RuntimeError(f"budget {budget}: two models do not get their full KV cache")
    try:
        c.load_model(LoadSpec("c", str(model_dir), max_model_len=CTX, max_num_seqs=SEQS))
    except EngineError:
        pass
    else:
        raise RuntimeError(f"budget {budget}: a third model fits")
    c.unload_model("a")
    c.load_model(LoadSpec("c", str(model_dir), max_model_len=CTX, max_num_seqs=SEQS))
    return budget


def model(d: Daemon, name: str) -> dict[str, Any]:
    code, body = d.get(f"/admin/v1/models/{name}", TOKEN)
    if code != 200:
        raise RuntimeError(f"{name}: {code} {body}")
    return body["model"]


def wait_state(d: Daemon, name: str, states: set[str], timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        m = model(d, name)
        if m["state"] in states:
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} is {m['state']}, not {states}: {m}")
        time.sleep(0.05)


def wait_engine_empty(d: Daemon, gone: tuple[str, ...] = (), timeout: float = 10.0) -> dict[str, Any]:
    """The worker's own stats: no model holds a KV page and the ``gone`` models are not loaded
    (the worker's Status comes every 0.25 s)."""
    deadline = time.monotonic() + timeout
    while True:
        eng = d.status()["engine"]
        if eng["kv_pages_used"] == 0 and not set(gone) & set(eng["models"]):
            return eng
        if time.monotonic() > deadline:
            raise TimeoutError(f"pages still held: {eng}")
        time.sleep(0.1)


def admin(d: Daemon, name: str, op: str, wait: bool = True, timeout: float = 60.0) -> tuple[int, Any]:
    return d.post(f"/admin/v1/models/{name}/{op}{'?wait=true' if wait else ''}", headers=TOKEN, timeout=timeout)


def complete(d: Daemon, name: str, max_tokens: int = 4, timeout: float = 60.0) -> tuple[int, Any]:
    return d.post("/v1/completions", {"model": name, "prompt": "hello", "max_tokens": max_tokens,
                                      "temperature": 0, "ignore_eos": True}, timeout=timeout)


def open_stream(d: Daemon, name: str, max_tokens: int = CTX - 8) -> tuple[http.client.HTTPConnection, Any]:
    """A streamed completion, open after its first chunk: the request is in flight."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    body = {"model": name, "prompt": "go", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"stream: {resp.status} {resp.read()!r}")
    if not resp.readline().startswith(b"data: "):
        raise RuntimeError("stream: no first chunk")
    return conn, resp


def read_stream(resp: Any) -> tuple[list[dict[str, Any]], bool]:
    """(chunks, saw [DONE]) until the server ends the response."""
    chunks, done = [], False
    try:
        for line in resp:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                else:
                    chunks.append(json.loads(data))
    except (http.client.IncompleteRead, ConnectionError):
        pass
    return chunks, done
