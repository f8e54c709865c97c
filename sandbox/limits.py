"""Process-wide knobs: death signal, rlimits, no_new_privs, network namespace, capabilities.

Each function applies one protection and returns a short detail string, or raises ``OSError``
when the kernel or our privileges refuse it; :func:`sandbox.launch.confine` decides what a
refusal means.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal

from sandbox import _libc


def die_with_parent(expected_parent_pid: int | None = None) -> str:
    """Have the kernel SIGKILL this process when its parent exits (``PR_SET_PDEATHSIG``).

    Call it first thing in the worker. The signal is tied to the parent *thread* that forked us,
    so the agent must spawn the worker from a thread that lives as long as the agent (its main
    thread). If the parent is already gone (we were reparented before the prctl ran), the signal
    would never come, so we deliver it ourselves.
    """
    _libc.prctl(_libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    if expected_parent_pid is not None and os.getppid() != expected_parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    return f"SIGKILL when pid {os.getppid()} exits"


def _lower(which: int, want: int) -> tuple[int, int]:
    soft, hard = resource.getrlimit(which)
    # Never raise: an unprivileged worker may not, and a lower ceiling set by the operator wins.
    new_hard = want if hard == resource.RLIM_INFINITY else min(hard, want)
    resource.setrlimit(which, (min(new_hard, want), new_hard))
    return resource.getrlimit(which)


def set_rlimits(max_open_files: int, max_processes: int) -> str:
    """No core dumps (weights, prompts and tokens stay out of crash files), bounded fds and tasks."""
    core = _lower(resource.RLIMIT_CORE, 0)
    nofile = _lower(resource.RLIMIT_NOFILE, max_open_files)
    nproc = _lower(resource.RLIMIT_NPROC, max_processes)
    return f"core={core[1]} nofile={nofile[1]} nproc={nproc[1]}"


def set_no_new_privs() -> str:
    """setuid/file capabilities stop working for us and our children; Landlock needs it too."""
    _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
    if _libc.prctl(_libc.PR_GET_NO_NEW_PRIVS) != 1:
        raise OSError(0, "no_new_privs did not stick")
    return "set"


def unshare_network() -> str:
    """Move this thread, and threads it creates later, into an empty network namespace.

    Needs CAP_SYS_ADMIN (root, a container's root); under the systemd unit the worker has no
    capabilities and RestrictNamespaces= forbids it, so it fails with EPERM and seccomp's
    AF_UNIX-only rule is the network barrier. Threads started before this call keep the old
    namespace; seccomp covers them.
    """
    _libc.check(_libc.libc().unshare(_libc.CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    return "empty network namespace (only lo, down)"


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _cap_last() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40


def drop_capabilities() -> str:
    """Empty the bounding, ambient, effective, permitted and inheritable sets.

    The worker needs no capability; this matters when it runs as root (containers, dev boxes),
    where it would otherwise keep CAP_DAC_OVERRIDE and friends.
    """
    had = _effective_caps()
    if had == 0:
        return "none held"
    try:
        _libc.prctl(_libc.PR_CAP_AMBIENT, _libc.PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass  # kernels before 4.3 have no ambient set
    for cap in range(_cap_last() + 1):
        try:
            _libc.prctl(_libc.PR_CAPBSET_DROP, cap)
        except OSError:
            break  # EINVAL past the last cap this kernel knows
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    lib = _libc.libc()
    _libc.check(lib.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    left = _effective_caps()
    if left:
        raise OSError(0, f"capabilities still held: {left:#x}")
    return f"dropped {had:#x}"


def _effective_caps() -> int:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _libc.check(_libc.libc().capget(ctypes.byref(header), ctypes.byref(data)), "capget")
    return data[0].effective | (data[1].effective << 32)


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1
