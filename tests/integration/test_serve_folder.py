"""``infire-agent serve DIR``: a local Hugging Face folder served in one command, as ``vllm serve
DIR`` does: published into the default local store, loaded at start, answering chat requests.
``load DIR`` with no agent running says how to serve a folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from tests.integration.agent_harness import REPO, free_port


def _env(tmp: Path, port: int) -> dict[str, str]:
    """A fresh user's environment (own HOME: the default store lives there), on the CPU."""
    drop = ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "RUNTIME_DIRECTORY", "STATE_DIRECTORY",
            "CACHE_DIRECTORY")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFIRE_") and k not in drop}
    (tmp / "home").mkdir(exist_ok=True)
    # systemd's folders name where the default store and cache are, for root too
    env.update(HOME=str(tmp / "home"), STATE_DIRECTORY=str(tmp / "state"), CACHE_DIRECTORY=str(tmp / "cache"),
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
               INFIRE_SERVER__PORT=str(port), INFIRE_SERVER__RUNTIME_DIR=str(tmp / "run"),
               INFIRE_GPU__DEVICE="cpu", INFIRE_GPU__CPU_MEMORY_BUDGET="256MiB", INFIRE_ENGINE__SANDBOX="false",
               INFIRE_LOG_FORMAT="json")
    return env


def _cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _ready(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz/tiny-folder", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _serve(env: dict[str, str], folder: Path, port: int, log_path: Path) -> tuple[subprocess.Popen, IO[bytes]]:
    """``infire-agent serve folder`` started, once its model answers /readyz; (process, its log file)."""
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "serve", str(folder)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not _ready(port):
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, log_path.read_text()[-4000:]
        time.sleep(0.2)
    return proc, log


def test_serve_a_model_folder_in_one_command(tmp_path: Path) -> None:
    port = free_port()
    env = _env(tmp_path, port)
    folder = tmp_path / "Tiny-Folder"
    made = _cli(env, "make-model", "--arch", "llama", "--preset", "tiny", "--out", str(folder), "--device", "cpu")
    assert made.returncode == 0, made.stderr
    load = _cli(env, "load", str(folder))  # no agent yet: it says how to serve a folder
    assert load.returncode != 0 and f"infire-agent serve {folder}" in load.stderr, load.stderr
    assert "Traceback" not in load.stderr and "not a model name" not in load.stderr, load.stderr
    proc, log = _serve(env, folder, port, tmp_path / "serve.log")
    try:
        code, body = _post(port, "/v1/chat/completions", {"model": "tiny-folder", "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert code == 200 and body["choices"][0]["message"]["role"] == "assistant", body
        out = (tmp_path / "serve.log").read_text()
        assert f"http://127.0.0.1:{port}/v1" in out, out[-2000:]
        # into the default local store, and known to the agent by the folder's name
        store = tmp_path / "state" / "store"
        assert (store / "models" / "tiny-folder" / "manifest.json").is_file(), list(store.rglob("*"))
        st = _cli(env, "status", "--json")
        assert st.returncode == 0, st.stderr
        m = next(m for m in json.loads(st.stdout)["models"] if m["name"] == "tiny-folder")
        assert m["state"] == "ready" and m["preload"] and m["autoload"], m
        # with the agent running, `load DIR` publishes into its store and loads
        again = _cli(env, "load", str(folder), "--name", "second")
        assert again.returncode == 0 and "second: ready" in again.stdout, again.stdout + again.stderr
        assert " 0 B/s" not in again.stderr, again.stderr
        # another folder under a name the agent has loaded: it serves the new bytes, not the old
        # (a cached model loads from its cache: "ready" once came over the previous weights)
        other = tmp_path / "Other"
        made = _cli(env, "make-model", "--arch", "llama", "--preset", "tiny", "--seed", "1", "--out", str(other),
                    "--device", "cpu")
        assert made.returncode == 0, made.stderr
        replaced = _cli(env, "load", str(other), "--name", "second")
        assert replaced.returncode == 0 and "second: ready" in replaced.stdout, replaced.stdout + replaced.stderr
        assert "unloading it first" in replaced.stderr, replaced.stderr
        cache_dir = Path(json.loads(_cli(env, "status", "--json").stdout)["cache"]["dir"])
        cached = json.loads((cache_dir / "models" / "second" / "manifest.json").read_text())
        published = json.loads((store / "models" / "second" / "manifest.json").read_text())
        assert cached["files"] == published["files"], (cached, published)
        first = json.loads((store / "models" / "tiny-folder" / "manifest.json").read_text())
        assert cached["files"] != first["files"]  # the other folder's bytes (seed 1), not the first's
        same = _cli(env, "load", str(other), "--name", "second")  # the version it has: nothing replaced
        assert same.returncode == 0 and "unloading" not in same.stderr, same.stderr
        # the store given a third version first (publish alone, or an earlier try that stopped
        # halfway): what counts is what the agent holds, not what the store held before
        third = tmp_path / "Third"
        assert _cli(env, "make-model", "--arch", "llama", "--preset", "tiny", "--seed", "3", "--out", str(third),
                    "--device", "cpu").returncode == 0
        assert _cli(env, "publish", str(third), "--name", "second").returncode == 0
        again = _cli(env, "load", str(third), "--name", "second")
        assert again.returncode == 0 and "unloading it first" in again.stderr, again.stderr
        cached = json.loads((cache_dir / "models" / "second" / "manifest.json").read_text())
        assert cached["files"] == json.loads((store / "models" / "second" / "manifest.json").read_text())["files"]
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    # the folder changed and served again: the cached previous version is dropped, the start
    # pulls the new one
    made = _cli(env, "make-model", "--arch", "llama", "--preset", "tiny", "--seed", "2", "--out", str(folder),
                "--device", "cpu", "--force")
    assert made.returncode == 0, made.stderr
    proc, log = _serve(env, folder, port, tmp_path / "serve2.log")
    try:
        assert "dropping the cached previous version of tiny-folder" in (tmp_path / "serve2.log").read_text()
        cached = json.loads((cache_dir / "models" / "tiny-folder" / "manifest.json").read_text())
        published = json.loads((store / "models" / "tiny-folder" / "manifest.json").read_text())
        assert cached["files"] == published["files"] != first["files"]
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    # a bad folder is refused before anything starts
    bad = _cli(env, "serve", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "is not a folder" in bad.stderr, bad.stderr
