"""The worker dies with the agent, limits bite, policies are checked, required layers fail closed,
and an unprivileged worker (the systemd case) cannot reach the agent's secrets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from sandbox.launch import confine
from sandbox.policy import SandboxPolicy, SandboxPolicyError
from tests.integration.sandbox_helpers import REPO, landlock_abi

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _kill_agent_and_expect_no_orphan(agent_src: str, message: str) -> None:
    """Run ``agent_src`` (it prints its worker's pid), SIGKILL it, and expect the worker gone."""
    proc = subprocess.Popen([sys.executable, "-c", agent_src], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        worker_pid = int(proc.stdout.readline())
        assert _alive(worker_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), message
    finally:
        proc.kill()
        proc.wait()


def test_worker_dies_when_agent_is_killed() -> None:
    """kill -9 of the parent leaves no orphan: PR_SET_PDEATHSIG delivers SIGKILL to the child."""
    agent = textwrap.dedent(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import os, time\\n"
            "from sandbox.limits import die_with_parent\\n"
            "die_with_parent(os.getppid())\\n"
            "print('ready', flush=True)\\n"
            "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    _kill_agent_and_expect_no_orphan(agent, "the worker outlived its killed parent")


def test_worker_whose_parent_already_changed_kills_itself() -> None:
    """If the agent died before the prctl ran, the death signal would never come: we self-kill."""
    code = "from sandbox.limits import die_with_parent; die_with_parent(1 << 22); print('survived')"
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert "survived" not in proc.stdout


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"read_only": ("relative/dir",)}, "read_only"),
        ({"read_write": ("/ok", "/bad\0path")}, "read_write"),
        ({"required": frozenset({"apparmor"})}, "required"),
        ({"required": frozenset({"seccomp"}), "disabled": frozenset({"seccomp"})}, "both"),
        ({"max_open_files": 3}, "max_open_files"),
        ({"seccomp_backend": "kafel"}, "seccomp_backend"),
        ({"parent_pid": 0}, "parent_pid"),
    ],
)
def test_bad_policy_is_refused_before_anything_is_applied(kwargs: dict, field: str) -> None:
    before = open("/proc/self/status").read()
    with pytest.raises(SandboxPolicyError, match=field):
        confine(SandboxPolicy(**kwargs))
    after = open("/proc/self/status").read()
    for key in ("NoNewPrivs:", "Seccomp:", "CapEff:"):
        assert [l for l in before.splitlines() if l.startswith(key)] == [l for l in after.splitlines() if l.startswith(key)]


def test_required_layer_that_cannot_apply_raises() -> None:
    code = textwrap.dedent(
        """
        import sys
        from sandbox.launch import confine
        from sandbox.policy import SandboxPolicy, SandboxUnavailableError
        try:
            confine(SandboxPolicy(read_only=(sys.prefix,), disabled=frozenset({"no_new_privs"}),
                                  required=frozenset({"landlock"})))
        except SandboxUnavailableError as e:
            print("refused:", e)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "refused: required sandbox layer(s) inactive: landlock (landlock: needs no_new_privs)" in proc.stdout


def _python_for_nobody() -> str | None:
    """An interpreter the nobody user can run and import this checkout's sandbox package with
    (the venv's usually lives under /root)."""
    check = f"import sys; sys.path.insert(0, {str(REPO)!r}); import sandbox.launch; sys.exit(sys.version_info < (3, 10))"
    for cand in (sys.executable, shutil.which("python3", path="/usr/bin:/usr/local/bin")):
        if not cand:
            continue
        try:
            probe = subprocess.run([cand, "-c", check], user=65534, group=65534,
                                   cwd="/", capture_output=True, timeout=30)
        except OSError:
            continue
        if probe.returncode == 0:
            return cand
    return None


UNPRIVILEGED = textwrap.dedent(
    """
    import json, os, resource, sys, threading
    sys.path.insert(0, REPO)
    from sandbox.launch import confine
    from sandbox.policy import SandboxPolicy
    agent = os.getpid()
    r, w = os.pipe()
    if os.fork() == 0:  # the worker: same uid as the agent, no capabilities
        rep = confine(SandboxPolicy(read_only=(sys.prefix, sys.base_prefix, REPO, "/usr", "/lib", "/proc"),
                                    max_processes=16, unshare_network=False))
        out = {"active": rep.active, "detail": rep.detail_line()}
        try:
            open(f"/proc/{agent}/environ", "rb").read()
            out["environ"] = "readable"
        except OSError as e:
            out["environ"] = e.errno
        started = 0
        try:
            for _ in range(64):
                threading.Thread(target=threading.Event().wait, args=(5,), daemon=True).start()
                started += 1
        except RuntimeError:
            pass
        out["threads"] = started
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = os.read(r, 65536)
    os.wait()
    print(data.decode())
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as the nobody user")
@pytest.mark.skipif(landlock_abi() == 0, reason="this kernel has no Landlock")
def test_unprivileged_worker_cannot_read_agent_environment_and_nproc_bites() -> None:
    """As under systemd: agent and worker share an unprivileged uid. Landlock's ptrace rule keeps
    the worker out of /proc/<agent>/environ (token, credentials), and RLIMIT_NPROC caps tasks."""
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python >= 3.10 that the nobody user can run with this checkout readable to it")
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        script = Path(d) / "agent.py"
        script.write_text(f"REPO = {str(REPO)!r}\n" + UNPRIVILEGED)
        os.chmod(script, 0o644)
        proc = subprocess.run([python, str(script)], user=65534, group=65534, cwd="/", capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "landlock" in out["active"] and "seccomp" in out["active"], out["detail"]
    assert out["environ"] == 13  # EACCES
    assert out["threads"] < 16


def test_confine_worker_creates_cache_dir_so_later_models_are_readable(tmp_path: Path) -> None:
    """A fresh host has no cache dir yet; the rule must still cover models pulled afterwards."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import sys
        from sandbox.launch import confine_worker
        rep = confine_worker(cache_dir={str(cache)!r}, runtime_dir={str(run)!r}, required=["landlock"])
        print("confined", flush=True)
        sys.stdin.readline()
        print(open({str(cache / "models/late/snapshot/config.json")!r}).read(), flush=True)
        try:
            open({str(tmp_path / "elsewhere.json")!r}).read()
        except PermissionError:
            print("elsewhere denied", flush=True)
        """
    )
    env = {**ENV, "TMPDIR": str(tmp_path / "tmp"), "TRITON_CACHE_DIR": str(tmp_path / "tmp" / "triton")}
    (tmp_path / "tmp").mkdir()
    if landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path / "tmp")
    try:
        assert proc.stdout.readline().strip() == "confined", proc.stderr.read() if proc.poll() is not None else ""
        assert cache.is_dir()
        (cache / "models/late/snapshot").mkdir(parents=True)
        (cache / "models/late/snapshot/config.json").write_text('{"late": true}')
        (tmp_path / "elsewhere.json").write_text("{}")
        out, err = proc.communicate("go\n", timeout=30)
    finally:
        proc.kill()
    assert '{"late": true}' in out and "elsewhere denied" in out, err


def test_policy_never_opens_the_root_or_the_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`python -m engine.worker` started from "/" (systemd's default) puts "/" on sys.path."""
    from sandbox import policy

    monkeypatch.chdir("/")
    monkeypatch.setattr(sys, "path", ["/", "", str(tmp_path), *sys.path])
    p = policy.default_policy(tmp_path / "cache", tmp_path / "run")
    assert "/" not in p.read_only + p.read_write
    assert "/etc" not in p.read_only and "/root" not in p.read_only
    assert str(tmp_path) in p.read_only  # an ordinary sys.path entry stays
    monkeypatch.chdir(tmp_path)
    assert str(tmp_path) not in policy._python_paths([str(tmp_path)])


def test_real_engine_worker_dies_with_a_killed_agent() -> None:
    """No orphan with ``engine.worker`` itself, started the way the agent starts it (its death
    signal and the EOF on its socket both end it)."""
    agent = textwrap.dedent(
        """
        import socket, subprocess, sys, time
        from engine.worker import protocol as P
        mine, theirs = socket.socketpair()
        subprocess.Popen([sys.executable, "-m", "engine.worker", "--engine", "none", "--fd", str(theirs.fileno())],
                         pass_fds=(theirs.fileno(),))
        theirs.close()
        dec = P.FrameDecoder()
        while True:
            hello = [m for m in dec.feed(mine.recv(65536)) if isinstance(m, P.Hello)]
            if hello:
                break
        print(hello[0].pid, flush=True)
        time.sleep(60)
        """
    )
    _kill_agent_and_expect_no_orphan(agent, "engine.worker outlived its killed agent")
