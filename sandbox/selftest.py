"""Confine this process, then try what the sandbox must stop and what the engine must still do.

``python -m sandbox.selftest [--ro DIR] [--rw DIR] [--outside FILE] [--torch]`` prints one JSON
object: the :class:`~sandbox.policy.SandboxReport` and, per probe, whether the attempt succeeded
and with which errno it failed. Operators run it on a new host to see which layers the kernel
gives them; the integration tests run it to prove each layer from inside a confined process.
"""

from __future__ import annotations

import argparse
import dataclasses
import ctypes
import errno
import json
import os
import resource
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from sandbox import _libc
from sandbox.launch import confine
from sandbox.policy import SandboxPolicy, default_policy

_PTRACE_TRACEME = 0
_PTRACE_ATTACH = 16
_PTRACE_DETACH = 17
_NR = {
    "x86_64": {"bpf": 321, "io_uring_setup": 425, "clone": 56, "clone3": 435},
    "aarch64": {"bpf": 280, "io_uring_setup": 425, "clone": 220, "clone3": 435},
}
_CLONE_NEWUSER = 0x10000000
_SIGCHLD = 17


def _probe(fn: Callable[[], object]) -> dict[str, Any]:
    try:
        value = fn()
    except OSError as e:
        return {"ok": False, "errno": errno.errorcode.get(e.errno or 0, str(e.errno)), "detail": str(e)}
    return {"ok": True, "errno": None, "detail": str(value)[:200]}


def _raw(ret: int, what: str) -> int:
    return _libc.check(ret, what)


def _ptrace_attach_child() -> str:
    pid = os.fork()
    if pid == 0:  # the tracee: just wait to be killed
        try:
            threading.Event().wait(30)
        finally:
            os._exit(0)
    try:
        lib = _libc.libc()
        _raw(lib.ptrace(ctypes.c_long(_PTRACE_ATTACH), ctypes.c_long(pid), None, None), "ptrace(ATTACH)")
        os.waitpid(pid, 0)  # the attach stop; detaching needs the tracee stopped
        lib.ptrace(ctypes.c_long(_PTRACE_DETACH), ctypes.c_long(pid), None, None)
        return f"attached to {pid}"
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def _ptrace_traceme_in_child() -> str:
    # In a child: if TRACEME succeeded in this process, whoever started us (a test runner,
    # a shell) would become our tracer and see us stop at the next signal.
    pid = os.fork()
    if pid == 0:
        ret = _libc.libc().ptrace(ctypes.c_long(_PTRACE_TRACEME), 0, None, None)
        os._exit(0 if ret == 0 else min(ctypes.get_errno(), 255))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise OSError(code, f"ptrace(TRACEME): {os.strerror(code)}")
    return "traced"


def _unix_socketpair() -> str:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.sendall(b"ping")
        b.sendall(b"pong")
        return (b.recv(4) + a.recv(4)).decode()


def _unix_connect(rw_dir: str) -> str:
    got = b""
    path = os.path.join(rw_dir, "probe.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        if os.path.exists(path):
            os.unlink(path)
        srv.bind(path)
        srv.listen(1)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as cli:
            cli.connect(path)
            conn, _ = srv.accept()
            with conn:
                cli.sendall(b"pong")
                got += conn.recv(4)
    return got.decode()


def _in_new_thread(fn: Callable[[], object]) -> object:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except OSError as e:
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(64).decode(errors="replace")


def _write(path: str) -> str:
    with open(path, "w") as f:
        f.write("x")
    return path


def _syscall(name: str) -> int:
    # bpf(BPF_MAP_CREATE, NULL, 0) / io_uring_setup(0, NULL): refused before the bad pointer is read.
    return _raw(_libc.libc().syscall(ctypes.c_long(_nr(name)), 0, None, 0), name)


def _nr(name: str) -> int:
    nr = _NR.get(_libc.machine(), {}).get(name)
    if nr is None:
        raise OSError(errno.ENOSYS, f"no number for {name}")
    return nr


def _clone_newuser() -> str:
    # A fork into a new user namespace, straight through clone(2): flags come first on every
    # architecture. The child leaves at once.
    pid = _raw(_libc.libc().syscall(ctypes.c_long(_nr("clone")), ctypes.c_ulong(_CLONE_NEWUSER | _SIGCHLD), None, None, None, None), "clone(CLONE_NEWUSER)")
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return f"child {pid} in a new user namespace"


def _clone3_probe() -> int:
    # clone3(NULL, 0) is EINVAL for the kernel; the filter answers ENOSYS before that.
    return _raw(_libc.libc().syscall(ctypes.c_long(_nr("clone3")), None, ctypes.c_size_t(0)), "clone3")


def _compile_c_stub() -> str:
    """What Triton does at a kernel's first launch: build a C stub with the system compiler in a
    temp dir and load it. Fails with EACCES when the toolchain or the temp dir is out of reach."""
    import shutil
    import subprocess

    cc = next((c for c in (os.environ.get("CC"), "clang", "gcc", "cc") if c and shutil.which(c)), None)
    if cc is None:
        raise OSError(errno.ENOENT, "no C compiler on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "stub.c"), os.path.join(tmp, "stub.so")
        with open(src, "w") as f:
            f.write("int infire_stub(int x) { return x + 1; }\n")
        proc = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", lib, src], capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(errno.EACCES if "ermission" in proc.stderr else errno.EIO, proc.stderr.strip()[-300:])
        return f"{cc}: stub returned {ctypes.CDLL(lib).infire_stub(41)}"


def run_probes(policy: SandboxPolicy, ro_dir: str, rw_dir: str, outside: str, with_torch: bool) -> dict[str, Any]:
    """Confine with ``policy`` and run every probe; returns the JSON-ready result."""
    matmul: Callable[[], object] | None = None
    if with_torch:
        import torch  # imported before confinement, as the worker does

        torch.manual_seed(0)
        x = torch.randn(256, 256)
        expected = x @ x

        def matmul() -> object:
            got = x @ x
            if not torch.allclose(got, expected):
                raise OSError(errno.EIO, "matmul result changed")
            return float(got.sum())

    ppid = os.getppid()
    report = confine(policy)
    lib = _libc.libc()
    probes: dict[str, Callable[[], object]] = {
        "read_allowed": lambda: _read(os.path.join(ro_dir, sorted(os.listdir(ro_dir))[0])),
        "read_outside": lambda: _read(outside),
        "list_outside": lambda: os.listdir(os.path.dirname(outside)),
        "write_read_only": lambda: _write(os.path.join(ro_dir, "new-file")),
        "write_runtime": lambda: _write(os.path.join(rw_dir, "new-file")),
        "read_outside_new_thread": lambda: _in_new_thread(lambda: _read(outside)),
        "parent_environ": lambda: _read(f"/proc/{ppid}/environ"),
        "own_proc_status": lambda: _read("/proc/self/status"),
        "signal_parent": lambda: os.kill(ppid, 0),
        "af_inet_socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(),
        "af_inet6_socket": lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close(),
        "af_netlink_socket": lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close(),
        "af_inet_socket_new_thread": lambda: _in_new_thread(lambda: socket.socket(socket.AF_INET).close()),
        "af_unix": _unix_socketpair,
        "unix_connect": lambda: _unix_connect(rw_dir),
        "ptrace_traceme": _ptrace_traceme_in_child,
        "ptrace_attach_child": _ptrace_attach_child,
        "mount_tmpfs": lambda: _raw(lib.mount(b"none", rw_dir.encode(), b"tmpfs", 0, None), "mount"),
        "unshare_user": lambda: _raw(lib.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)"),
        "clone_newuser": _clone_newuser,
        "clone3": _clone3_probe,
        "bpf": lambda: _syscall("bpf"),
        "io_uring_setup": lambda: _syscall("io_uring_setup"),
        "net_devices": lambda: " ".join(line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]),
        "fork_and_exit": lambda: os.waitpid(_fork_exit(), 0)[1],
        "compile_c_stub": _compile_c_stub,
        "rlimits": lambda: json.dumps({n: resource.getrlimit(getattr(resource, "RLIMIT_" + n.upper())) for n in ("core", "nofile", "nproc")}),
        "cap_eff": lambda: _status_field("CapEff"),
        "no_new_privs": lambda: _status_field("NoNewPrivs"),
        "seccomp_mode": lambda: _status_field("Seccomp"),
    }
    if matmul is not None:
        probes["torch_matmul"] = matmul
    return {"report": report.to_dict(), "probes": {name: _probe(fn) for name, fn in probes.items()}}


def _status_field(name: str) -> str:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split()[1]
    raise OSError(errno.ENOENT, f"{name} not in /proc/self/status")


def _fork_exit() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return pid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.selftest", description=__doc__.split("\n")[0])
    ap.add_argument("--ro", help="a directory the confined process may read (default: the Python prefix)")
    ap.add_argument("--rw", help="its runtime dir (default: a new temp dir)")
    ap.add_argument("--outside", default="/etc/hostname", help="a file it must not read")
    ap.add_argument("--torch", action="store_true", help="also check a torch CPU matmul still runs")
    ap.add_argument("--seccomp-backend", default="auto", choices=("auto", "libseccomp", "bpf"))
    ap.add_argument("--disable", default="", help="comma-separated layers to skip, e.g. landlock,capabilities")
    ap.add_argument("--allow-unix-connect", action="store_true", help="let connect() through (policy.allow_unix_connect)")
    args = ap.parse_args(argv)
    ro = args.ro or sys.prefix
    rw = args.rw or tempfile.mkdtemp(prefix="infire-selftest-")
    base = default_policy(ro, rw)
    disabled = frozenset(x for x in args.disable.split(",") if x)
    policy = dataclasses.replace(base, seccomp_backend=args.seccomp_backend, disabled=disabled,
                                 allow_unix_connect=args.allow_unix_connect)
    out = run_probes(policy, ro, rw, args.outside, args.torch)
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
