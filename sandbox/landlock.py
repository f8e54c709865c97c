"""Landlock through raw syscalls: filesystem allow-list, TCP deny, signal/abstract-socket scoping.

The ABI is probed (``landlock_create_ruleset(NULL, 0, VERSION)``) and only rights the running
kernel knows are handled, so the same policy works from Linux 5.13 (ABI 1) upward. Rights that
did not exist yet are simply not restricted on older kernels; the report says which ABI ran.

Without ``LANDLOCK_RESTRICT_SELF_TSYNC`` (ABI 8, Linux 7.0) a domain binds the calling thread and
the threads it creates afterwards, not sibling threads that already exist (CUDA's and OpenMP's
helpers, which run no Python). The report counts them; seccomp, which syncs all threads, covers
them for the network and kernel-attack-surface rules.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass

from sandbox import _libc

_NR_CREATE_RULESET = 444  # identical on every architecture
_NR_ADD_RULE = 445
_NR_RESTRICT_SELF = 446

_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_RESTRICT_SELF_TSYNC = 1 << 3  # ABI 8

# Filesystem rights, by the ABI that introduced them.
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5

NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

_FS_BY_ABI = {1: (1 << 13) - 1, 2: REFER, 3: TRUNCATE, 5: IOCTL_DEV}
# Rights that make sense on a non-directory; anything else on a file rule is EINVAL.
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV

READ_ONLY = EXECUTE | READ_FILE | READ_DIR
READ_WRITE = (
    READ_ONLY | WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
    | MAKE_SYM | REFER | TRUNCATE
)
DEVICE = READ_FILE | WRITE_FILE | READ_DIR | IOCTL_DEV


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel struct is __attribute__((packed))
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi_version() -> int:
    """The Landlock ABI of the running kernel, 0 when Landlock is absent or disabled."""
    ret = _libc.libc().syscall(ctypes.c_long(_NR_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return int(ret) if ret > 0 else 0


def handled_fs(abi: int) -> int:
    return sum(bits for since, bits in _FS_BY_ABI.items() if abi >= since)


@dataclass(frozen=True)
class Rule:
    path: str
    access: int


@dataclass(frozen=True)
class LandlockResult:
    abi: int
    rules: int
    skipped: tuple[str, ...]
    process_wide: bool
    threads_outside: int
    scoped: int
    net_handled: bool

    def detail(self) -> str:
        scope = "all threads" if self.process_wide else f"this thread and its children ({self.threads_outside} older threads outside)"
        extras = []
        if self.net_handled:
            extras.append("tcp bind/connect denied")
        if self.scoped & SCOPE_SIGNAL:
            extras.append("signals scoped")
        if self.scoped & SCOPE_ABSTRACT_UNIX_SOCKET:
            extras.append("abstract unix scoped")
        return f"ABI {self.abi}, {self.rules} rules, {scope}" + (", " + ", ".join(extras) if extras else "")


def restrict(rules: list[Rule], *, deny_tcp: bool, scope_signals: bool, scope_abstract_unix: bool, other_threads: int) -> LandlockResult:
    """Build a ruleset from ``rules`` and enforce it on the calling thread (all threads on ABI 8+).

    Requires no_new_privs (or CAP_SYS_ADMIN). Raises ``OSError`` with ``ENOSYS``/``EOPNOTSUPP``
    when Landlock is unavailable; nothing is enforced unless every step before
    ``landlock_restrict_self`` succeeded, so a failure leaves the process as it was.
    """
    abi = abi_version()
    if abi <= 0:
        raise OSError(errno.EOPNOTSUPP, "Landlock is not supported or not enabled by this kernel (see /sys/kernel/security/lsm)")
    fs_mask = handled_fs(abi)
    attr = _RulesetAttr(handled_access_fs=fs_mask)
    size = 8
    if abi >= 4:
        size = 16
        if deny_tcp:
            attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP
    if abi >= 6:
        size = 24
        attr.scoped = (SCOPE_SIGNAL if scope_signals else 0) | (SCOPE_ABSTRACT_UNIX_SOCKET if scope_abstract_unix else 0)
    lib = _libc.libc()
    rs_fd = _libc.check(
        lib.syscall(ctypes.c_long(_NR_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )
    added = 0
    skipped: list[str] = []
    try:
        for rule in rules:
            try:
                fd = os.open(rule.path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                skipped.append(rule.path)
                continue
            try:
                access = rule.access & fs_mask
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= _FILE_RIGHTS
                if not access:
                    skipped.append(rule.path)
                    continue
                pb = _PathBeneathAttr(allowed_access=access, parent_fd=fd)
                _libc.check(
                    lib.syscall(ctypes.c_long(_NR_ADD_RULE), ctypes.c_int(rs_fd), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(pb), ctypes.c_uint32(0)),
                    f"landlock_add_rule({rule.path})",
                )
                added += 1
            finally:
                os.close(fd)
        flags = _RESTRICT_SELF_TSYNC if abi >= 8 else 0
        _libc.check(lib.syscall(ctypes.c_long(_NR_RESTRICT_SELF), ctypes.c_int(rs_fd), ctypes.c_uint32(flags)), "landlock_restrict_self")
    finally:
        os.close(rs_fd)
    return LandlockResult(
        abi=abi,
        rules=added,
        skipped=tuple(skipped),
        process_wide=abi >= 8,
        threads_outside=0 if abi >= 8 else other_threads,
        scoped=int(attr.scoped),
        net_handled=bool(attr.handled_access_net),
    )
