"""The seccomp filter as a classic-BPF program we assemble ourselves, for hosts without libseccomp.

Layout: check the audit arch (anything else → EPERM), on x86_64 refuse x32 numbers, then one
``jeq`` per denied syscall, then argument checks for ``socket``/``socketpair`` (family) and
``clone`` (namespace flags), default allow. Loaded with ``seccomp(SET_MODE_FILTER, TSYNC)``.
Syscall numbers are per architecture; the tables below are checked against libseccomp's own
tables by the tests wherever libseccomp is installed.
"""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass

from sandbox import _libc
from sandbox.seccomp import FilterRules, SeccompError

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "unshare": 272, "setns": 308, "kexec_load": 246,
        "kexec_file_load": 320, "reboot": 169, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "init_module": 175, "finit_module": 313, "delete_module": 176,
        "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "syslog": 103, "iopl": 172,
        "ioperm": 173, "uselib": 134, "vhangup": 153, "sethostname": 170, "setdomainname": 171,
        "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
        "add_key": 248, "request_key": 249, "keyctl": 250, "open_by_handle_at": 304,
        "lookup_dcookie": 212, "nfsservctl": 180, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "connect": 42, "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "unshare": 97, "setns": 268, "kexec_load": 104,
        "kexec_file_load": 294, "reboot": 142, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "init_module": 105, "finit_module": 273, "delete_module": 106,
        "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "syslog": 116,
        "vhangup": 58, "sethostname": 161, "setdomainname": 162, "settimeofday": 170,
        "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "add_key": 217,
        "request_key": 218, "keyctl": 219, "open_by_handle_at": 265, "lookup_dcookie": 18,
        "nfsservctl": 42, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "connect": 203, "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435,
    },
}

# Classic BPF opcodes (linux/filter.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
# struct seccomp_data: nr @0, arch @4, ip @8, args[6] @16; low word of args[0] (little endian).
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16


def _ret_errno(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


@dataclass
class _Insn:
    code: int
    k: int
    jt: str | int = 0  # label name or relative offset
    jf: str | int = 0


def assemble(rules: FilterRules, arch: str) -> list[tuple[int, int, int, int]]:
    """Return the program as (code, jt, jf, k) tuples; raises SeccompError on an unknown arch."""
    table = SYSCALLS.get(arch)
    if table is None or arch not in AUDIT_ARCH:
        raise SeccompError(errno.ENOSYS, f"no syscall table for {arch}; install libseccomp")
    prog: list[_Insn] = []
    labels: dict[str, int] = {}

    def label(name: str) -> None:
        labels[name] = len(prog)

    prog.append(_Insn(_LD_W_ABS, _OFF_ARCH))
    prog.append(_Insn(_JEQ_K, AUDIT_ARCH[arch], 0, "eperm"))
    prog.append(_Insn(_LD_W_ABS, _OFF_NR))
    if arch == "x86_64":
        prog.append(_Insn(_JGE_K, _X32_SYSCALL_BIT, "eperm", 0))
    for name in rules.deny_eperm:
        if name in table:
            prog.append(_Insn(_JEQ_K, table[name], "eperm", 0))
    for name in rules.enosys:
        if name in table:
            prog.append(_Insn(_JEQ_K, table[name], "enosys", 0))
    prog.append(_Insn(_JEQ_K, table["socket"], "socket", 0))
    prog.append(_Insn(_JEQ_K, table["socketpair"], "socket", 0))
    prog.append(_Insn(_JEQ_K, table["clone"], "clone", 0))
    prog.append(_Insn(_RET_K, _RET_ALLOW))
    label("socket")
    if rules.socket_family_allowed is None:
        prog.append(_Insn(_RET_K, _ret_errno(errno.EPERM)))
    else:
        prog.append(_Insn(_LD_W_ABS, _OFF_ARG0_LO))
        prog.append(_Insn(_JEQ_K, rules.socket_family_allowed, "allow", "eperm"))
    label("clone")
    mask = 0
    for flag in rules.clone_ns_flags:
        mask |= flag
    prog.append(_Insn(_LD_W_ABS, _OFF_ARG0_LO))
    prog.append(_Insn(_JSET_K, mask, "eperm", "allow"))
    label("allow")
    prog.append(_Insn(_RET_K, _RET_ALLOW))
    label("eperm")
    prog.append(_Insn(_RET_K, _ret_errno(errno.EPERM)))
    label("enosys")
    prog.append(_Insn(_RET_K, _ret_errno(errno.ENOSYS)))

    out = []
    for i, insn in enumerate(prog):
        jumps = []
        for target in (insn.jt, insn.jf):
            off = labels[target] - i - 1 if isinstance(target, str) else target
            if not 0 <= off <= 255:
                raise SeccompError(errno.E2BIG, f"BPF jump out of range at {i}")
            jumps.append(off)
        out.append((insn.code, jumps[0], jumps[1], insn.k))
    return out


def load(rules: FilterRules) -> str:
    """Assemble for this machine and load with TSYNC; returns a detail string."""
    arch = _libc.machine()
    prog = assemble(rules, arch)
    nr = _libc.seccomp_syscall_nr()
    if nr is None:
        raise SeccompError(errno.ENOSYS, f"no seccomp syscall number for {arch}")
    insns = (_SockFilter * len(prog))(*(_SockFilter(c, jt, jf, k) for c, jt, jf, k in prog))
    fprog = _SockFprog(len(prog), insns)
    # seccomp() rather than prctl(PR_SET_SECCOMP): only the syscall takes TSYNC.
    ret = _libc.libc().syscall(ctypes.c_long(nr), ctypes.c_uint(_SECCOMP_SET_MODE_FILTER), ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog))
    if ret != 0:
        if ret > 0:  # TSYNC reports the id of a thread it could not synchronise
            raise SeccompError(errno.EBUSY, f"seccomp TSYNC failed on thread {ret}")
        err = ctypes.get_errno()
        raise SeccompError(err, f"seccomp(SET_MODE_FILTER): {errno.errorcode.get(err, err)}")
    denied = sum(1 for n in rules.deny_eperm if n in SYSCALLS[arch])
    word = "no sockets" if rules.socket_family_allowed is None else "sockets: AF_UNIX only"
    return f"bpf ({len(prog)} insns), {denied} syscalls denied, {word}, all threads"
