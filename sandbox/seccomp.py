"""The worker's seccomp filter: default allow, EPERM for what an inference engine never needs.

Denied with EPERM (never a kill, so a probing library gets an error it can handle):
- sockets of any family but AF_UNIX (``socket``/``socketpair`` first argument), and io_uring,
  which could open sockets without passing through ``socket()``; ``connect`` too unless the
  policy allows it: Landlock cannot stop a connect to a unix socket by path (the agent's admin
  socket, a container runtime's socket), and the worker only needs the socketpair it inherits;
- ptrace and cross-process memory/fd access (``process_vm_*``, ``pidfd_getfd``);
- mount and the new mount API, ``pivot_root``, ``chroot``; ``unshare``, ``setns`` and ``clone``
  with namespace flags; kexec, reboot, bpf, perf_event_open, userfaultfd, module loading,
  swap, acct, quotactl, syslog, clock setting, hostname, keyrings, ``open_by_handle_at``.
``clone3`` answers ENOSYS: its flags sit behind a pointer a filter cannot read, and glibc falls
back to ``clone``, whose flags it can. Other architectures' syscalls (i386 ``int 0x80``, x32)
get EPERM too. Everything CUDA uses (ioctl, mmap, mbind, sched_setaffinity, ...) stays allowed.

Two backends share :func:`build_rules`: libseccomp through ctypes when ``libseccomp.so.2`` is
installed, else a classic-BPF program of our own (:mod:`sandbox.bpf`). Both set TSYNC, so the
filter binds every thread of the process, including those CUDA and OpenMP started earlier.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import socket
from dataclasses import dataclass

DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "mount", "umount", "umount2", "pivot_root", "chroot",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "unshare", "setns",
    "kexec_load", "kexec_file_load", "reboot",
    "bpf", "perf_event_open", "userfaultfd",
    "init_module", "finit_module", "delete_module",
    "swapon", "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm", "uselib", "vhangup",
    "sethostname", "setdomainname", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "add_key", "request_key", "keyctl", "open_by_handle_at", "lookup_dcookie", "nfsservctl",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)

# clone() flags that create namespaces (CLONE_NEWTIME shares its bit with the exit signal in
# clone(), so it is only meaningful to unshare/clone3, both handled above).
CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


class SeccompError(OSError):
    """The filter could not be built or loaded."""


@dataclass(frozen=True)
class FilterRules:
    """Backend-neutral description of the filter."""

    deny_eperm: tuple[str, ...]
    enosys: tuple[str, ...]
    socket_family_allowed: int | None  # None: every socket() is denied
    clone_ns_flags: tuple[int, ...]


def build_rules(allow_af_unix: bool, allow_connect: bool = False) -> FilterRules:
    return FilterRules(
        deny_eperm=DENIED_SYSCALLS + (() if allow_connect else ("connect",)),
        enosys=("clone3",),
        socket_family_allowed=socket.AF_UNIX if allow_af_unix else None,
        clone_ns_flags=CLONE_NS_FLAGS,
    )


# libseccomp ABI constants (seccomp.h); stable since 2.x.
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_FLTATR_ACT_BADARCH = 2
_SCMP_FLTATR_CTL_TSYNC = 4
_SCMP_CMP_NE = 1
_SCMP_CMP_MASKED_EQ = 7


def scmp_act_errno(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


@functools.cache
def _libseccomp() -> ctypes.CDLL | None:
    for name in ("libseccomp.so.2", ctypes.util.find_library("seccomp")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        return lib
    return None


def libseccomp_available() -> bool:
    return _libseccomp() is not None


def _ok(ret: int, what: str) -> None:
    # libseccomp returns -errno rather than setting errno.
    if ret < 0:
        raise SeccompError(-ret, f"{what}: {errno.errorcode.get(-ret, -ret)}")


def load_libseccomp(rules: FilterRules) -> str:
    """Build and load the filter with libseccomp; returns a detail string."""
    lib = _libseccomp()
    if lib is None:
        raise SeccompError(errno.ENOENT, "libseccomp.so.2 is not installed")
    eperm = scmp_act_errno(errno.EPERM)
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompError(errno.ENOMEM, "seccomp_init failed")
    try:
        _ok(lib.seccomp_attr_set(ctx, _SCMP_FLTATR_ACT_BADARCH, eperm), "seccomp_attr_set(BADARCH)")
        _ok(lib.seccomp_attr_set(ctx, _SCMP_FLTATR_CTL_TSYNC, 1), "seccomp_attr_set(TSYNC)")

        def add(action: int, name: str, *conds: _ArgCmp) -> bool:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return False  # not a syscall on this architecture
            arr = (_ArgCmp * max(1, len(conds)))(*conds)
            _ok(lib.seccomp_rule_add_array(ctx, action, nr, len(conds), arr), f"rule {name}")
            return True

        n = sum(add(eperm, name) for name in rules.deny_eperm)
        n += sum(add(scmp_act_errno(errno.ENOSYS), name) for name in rules.enosys)
        for name in ("socket", "socketpair"):
            if rules.socket_family_allowed is None:
                add(eperm, name)
            else:
                add(eperm, name, _ArgCmp(0, _SCMP_CMP_NE, rules.socket_family_allowed, 0))
        for flag in rules.clone_ns_flags:
            add(eperm, "clone", _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
        _ok(lib.seccomp_load(ctx), "seccomp_load")
    finally:
        lib.seccomp_release(ctx)
    return f"libseccomp, {n} syscalls denied, {_sockets_word(rules)}, all threads"


def _sockets_word(rules: FilterRules) -> str:
    return "no sockets" if rules.socket_family_allowed is None else "sockets: AF_UNIX only"
