"""The systemd unit, its environment file, sysusers/tmpfiles entries, checked by systemd's tools.

Tests that run ``systemd-analyze``/``systemd-sysusers``/``systemd-tmpfiles`` skip only when the
binary is absent (CI: ``apt-get install -y systemd``).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.config import Settings, default_cache_dir, default_runtime_dir, default_store_url, load_settings

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "infire-agent.service"
ENV_EXAMPLE = SYSTEMD / "infire-agent.env.example"
INSTALL_PREFIX = "/opt/infire-agent"
WORKER_STOP_TIMEOUT_S = 10.0  # WorkerClient.stop() default
EXPOSURE_LIMIT = 3.0

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt-get install -y systemd)")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections → key → every value, in order (systemd keys repeat and accumulate)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"not a key=value line: {raw!r}")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def seconds(value: str) -> float:
    """systemd time span ("50s", "10min", "1min 30s") in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
    total = 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    if not parts:
        raise ValueError(value)
    for n, u in parts:
        total += float(n) * units[u or "s"]
    return total


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(unit: dict[str, dict[str, list[str]]], key: str, section: str = "Service") -> str:
    values = unit[section].get(key)
    assert values, f"{section}.{key} is missing"
    return values[-1]


def test_lifecycle_settings(unit: dict) -> None:
    assert one(unit, "Type") == "notify"
    assert one(unit, "NotifyAccess") == "main"
    assert seconds(one(unit, "WatchdogSec")) >= 10
    assert one(unit, "Restart") == "on-failure"
    assert seconds(one(unit, "RestartSec")) >= 1
    assert int(one(unit, "StartLimitBurst", "Unit")) >= 3
    assert one(unit, "KillMode") == "mixed"
    drain = Settings().server.drain_timeout
    assert seconds(one(unit, "TimeoutStopSec")) > drain + WORKER_STOP_TIMEOUT_S
    assert one(unit, "ExecStart").split()[1:] == ["serve"]
    assert one(unit, "EnvironmentFile").lstrip("-") == "/etc/infire/agent.env"


HARDENING = {
    "NoNewPrivileges": "yes", "CapabilityBoundingSet": "", "AmbientCapabilities": "",
    "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes", "PrivateUsers": "yes",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes", "ProtectClock": "yes", "ProtectHostname": "yes",
    "RestrictNamespaces": "yes", "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes", "UMask": "0077", "SystemCallArchitectures": "native",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "DevicePolicy": "closed",
    "LimitCORE": "0", "User": "infire",
}


def test_hardening_list(unit: dict) -> None:
    for key, want in HARDENING.items():
        assert one(unit, key) == want, key
    allowed = " ".join(unit["Service"]["DeviceAllow"])
    for dev in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend", "char-nvidia-uvm"):
        assert dev in allowed
    for key in ("LimitNOFILE", "TasksMax", "StateDirectory", "CacheDirectory", "RuntimeDirectory"):
        one(unit, key)


def test_unit_directories_are_the_config_defaults(unit: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd exports $STATE/CACHE/RUNTIME_DIRECTORY; the agent's defaults must follow them."""
    state, cache, runtime = (one(unit, k).split() for k in ("StateDirectory", "CacheDirectory", "RuntimeDirectory"))
    monkeypatch.setenv("STATE_DIRECTORY", ":".join(f"/var/lib/{d}" for d in state))
    monkeypatch.setenv("CACHE_DIRECTORY", ":".join(f"/var/cache/{d}" for d in cache))
    monkeypatch.setenv("RUNTIME_DIRECTORY", ":".join(f"/run/{d}" for d in runtime))
    assert default_cache_dir() == Path("/var/cache/infire")
    assert default_runtime_dir() == Path("/run/infire")
    assert default_store_url() == "file:///var/lib/infire/store"
    triton = [v for v in unit["Service"]["Environment"] if v.startswith("TRITON_CACHE_DIR=")]
    assert triton and triton[0].split("=", 1)[1].startswith(tuple(f"/var/cache/{d}/" for d in cache))


def _syscall_groups() -> dict[str, list[str]]:
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = line.split()[0]
            groups[current] = []
        elif current and line.strip() and not line.strip().startswith("#"):
            groups[current].append(line.split()[0])
    return groups


def _expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for n in names:
        out |= _expand(groups[n], groups) if n.startswith("@") else {n}
    return out


@needs_analyze
def test_syscall_filter_keeps_what_cuda_and_the_sandbox_need(unit: dict) -> None:
    groups = _syscall_groups()
    filters = unit["Service"]["SystemCallFilter"]
    allowed: set[str] = set()
    for f in filters:
        if f.startswith("~"):
            allowed -= _expand(f[1:].split(), groups)
        else:
            allowed |= _expand(f.split(), groups)
    needed = {"ioctl", "mmap", "munmap", "mprotect", "mbind", "set_mempolicy", "get_mempolicy", "sched_setaffinity",
              "sched_getaffinity", "madvise", "futex", "clone", "execve", "prctl", "setrlimit", "prlimit64", "socket",
              "socketpair", "seccomp", "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
              "memfd_create", "eventfd2", "epoll_wait", "getrandom", "capget", "close_range"}
    assert needed <= allowed, sorted(needed - allowed)
    denied = {"ptrace", "mount", "umount2", "kexec_load", "bpf", "init_module", "finit_module", "reboot", "swapon",
              "settimeofday", "perf_event_open", "pivot_root", "chroot", "setuid", "iopl"}
    assert not denied & allowed, sorted(denied & allowed)


def _analyze_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointed at this checkout's entry point (verify checks it exists)."""
    exe = Path(sys.prefix) / "bin" / "infire-agent"
    if not exe.exists():
        pytest.skip(f"{exe} is not installed (pip install -e .)")
    text = UNIT.read_text().replace(f"{INSTALL_PREFIX}/venv/bin/infire-agent", str(exe))
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    return copy


@needs_analyze
def test_security_exposure_at_most_3(tmp_path: Path) -> None:
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(_analyze_copy(tmp_path))],
                          capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert float(m.group(1)) <= EXPOSURE_LIMIT, proc.stdout


@needs_analyze
def test_verify_is_clean(tmp_path: Path) -> None:
    proc = subprocess.run(["systemd-analyze", "verify", str(_analyze_copy(tmp_path))], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "infire-agent" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@needs_analyze
def test_restart_backoff_dropin(tmp_path: Path) -> None:
    dropin = parse_unit((SYSTEMD / "restart-backoff.conf").read_text())["Service"]
    assert int(dropin["RestartSteps"][0]) > 0 and seconds(dropin["RestartMaxDelaySec"][0]) >= 30
    version = int(re.search(r"systemd (\d+)", subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout).group(1))
    if version < 254:
        pytest.skip(f"systemd {version} predates RestartSteps= (254); install.sh leaves the drop-in out there")
    copy = _analyze_copy(tmp_path)
    d = tmp_path / "infire-agent.service.d"
    d.mkdir()
    shutil.copy(SYSTEMD / "restart-backoff.conf", d)
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Unknown key" not in proc.stderr, proc.stderr


def _setting_env_names(model: type[BaseModel] = Settings, prefix: str = "INFIRE_") -> list[str]:
    names = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names += _setting_env_names(ann, f"{prefix}{name.upper()}__")
        else:
            names.append(prefix + name.upper())
    return names


def test_env_example_documents_every_setting() -> None:
    text = ENV_EXAMPLE.read_text()
    documented = set(re.findall(r"^#?(INFIRE_[A-Z0-9_]+)=", text, re.M))
    settings = set(_setting_env_names())
    assert settings - documented == set(), "undocumented settings"
    extras = {"INFIRE_CONFIG", "INFIRE_ADMIN_TOKEN", "INFIRE_KERNELS"}
    assert documented - settings - extras == set(), "documented variables the agent does not read"


def test_env_example_values_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncommenting every example at once gives a configuration the agent accepts."""
    for k in list(os.environ):
        if k.startswith("INFIRE_"):
            monkeypatch.delenv(k)
    for m in re.finditer(r"^#(INFIRE_[A-Z0-9_]+)=(.+)$", ENV_EXAMPLE.read_text(), re.M):
        if m.group(1) not in ("INFIRE_CONFIG", "INFIRE_KERNELS"):
            monkeypatch.setenv(m.group(1), m.group(2))
    s = load_settings()
    assert s.server.drain_timeout == 30.0 and s.cache.max_bytes == 100 * 1024**3
    assert s.models[0].name == "llama-3.1-8b" and s.models[0].preload


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
                    reason="systemd-sysusers/systemd-tmpfiles not installed (apt-get install -y systemd)")
def test_sysusers_and_tmpfiles_create_user_and_dirs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for d in ("etc", "usr/lib/sysusers.d", "usr/lib/tmpfiles.d"):
        (root / d).mkdir(parents=True)
    shutil.copy(SYSTEMD / "sysusers.d" / "infire-agent.conf", root / "usr/lib/sysusers.d")
    shutil.copy(SYSTEMD / "tmpfiles.d" / "infire-agent.conf", root / "usr/lib/tmpfiles.d")
    subprocess.run(["systemd-sysusers", f"--root={root}"], check=True, capture_output=True, timeout=60)
    passwd = {l.split(":")[0]: l.split(":") for l in (root / "etc/passwd").read_text().splitlines()}
    assert passwd["infire"][5:] == ["/var/lib/infire", "/usr/sbin/nologin"]
    uid = int(passwd["infire"][2])
    assert "infire" in [l for l in (root / "etc/group").read_text().splitlines() if l.startswith("video:")][0]
    subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create"], check=True, capture_output=True, timeout=60)
    for d in ("var/lib/infire", "var/lib/infire/store", "var/cache/infire", "var/cache/infire-agent", "run/infire"):
        st = (root / d).stat()
        assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o750, d
    env = (root / "etc/infire/agent.env").stat()
    assert env.st_uid == 0 and stat.S_IMODE(env.st_mode) == 0o600
