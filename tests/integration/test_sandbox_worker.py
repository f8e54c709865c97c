"""The real engine worker, confined, still serves a tiny model, and its confinement holds.

Driven over the worker's own protocol (``engine.worker.protocol`` frames on a socketpair), the way the
agent drives it: a greedy generation must give the same tokens with and without the sandbox; a
model copied into the cache *after* confinement still loads (the whole cache dir is readable);
a model folder outside the cache cannot be read; the kernel shows the filter on the process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.load_spec import LoadSpec
from engine.worker import protocol as P
from engine.sampling import SamplingParams
from tests.integration.sandbox_helpers import REPO, landlock_abi, seccomp_filter_supported

pytestmark = pytest.mark.skipif(not seccomp_filter_supported() or landlock_abi() == 0,
                                reason="this kernel lacks seccomp filters or Landlock")


class WorkerProc:
    def __init__(self, tmp: Path, cache: Path, sandbox: bool) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        runtime = tmp / "run"
        runtime.mkdir(exist_ok=True)
        (tmp / "tmp").mkdir(exist_ok=True)
        options = {"device": "cpu", "sandbox": sandbox, "memory_budget_bytes": 256 << 20,
                   "sandbox_options": {"cache_dir": str(cache), "runtime_dir": str(runtime), "parent_pid": os.getpid(),
                                       "required": ["landlock", "seccomp", "no_new_privs"] if sandbox else []}}
        env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp / "tmp"), "TRITON_CACHE_DIR": str(tmp / "tmp" / "triton"),
               "OMP_NUM_THREADS": "1"}
        self.stderr = open(tmp / "worker.stderr", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.worker", "--fd", str(child.fileno()), "--options", json.dumps(options)],
                                     pass_fds=(child.fileno(),), env=env, cwd=tmp / "tmp", stderr=self.stderr)
        child.close()
        self.decoder = P.FrameDecoder()
        self.pending: list[P.Message] = []

    def send(self, msg: P.Message) -> None:
        self.sock.sendall(P.encode(msg))

    def wait_for(self, pred: Callable[[P.Message], bool], timeout: float = 60) -> P.Message:
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.pending):
                if pred(m):
                    return self.pending.pop(i)
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stderr.seek(0)
                raise AssertionError(f"worker gave no matching message (exit {self.proc.poll()}):\n{self.stderr.read()[-3000:]}")
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 20)
            if not data:
                continue
            self.pending.extend(m for m in self.decoder.feed(data) if not isinstance(m, (P.Heartbeat, P.Status)))

    def load(self, name: str, model_dir: Path) -> P.Message:
        self.send(P.Load(spec=LoadSpec(name, str(model_dir), max_model_len=256, max_num_seqs=4)))
        return self.wait_for(lambda m: isinstance(m, (P.Loaded, P.Error)) and getattr(m, "model", None) == name)

    def generate(self, name: str, prompt: list[int], n: int) -> list[int]:
        rid = f"r-{name}-{time.monotonic_ns()}"
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        self.send(P.Add(req_id=rid, model=name, prompt_token_ids=prompt, sampling=params))
        ids: list[int] = []
        while True:
            msg = self.wait_for(lambda m: isinstance(m, P.Tokens) and any(o[0] == rid for o in m.outputs)
                                or isinstance(m, P.Error) and m.req_id == rid)
            assert isinstance(msg, P.Tokens), msg
            for out in P.unpack_outputs(msg):
                if out.req_id == rid:
                    ids += out.new_token_ids
                    if out.finish_reason is not None:
                        assert out.finish_reason == "length"
                        return ids

    def close(self) -> None:
        try:
            self.send(P.Shutdown())
        except OSError:
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()
        self.stderr.close()


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _run(tmp: Path, model: Path, sandbox: bool) -> dict[str, Any]:
    cache = tmp / "cache"
    snapshot = cache / "models" / "tiny" / "snapshot"
    shutil.copytree(model, snapshot)
    w = WorkerProc(tmp, cache, sandbox)
    out: dict[str, Any] = {}
    try:
        hello = w.wait_for(lambda m: isinstance(m, P.Hello))
        assert hello.engine_error == "", hello.engine_error
        out["status"] = _status(hello.pid)
        loaded = w.load("tiny", snapshot)
        assert isinstance(loaded, P.Loaded), loaded
        out["tokens"] = w.generate("tiny", list(range(100, 124)), 12)
        # Pulled after the worker started (and, when sandboxed, after it was confined).
        late = cache / "models" / "late" / "snapshot"
        shutil.copytree(model, late)
        out["late"] = w.load("late", late)
        outside = tmp / "elsewhere" / "tiny"
        shutil.copytree(model, outside)
        out["outside"] = w.load("outside", outside)
        return out
    finally:
        w.close()
        out["stderr"] = (tmp / "worker.stderr").read_text()


def test_confined_worker_serves_and_stays_confined(tmp_path: Path, tiny_llama_dir: Path) -> None:
    plain = _run(tmp_path / "plain", tiny_llama_dir, sandbox=False)
    boxed = _run(tmp_path / "boxed", tiny_llama_dir, sandbox=True)

    assert plain["status"]["Seccomp"] == "0" and plain["status"]["NoNewPrivs"] == "0"
    assert boxed["status"]["Seccomp"] == "2" and boxed["status"]["NoNewPrivs"] == "1"
    assert boxed["tokens"] == plain["tokens"] and len(boxed["tokens"]) == 12
    assert isinstance(boxed["late"], P.Loaded), boxed["late"]
    assert isinstance(plain["outside"], P.Loaded)
    assert isinstance(boxed["outside"], P.Error) and "Permission denied" in boxed["outside"].message, boxed["outside"]
    line = next(l for l in boxed["stderr"].splitlines() if l.startswith("sandbox active="))
    assert "'landlock'" in line.split(" inactive=")[0] and "'seccomp'" in line.split(" inactive=")[0], line
    assert "sandbox active=" not in plain["stderr"]
