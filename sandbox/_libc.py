"""The few raw libc entry points the sandbox needs, with errors turned into ``OSError``."""

from __future__ import annotations

import ctypes
import functools
import os
import platform

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

CLONE_NEWNET = 0x40000000

# Syscall numbers that differ per architecture; the Landlock ones are the same everywhere.
_SECCOMP_NR = {"x86_64": 317, "aarch64": 277}


@functools.cache
def libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    lib.prctl.restype = ctypes.c_int
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    lib.unshare.argtypes = [ctypes.c_int]
    lib.unshare.restype = ctypes.c_int
    return lib


def machine() -> str:
    m = platform.machine()
    return "aarch64" if m == "arm64" else m


def seccomp_syscall_nr() -> int | None:
    return _SECCOMP_NR.get(machine())


def check(ret: int, what: str) -> int:
    """Raise ``OSError(errno)`` when a libc call returned -1."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return check(libc().prctl(option, arg2, arg3, arg4, arg5), f"prctl({option})")
