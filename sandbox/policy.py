"""What the engine worker may touch once confined, and what confinement achieved.

:class:`SandboxPolicy` is plain data built by the worker (usually via :func:`default_policy`) and
handed to :func:`sandbox.launch.confine`. :class:`SandboxReport` is what comes back: one
:class:`Protection` per layer, each either active or inactive with the reason, so the worker can
log it and the agent can show it in status.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROTECTIONS = (
    "die_with_parent",
    "rlimits",
    "net_namespace",
    "no_new_privs",
    "landlock",
    "seccomp",
    "capabilities",
)


class SandboxError(Exception):
    """Confinement could not be set up as the policy demands."""


class SandboxPolicyError(SandboxError):
    """The policy itself is malformed (relative path, unknown protection name, bad limit)."""


class SandboxUnavailableError(SandboxError):
    """A protection named in ``SandboxPolicy.required`` could not be applied on this host."""


@dataclass(frozen=True)
class SandboxPolicy:
    """Paths and limits for the confined worker.

    ``read_only`` paths may be read, listed and executed (Triton runs ``ptxas`` and a C compiler
    at first use). ``read_write`` paths may also be created, written, truncated and removed.
    ``devices`` are character devices opened read-write with ioctl allowed (``/dev/nvidia*``).
    Landlock grants access to whole directory trees and cannot be widened later, so give
    directories that will *contain* future files (the whole cache dir), not today's files.
    Missing paths are skipped and listed in the report. ``required`` names protections that must
    be active, otherwise :func:`confine` raises :class:`SandboxUnavailableError`.
    """

    read_only: tuple[str, ...] = ()
    read_write: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    allow_af_unix: bool = True
    # connect() is denied by default: the worker talks over the socketpair it inherited, and a
    # path socket is reachable whatever Landlock says (the agent's admin socket, docker.sock...).
    allow_unix_connect: bool = False
    unshare_network: bool = True
    scope_signals: bool = True  # a confined worker cannot signal the agent (Landlock ABI >= 6)
    scope_abstract_unix: bool = True  # nor connect to abstract unix sockets made outside it
    max_open_files: int = 8192
    max_processes: int = 4096  # threads count: torch and CUDA start dozens
    parent_pid: int | None = None  # die_with_parent checks the parent is still this one
    seccomp_backend: str = "auto"  # "auto" (libseccomp if present, else raw BPF), "libseccomp", "bpf"
    required: frozenset[str] = frozenset()
    disabled: frozenset[str] = frozenset()  # layers to skip (operators debugging a host, tests)

    def validate(self) -> None:
        """Raise :class:`SandboxPolicyError` naming the first bad field."""
        for name in ("read_only", "read_write", "devices"):
            for p in getattr(self, name):
                if not isinstance(p, str) or not os.path.isabs(p) or "\0" in p:
                    raise SandboxPolicyError(f"{name}: {p!r} is not an absolute path")
        for name in ("required", "disabled"):
            unknown = set(getattr(self, name)) - set(PROTECTIONS)
            if unknown:
                raise SandboxPolicyError(f"{name}: unknown protection(s) {sorted(unknown)}; known: {PROTECTIONS}")
        both = set(self.required) & set(self.disabled)
        if both:
            raise SandboxPolicyError(f"required and disabled both name {sorted(both)}")
        if not 16 <= self.max_open_files <= 1 << 20:
            raise SandboxPolicyError(f"max_open_files: {self.max_open_files} is outside 16..1048576")
        if not 16 <= self.max_processes <= 1 << 22:
            raise SandboxPolicyError(f"max_processes: {self.max_processes} is outside 16..4194304")
        if self.seccomp_backend not in ("auto", "libseccomp", "bpf"):
            raise SandboxPolicyError(f"seccomp_backend: {self.seccomp_backend!r} is not auto, libseccomp or bpf")
        if self.parent_pid is not None and self.parent_pid <= 0:
            raise SandboxPolicyError(f"parent_pid: {self.parent_pid} is not a pid")


@dataclass(frozen=True)
class Protection:
    name: str
    active: bool
    detail: str = ""


@dataclass
class SandboxReport:
    """The outcome of :func:`sandbox.launch.confine`, one entry per protection."""

    protections: dict[str, Protection] = field(default_factory=dict)
    skipped_paths: list[str] = field(default_factory=list)

    def add(self, name: str, active: bool, detail: str = "") -> None:
        self.protections[name] = Protection(name, active, detail)

    def is_active(self, name: str) -> bool:
        p = self.protections.get(name)
        return p is not None and p.active

    @property
    def active(self) -> list[str]:
        return [n for n, p in self.protections.items() if p.active]

    @property
    def inactive(self) -> list[str]:
        return [n for n, p in self.protections.items() if not p.active]

    def detail_line(self) -> str:
        return "; ".join(f"{n}: {p.detail}" for n, p in self.protections.items())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for logs and the agent's status endpoint."""
        return {
            "active": self.active,
            "inactive": self.inactive,
            "detail": {n: p.detail for n, p in self.protections.items()},
            "skipped_paths": list(self.skipped_paths),
        }


def _python_paths(search_path: list[str] | None = None, cwd: str | None = None) -> list[str]:
    search_path = sys.path if search_path is None else search_path
    cwd = os.getcwd() if cwd is None else cwd
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for p in search_path:
        # `python -m` puts the working directory first on sys.path, and a service's working
        # directory is "/": taking it would open the whole disk. Only real library dirs count.
        if not p or not os.path.isabs(p) or not os.path.isdir(p):
            continue
        p = os.path.normpath(p)
        if p == "/" or p == os.path.normpath(cwd):
            continue
        paths.add(p)
    # The project's own packages: an editable install maps them through an import hook rather
    # than sys.path, and modules imported lazily after confinement must still be readable.
    for pkg in ("agent", "engine", "cache", "sandbox"):
        spec = importlib.util.find_spec(pkg)
        for loc in (spec.submodule_search_locations or []) if spec else []:
            paths.add(os.path.abspath(loc))
    paths.discard("/")
    return sorted(paths)


def _compiler_paths() -> list[str]:
    """Install prefixes of the C compiler Triton runs to build its launcher stubs at first use.

    Triton picks ``$CC`` or the first of clang/gcc/cc on ``PATH``; a toolchain outside /usr (e.g.
    /opt/gcc with its libexec/cc1 and binutils) must stay readable and executable, or the first
    kernel compile after confinement fails with EACCES.
    """
    found = []
    for name in (os.environ.get("CC"), "clang", "gcc", "cc"):
        exe = shutil.which(name) if name else None
        if not exe:
            continue
        real = os.path.realpath(exe)
        for path in (exe, real):
            prefix = os.path.dirname(os.path.dirname(path))  # <prefix>/bin/gcc -> <prefix>
            if prefix not in ("", "/"):
                found.append(prefix)
    return found


def default_policy(
    cache_dir: str | os.PathLike[str],
    runtime_dir: str | os.PathLike[str],
    *,
    extra_read_only: tuple[str, ...] = (),
    extra_read_write: tuple[str, ...] = (),
    parent_pid: int | None = None,
    required: frozenset[str] = frozenset(),
) -> SandboxPolicy:
    """The policy the engine worker runs under.

    Read-only: the *whole* model cache dir (snapshots link into ``blobs/``, and models loaded after
    confinement land there too), the Python installation and ``sys.path``, system libraries,
    ``/proc`` and ``/sys`` (CUDA and NUMA discovery; other processes' ``/proc`` entries stay closed
    because Landlock denies ptrace-mode access across domains), and the few ``/etc`` files the
    dynamic loader and ``pwd`` need. ``/etc`` as a whole stays closed: the agent's environment
    file with the admin token and store credentials lives there.
    Read-write: the runtime dir, the temp dir and Triton's kernel cache (JIT at first use),
    ``/dev/shm``. Devices: ``/dev/nvidia*`` present now, plus the usual null/zero/random nodes.
    """
    ro = [
        os.fspath(cache_dir),
        *_python_paths(),
        "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin",
        "/proc", "/sys",
        "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
        "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/alternatives",
        *_compiler_paths(),
        *extra_read_only,
    ]
    triton_cache = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton")
    rw = [os.fspath(runtime_dir), tempfile.gettempdir(), "/dev/shm", triton_cache]
    if os.environ.get("CUDA_CACHE_PATH"):  # CUDA's PTX JIT cache; without it CUDA just recompiles
        rw.append(os.environ["CUDA_CACHE_PATH"])
    rw += extra_read_write
    devices = sorted(glob.glob("/dev/nvidia*")) + ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
    return SandboxPolicy(
        read_only=tuple(dict.fromkeys(ro)),
        read_write=tuple(dict.fromkeys(rw)),
        devices=tuple(dict.fromkeys(devices)),
        parent_pid=parent_pid,
        required=required,
    )
