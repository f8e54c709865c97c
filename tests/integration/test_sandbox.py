"""Each layer of the worker sandbox, proven by attempts made from inside a confined process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox import bpf, seccomp
from sandbox.policy import PROTECTIONS
from tests.integration.sandbox_helpers import Layout, landlock_abi, netns_permitted, run_selftest, seccomp_filter_supported

FILE_PROBES_DENIED = ("read_outside", "list_outside", "write_read_only", "read_outside_new_thread")
SECCOMP_PROBES_DENIED = (
    "af_inet_socket", "af_inet6_socket", "af_netlink_socket", "af_inet_socket_new_thread",
    "ptrace_traceme", "ptrace_attach_child", "mount_tmpfs", "unshare_user", "bpf", "io_uring_setup",
    "unix_connect", "clone_newuser",
)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One fully confined run (every layer, torch imported), shared by the tests below."""
    return run_selftest(Layout.make(tmp_path_factory.mktemp("sbx-full")), "--torch")


def _ok(result: dict[str, Any], probe: str) -> None:
    p = result["probes"][probe]
    assert p["ok"], f"{probe} should work under the sandbox: {p['detail']}"


def _denied(result: dict[str, Any], probe: str, err: str) -> None:
    p = result["probes"][probe]
    assert not p["ok"] and p["errno"] == err, f"{probe}: expected {err}, got {p}"


def test_report_names_every_layer(full: dict[str, Any]) -> None:
    rep = full["report"]
    assert sorted(rep["active"] + rep["inactive"]) == sorted(PROTECTIONS)
    assert set(rep["detail"]) == set(PROTECTIONS)
    for name in ("die_with_parent", "rlimits", "no_new_privs"):
        assert name in rep["active"], rep["detail"][name]


@pytest.mark.skipif(landlock_abi() == 0, reason="this kernel has no Landlock (CONFIG_SECURITY_LANDLOCK or lsm= lacks it)")
def test_landlock_confines_files(full: dict[str, Any]) -> None:
    assert "landlock" in full["report"]["active"], full["report"]["detail"]["landlock"]
    for probe in FILE_PROBES_DENIED:
        _denied(full, probe, "EACCES")
    # The agent's environment (admin token, store credentials) is out of reach through /proc.
    _denied(full, "parent_environ", "EACCES")
    for probe in ("read_allowed", "write_runtime", "own_proc_status", "fork_and_exit"):
        _ok(full, probe)
    # Triton builds a C launcher stub at a kernel's first use, after confinement.
    if shutil.which("gcc") or shutil.which("cc") or shutil.which("clang"):
        _ok(full, "compile_c_stub")
        assert full["probes"]["compile_c_stub"]["detail"].endswith("stub returned 42")
    assert full["probes"]["read_allowed"]["detail"] == "allowed\n"


@pytest.mark.skipif(landlock_abi() < 6, reason="Landlock signal scoping needs ABI 6 (Linux 6.12)")
def test_landlock_scopes_signals(full: dict[str, Any]) -> None:
    _denied(full, "signal_parent", "EPERM")


@pytest.mark.skipif(not seccomp_filter_supported(), reason="this kernel has no seccomp filter mode")
def test_seccomp_denies_network_ptrace_and_kernel_surface(full: dict[str, Any]) -> None:
    assert "seccomp" in full["report"]["active"], full["report"]["detail"]["seccomp"]
    for probe in SECCOMP_PROBES_DENIED:
        _denied(full, probe, "EPERM")
    _denied(full, "clone3", "ENOSYS")  # glibc then falls back to clone(), whose flags are checked
    _ok(full, "af_unix")
    assert full["probes"]["af_unix"]["detail"] == "pingpong"
    assert full["probes"]["seccomp_mode"]["detail"] == "2"


def test_torch_matmul_still_runs(full: dict[str, Any]) -> None:
    _ok(full, "torch_matmul")


def test_rlimits_no_new_privs_and_capabilities(full: dict[str, Any]) -> None:
    limits = json.loads(full["probes"]["rlimits"]["detail"])
    assert limits["core"] == [0, 0]
    assert limits["nofile"][1] <= 8192
    assert limits["nproc"][1] <= 4096
    assert full["probes"]["no_new_privs"]["detail"] == "1"
    assert "capabilities" in full["report"]["active"]
    assert int(full["probes"]["cap_eff"]["detail"], 16) == 0


def test_network_namespace(full: dict[str, Any]) -> None:
    if not netns_permitted():
        assert "net_namespace" in full["report"]["inactive"]
        pytest.skip("unshare(CLONE_NEWNET) is not permitted here (needs CAP_SYS_ADMIN); seccomp is the network barrier")
    assert "net_namespace" in full["report"]["active"]
    assert full["probes"]["net_devices"]["detail"] == "lo"


BACKENDS = [
    pytest.param("libseccomp", marks=pytest.mark.skipif(not seccomp.libseccomp_available(), reason="libseccomp.so.2 is not installed")),
    "bpf",
]


@pytest.mark.skipif(not seccomp_filter_supported(), reason="this kernel has no seccomp filter mode")
@pytest.mark.parametrize("backend", BACKENDS)
def test_seccomp_alone_per_backend(tmp_path: Path, backend: str) -> None:
    """Only seccomp (plus no_new_privs): every denial must come from the filter itself, while the
    process keeps its capabilities and can read files Landlock would have hidden."""
    res = run_selftest(Layout.make(tmp_path), "--seccomp-backend", backend, "--disable", "landlock,capabilities,net_namespace")
    assert res["report"]["active"] == ["die_with_parent", "rlimits", "no_new_privs", "seccomp"]
    assert res["report"]["detail"]["seccomp"].startswith(backend)
    for probe in SECCOMP_PROBES_DENIED:
        _denied(res, probe, "EPERM")
    _denied(res, "clone3", "ENOSYS")
    for probe in ("af_unix", "read_outside", "fork_and_exit"):
        _ok(res, probe)


@pytest.mark.skipif(landlock_abi() == 0, reason="this kernel has no Landlock")
def test_landlock_alone(tmp_path: Path) -> None:
    res = run_selftest(Layout.make(tmp_path), "--disable", "seccomp,capabilities,net_namespace")
    assert "landlock" in res["report"]["active"] and "seccomp" not in res["report"]["active"]
    for probe in FILE_PROBES_DENIED:
        _denied(res, probe, "EACCES")
    # Sockets are seccomp's job: with it off, creating one works (connecting TCP would not,
    # Landlock ABI >= 4 handles that, but there is nothing to connect to in a test).
    _ok(res, "af_inet_socket")
    _ok(res, "read_allowed")
    # Why seccomp denies connect(): Landlock does not stop a connect to a unix socket by path.
    _ok(res, "unix_connect")
    _denied(res, "clone3", "EINVAL")  # the kernel's own answer, no filter in the way


@pytest.mark.skipif(not seccomp_filter_supported(), reason="this kernel has no seccomp filter mode")
def test_unix_connect_can_be_allowed(tmp_path: Path) -> None:
    res = run_selftest(Layout.make(tmp_path), "--allow-unix-connect")
    _ok(res, "unix_connect")
    assert res["probes"]["unix_connect"]["detail"] == "pong"
    for probe in ("af_inet_socket", "ptrace_traceme", "mount_tmpfs"):
        _denied(res, probe, "EPERM")


def test_bpf_program_assembles_for_every_table() -> None:
    rules = seccomp.build_rules(allow_af_unix=True)
    for arch in bpf.SYSCALLS:
        prog = bpf.assemble(rules, arch)
        assert prog[-1] == (0x06, 0, 0, 0x00050000 | 38)  # ENOSYS tail for clone3
        assert all(0 <= jt <= 255 and 0 <= jf <= 255 for _, jt, jf, _ in prog)
    with pytest.raises(seccomp.SeccompError):
        bpf.assemble(rules, "mips")


@pytest.mark.skipif(not seccomp.libseccomp_available(), reason="libseccomp.so.2 is not installed to cross-check against")
def test_bpf_syscall_tables_match_libseccomp() -> None:
    import ctypes

    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    for arch, table in bpf.SYSCALLS.items():
        for name, nr in table.items():
            assert lib.seccomp_syscall_resolve_name_arch(bpf.AUDIT_ARCH[arch], name.encode()) == nr, (arch, name)
        for name in seccomp.DENIED_SYSCALLS:
            if name not in table:
                assert lib.seccomp_syscall_resolve_name_arch(bpf.AUDIT_ARCH[arch], name.encode()) < 0, (arch, name)


@pytest.mark.skipif(landlock_abi() == 0, reason="this kernel has no Landlock")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to wrap")
def test_toolchain_outside_usr_stays_executable(tmp_path: Path) -> None:
    """A compiler installed outside /usr (the GPU image keeps gcc in /opt/gcc) is found the way
    Triton finds it ($CC, PATH) and stays executable after confinement."""
    lay = Layout.make(tmp_path / "sbx")
    bindir = tmp_path / "toolchain" / "bin"
    bindir.mkdir(parents=True)
    cc = bindir / "cc"
    cc.write_text(f"#!/bin/sh\nexec {shutil.which('gcc')} \"$@\"\n")
    cc.chmod(0o755)
    env = {**lay.env(), "CC": str(cc)}
    cmd = [sys.executable, "-m", "sandbox.selftest", "--ro", str(lay.ro), "--rw", str(lay.rw), "--outside", str(lay.secret)]
    proc = subprocess.run(cmd, cwd=lay.tmp, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(proc.stdout)["probes"]["compile_c_stub"]
    assert probe["ok"], probe
    assert probe["detail"] == f"{cc}: stub returned 42"
