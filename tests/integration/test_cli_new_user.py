"""A new user's first steps with the installed ``infire-agent``: the README's "Using it" commands,
run in order against the daemon ``scripts/run.sh`` (``infire-agent demo``) just started, with no
extra setting; stopping it; and what the CLI says when no agent (or a stale socket) is there.

Each command runs in a subprocess with a fresh HOME and runtime dir, as on a new machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.agent_harness import REPO, Daemon, free_port

CLI = REPO / ".venv" / "bin" / "infire-agent"
README = REPO / "README.md"

pytestmark = pytest.mark.skipif(not CLI.exists(), reason="the project is not installed in .venv")


def _env(tmp: Path) -> dict[str, str]:
    """A new user's environment: no INFIRE_* setting, no XDG dirs but the session's runtime dir."""
    drop = ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "RUNTIME_DIRECTORY", "STATE_DIRECTORY",
            "CACHE_DIRECTORY")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFIRE_") and k not in drop}
    (tmp / "home").mkdir(exist_ok=True)
    (tmp / "xdg-run").mkdir(mode=0o700, exist_ok=True)
    env.update(HOME=str(tmp / "home"), XDG_RUNTIME_DIR=str(tmp / "xdg-run"), OMP_NUM_THREADS="1")
    return env


def _cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _readme_using_it() -> list[str]:
    """The shell commands of the README's "Using it" block, continuation lines joined."""
    text = README.read_text()
    block = re.search(r"## Using it\n.*?```sh\n(.*?)```", text, re.S)
    assert block, "the README has no 'Using it' sh block"
    cmds, cur = [], ""
    for line in block.group(1).splitlines():
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if cur.strip():
                cmds.append(cur.strip())
            cur = ""
    return cmds


def _default_store_dir(env: dict[str, str]) -> Path:
    """Where the settings' default file store is for this environment (root: /var/lib/infire/store)."""
    out = subprocess.run([str(CLI.parent / "python"), "-c", "from agent.config import default_store_url as d; print(d())"],
                         env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    return Path(out.removeprefix("file://"))


def _alive(pid: int) -> bool:
    """Running (an exited daemon that nobody reaped yet is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_readme_commands_work_against_the_demo(tmp_path: Path) -> None:
    """``scripts/run.sh`` then every "Using it" line, as written, then status after stopping."""
    env = _env(tmp_path)
    default_store = _default_store_dir(env)
    had_default_store = default_store.exists()
    env["INFIRE_ENGINE__SANDBOX"] = "false"  # this test host's kernel; nothing to do with finding the agent
    port = free_port()
    demo = _cli(env, "demo", "--preset", "tiny", "--port", str(port), "--max-tokens", "4", timeout=240)
    pid = re.search(r"\(pid (\d+)", demo.stdout)
    sock = tmp_path / "xdg-run" / "infire" / "admin.sock"
    try:
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "worker down" not in demo.stdout, demo.stdout  # a normal start is not a fault
        assert "infire-agent stop" in demo.stdout  # it says how to stop it
        assert pid and sock.is_socket()
        cmds = _readme_using_it()
        assert any(" publish " in c for c in cmds) and any(" load " in c for c in cmds)
        assert any(c.endswith(" stop") or " stop " in c for c in cmds)
        outputs: dict[str, str] = {}
        for cmd in cmds:
            if " serve " in cmd:
                continue  # the systemd line: the demo is the daemon here
            if cmd.split()[0] == "curl" and shutil.which("curl") is None:
                continue
            line = (cmd.replace(".venv/bin/infire-agent", str(CLI)).replace("/tmp/tiny", str(tmp_path / "tiny"))
                    .replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
            r = subprocess.run(["bash", "-c", line], env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
            assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
            outputs[cmd] = r.stdout + r.stderr
        status = [o for c, o in outputs.items() if c.split()[1:2] == ["status"]][-1]  # after the load
        assert re.search(r"^tiny\s+ready", status, re.M) and re.search(r"^demo-llama\s+", status, re.M), status
        published = next(o for c, o in outputs.items() if " publish " in c)
        assert "demo/store" in published, published  # the demo daemon's store
        assert default_store.exists() == had_default_store, default_store
        chat = next((o for c, o in outputs.items() if "chat/completions" in c), None)
        if chat is not None:
            assert json.loads(chat)["choices"][0]["message"]["role"] == "assistant"
        # stopping (the README's last line) removed the socket and ended the daemon
        assert not sock.exists()
        deadline = time.monotonic() + 30
        while _alive(int(pid.group(1))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(int(pid.group(1)))
        after = _cli(env, "status")
        assert after.returncode == 1 and "not running" in after.stderr and "Traceback" not in after.stderr
    finally:
        if pid and _alive(int(pid.group(1))):
            os.kill(int(pid.group(1)), 15)


def test_status_with_no_agent_names_where_it_looked(tmp_path: Path) -> None:
    env = _env(tmp_path)
    r = _cli(env, "status")
    sock = tmp_path / "xdg-run" / "infire" / "admin.sock"
    assert r.returncode == 1
    assert str(sock) in r.stderr, r.stderr
    for hint in ("--config", "INFIRE_CONFIG", "infire-agent demo"):
        assert hint in r.stderr, r.stderr
    for cmd in ("models", "load", "stop"):
        r = _cli(env, *([cmd, "tiny"] if cmd == "load" else [cmd]))
        assert r.returncode == 1 and str(sock) in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)


def test_a_stale_socket_reads_as_no_agent(tmp_path: Path) -> None:
    env = _env(tmp_path)
    sock = tmp_path / "xdg-run" / "infire" / "admin.sock"
    sock.parent.mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))
    s.close()  # the file stays: what an agent killed with SIGKILL leaves
    r = _cli(env, "status")
    assert r.returncode == 1 and "not running" in r.stderr and "stale" in r.stderr, r.stderr
    assert "ConnectionRefusedError" not in r.stderr and "Errno" not in r.stderr, r.stderr
    j = _cli(env, "status", "--json")
    assert j.returncode == 1 and json.loads(j.stdout)["up"] is False


def test_serve_starts_over_a_stale_socket_and_removes_its_own_on_exit(tmp_path: Path) -> None:
    d = Daemon(tmp_path, engine="none")
    d.runtime.mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(d.socket))
    s.close()
    d.start(ready=False)
    try:
        assert d.engine_status()["pid"] == d.proc.pid
    finally:
        assert d.stop() == 0
    assert not d.socket.exists()


def test_a_second_serve_refused_for_a_live_socket_leaves_it(tmp_path: Path) -> None:
    first = Daemon(tmp_path, engine="none").start(ready=False)
    try:
        second = subprocess.run([str(CLI), "serve", "--engine", "none"], cwd=REPO, capture_output=True, text=True,
                                env={**first.env, "INFIRE_SERVER__PORT": str(free_port())}, timeout=60)
        assert second.returncode == 1
        assert first.socket.is_socket() and first.engine_status()["pid"] == first.proc.pid
    finally:
        first.stop()


def test_publish_with_no_store_and_no_agent_refuses(tmp_path: Path) -> None:
    env = _env(tmp_path)
    default_store = _default_store_dir(env)
    had_default_store = default_store.exists()
    (tmp_path / "model").mkdir()
    r = _cli(env, "publish", str(tmp_path / "model"), "--name", "tiny")
    assert r.returncode == 2, r.stdout + r.stderr
    for hint in ("store.url", "INFIRE_STORE__URL", "--store"):
        assert hint in r.stderr, r.stderr
    assert default_store.exists() == had_default_store, default_store


def test_a_failed_pull_of_a_typo_leaves_nothing_in_models(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start(ready=False)  # an empty store: every name is a typo
    env = {**_env(tmp_path), "INFIRE_SERVER__RUNTIME_DIR": str(d.runtime)}
    try:
        r = _cli(env, "pull", "tnyi")
        assert r.returncode == 2 and "tnyi" in r.stderr and "Traceback" not in r.stderr, r.stderr
        listed = _cli(env, "models", "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stdout
    finally:
        d.stop()
